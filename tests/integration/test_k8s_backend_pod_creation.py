"""Creating pods: what the backend builds (labels, owner, containers, resources, the job's headless Service),
from the deploy templates too, and how the API's refusals come back.
(The fake API server, the backend and the watcher: k8s_backend_support.)"""

from __future__ import annotations

import json

import k8s_backend_support
import pytest
import yaml
from fake_k8s import FakeK8s
from k8s_backend_support import JOB, NS, OWNER, TEMPLATE, new_backend, spec
from pacer.contracts.executor import PodSpec
from pacer.errors import Conflict, Unavailable
from pacer.jobs.limits import MAX_NODES_PER_ROLE
from pacer.jobs.spec import JOB_NAME_MAX_LEN
from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend, from_env

# The fixtures of k8s_backend_support (pytest finds them as attributes of this module).
fake = k8s_backend_support.fake
backend = k8s_backend_support.backend


# -- create -------------------------------------------------------------------


async def test_create_builds_the_pod(fake: FakeK8s, backend: KubernetesBackend) -> None:
    await backend.create(spec("worker-0"))
    await backend.create(spec("ps-1"))

    pod = fake.pods[(NS, "job1-worker-0-g0")]
    assert "{pod_dir}" not in json.dumps(pod)
    md, ps = pod["metadata"], pod["spec"]
    assert md["labels"] == {
        "app.kubernetes.io/part-of": "pacer", "pacer.io/job": JOB, "pacer.io/node": "worker-0",
        "pacer.io/role": "worker", "pacer.io/index": "0", "pacer.io/generation": "0",
    }
    assert md["ownerReferences"] == [OWNER]
    assert ps["restartPolicy"] == "Never"
    assert ps["hostname"] == "job1-worker-0" and ps["subdomain"] == JOB
    assert ps["shareProcessNamespace"] is True
    assert ps["serviceAccountName"] == "pacer-trainer"
    assert ps["volumes"] == [{"name": "pod-dir", "emptyDir": {}}]
    assert "affinity" not in ps  # no placement, no preference
    trainer, agent = ps["containers"]
    assert trainer["name"] == "trainer" and agent["name"] == "agent"
    assert trainer["image"] == agent["image"] == "pacer:test"
    assert trainer["command"] == ["python", "-m", "pacer.trainer.worker", "--result", "/var/run/pacer/result.json"]
    assert agent["command"] == ["python", "-m", "pacer.agent.main", "--ipc", "/var/run/pacer/agent.ipc"]
    assert trainer["resources"] == {"requests": {"cpu": "1500m", "memory": "2048Mi"},
                                    "limits": {"cpu": "1500m", "memory": "2048Mi"}}
    assert agent["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert trainer["ports"] == [{"name": "tf-grpc", "containerPort": 2222}]
    # The trainer's memory can be raised in place, without a restart (resize); the agent's is fixed.
    assert trainer["resizePolicy"] == [{"resourceName": "memory", "restartPolicy": "NotRequired"}]
    assert "resizePolicy" not in agent
    for c in (trainer, agent):
        assert {"name": "PACER_AGENT_IPC", "value": "/var/run/pacer/agent.ipc"} in c["env"]
        assert c["volumeMounts"] == [{"name": "pod-dir", "mountPath": "/var/run/pacer"}]

    # The headless Service of the job: created once, for the first pod.
    posts = fake.requests_to("POST", "/services")
    assert len(posts) == 1
    svc = fake.services[(NS, JOB)]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"app.kubernetes.io/part-of": "pacer", "pacer.io/job": JOB}
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["ownerReferences"] == [OWNER]


async def test_service_exists_after_an_executor_restart(fake: FakeK8s, backend: KubernetesBackend) -> None:
    await backend.create(spec("worker-0"))
    again = new_backend(fake)  # a restarted executor does not know the Service exists: 409 is fine
    await again.create(spec("worker-1"))
    assert [r.path for r in fake.requests_to("POST", "/services")] == [f"/api/v1/namespaces/{NS}/services"] * 2
    assert (NS, "job1-worker-1-g0") in fake.pods
    again.api.api_client.close()


async def test_create_without_agent_or_port(fake: FakeK8s, backend: KubernetesBackend) -> None:
    bare = PodSpec(name="job1-ps-0-g0", job=JOB, node="ps-0", role="ps", index=0, generation=0,
                   cpu=0.25, memory_mb=512, command=["python", "-c", "pass"])
    await backend.create(bare)
    (trainer,) = fake.pods[(NS, "job1-ps-0-g0")]["spec"]["containers"]
    assert "ports" not in trainer
    assert trainer["resources"]["limits"] == {"cpu": "250m", "memory": "512Mi"}


