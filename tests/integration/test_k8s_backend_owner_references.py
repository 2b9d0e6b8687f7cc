"""Owner references: pods and Services are owned by the executor's Deployment by default, can be turned off,
and a failed owner lookup degrades to none (once, counted).
(The fake API server, the backend and the watcher: k8s_backend_support.)"""

from __future__ import annotations

import json

import k8s_backend_support
import pytest
from fake_k8s import FakeK8s
from k8s_backend_support import JOB, NS, OWNER, spec
from pacer.metrics import REGISTRY
from pacer_services.pod_executor.backends.kubernetes import from_env

# The fixtures of k8s_backend_support (pytest finds them as attributes of this module).
fake = k8s_backend_support.fake


# -- owner references ---------------------------------------------------------


def owner_failures(reason: str) -> float:
    return REGISTRY.get_sample_value("pacer_executor_owner_lookup_failures_total", {"reason": reason}) or 0.0


async def test_pods_and_services_are_owned_by_the_executors_deployment_by_default(fake: FakeK8s) -> None:
    pod_name, uid = fake.run_executor("pod-executor")
    b = from_env({"PACER_KUBE_HOST": fake.host, "PACER_NAMESPACE": NS, "PACER_EXECUTOR_POD": pod_name})
    await b.create(spec("worker-0"))
    await b.create(spec("ps-0"))
    want = [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "pod-executor", "uid": uid,
             "controller": False, "blockOwnerDeletion": False}]
    assert fake.pods[(NS, "job1-worker-0-g0")]["metadata"]["ownerReferences"] == want
    assert fake.pods[(NS, "job1-ps-0-g0")]["metadata"]["ownerReferences"] == want
    assert fake.services[(NS, JOB)]["metadata"]["ownerReferences"] == want
    # pod -> replicaset -> deployment, looked up once for all creates
    assert len(fake.requests_to("GET", "/" + pod_name)) == 1
    assert len(fake.requests_to("GET", "/replicasets/pod-executor-7c9f8d6b5")) == 1
    assert len(fake.requests_to("GET", "/deployments/pod-executor")) == 1
    b.api.api_client.close()


async def test_owner_references_can_be_turned_off(fake: FakeK8s) -> None:
    pod_name, _ = fake.run_executor()
    b = from_env({"PACER_KUBE_HOST": fake.host, "PACER_NAMESPACE": NS, "PACER_EXECUTOR_POD": pod_name,
                  "PACER_OWNER_REFERENCES": "0", "PACER_OWNER": json.dumps(OWNER)})
    await b.create(spec("worker-0"))
    assert "ownerReferences" not in fake.pods[(NS, "job1-worker-0-g0")]["metadata"]
    assert "ownerReferences" not in fake.services[(NS, JOB)]["metadata"]
    assert not fake.requests_to("GET", "/" + pod_name)  # not even looked up
    b.api.api_client.close()


@pytest.mark.parametrize("failure", ["forbidden", "not_found", "no_owner", "no_pod_name"])
async def test_a_failed_owner_lookup_degrades_to_no_owner_references(fake: FakeK8s, failure: str) -> None:
    pod_name, _ = fake.run_executor()
    env = {"PACER_KUBE_HOST": fake.host, "PACER_NAMESPACE": NS, "PACER_EXECUTOR_POD": pod_name}
    if failure == "forbidden":  # the Role lacks get on apps replicasets
        fake.forbidden.add("replicasets")
    elif failure == "not_found":  # e.g. the executor runs in another namespace
        env["PACER_EXECUTOR_POD"] = "pod-executor-elsewhere"
    elif failure == "no_owner":  # a bare pod, not run by a Deployment
        del fake.pods[(NS, pod_name)]["metadata"]["ownerReferences"]
    else:  # an old manifest without the downward API variable
        del env["PACER_EXECUTOR_POD"]
    before = owner_failures(failure)
    b = from_env(env)
    await b.create(spec("worker-0"))
    await b.create(spec("worker-1"))
    for name in ("job1-worker-0-g0", "job1-worker-1-g0"):
        assert "ownerReferences" not in fake.pods[(NS, name)]["metadata"]
    assert "ownerReferences" not in fake.services[(NS, JOB)]["metadata"]
    assert owner_failures(failure) == before + 1  # once, not per pod
    b.api.api_client.close()
