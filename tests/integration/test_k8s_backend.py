"""The Kubernetes backend over real HTTP, against the in-process fake API server.

No API server can run here (docs/design.md), so these tests check what the
backend sends and how it reads back what a kubelet would report, through the
official client and ``tests/fake_k8s.py``; they say nothing about a real
cluster's scheduling, DNS or garbage collection.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import pytest
import yaml
from conftest import InProcess
from fake_k8s import FakeK8s
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode, encode
from pacer.contracts.executor import ClusterStatus, PodPhase, PodSpec, PodStatus
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.embedded import EmbeddedNats
from pacer.errors import Conflict, NotFound, Unavailable
from pacer.jobs.limits import MAX_NODES_PER_ROLE
from pacer.jobs.spec import JOB_NAME_MAX_LEN, parse_job_spec
from pacer.metrics import REGISTRY
from pacer_services.pod_executor.app import ExecutorConfig, ExecutorService
from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend, from_env
from pacer_services.pod_executor.core import ExitInfo, ExitReason, classify

NS = "training"
JOB = "job1"
OWNER = {"apiVersion": "pacer.io/v1", "kind": "PacerJob", "name": JOB, "uid": "6a1f-0042"}
TEMPLATE = Path(__file__).resolve().parents[2] / "deploy/base/pod-templates/worker.yaml"


def spec(node: str = "worker-0", generation: int = 0, job: str = JOB) -> PodSpec:
    role, index = node.split("-")
    return PodSpec(
        name=f"{job}-{node}-g{generation}", job=job, node=node, role=role, index=int(index),
        generation=generation, cpu=1.5, memory_mb=2048,
        command=["python", "-m", "pacer.trainer.worker", "--result", "{pod_dir}/result.json"],
        agent=["python", "-m", "pacer.agent.main", "--ipc", "{pod_dir}/agent.ipc"],
        env={"PACER_AGENT_IPC": "{pod_dir}/agent.ipc", "PACER_NATS_URL": "nats://nats:4222"},
        port=2222,
    )


def exit_reason(s: PodStatus) -> ExitReason:
    return classify(ExitInfo(code=s.exit_code, signal=s.signal, k8s_reason=s.reason, oom=s.oom))


def new_backend(fake: FakeK8s | str, **kw: object) -> KubernetesBackend:
    host = fake if isinstance(fake, str) else fake.host
    api = k8s.ApiClient(k8s.Configuration(host=host))
    return KubernetesBackend(api, NS, "pacer:test", owner=OWNER, service_account="pacer-trainer",
                             watch_timeout_s=30, retry_s=0.05, **kw)  # type: ignore[arg-type]


@pytest.fixture
def fake() -> Iterator[FakeK8s]:
    f = FakeK8s(namespace=NS).start()
    yield f
    f.stop()


@pytest.fixture
async def backend(fake: FakeK8s) -> AsyncIterator[KubernetesBackend]:
    b = new_backend(fake)
    yield b
    await b.close()
    b.api.api_client.close()


async def until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


class Watcher:
    """Runs ``backend.watch()`` in a task and keeps what it yields."""

    def __init__(self, backend: KubernetesBackend) -> None:
        self.seen: list[PodStatus] = []
        self.task = asyncio.create_task(self._run(backend))

    async def _run(self, backend: KubernetesBackend) -> None:
        async for s in backend.watch():
            self.seen.append(s)

    def of(self, name: str) -> list[PodStatus]:
        return [s for s in self.seen if s.name == name]

    def phases(self, name: str) -> list[PodPhase]:
        return [s.phase for s in self.of(name)]

    async def wait(self, name: str, phase: PodPhase) -> PodStatus:
        await until(lambda: any(s.phase is phase for s in self.of(name)))
        return next(s for s in self.of(name) if s.phase is phase)

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def watcher(backend: KubernetesBackend) -> AsyncIterator[Watcher]:
    w = Watcher(backend)
    yield w
    await w.stop()


def lists(fake: FakeK8s) -> int:
    """Pod list requests (not watches) the fake received."""
    return sum(1 for r in fake.requests_to("GET", "/pods") if r.query.get("watch") != "true")


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


# -- list ---------------------------------------------------------------------


async def test_list_maps_phases(fake: FakeK8s, backend: KubernetesBackend) -> None:
    for node in ("worker-0", "worker-1", "worker-2", "ps-0"):
        await backend.create(spec(node))
    await backend.create(spec("worker-0", job="job2"))
    fake.set_running("job1-worker-1-g0", node="node-7")
    fake.set_running("job1-worker-2-g0")
    fake.terminate("job1-worker-2-g0", 0)
    fake.set_running("job1-ps-0-g0")
    fake.terminate("job1-ps-0-g0", 1)

    got = {s.name: s for s in await backend.list(JOB)}
    assert sorted(got) == ["job1-ps-0-g0", "job1-worker-0-g0", "job1-worker-1-g0", "job1-worker-2-g0"]
    assert got["job1-worker-0-g0"].phase is PodPhase.PENDING
    running = got["job1-worker-1-g0"]
    assert running.phase is PodPhase.RUNNING and running.host == "node-7" and running.started_at > 0
    assert (running.job, running.node, running.role, running.generation) == (JOB, "worker-1", "worker", 0)
    assert (running.cpu, running.memory_mb) == (1.5, 2048)
    assert abs(running.created_at - time.time()) < 60
    done = got["job1-worker-2-g0"]
    assert (done.phase, done.exit_code, done.reason) == (PodPhase.EXITED, 0, "Completed")
    assert done.finished_at > 0 and exit_reason(done) is ExitReason.COMPLETED
    failed = got["job1-ps-0-g0"]
    assert (failed.phase, failed.exit_code) == (PodPhase.EXITED, 1)
    assert exit_reason(failed) is ExitReason.USER_ERROR
    assert len(await backend.list()) == 5
    assert fake.requests_to("GET", "/pods")[0].query["labelSelector"] == "app.kubernetes.io/part-of=pacer,pacer.io/job=job1"


# -- watch --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("end", "reason", "code", "expected"),
    [
        (lambda f, n: f.terminate(n, 0), "Completed", 0, ExitReason.COMPLETED),
        (lambda f, n: f.terminate(n, 75), "Error", 75, ExitReason.RESTART_REQUESTED),
        (lambda f, n: f.terminate(n, 137, "OOMKilled"), "OOMKilled", 137, ExitReason.OOM),
        (lambda f, n: f.evict(n), "Evicted", 137, ExitReason.EVICTED),
    ],
    ids=["completed", "kill-restart", "oom", "evicted"],
)
async def test_watch_pending_running_exited(
    fake: FakeK8s, backend: KubernetesBackend, watcher: Watcher,
    end: Callable[[FakeK8s, str], None], reason: str, code: int, expected: ExitReason,
) -> None:
    name = "job1-worker-0-g0"
    await backend.create(spec())
    await watcher.wait(name, PodPhase.PENDING)
    fake.set_running(name)
    await watcher.wait(name, PodPhase.RUNNING)
    end(fake, name)
    s = await watcher.wait(name, PodPhase.EXITED)
    assert watcher.phases(name) == [PodPhase.PENDING, PodPhase.RUNNING, PodPhase.EXITED]
    assert (s.exit_code, s.reason, s.oom) == (code, reason, expected is ExitReason.OOM)
    assert s.finished_at > 0
    assert exit_reason(s) is expected


async def test_trainer_exit_ends_the_pod_while_the_agent_runs(fake: FakeK8s, backend: KubernetesBackend, watcher: Watcher) -> None:
    name = "job1-worker-0-g0"
    await backend.create(spec())
    fake.set_running(name)
    await watcher.wait(name, PodPhase.RUNNING)
    fake.terminate(name, 1, agent_alive=True)
    s = await watcher.wait(name, PodPhase.EXITED)
    assert fake.pods[(NS, name)]["status"]["phase"] == "Running"
    assert (s.exit_code, s.reason) == (1, "Error") and exit_reason(s) is ExitReason.USER_ERROR


async def test_watch_image_pull_error_is_a_config_error(fake: FakeK8s, backend: KubernetesBackend, watcher: Watcher) -> None:
    name = "job1-worker-0-g0"
    await backend.create(spec())
    await watcher.wait(name, PodPhase.PENDING)
    fake.image_pull_error(name)
    s = await watcher.wait(name, PodPhase.EXITED)
    assert watcher.phases(name) == [PodPhase.PENDING, PodPhase.EXITED]
    assert (s.reason, s.exit_code) == ("ErrImagePull", None)
    assert exit_reason(s) is ExitReason.CONFIG_ERROR


async def test_watch_reports_existing_pods_first(fake: FakeK8s, backend: KubernetesBackend) -> None:
    await backend.create(spec("worker-0"))
    await backend.create(spec("worker-1"))
    fake.set_running("job1-worker-1-g0")
    w = Watcher(backend)
    await until(lambda: len(w.seen) == 2)
    assert [(s.name, s.phase) for s in w.seen] == [
        ("job1-worker-0-g0", PodPhase.PENDING), ("job1-worker-1-g0", PodPhase.RUNNING),
    ]
    await w.stop()


async def test_watch_survives_dropped_and_ended_streams(fake: FakeK8s, backend: KubernetesBackend, watcher: Watcher) -> None:
    a, b = "job1-worker-0-g0", "job1-worker-1-g0"
    await backend.create(spec("worker-0"))
    await backend.create(spec("worker-1"))
    await watcher.wait(b, PodPhase.PENDING)
    await until(lambda: fake.open_watches() == 1)
    assert lists(fake) == 1

    fake.drop_watches()  # a dropped connection: re-list, then watch again
    fake.set_running(a)
    await watcher.wait(a, PodPhase.RUNNING)
    await until(lambda: lists(fake) == 2 and fake.open_watches() == 1)

    fake.set_running(b)
    await watcher.wait(b, PodPhase.RUNNING)
    fake.touch(b)  # an event that changes nothing the executor sees: not yielded
    fake.end_watches()  # a clean end (timeoutSeconds): resume from the last version, no list
    await until(lambda: len(fake.requests_to("GET", "/pods")) == 5)
    fake.terminate(a, 0)
    await watcher.wait(a, PodPhase.EXITED)
    assert lists(fake) == 2
    watches = [r for r in fake.requests_to("GET", "/pods") if r.query.get("watch") == "true"]
    assert int(watches[-1].query["resourceVersion"]) > int(watches[-2].query["resourceVersion"])

    # Statuses are not repeated across reconnects.
    assert watcher.phases(a) == [PodPhase.PENDING, PodPhase.RUNNING, PodPhase.EXITED]
    assert watcher.phases(b) == [PodPhase.PENDING, PodPhase.RUNNING]


async def test_watch_relists_after_410_gone(fake: FakeK8s, backend: KubernetesBackend, watcher: Watcher) -> None:
    a = "job1-worker-0-g0"
    await backend.create(spec("worker-0"))
    await watcher.wait(a, PodPhase.PENDING)
    await until(lambda: fake.open_watches() == 1)
    fake.expire_watches()
    await until(lambda: lists(fake) == 2 and fake.open_watches() == 1)
    fake.set_running(a)
    await watcher.wait(a, PodPhase.RUNNING)
    assert watcher.phases(a) == [PodPhase.PENDING, PodPhase.RUNNING]


async def test_watch_reports_a_pod_deleted_while_disconnected(fake: FakeK8s, backend: KubernetesBackend) -> None:
    a = "job1-worker-0-g0"
    await backend.create(spec("worker-0"))
    fake.set_running(a)
    w = Watcher(backend)
    await w.wait(a, PodPhase.RUNNING)
    await until(lambda: fake.open_watches() == 1)
    fake.expire_watches()  # history is gone: only a re-list can tell
    other = new_backend(fake)
    await other.delete(a)  # someone else deletes it
    s = await w.wait(a, PodPhase.EXITED)
    assert s.reason == "Deleted" and exit_reason(s) is ExitReason.KILLED
    await w.stop()
    other.api.api_client.close()


async def test_watch_cancel_stops_the_watch_thread(fake: FakeK8s, backend: KubernetesBackend) -> None:
    w = Watcher(backend)
    await until(lambda: fake.open_watches() == 1)
    await w.stop()
    await until(lambda: not any(t.name == "pacer-k8s-watch" and t.is_alive() for t in threading.enumerate()), 5)


async def test_close_ends_the_watch(fake: FakeK8s, backend: KubernetesBackend) -> None:
    w = Watcher(backend)
    await until(lambda: fake.open_watches() == 1)
    await backend.close()
    await asyncio.wait_for(w.task, 5)


# -- delete, forget, logs, cluster -------------------------------------------


async def test_delete_sends_the_grace_period(fake: FakeK8s, backend: KubernetesBackend, watcher: Watcher) -> None:
    a = "job1-worker-0-g0"
    await backend.create(spec())
    fake.set_running(a)
    await watcher.wait(a, PodPhase.RUNNING)
    await backend.delete(a, grace_s=7)
    (req,) = fake.requests_to("DELETE", f"/pods/{a}")
    assert req.query["gracePeriodSeconds"] == "7"
    assert (NS, a) not in fake.pods

    # The last status stays visible (exited) until forget().
    s = await watcher.wait(a, PodPhase.EXITED)
    assert (s.reason, s.signal) == ("Deleted", 15)
    assert [(x.name, x.phase) for x in await backend.list(JOB)] == [(a, PodPhase.EXITED)]
    await backend.forget(a)
    assert await backend.list(JOB) == []

    await backend.delete("job1-nothing-g0")  # 404: a no-op
    assert len(fake.requests_to("DELETE")) == 3  # forget() tried to delete too


async def test_delete_of_an_exited_pod_keeps_its_exit(fake: FakeK8s, backend: KubernetesBackend) -> None:
    a = "job1-worker-0-g0"
    await backend.create(spec())
    fake.set_running(a)
    fake.terminate(a, 137, "OOMKilled")
    await backend.delete(a, 0)
    (s,) = await backend.list(JOB)
    assert (s.phase, s.reason, s.oom, s.exit_code) == (PodPhase.EXITED, "OOMKilled", True, 137)


async def test_logs(fake: FakeK8s, backend: KubernetesBackend) -> None:
    a = "job1-worker-0-g0"
    await backend.create(spec())
    fake.set_log(a, "one\ntwo\nthree\n")
    fake.set_log(a, "agent up\n", container="agent")
    assert await backend.logs(a, tail=2) == "two\nthree\n"
    assert await backend.logs(a, container="agent") == "agent up\n"
    assert fake.requests_to("GET", "/log")[0].query == {"container": "trainer", "tailLines": "2"}
    assert await backend.logs("job1-nothing-g0") == ""  # as the local backend


# -- in-place resize ------------------------------------------------------------


def trainer_and_agent(fake: FakeK8s, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stored pod's trainer and agent containers, by name."""
    by_name = {c["name"]: c for c in fake.pods[(NS, name)]["spec"]["containers"]}
    return by_name["trainer"], by_name["agent"]


