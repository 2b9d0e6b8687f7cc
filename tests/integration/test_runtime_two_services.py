"""Two services in one process stop independently: stopping one cancels only its own tasks.

``run_service`` cancels a stopping service's long-lived ``pacer:`` tasks;
it used to cancel every such task of the process, so stopping one of two
in-process instances (the HA tests run two instances of a service) also
killed the other's loops.  Real bus; the services are minimal.
"""

from __future__ import annotations

import asyncio

from pacer import telemetry
from pacer.bus import Bus
from pacer.embedded import EmbeddedNats
from pacer.runtime import RuntimeConfig, run_service


class Looper:
    def __init__(self, name: str) -> None:
        self.name = name
        self.counters = telemetry.Counters(name)
        self.ticks = 0
        self.task: asyncio.Task[None] | None = None
        self.child: asyncio.Task[None] | None = None

    async def start(self, tg: asyncio.TaskGroup) -> None:
        async def child() -> None:
            await asyncio.Event().wait()

        async def loop() -> None:
            # A task of the service spawns another, outside the task group (as per-job loops do).
            self.child = asyncio.create_task(child(), name=f"pacer:{self.name}:child")
            while True:
                self.ticks += 1
                await asyncio.sleep(0.01)

        self.task = asyncio.create_task(loop(), name=f"pacer:{self.name}:loop")

    async def drain(self) -> None:
        return None


async def test_stopping_one_service_leaves_the_others_tasks_running(nats_server: EmbeddedNats) -> None:
    a, b = Looper("svc-a"), Looper("svc-b")
    stop_a, stop_b = asyncio.Event(), asyncio.Event()

    async def make(svc: Looper):  # type: ignore[no-untyped-def]
        async def factory(bus: Bus, cfg: RuntimeConfig) -> Looper:
            return svc
        return factory

    cfg = RuntimeConfig(nats_url=nats_server.url, drain_s=1.0)
    run_a = asyncio.create_task(run_service(await make(a), cfg, stop_a, install_signals=False))
    run_b = asyncio.create_task(run_service(await make(b), cfg, stop_b, install_signals=False))
    while not (a.child and b.child):
        await asyncio.sleep(0.01)
    stop_a.set()
    await asyncio.wait_for(run_a, 30)
    assert a.task is not None and a.task.done() and a.child.done()
    before = b.ticks
    await asyncio.sleep(0.2)
    assert b.task is not None and not b.task.done() and not b.child.done()
    assert b.ticks > before  # still working
    stop_b.set()
    await asyncio.wait_for(run_b, 30)
    assert b.task.done() and b.child.done()
