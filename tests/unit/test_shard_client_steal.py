"""Work stealing on the worker side: the shard client, the TF worker's feed and the SDK apply
``LeaseReply.shortened`` (a held shard now ends earlier: another node took the rest).

The service side is the real shard core behind a bus double (:class:`CoreBus`): each lease
request is encoded, decided by ``JobShards.lease`` at a simulated time and the reply decoded,
as the service would.  Real NATS is in ``tests/integration/test_shard_steal.py``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
from pacer.codec import decode, encode
from pacer.contracts.shards import DatasetSpec, LeaseReply, LeaseRequest, ShardLease, ShardProgress
from pacer.shards.client import ShardClient
from pacer_services.shard_service.core import JobShards

JOB, DS = "j", "d"
SHARD = ShardLease(shard=4, epoch=0, start=100, end=200, offset=100, seed=1)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class ScriptedBus:
    """Answers lease requests with ``replies`` in turn (then empty ones), keeping what was sent."""

    def __init__(self, *replies: LeaseReply) -> None:
        self.replies = list(replies)
        self.sent: list[LeaseRequest] = []

    async def request(self, subject: str, msg: LeaseRequest, reply: type[Any], timeout: float, retry: Any) -> Any:
        self.sent.append(msg)
        return self.replies.pop(0) if self.replies else lease_reply()


class CoreBus:
    """The shard service's decisions without its IO: each request goes over the codec to the real core."""

    def __init__(self, js: JobShards, clock: Clock) -> None:
        self.js, self.clock = js, clock
        self.log: list[list[Any]] = []

    async def request(self, subject: str, msg: LeaseRequest, reply: type[Any], timeout: float, retry: Any) -> Any:
        out = self.js.lease(decode(LeaseRequest, encode(msg)), self.clock())
        self.log += out.records
        return decode(reply, encode(out.reply))


def lease_reply(shards: list[ShardLease] | None = None, shortened: list[ShardLease] | None = None) -> LeaseReply:
    return LeaseReply(shards=shards or [], lease_s=4.0, finished=False, shortened=shortened or [])


# ------------------------------------------------------------------ ShardClient
async def test_the_client_applies_shortened_to_held_and_prefetched_shards_idempotently() -> None:
    other = ShardLease(shard=5, epoch=0, start=300, end=400, offset=300, seed=2)
    bus = ScriptedBus(
        lease_reply(shards=[SHARD, other]),
        lease_reply(shortened=[ShardLease(4, 0, 130, 150, 100, 1), ShardLease(5, 0, 300, 350, 300, 2)]),
        lease_reply(shortened=[ShardLease(4, 0, 140, 150, 100, 1)]),  # every reply repeats it
        lease_reply(shortened=[ShardLease(9, 0, 0, 10, 0, 3)]),  # not held (done meanwhile): nothing
    )
    c = ShardClient(bus, JOB, DS, "w0", prefetch=1)  # type: ignore[arg-type]
    await c._sync(2)
    first = await c.next()
    assert first == SHARD and c.end_of(first) == 200
    await c._sync(0)
    assert c.end_of(first) == 150, "the shard being read ends earlier"
    assert first.end == 200, "the lease the reader holds is not changed under it"
    nxt = await c.next()
    assert nxt is not None and (nxt.shard, nxt.start, nxt.end) == (5, 300, 350), "handed out with its new end"
    await c._sync(0)
    await c._sync(0)
    assert (c.end_of(first), c.end_of(nxt), c.records_stolen) == (150, 350, 100)


async def test_done_keeps_a_progress_past_the_new_end_and_only_that() -> None:
    bus = ScriptedBus(lease_reply(shards=[SHARD]), lease_reply(shortened=[ShardLease(4, 0, 130, 150, 100, 1)]),
                      lease_reply(), lease_reply(shards=[replace(SHARD, shard=6)]), lease_reply())
    c = ShardClient(bus, JOB, DS, "w0", prefetch=1)  # type: ignore[arg-type]
    shard = await c.next()
    assert shard is not None
    c.progress(shard, 40)
    await c._sync(0)  # learns: ends at 150, i.e. 50 from its offset
    c.progress(shard, 60)  # the batch in flight went past it
    c.done(shard)
    await c._sync(0)
    assert bus.sent[-1].done == [4] and bus.sent[-1].progress == [ShardProgress(4, 60)]
    # a shard not cut: done drops its progress, as ever
    s6 = await c.next()
    assert s6 is not None
    c.progress(s6, 100)
    c.done(s6)
    await c._sync(0)
    assert bus.sent[-1].done == [6] and bus.sent[-1].progress == []


