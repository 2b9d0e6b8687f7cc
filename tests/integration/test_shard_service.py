"""The shard service over a real nats-server: coverage, leases, deaths, checkpoints."""

from __future__ import annotations

import asyncio

import pytest
from pacer import subjects
from pacer.bus import Bus
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetSpec, ShardLease
from pacer.errors import NotFound
from pacer.shards.client import ShardAdmin, ShardClient

JOB = "job1"


def spec(records: int = 20_000, **kw: object) -> DatasetSpec:
    base: dict[str, object] = dict(job=JOB, dataset="train", records=records, batch_size=10, batches_per_shard=10)
    base.update(kw)
    return DatasetSpec(**base)  # type: ignore[arg-type]


async def consume(bus: Bus, node: str, got: list[tuple[str, ShardLease]], prefetch: int = 4, **kw: object) -> None:
    c = ShardClient(bus, JOB, "train", node, prefetch=prefetch, **kw)  # type: ignore[arg-type]
    await c.start()
    while (s := await c.next()) is not None:
        got.append((node, s))
        c.done(s)
    await c.close()


def assert_exact_cover(got: list[tuple[str, ShardLease]], records: int, epochs: int = 1) -> None:
    for epoch in range(epochs):
        ranges = sorted((s.start, s.end) for _, s in got if s.epoch == epoch)
        pos = 0
        for a, b in ranges:
            assert a == pos, f"epoch {epoch}: gap or overlap at {pos} (next range starts at {a})"
            pos = b
        assert pos == records, f"epoch {epoch}: covered up to {pos} of {records}"


async def test_several_clients_cover_every_record_exactly_once(bus: Bus, shard_service: object) -> None:
    admin = ShardAdmin(bus)
    await admin.register(spec(records=30_000, epochs=2))
    got: list[tuple[str, ShardLease]] = []
    await asyncio.gather(*(consume(bus, f"w{i}", got) for i in range(4)))
    assert_exact_cover(got, 30_000, epochs=2)
    st = await admin.status(JOB, "train")
    # 600 shards, the last ones of the last epoch cut into pieces for the four clients (tail_split).
    assert st.finished and st.done == len(got) > 600 and st.records_done == 60_000 and st.records_duplicated == 0
    assert {n.node for n in st.nodes} == {f"w{i}" for i in range(4)}
    assert sum(n.records for n in st.nodes) == 60_000


async def test_unknown_job_gets_clear_error_and_service_keeps_running(bus: Bus, shard_service: object) -> None:
    admin = ShardAdmin(bus)
    with pytest.raises(NotFound, match="unknown job"):
        await admin.status("nojob", "train")
    await admin.register(spec())
    assert (await admin.status(JOB, "train")).todo == 200


async def test_node_death_event_requeues_at_once(bus: Bus, shard_service: object) -> None:
    admin = ShardAdmin(bus)
    await admin.register(spec(lease_s=600.0))
    dead = ShardClient(bus, JOB, "train", "victim", prefetch=4)
    first = await dead.next()
    assert first is not None
    st = await admin.status(JOB, "train")
    assert st.doing == 4
    await bus.publish_durable(subjects.event("node", JOB, "died"), NodeEvent(JOB, "victim", "died", 0.0, "killed"))
    for _ in range(100):
        st = await admin.status(JOB, "train")
        if st.doing == 0:
            break
        await asyncio.sleep(0.02)
    assert st.doing == 0 and st.todo == 200
    got: list[tuple[str, ShardLease]] = []
    await consume(bus, "survivor", got)
    assert_exact_cover(got, 20_000)


async def test_checkpoint_is_stored_and_announced(bus: Bus, shard_service: object) -> None:
    from nats.aio.msg import Msg
    from pacer.codec import decode
    from pacer.contracts.shards import ShardEvent

    admin = ShardAdmin(bus)
    await admin.register(spec())
    got: list[ShardEvent] = []
    async def on_event(m: Msg) -> None:
        got.append(decode(ShardEvent, m.data))

    sub = await bus.nc.subscribe(subjects.event("shard", JOB, "checkpointed"), cb=on_event)
    reply = await admin.checkpoint(JOB, "train", "ck-1")
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.02)
    await sub.unsubscribe()
    assert reply.checkpoint == "ck-1" and reply.shards == 200
    assert [(e.kind, e.dataset, e.detail) for e in got] == [("checkpointed", "train", "ck-1")]