async def test_create_from_the_deploy_template(fake: FakeK8s) -> None:
    b = new_backend(fake, template=yaml.safe_load(TEMPLATE.read_text()))
    await b.create(spec("worker-3"))
    pod = fake.pods[(NS, "job1-worker-3-g0")]
    md, ps = pod["metadata"], pod["spec"]
    assert md["labels"]["pacer.io/job"] == JOB and md["labels"]["pacer.io/index"] == "3"
    assert md["labels"]["app.kubernetes.io/name"] == "pacer-trainer"
    assert ps["securityContext"]["runAsUser"] == 10001
    assert ps["terminationGracePeriodSeconds"] == 60
    assert [v["name"] for v in ps["volumes"]] == ["nats-ca", "data", "checkpoints", "pod-dir"]  # the template's + ours
    trainer = ps["containers"][0]
    assert "args" not in trainer  # the PodSpec argv is the whole command line
    assert trainer["command"][:3] == ["python", "-m", "pacer.trainer.worker"]
    env = {e["name"]: e for e in trainer["env"]}
    assert ps["securityContext"]["fsGroup"] == 10001  # the template's pod-level settings are kept
    assert env["PACER_AGENT_IPC"]["value"] == "/var/run/pacer/agent.ipc"  # the PodSpec's wins
    assert [m["name"] for m in trainer["volumeMounts"]] == ["nats-ca", "data", "checkpoints", "pod-dir"]
    b.api.api_client.close()


async def test_each_job_mounts_only_its_own_checkpoint_directory(fake: FakeK8s) -> None:
    """With the executor's checkpoint root, the template's mount there shows the job's directory only."""
    root = "/var/lib/pacer/checkpoints"  # where deploy/base/pod-templates/worker.yaml mounts the PVC
    b = new_backend(fake, template=yaml.safe_load(TEMPLATE.read_text()), checkpoint_root=root + "/")
    for job in ("team-a", "team-b"):
        await b.create(spec("worker-0", job=job))
    for job, other in (("team-a", "team-b"), ("team-b", "team-a")):
        pod = fake.pods[(NS, f"{job}-worker-0-g0")]
        claims = {v["name"] for v in pod["spec"]["volumes"]
                  if v.get("persistentVolumeClaim", {}).get("claimName") == "pacer-checkpoints"}
        mounts = [m for c in pod["spec"]["containers"] for m in c["volumeMounts"] if m["name"] in claims]
        assert mounts == [{"name": "checkpoints", "mountPath": f"{root}/{job}", "subPath": job}]
        assert not any(m["mountPath"] in (root, f"{root}/{other}") for m in mounts)
    b.api.api_client.close()


async def test_the_longest_job_name_gives_valid_pod_hostnames(fake: FakeK8s, backend: KubernetesBackend) -> None:
    job = "j" * JOB_NAME_MAX_LEN  # what the spec lets through, with the highest node index it allows
    await backend.create(spec(f"worker-{MAX_NODES_PER_ROLE - 1}", job=job))
    (pod,) = [p for (_, name), p in fake.pods.items() if name.startswith(job)]
    assert len(pod["spec"]["hostname"]) == 63  # the fake refuses hostnames over 63 characters, as the API server


async def test_duplicate_create_is_a_conflict(fake: FakeK8s, backend: KubernetesBackend) -> None:
    await backend.create(spec())
    with pytest.raises(Conflict):
        await backend.create(spec())


async def test_api_errors_are_unavailable(fake: FakeK8s, backend: KubernetesBackend) -> None:
    bad = PodSpec(name="Job1_Worker", job=JOB, node="worker-0", role="worker", index=0, generation=0,
                  cpu=1, memory_mb=1, command=["python"])
    with pytest.raises(Unavailable, match="422") as e:
        await backend.create(bad)
    assert e.value.temporary

    down = new_backend("http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(Unavailable):
        await down.list()
    down.api.api_client.close()


async def test_from_env_uses_the_role_templates(fake: FakeK8s) -> None:
    b = from_env({
        "PACER_KUBE_HOST": fake.host, "PACER_NAMESPACE": NS, "PACER_TRAINER_IMAGE": "reg/pacer:9",
        "PACER_POD_TEMPLATES": str(TEMPLATE.parent), "PACER_OWNER": json.dumps(OWNER),
    })
    await b.create(spec("ps-0"))
    await b.create(spec("worker-0"))
    ps, worker = fake.pods[(NS, "job1-ps-0-g0")], fake.pods[(NS, "job1-worker-0-g0")]
    assert ps["spec"]["terminationGracePeriodSeconds"] == 30  # ps.yaml
    assert worker["spec"]["terminationGracePeriodSeconds"] == 60  # worker.yaml
    assert ps["spec"]["containers"][0]["image"] == "reg/pacer:9"
    assert ps["metadata"]["ownerReferences"] == [OWNER]
    assert "serviceAccountName" not in ps["spec"]
    b.api.api_client.close()