def container_status(fake: FakeK8s, name: str, container: str) -> dict[str, Any]:
    (st,) = [s for s in fake.pods[(NS, name)]["status"]["containerStatuses"] if s["name"] == container]
    return st


async def test_resize_raises_the_trainers_memory_in_place(fake: FakeK8s, backend: KubernetesBackend,
                                                          watcher: Watcher) -> None:
    a = "job1-worker-0-g0"
    await backend.create(spec())
    fake.set_running(a)
    await watcher.wait(a, PodPhase.RUNNING)
    uid = fake.pods[(NS, a)]["metadata"]["uid"]
    agent_before = copy.deepcopy(trainer_and_agent(fake, a)[1])

    await backend.resize(a, 4096)

    trainer, agent = trainer_and_agent(fake, a)
    assert trainer["resources"] == {"requests": {"cpu": "1500m", "memory": "4096Mi"},
                                    "limits": {"cpu": "1500m", "memory": "4096Mi"}}  # the CPU stays
    assert agent == agent_before
    assert container_status(fake, a, "trainer")["resources"]["limits"]["memory"] == "4096Mi"
    assert container_status(fake, a, "agent")["resources"] == agent_before["resources"]
    # In place: the same pod (no delete, no second create), its trainer still running.
    assert fake.pods[(NS, a)]["metadata"]["uid"] == uid
    assert not fake.requests_to("DELETE") and len(fake.requests_to("POST", "/pods")) == 1
    (patch,) = fake.requests_to("PATCH")
    assert patch.path == f"/api/v1/namespaces/{NS}/pods/{a}/resize"
    assert "running" in container_status(fake, a, "trainer")["state"]

    (s,) = await backend.list(JOB)
    assert (s.phase, s.memory_mb, s.cpu) == (PodPhase.RUNNING, 4096, 1.5)
    await until(lambda: watcher.of(a)[-1].memory_mb == 4096)  # the watch reports it too
    assert [x.memory_mb for x in watcher.of(a)][-2:] == [2048, 4096]


