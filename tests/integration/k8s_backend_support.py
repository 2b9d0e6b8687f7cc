"""What the Kubernetes backend tests share: the job, a pod spec, a backend on the fake API server, a watcher.

These tests (tests/integration/test_k8s_backend_*.py) run the Kubernetes
backend over real HTTP, against the in-process fake API server.  No API
server can run here (docs/design.md), so they check what the backend sends
and how it reads back what a kubelet would report, through the official
client and ``tests/fake_k8s.py``; they say nothing about a real cluster's
scheduling, DNS or garbage collection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import kubernetes.client as k8s
import pytest
from fake_k8s import FakeK8s
from pacer.contracts.executor import PodPhase, PodSpec, PodStatus
from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend
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
