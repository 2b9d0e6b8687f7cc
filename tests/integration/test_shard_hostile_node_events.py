"""Node-death events: malformed ones are dead-lettered and terminated, not redelivered; the death of a node of
an unknown job is acked and ignored.
(The module's nats-server and shard service, and the checks: shard_hostile_support.)"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import shard_hostile_support
from pacer import subjects
from pacer.codec import encode
from pacer.contracts.nodes import NodeEvent
from shard_hostile_support import JOB, NODE, Harness

# The fixtures of shard_hostile_support (pytest finds them as attributes of this module).
h = shard_hostile_support.h


# ====================================================================== node events
def test_malformed_node_events_are_dead_lettered_and_terminated(h: Harness) -> None:
    died = subjects.event("node", JOB, "died")
    cases: list[tuple[str, bytes]] = [
        (died, b""),
        (died, b"\xc1"),
        (died, b"not msgpack at all"),
        (died, msgpack.packb([JOB, NODE, "died"])),
        (died, msgpack.packb({"job": JOB})),
        (died, msgpack.packb({"job": JOB, "node": 5, "kind": "died", "ts": 0.0})),
        (died, msgpack.packb({"job": JOB, "node": NODE, "kind": "died", "ts": "yesterday"})),
        # Well-formed, but published under another job's subject: it must not kill JOB's node.
        (subjects.event("node", "ghost", "died"), encode(NodeEvent(JOB, NODE, "died", 0.0, "spoofed"))),
    ]
    durable = h.service.cfg.node_events_durable

    async def go() -> tuple[list[Any], Any]:
        sub = await h.b.nc.subscribe(subjects.dead_letter("shard"))
        for subject, data in cases:
            await h.b.js.publish(subject, data, timeout=5.0)
        letters = [await sub.next_msg(timeout=10.0) for _ in cases]
        await sub.unsubscribe()
        info = None
        for _ in range(100):
            info = await h.b.js.consumer_info(subjects.EVENTS_STREAM, durable)
            if info.num_ack_pending == 0 and info.num_pending == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a nak'd or un-acked message would come back
        return letters, await h.b.js.consumer_info(subjects.EVENTS_STREAM, durable)

    before = h.counters()
    info0 = h.run(h.b.js.consumer_info(subjects.EVENTS_STREAM, durable))
    letters, info = h.run(go(), 60)
    for (subject, data), letter in zip(cases, letters, strict=True):
        assert letter.data == data
        assert letter.headers["Pacer-Subject"] == subject
        assert len(letter.headers["Pacer-Error"]) >= 8, letter.headers
    assert "job" in letters[-1].headers["Pacer-Error"]
    after = h.counters()
    assert after["bad_node_events"] == before.get("bad_node_events", 0) + len(cases)
    assert after.get("node_deaths", 0) == before.get("node_deaths", 0)
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0
    assert info.delivered.consumer_seq == info0.delivered.consumer_seq + len(cases), "redelivered"
    assert h.status() == h.baseline


def test_death_of_a_node_of_an_unknown_job_is_acked_and_ignored(h: Harness) -> None:
    durable = h.service.cfg.node_events_durable
    before = h.counters()
    info0 = h.run(h.b.js.consumer_info(subjects.EVENTS_STREAM, durable))

    async def go() -> Any:
        await h.b.publish_durable(subjects.event("node", "ghost", "died"), NodeEvent("ghost", NODE, "died", 0.0))
        for _ in range(100):
            info = await h.b.js.consumer_info(subjects.EVENTS_STREAM, durable)
            if info.delivered.consumer_seq > info0.delivered.consumer_seq and info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        return await h.b.js.consumer_info(subjects.EVENTS_STREAM, durable)

    info = h.run(go())
    assert info.delivered.consumer_seq == info0.delivered.consumer_seq + 1
    assert info.num_ack_pending == 0 and info.num_redelivered == 0
    after = h.counters()
    assert after.get("bad_node_events", 0) == before.get("bad_node_events", 0)
    assert after.get("node_deaths", 0) == before.get("node_deaths", 0)
    assert h.status() == h.baseline and h.jobs() == h.jobs_before