async def test_memory_is_what_the_container_has_while_a_resize_is_pending(
        fake: FakeK8s, backend: KubernetesBackend) -> None:
    a, b = "job1-worker-0-g0", "job1-worker-1-g0"
    await backend.create(spec("worker-0"))
    await backend.create(spec("worker-1"))
    fake.set_running(a)
    fake.kubelet_resizes = False  # e.g. the node has no room yet
    await backend.resize(a, 3072)
    await backend.resize(b, 3072)  # not started: nothing to apply it to, the spec is all there is
    trainer, _ = trainer_and_agent(fake, a)
    assert trainer["resources"]["limits"]["memory"] == "3072Mi"  # desired ...
    assert container_status(fake, a, "trainer")["resources"]["limits"]["memory"] == "2048Mi"  # ... not actual
    got = {s.name: s.memory_mb for s in await backend.list(JOB)}
    assert got == {a: 2048, b: 3072}

    fake.kubelet_resizes = True
    await backend.resize(a, 3072)
    assert {s.name: s.memory_mb for s in await backend.list(JOB)}[a] == 3072


async def test_a_template_keeps_its_own_resize_policy(fake: FakeK8s) -> None:
    tpl = yaml.safe_load(TEMPLATE.read_text())
    own = [{"resourceName": "cpu", "restartPolicy": "NotRequired"},
           {"resourceName": "memory", "restartPolicy": "RestartContainer"}]
    next(c for c in tpl["spec"]["containers"] if c["name"] == "trainer")["resizePolicy"] = own
    b = new_backend(fake, template=tpl)
    try:
        await b.create(spec("worker-0"))
        assert trainer_and_agent(fake, "job1-worker-0-g0")[0]["resizePolicy"] == own
    finally:
        b.api.api_client.close()


