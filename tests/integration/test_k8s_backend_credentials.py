"""A job's bus password reaches its pods through a Secret of the job's, never as a literal in the pod spec;
the Secret goes when the job is torn down (owned by the job's headless Service, which release deletes).
(The fake API server, the backend and the watcher: k8s_backend_support.)"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import replace
from typing import Any

import k8s_backend_support
import pytest
from fake_k8s import FakeK8s
from k8s_backend_support import NS, new_backend
from pacer import authjwt
from pacer.contracts.executor import PodSpec
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.errors import Unavailable
from pacer.jobs.spec import parse_job_spec
from pacer.trainer.cluster import ClusterDesc
from pacer_services.pod_executor import launch
from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend

fake = k8s_backend_support.fake
backend = k8s_backend_support.backend

SECRET = "the-executors-token-secret"
CFG = launch.LaunchConfig("nats://nats:4222", agent_secret=SECRET)


def record(job: str, submitted_at: float = 1_700_000_000.0) -> JobRecord:
    spec = parse_job_spec(f"name: {job}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    return JobRecord(job, spec, JobState.RUNNING, submitted_at, data_path="/data/train.rec", records=100)


def pod(rec: JobRecord, role: str = "worker", index: int = 0, cfg: launch.LaunchConfig = CFG) -> PodSpec:
    plan = ResourcePlan(rec.job, 2, 1, 1.0, 1024, 1.0, 1024, PlanSource.BRAIN)
    b = rec.job
    cluster = ClusterDesc((f"{b}-ps-0.{b}:2222",), (f"{b}-worker-0.{b}:2222", f"{b}-worker-1.{b}:2222"))
    return launch.pod_spec(rec, plan, cluster, role, index, 0, 1.0, 1024, 2222, cfg)


def secrets_of(fake: FakeK8s, job: str) -> dict[str, dict[str, Any]]:
    return {name: s for (ns, name), s in fake.secrets.items() if ns == NS and name.startswith(f"{job}-agent-")}


async def test_the_password_is_a_secret_of_the_job_never_a_literal(fake: FakeK8s, backend: KubernetesBackend) -> None:
    rec = record("alpha")
    specs = [pod(rec, "worker", 0), pod(rec, "worker", 1), pod(rec, "ps", 0)]
    token = specs[0].env["PACER_NATS_PASSWORD"]
    assert authjwt.token_ok(SECRET, "alpha", token, time.time())  # a real token is there to hide
    for s in specs:
        await backend.create(s)
    (name, secret), = secrets_of(fake, "alpha").items()  # one Secret for the job's pods
    assert base64.b64decode(secret["data"]["password"]).decode() == token
    assert secret["immutable"] is True and secret["type"] == "Opaque"
    svc = fake.services[(NS, "alpha")]
    assert secret["metadata"]["ownerReferences"] == [{
        "apiVersion": "v1", "kind": "Service", "name": "alpha", "uid": svc["metadata"]["uid"],
        "controller": False, "blockOwnerDeletion": False}]
    for s in specs:
        created = fake.pods[(NS, s.name)]
        assert token not in json.dumps(created)  # nowhere in the pod: env, command, annotations
        for c in created["spec"]["containers"]:
            env = {e["name"]: e for e in c["env"]}
            assert env["PACER_NATS_PASSWORD"] == {"name": "PACER_NATS_PASSWORD", "valueFrom": {
                "secretKeyRef": {"name": name, "key": "password"}}}
            assert env["PACER_NATS_USER"]["value"] == "agent-alpha"
    assert len(fake.requests_to("POST", "/secrets")) == 1  # made once by this instance


async def test_the_secret_goes_with_the_job(fake: FakeK8s, backend: KubernetesBackend) -> None:
    await backend.create(pod(record("alpha")))
    await backend.create(pod(record("beta")))
    await backend.release("alpha")  # the job is torn down: its Service, and with it its Secrets
    assert secrets_of(fake, "alpha") == {} and len(secrets_of(fake, "beta")) == 1


async def test_a_later_job_of_the_same_name_gets_another_secret(fake: FakeK8s, backend: KubernetesBackend) -> None:
    first = record("alpha")
    await backend.create(pod(first))
    (old,) = secrets_of(fake, "alpha")
    await backend.delete(pod(first).name, 0)  # the job is torn down: its pods, then its Service
    await backend.release("alpha")
    second = replace(first, submitted_at=first.submitted_at + 600.0)
    await backend.create(pod(second))
    (new,) = secrets_of(fake, "alpha")
    assert new != old
    token = base64.b64decode(fake.secrets[(NS, new)]["data"]["password"]).decode()
    claims = authjwt.parse_token(token)
    assert claims is not None and claims.incarnation == authjwt.incarnation(second.submitted_at)


async def test_a_restarted_executor_finds_the_secret_and_its_owner(fake: FakeK8s, backend: KubernetesBackend) -> None:
    rec = record("alpha")
    await backend.create(pod(rec, "worker", 0))
    again = new_backend(fake)  # knows neither the Service nor the Secret: both creates answer 409
    try:
        await again.create(pod(rec, "worker", 1))
        (name,) = secrets_of(fake, "alpha")
        env = {e["name"]: e for e in fake.pods[(NS, "alpha-worker-1-g0")]["spec"]["containers"][0]["env"]}
        assert env["PACER_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == name
        await again.release("alpha")
        assert secrets_of(fake, "alpha") == {}
    finally:
        again.api.api_client.close()


async def test_without_rbac_for_secrets_no_pod_is_made(fake: FakeK8s, backend: KubernetesBackend) -> None:
    """No Secret, no pod: the executor never falls back to a literal password (the pod would fail to
    start anyway without its Secret)."""
    fake.forbidden.add("secrets")
    with pytest.raises(Unavailable, match="403"):
        await backend.create(pod(record("alpha")))
    assert not any(name.startswith("alpha-") for _, name in fake.pods)


async def test_a_pod_without_a_password_needs_no_secret(fake: FakeK8s, backend: KubernetesBackend) -> None:
    open_bus = launch.LaunchConfig("nats://nats:4222")  # no token secret, no user in the URL: an open bus
    await backend.create(pod(record("alpha"), cfg=open_bus))
    assert fake.secrets == {} and fake.requests_to("POST", "/secrets") == []
