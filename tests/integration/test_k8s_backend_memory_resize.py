"""In-place memory resize of the trainer container: applied without a restart, reported while pending,
and refused with the API's reason (unknown pod, a server before 1.33, a lowered limit, no RBAC).
(The fake API server, the backend and the watcher: k8s_backend_support.)"""

from __future__ import annotations

import copy
from typing import Any

import k8s_backend_support
import pytest
import yaml
from fake_k8s import FakeK8s
from k8s_backend_support import JOB, NS, TEMPLATE, Watcher, new_backend, spec, until
from pacer.contracts.executor import PodPhase
from pacer.errors import Conflict, NotFound, Unavailable
from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend

# The fixtures of k8s_backend_support (pytest finds them as attributes of this module).
fake = k8s_backend_support.fake
backend = k8s_backend_support.backend
watcher = k8s_backend_support.watcher


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