async def test_resize_of_an_unknown_pod_is_not_found(fake: FakeK8s, backend: KubernetesBackend) -> None:
    with pytest.raises(NotFound, match="job1-nothing-g0"):
        await backend.resize("job1-nothing-g0", 4096)
    assert fake.requests_to("GET", "/pods/job1-nothing-g0")  # a 404 on the subresource: is the pod there?
    with pytest.raises(ValueError):
        await backend.resize("job1-nothing-g0", 0)


async def test_a_server_before_1_33_refuses_the_resize(fake: FakeK8s, backend: KubernetesBackend) -> None:
    a = "job1-worker-0-g0"
    fake.resize_subresource = False
    await backend.create(spec())
    fake.set_running(a)
    with pytest.raises(Conflict, match=r"1\.33.*404 NotFound: the server could not find the requested resource") as e:
        await backend.resize(a, 4096)
    assert not e.value.temporary
    assert trainer_and_agent(fake, a)[0]["resources"]["limits"]["memory"] == "2048Mi"
    (s,) = await backend.list(JOB)
    assert s.memory_mb == 2048  # from the spec: such a kubelet reports no resources in the status
    with pytest.raises(NotFound):  # an unknown pod is still NotFound there
        await backend.resize("job1-nothing-g0", 4096)


async def test_refused_resizes_are_conflicts_with_the_apis_reason(fake: FakeK8s, backend: KubernetesBackend) -> None:
    a = "job1-worker-0-g0"
    await backend.create(spec())
    fake.set_running(a)
    with pytest.raises(Conflict, match=r"422 Invalid: .*memory limits cannot be decreased"):
        await backend.resize(a, 1024)  # 1.33 lowers no memory limit under NotRequired
    fake.forbidden.add("pods/resize")  # the Role lacks patch on pods/resize
    with pytest.raises(Conflict, match=r'403 Forbidden: .*cannot patch resource "pods/resize"'):
        await backend.resize(a, 4096)
    assert trainer_and_agent(fake, a)[0]["resources"]["limits"]["memory"] == "2048Mi"

    down = new_backend("http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(Unavailable):
        await down.resize(a, 4096)
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


def test_cluster_addresses(fake: FakeK8s) -> None:
    b = new_backend(fake)
    c = b.cluster(JOB, 2, 3)
    assert c.ps == ("job1-ps-0.job1.training.svc:2222", "job1-ps-1.job1.training.svc:2222")
    assert c.workers[2] == "job1-worker-2.job1.training.svc:2222" and len(c.workers) == 3
    assert b.pod_port(c, "worker", 1) == 2222 and b.name == "kubernetes"
    b.api.api_client.close()


async def test_release_deletes_the_jobs_headless_service(fake: FakeK8s, backend: KubernetesBackend) -> None:
    await backend.create(spec())
    assert (NS, JOB) in fake.services
    await backend.release(JOB)
    assert (NS, JOB) not in fake.services
    await backend.release(JOB)  # gone already: a 404 is fine


# -- placement and machines ---------------------------------------------------


def preferred_hosts(pod: dict[str, object]) -> list[tuple[int, list[str]]]:
    """(weight, hostnames) of each preferred node-affinity term on kubernetes.io/hostname."""
    terms = (pod["spec"].get("affinity", {}).get("nodeAffinity", {})  # type: ignore[attr-defined]
             .get("preferredDuringSchedulingIgnoredDuringExecution", []))
    return [(t["weight"], e["values"]) for t in terms for e in t["preference"]["matchExpressions"]
            if e["key"] == "kubernetes.io/hostname" and e["operator"] == "In"]


async def test_a_placed_pod_prefers_its_machine_softly(fake: FakeK8s) -> None:
    """The placement becomes a preferred (never a required) node affinity, added to the template's own."""
    tpl = yaml.safe_load(TEMPLATE.read_text())
    own = {"weight": 5, "preference": {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}}
    tpl["spec"]["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [own]}}
    b = new_backend(fake, template=tpl)
    try:
        await b.create(replace(spec("worker-0"), machine="node-b"))
        await b.create(replace(spec("worker-1"), machine="Not A Hostname!"))  # could not match: dropped
        pod = fake.pods[(NS, "job1-worker-0-g0")]
        affinity = pod["spec"]["affinity"]["nodeAffinity"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity
        assert affinity["preferredDuringSchedulingIgnoredDuringExecution"][0] == own
        assert preferred_hosts(pod) == [(100, ["node-b"])]
        assert preferred_hosts(fake.pods[(NS, "job1-worker-1-g0")]) == []
        assert tpl["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [own]
    finally:
        b.api.api_client.close()


async def test_machines_are_ready_schedulable_nodes_with_what_is_free(fake: FakeK8s) -> None:
    fake.add_node("node-a", "8", "32Gi")
    fake.add_node("node-b", "4", "16Gi", hostname="b.example")  # affinity matches the hostname label
    fake.add_node("node-cordoned", "64", "256Gi", unschedulable=True)
    fake.add_node("node-down", "64", "256Gi", ready=False)
    fake.add_node("node-gpu", "32", "128Gi", taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}])
    fake.add_node("node-pref", "2", "8Gi", taints=[{"key": "spot", "effect": "PreferNoSchedule"}])
    b = new_backend(fake, machines_every_s=0.0)
    try:
        await b.create(spec("worker-0"))  # 1.5 CPUs / 2 GiB + the agent's 100m / 128 MiB
        await b.create(spec("ps-0", job="job2"))
        await b.create(spec("worker-1"))  # never scheduled: holds nothing
        fake.set_running("job1-worker-0-g0", node="node-a")
        fake.set_running("job2-ps-0-g0", node="node-a")
        fake.add_foreign_pod("web-1", "other", "node-b", "1500m", "3Gi")
        fake.add_foreign_pod("done-1", "other", "node-b", "2", "8Gi", phase="Succeeded")
        fake.terminate("job2-ps-0-g0", 0)  # Succeeded: its requests are free again
        machines = {m.name: m for m in await b.machines()}
        assert sorted(machines) == ["b.example", "node-a", "node-pref"]
        a, bb = machines["node-a"], machines["b.example"]
        assert (a.cpu, a.memory_mb) == (8.0, 32 * 1024)
        assert a.free_cpu == pytest.approx(8 - 1.6) and a.free_memory_mb == 32 * 1024 - 2048 - 128
        assert a.held_cpu == {"job1": pytest.approx(1.6)} and a.held_memory_mb == {"job1": 2048 + 128}
        # a foreign pod counts against the free capacity, not as anyone's own
        assert (bb.free_cpu, bb.free_memory_mb, bb.held_cpu) == (2.5, 13 * 1024, {})
        listed = fake.requests_to("GET", "/api/v1/pods")
        assert listed and listed[-1].query["fieldSelector"] == "status.phase!=Succeeded,status.phase!=Failed"
    finally:
        b.api.api_client.close()


async def test_tolerated_taints_count_and_listing_is_throttled(fake: FakeK8s) -> None:
    fake.add_node("node-gpu", "32", "128Gi", taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}])
    tpl = yaml.safe_load(TEMPLATE.read_text())
    tpl["spec"]["tolerations"] = [{"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]
    only_worker = new_backend(fake, template={"worker": tpl, "ps": yaml.safe_load(TEMPLATE.read_text())})
    both = new_backend(fake, template={"worker": tpl, "ps": tpl}, machines_every_s=3600.0)
    try:
        assert await only_worker.machines() == []  # a PS could not go there
        assert [m.name for m in await both.machines()] == ["node-gpu"]
        fake.add_node("node-new", "8", "32Gi")
        nodes_before = len(fake.requests_to("GET", "/api/v1/nodes"))
        assert [m.name for m in await both.machines()] == ["node-gpu"]  # reused within machines_every_s
        assert len(fake.requests_to("GET", "/api/v1/nodes")) == nodes_before
    finally:
        only_worker.api.api_client.close()
        both.api.api_client.close()


async def test_machines_unknown_when_the_api_fails() -> None:
    b = new_backend("http://127.0.0.1:9", machines_every_s=0.0)  # nothing listens there
    try:
        assert await b.machines() == []
    finally:
        b.api.api_client.close()


async def test_the_executor_places_pods_and_reports_machines(fake: FakeK8s, nats_server: EmbeddedNats,
                                                             bus: Bus) -> None:
    """A plan with a placement, through the real executor and the fake API server: each pod prefers its
    node's machine; the ClusterStatus on the bus lists the machines, with what the job holds."""
    fake.add_node("node-a", "8", "32Gi")
    fake.add_node("node-b", "8", "32Gi")
    statuses: list[ClusterStatus] = []

    async def on_status(m: Msg) -> None:
        statuses.append(decode(ClusterStatus, m.data))

    await bus.nc.subscribe(subjects.cluster_status(), cb=on_status)
    job_spec = parse_job_spec(f"name: {JOB}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    rec = JobRecord(JOB, job_spec, JobState.PLANNING, time.time(), data_path="/data/train.rec", records=1000)
    await (await bus.kv(subjects.JOB_BUCKET)).put(JOB, encode(rec))
    backend = new_backend(fake, machines_every_s=0.0)
    cfg = ExecutorConfig(backend="kubernetes", cluster_every_s=0.1, durable="executor-k8s-test", reconcile_s=0.2)
    svc = InProcess(nats_server.url, lambda b: ExecutorService(b, backend, cfg))
    await svc.start()
    try:
        plan = ResourcePlan(JOB, 2, 1, 1.0, 1024, 2.0, 2048, PlanSource.BRAIN,
                            placement={"ps-0": "node-b", "worker-0": "node-b", "worker-1": "node-a"})
        await bus.publish_durable(subjects.job_event(JOB, subjects.JobEventKind.PLAN), plan)
        names = {f"{JOB}-{n}-g0" for n in ("ps-0", "worker-0", "worker-1")}
        await until(lambda: names <= {name for _, name in fake.pods})
        assert preferred_hosts(fake.pods[(NS, f"{JOB}-ps-0-g0")]) == [(100, ["node-b"])]
        assert preferred_hosts(fake.pods[(NS, f"{JOB}-worker-0-g0")]) == [(100, ["node-b"])]
        assert preferred_hosts(fake.pods[(NS, f"{JOB}-worker-1-g0")]) == [(100, ["node-a"])]
        fake.set_running(f"{JOB}-ps-0-g0", node="node-b")
        await until(lambda: any(m.held_cpu for s in statuses[-1:] for m in s.machines), timeout=15)
        last = statuses[-1]
        assert last.backend == "kubernetes" and last.reserves_capacity
        by_name = {m.name: m for m in last.machines}
        assert sorted(by_name) == ["node-a", "node-b"]
        # ps-0's trainer (2 CPU) and its agent sidecar (100m): PS pods have an agent too.
        assert by_name["node-b"].held_cpu[JOB] == pytest.approx(2.1) and by_name["node-b"].free_cpu == pytest.approx(5.9)
        assert last.total_cpu == 16.0 and last.free_cpu == pytest.approx(13.9)
    finally:
        await svc.stop()
        await backend.close()
        backend.api.api_client.close()
