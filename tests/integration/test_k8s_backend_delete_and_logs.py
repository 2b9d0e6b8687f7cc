"""Deleting and forgetting pods, their logs, the job's cluster addresses and the release of its headless Service.
(The fake API server, the backend and the watcher: k8s_backend_support.)"""

from __future__ import annotations

import k8s_backend_support
from fake_k8s import FakeK8s
from k8s_backend_support import JOB, NS, Watcher, new_backend, spec
from pacer.contracts.executor import PodPhase
from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend

# The fixtures of k8s_backend_support (pytest finds them as attributes of this module).
fake = k8s_backend_support.fake
backend = k8s_backend_support.backend
watcher = k8s_backend_support.watcher


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
