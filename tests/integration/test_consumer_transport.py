"""A handler that fails because the bus failed under it (a JetStream leader election, a reconnect)
gets its event again; it is not dead-lettered.

Found by the chaos runs: the job service's KV write for a dataset's
``finished`` event raised ``NoStreamResponseError`` while the KV stream
elected a leader; the event was dead-lettered and the job stayed RUNNING
for ever.  Real nats-server and JetStream; the failure is raised by the
handler exactly as nats-py raises it.
"""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import Bus
from pacer.consumer import DurableConsumer
from pacer.contracts.agent import Heartbeat
from pacer.telemetry import Counters


@pytest.mark.parametrize("failure", [nats.js.errors.NoStreamResponseError(), nats.errors.TimeoutError(),
                                     nats.js.errors.ServiceUnavailableError()],
                         ids=["no-stream-response", "timeout", "unavailable"])
async def test_a_transport_failure_redelivers_the_event(bus: Bus, failure: Exception) -> None:
    seen: list[int] = []
    dead: list[Msg] = []

    async def on_dead(msg: Msg) -> None:
        dead.append(msg)

    await bus.nc.subscribe(subjects.dead_letter("t-svc"), cb=on_dead)

    async def handle(m: Msg) -> None:
        seen.append(m.metadata.num_delivered)
        if len(seen) == 1:
            raise failure

    counters = Counters("t-svc")
    consumer = DurableConsumer(bus, "t-svc", f"t-{type(failure).__name__}", ["pacer.events.agent.tj.>"],
                               handle, counters, retry_delay_s=0.1)
    task = asyncio.create_task(consumer.run())
    try:
        await bus.publish_durable("pacer.events.agent.tj.metrics",  # any stored event: the payload is not read
                                  Heartbeat(job="tj", node="worker-0", role="worker", ts=1.0, instance="h-1",
                                            primary=False, trainer_alive=True))
        for _ in range(500):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.01)
        await bus.nc.flush()
        assert seen[:2] == [1, 2]  # delivered again after the failure
        assert not dead
        assert counters.snapshot().get("events_retried", 0) >= 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_bug_in_a_handler_is_still_dead_lettered(bus: Bus) -> None:
    dead: list[Msg] = []

    async def on_dead(msg: Msg) -> None:
        dead.append(msg)

    await bus.nc.subscribe(subjects.dead_letter("t-bug"), cb=on_dead)

    async def handle(m: Msg) -> None:
        raise KeyError("a bug, not the bus")

    consumer = DurableConsumer(bus, "t-bug", "t-bug", ["pacer.events.agent.tb.>"], handle, Counters("t-bug"))
    task = asyncio.create_task(consumer.run())
    try:
        await bus.publish_durable("pacer.events.agent.tb.metrics",  # any stored event: the payload is not read
                                  Heartbeat(job="tb", node="worker-0", role="worker", ts=1.0, instance="h-1",
                                            primary=False, trainer_alive=True))
        for _ in range(500):
            if dead:
                break
            await asyncio.sleep(0.01)
        assert len(dead) == 1 and "KeyError" in (dead[0].headers or {}).get("Pacer-Error", "")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