async def test_a_slow_and_a_fast_client_over_the_core_share_the_last_shard() -> None:
    """slow (10 records/s) holds the only shard; fast (100 records/s) comes later and takes its end;
    slow learns its shorter lease from its next heartbeat and stops there.  Simulated time: each
    tick, each reader trains its records, then sends its heartbeat or asks for a shard."""
    js = JobShards(JOB)
    js.register(DatasetSpec(job=JOB, dataset=DS, records=1_000, batch_size=10, batches_per_shard=100, lease_s=4.0))
    clock = Clock()
    bus = CoreBus(js, clock)
    speed = {"slow": 10, "fast": 100}
    clients = {n: ShardClient(bus, JOB, DS, n, prefetch=1, clock=clock) for n in speed}  # type: ignore[arg-type]
    reading: dict[str, list[Any]] = {}  # node -> [lease, next record]
    reads: Counter[int] = Counter()
    for tick in range(200):
        clock.t = float(tick)
        for n, c in clients.items():
            if n == "fast" and tick < 3:
                continue  # joins later, when slow's whole shard is taken
            if n not in reading:
                shard = await c.next(wait=False)
                if shard is not None:
                    reading[n] = [shard, shard.start]
                continue
            shard, pos = reading[n]
            for _ in range(speed[n] // 10):  # batches of 10, never across the end as it is now
                end = c.end_of(shard)
                if pos >= end:
                    break
                hi = min(end, pos + 10)
                reads.update(range(pos, hi))
                c.trained(hi - pos)
                c.progress(shard, hi - shard.offset)
                pos = hi
            reading[n][1] = pos
            if pos >= c.end_of(shard):
                c.done(shard)
                del reading[n]
            await c._sync(0)  # the heartbeat: reports, and learns of a cut
        if js.datasets[DS].finished():
            break
    st = js.status(DS)
    assert st.finished and st.records_done == 1_000
    assert sorted(reads) == list(range(1_000)) and set(reads.values()) == {1}, "every record read once"
    assert st.records_duplicated == 0
    assert "steal" in [r[0] for r in bus.log]
    assert clients["slow"].records_stolen > 0 and clients["fast"].records_stolen == 0
    by_node = {n.node: n.records for n in st.nodes}
    assert by_node["fast"] > by_node["slow"], by_node
    assert tick < 60, "slow alone would need 100 ticks"  # simulated ticks, not the machine's time


# ------------------------------------------------------------------ the TF worker's feed
class FeedClient:
    """The BlockingShardClient calls ShardFeed makes, over one scripted shard whose end may move."""

    def __init__(self, shard: ShardLease) -> None:
        self.shards = [shard]
        self.end = shard.end
        self.calls: list[tuple[Any, ...]] = []

    def next(self, wait: bool = True) -> ShardLease | None:
        return self.shards.pop(0) if self.shards else None

    def end_of(self, shard: ShardLease) -> int:
        return self.end if shard.shard == 4 else shard.end

    def progress(self, shard: ShardLease, consumed: int) -> None:
        self.calls.append(("progress", shard.shard, consumed))

    def done(self, shard: ShardLease) -> None:
        self.calls.append(("done", shard.shard))

    def discarded(self, shard: ShardLease, start: int, end: int) -> None:
        self.calls.append(("discarded", shard.shard, start, end))

    def trained(self, records: int) -> None:
        pass

    def report_soon(self) -> None:
        pass


class Records:
    """A source whose ``label`` column is the record index: a batch says which records it holds."""

    rows = 10_000

    def read(self, lo: int, hi: int, columns: Any = None) -> dict[str, np.ndarray]:
        return {"label": np.arange(lo, min(hi, self.rows), dtype=np.int64)}


def feed(shard: ShardLease = SHARD) -> tuple[Any, FeedClient]:
    from pacer.trainer.worker import ShardFeed

    fc = FeedClient(shard)
    return ShardFeed(fc, Records(), ["label"], seed=None), fc  # file order: the positions are the records


def labels(batch: Any) -> list[int]:
    return [int(x) for x in batch["label"]]


def test_the_feed_stops_at_the_new_end_and_reports_the_shard_done_after_that_step() -> None:
    f, fc = feed()
    assert labels(f.batch(30)) == list(range(100, 130))
    f.commit(report_progress=True)
    fc.end = 145  # another worker took [145, 200)
    assert labels(f.batch(30)) == list(range(130, 145)), "no batch crosses the new end"
    assert fc.calls == [("progress", 4, 30)]
    f.commit(report_progress=False)
    assert fc.calls[-1] == ("done", 4), "done once the step that read the last records ran"
    assert f.batch(30) is None  # no more shards
    assert fc.calls == [("progress", 4, 30), ("done", 4)]


def test_a_feed_past_the_new_end_reports_how_far_it_read_with_the_done() -> None:
    f, fc = feed()
    f.batch(30)
    f.commit(report_progress=False)
    f.batch(30)  # [130, 160)
    f.commit(report_progress=False)
    fc.end = 145  # the news came after the step that read past it
    assert f.batch(30) is None  # the shard is over; no more shards
    assert fc.calls == [("progress", 4, 60), ("done", 4)], "60 read: 15 past the new end, trained twice"


def test_accumulated_batches_past_the_new_end_report_done_after_their_step() -> None:
    f, fc = feed()
    f.batch(30)  # [100, 130): micro-batch 1 of a step
    fc.end = 120
    assert f.batch(30) is None, "micro-batch 2: the shard is over"
    assert fc.calls == [], "not before the step that read it ran"
    f.commit(report_progress=False)
    assert fc.calls == [("progress", 4, 30), ("done", 4)]


# ------------------------------------------------------------------ the SDK
def test_sdk_batches_end_at_the_new_end_and_shards_move_on(tmp_path: Any) -> None:
    from pacer.trainer.sdk import TrainerEnv, Worker

    env = TrainerEnv(job=JOB, node="worker-1", role="worker", index=1, ps=("p:1",), workers=("a:1", "b:1"),
                     nats_url="nats://n:4222", batch_size=30)
    w = Worker(env)
    fc = w._client = FeedClient(SHARD)
    nxt = ShardLease(shard=5, epoch=0, start=300, end=320, offset=300, seed=2)
    fc.shards.append(nxt)
    got: list[tuple[int, int, int]] = []
    for sh in w.shards():
        for lo, hi in w.batches(sh):
            got.append((sh.shard, lo, hi))
            if (lo, hi) == (130, 160):
                fc.end = 145  # learnt while this step ran: it read past the new end
    assert got == [(4, 100, 130), (4, 130, 160), (5, 300, 320)]
    assert fc.calls == [("progress", 4, 30), ("progress", 4, 60), ("done", 4), ("progress", 5, 20), ("done", 5)]
