"""Reading pods back: the listed phases, and the watch (pending, running, exited; exit reasons; dropped,
ended and expired streams; cancel and close).
(The fake API server, the backend and the watcher: k8s_backend_support.)"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import k8s_backend_support
import pytest
from fake_k8s import FakeK8s
from k8s_backend_support import JOB, NS, Watcher, exit_reason, new_backend, spec, until
from pacer.contracts.executor import PodPhase
from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend
from pacer_services.pod_executor.core import ExitReason

# The fixtures of k8s_backend_support (pytest finds them as attributes of this module).
fake = k8s_backend_support.fake
backend = k8s_backend_support.backend
watcher = k8s_backend_support.watcher


def lists(fake: FakeK8s) -> int:
    """Pod list requests (not watches) the fake received."""
    return sum(1 for r in fake.requests_to("GET", "/pods") if r.query.get("watch") != "true")


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
