"""Discarded gradients over a real nats-server: their records are served again, to other nodes.

Clients read their shards batch by batch.  A "slow" node's gradients are
always discarded (the backup worker that is always late), a "flaky" node's
every other batch; both report those batches with ``ShardClient.discarded``
and the others train them.  Every record must end up trained with a kept
gradient, the counts must say how many were served again, and the progress
events the job service reads must carry them.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from conftest import InProcessService
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import Bus, RetryPolicy
from pacer.codec import decode
from pacer.contracts.shards import DatasetSpec, ProgressEvent
from pacer.embedded import EmbeddedNats
from pacer.shards.client import ShardAdmin, ShardClient
from pacer_services.shard_service.app import ShardServiceConfig

JOB = "disc"
BATCH = 10
PATIENT = RetryPolicy(attempts=100, first_delay=0.05, max_delay=0.5)  # rides out a restart of the service

pytestmark = pytest.mark.timeout(120)


class Reader:
    """One node: reads batch by batch; ``discard(batch number) -> bool`` says which gradients are lost."""

    def __init__(self, bus: Bus, node: str, discard: str, max_shards: int = 0) -> None:
        self.client = ShardClient(bus, JOB, "train", node, prefetch=2, poll_s=0.02, retry=PATIENT)
        self.node, self.discard, self.max_shards = node, discard, max_shards
        self.kept: list[tuple[int, int, int]] = []  # (epoch, first record, one past the last)
        self.lost: list[tuple[int, int, int]] = []
        self.batches = 0
        self.shards = 0

    def discarded_now(self) -> bool:
        self.batches += 1
        return self.discard == "all" or (self.discard == "every_other" and self.batches % 2 == 0)

    async def run(self) -> None:
        c = self.client
        await c.start()
        while (shard := await c.next()) is not None:
            for lo in range(shard.start, shard.end, BATCH):
                hi = min(shard.end, lo + BATCH)
                await asyncio.sleep(0)  # a step: let the others and the client's requests run
                if self.discarded_now():
                    c.discarded(shard, lo - shard.offset, hi - shard.offset)
                    self.lost.append((shard.epoch, lo, hi))
                else:
                    self.kept.append((shard.epoch, lo, hi))
                c.progress(shard, hi - shard.offset)
            c.done(shard)
            self.shards += 1
            if self.shards == self.max_shards:
                break
        await c.close()


async def test_discarded_records_are_served_again_to_other_nodes_until_every_one_is_kept(
    bus: Bus, shard_service: object
) -> None:
    records, epochs = 6_000, 2
    admin = ShardAdmin(bus)
    await admin.register(DatasetSpec(job=JOB, dataset="train", records=records, batch_size=BATCH,
                                     batches_per_shard=10, epochs=epochs, seed=3))
    progress: list[ProgressEvent] = []

    async def on_progress(m: Msg) -> None:
        progress.append(decode(ProgressEvent, m.data))

    sub = await bus.nc.subscribe(subjects.event("shard", JOB, subjects.ShardEventKind.PROGRESS), cb=on_progress)
    readers = [Reader(bus, "slow", "all"), Reader(bus, "flaky", "every_other"),
               Reader(bus, "fast-0", "none"), Reader(bus, "fast-1", "none")]
    await asyncio.gather(*(r.run() for r in readers))

    # Every record of every epoch was trained with a kept gradient, at least once.
    for epoch in range(epochs):
        covered = bytearray(records)
        for r in readers:
            for ep, lo, hi in r.kept:
                if ep == epoch:
                    covered[lo:hi] = b"\x01" * (hi - lo)
        missing = covered.count(0)
        assert missing == 0, f"epoch {epoch}: {missing} records never trained with a kept gradient"
    # Nothing the slow node read was ever kept by it: its records reached the model through the others.
    slow = readers[0]
    assert slow.lost and not slow.kept
    kept_by: dict[tuple[int, int], set[str]] = defaultdict(set)
    for r in readers:
        for ep, lo, hi in r.kept:
            for rec in range(lo, hi):
                kept_by[(ep, rec)].add(r.node)
    assert all(kept_by[(ep, rec)] - {"slow"} for ep, lo, hi in slow.lost for rec in range(lo, hi))

    st = await admin.status(JOB, "train")
    lost = sum(hi - lo for r in readers for _, lo, hi in r.lost)
    assert st.finished and st.todo == st.doing == st.failed == 0
    assert st.records_done == st.records_total == records * epochs
    assert st.records_reserved == lost == sum(r.client.records_discarded for r in readers)
    assert {n.node: n.records_discarded for n in st.nodes} == {
        r.node: sum(hi - lo for _, lo, hi in r.lost) for r in readers}
    assert st.records_duplicated == 0  # nobody died: only the discarded records were served twice
    assert sum(n.records for n in st.nodes) == records * epochs + lost
    assert all(r.client.rejected == 0 for r in readers)

    # The progress events (what the job service copies into the job's record) carry the count.
    for _ in range(100):
        if progress and progress[-1].status.finished:
            break
        await asyncio.sleep(0.05)
    await sub.unsubscribe()
    assert progress[-1].status.records_reserved == lost


async def test_a_discard_of_records_not_reported_consumed_is_refused_and_counted(
    bus: Bus, shard_service: InProcessService
) -> None:
    from pacer.contracts.shards import LeaseReply, LeaseRequest, ShardRange
    from pacer.subjects import ShardOp

    admin = ShardAdmin(bus)
    await admin.register(DatasetSpec(job=JOB, dataset="train", records=100, batch_size=BATCH, batches_per_shard=10))
    subject = subjects.rpc(subjects.SHARD_SERVICE, JOB, ShardOp.LEASE)
    got = await bus.request(subject, LeaseRequest(job=JOB, dataset="train", node="a", want=1), LeaseReply)
    sid = got.shards[0].shard
    bad = LeaseRequest(job=JOB, dataset="train", node="a", held=[sid],
                       discarded=[ShardRange(sid, 0, 10), ShardRange(sid, 5, 3), ShardRange(sid + 7, 0, 1)])
    reply = await bus.request(subject, bad, LeaseReply)
    assert [(r.shard, r.reason) for r in reply.rejected] == [
        (sid, "discard_not_consumed"), (sid, "bad_discard"), (sid + 7, "unknown_shard")]
    st = await admin.status(JOB, "train")
    assert st.records_reserved == 0 and st.todo == 0 and st.doing == 1
    # the same range once it was reported consumed: accepted, and served again
    ok = LeaseRequest(job=JOB, dataset="train", node="a", held=[sid], progress=[], discarded=[ShardRange(sid, 0, 10)],
                      done=[sid])
    reply = await bus.request(subject, ok, LeaseReply)
    assert not reply.rejected
    st = await admin.status(JOB, "train")
    assert (st.records_reserved, st.records_done, st.todo, st.finished) == (10, 90, 1, False)
    assert shard_service.svc is not None
    counters = shard_service.svc.counters.values
    assert (counters["discards_rejected"], counters["records_reserved"]) == (3, 10)


def covered(readers: list[Reader], records: int) -> int:
    """How many records no reader trained with a kept gradient."""
    seen = bytearray(records)
    for r in readers:
        for _, lo, hi in r.kept:
            seen[lo:hi] = b"\x01" * (hi - lo)
    return seen.count(0)


async def test_pieces_survive_a_restart_from_a_snapshot_and_the_log(bus: Bus, nats_server: EmbeddedNats) -> None:
    """Pieces and counts are rebuilt exactly: from a snapshot (the first instance snapshots often),
    then from that snapshot plus log records appended after it (the second never snapshots)."""
    records = 4_000
    cfg = ShardServiceConfig(snapshot_every=30, reap_interval_s=0.05, progress_interval_s=0.2)
    no_snapshots = ShardServiceConfig(snapshot_every=10**9, reap_interval_s=0.05, progress_interval_s=0.2)
    svc = InProcessService(nats_server.url, cfg)
    first = await svc.start()
    admin = ShardAdmin(bus, retry=PATIENT)
    try:
        await admin.register(DatasetSpec(job=JOB, dataset="train", records=records, batch_size=BATCH,
                                         batches_per_shard=10))
        readers = [Reader(bus, "slow", "all", max_shards=6), Reader(bus, "fast", "every_other", max_shards=6)]
        await asyncio.gather(*(r.run() for r in readers))
        st = await admin.status(JOB, "train")
        assert st.records_reserved > 0 and st.todo > 0 and not st.finished
        assert first.counters.values["snapshots"] > 0
        await svc.stop()

        svc = InProcessService(nats_server.url, no_snapshots)
        await svc.start()
        assert await admin.status(JOB, "train") == st, "the state rebuilt from the snapshot differs"
        tail = Reader(bus, "tail", "all", max_shards=1)  # discards appended after the last snapshot
        await tail.run()
        readers.append(tail)
        st = await admin.status(JOB, "train")
        await svc.stop()

        svc = InProcessService(nats_server.url, no_snapshots)
        third = await svc.start()
        assert third.counters.values["records_replayed"] > 0
        assert await admin.status(JOB, "train") == st, "the state rebuilt from the snapshot and the log differs"
        more = [Reader(bus, "slow", "all"), Reader(bus, "fast", "none"), Reader(bus, "other", "none")]
        await asyncio.gather(*(r.run() for r in more))
        readers += more
        assert covered(readers, records) == 0
        final = await admin.status(JOB, "train")
        lost = sum(hi - lo for r in readers for _, lo, hi in r.lost)
        assert final.finished and final.records_done == records and final.records_reserved == lost
    finally:
        await svc.stop()
