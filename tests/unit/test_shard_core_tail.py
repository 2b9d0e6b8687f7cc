"""The end of an epoch: shards split between workers, by rate (weighted factoring) and by stealing.  (How these tests drive the core: shard_core_support.)"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pacer.contracts.shards import (
    LeaseReply,
    Rejected,
    ShardLease,
    ShardProgress,
    ShardRange,
)
from pacer.errors import ValidationError
from pacer_services.shard_service import core
from pacer_services.shard_service.core import (
    TAIL_FACTOR,
    TAIL_MIN_PIECES,
    IllegalTransition,
    JobShards,
    fold,
)

from .shard_core_support import (
    DS,
    JOB,
    PROPS,
    check_invariants,
    covered_exactly,
    kinds,
    lease_len,
    new_job,
    ops,
    replay,
    req,
    spec,
    stream_spec,
)


# =========================================================================== splits
def test_split_record_and_placement() -> None:
    js, _ = new_job(spec(records=20, batch_size=10, shuffle=False))
    out = js.lease(req("a", want=1, max_records=3), 0.0)
    assert out.records == [["split", DS, 0, 3, 2], ["grant", DS, 0, "a"]]
    (le,) = out.reply.shards
    assert (le.start, le.end) == (0, 3)
    # the remainder is next in line, before shard 1
    nxt = js.lease(req("b", want=1), 0.0).reply.shards[0]
    assert (nxt.shard, nxt.start, nxt.end, nxt.offset) == (2, 3, 10, 3)
    # a partially consumed shard is split from its resume point
    js.lease(req("b", held=[2], progress=[ShardProgress(2, 5)]), 0.0)
    js.node_died("b")
    le = js.lease(req("c", want=1, max_records=1), 0.0).reply.shards[0]
    assert (le.shard, le.start, le.end, le.attempt) == (2, 8, 9, 1)
    rest = js.lease(req("c", want=1, held=[2]), 0.0).reply.shards[0]
    assert (rest.start, rest.end, rest.attempt) == (9, 10, 1), (
        "the split-off part was handed out before"
    )
    assert js.status(DS).records_duplicated == 2
    # no split when the shard already fits
    out = js.lease(req("d", want=1, max_records=10), 0.0)
    assert ops(out) == ["grant"]
    check_invariants(js)


@PROPS
@given(
    records=st.integers(1, 200),
    batch_size=st.integers(1, 10),
    bps=st.integers(1, 3),
    epochs=st.integers(1, 2),
    caps=st.lists(st.integers(0, 12), min_size=1, max_size=20),
)
def test_splits_keep_coverage_exact(
    records: int, batch_size: int, bps: int, epochs: int, caps: list[int]
) -> None:
    js, _ = new_job(
        spec(records=records, batch_size=batch_size, batches_per_shard=bps, epochs=epochs)
    )
    granted: dict[int, list[tuple[int, int]]] = {e: [] for e in range(epochs)}
    for i in itertools.count():
        cap = caps[i % len(caps)]
        out = js.lease(req("a", want=2, max_records=cap), 0.0)
        for le in out.reply.shards:
            if cap:
                assert lease_len(le) <= cap
            granted[le.epoch].append((le.start, le.end))
        js.lease(req("a", done=[le.shard for le in out.reply.shards]), 0.0)
        if not out.reply.shards:
            break
    assert js.status(DS).finished
    check_invariants(js)
    for e in range(epochs):
        covered_exactly(granted[e], records)


# =========================================================================== the tail (weighted factoring)
def _drain(js: JobShards, rates: dict[str, float], now: float = 0.0) -> dict[str, list[tuple[int, int]]]:
    """Every node in turn finishes what it holds and asks for one more piece, until nothing is left;
    returns the ranges each node was granted, in order."""
    got: dict[str, list[tuple[int, int]]] = {n: [] for n in rates}
    held: dict[str, list[int]] = {n: [] for n in rates}
    for n, r in rates.items():  # every node is known (a heartbeat) before the first grant
        js.lease(req(n, rate=r), now)
    while True:
        granted = 0
        for n, r in rates.items():
            out = js.lease(req(n, done=held[n], want=1, rate=r), now)
            held[n] = [le.shard for le in out.reply.shards]
            got[n] += [(le.start, le.end) for le in out.reply.shards]
            granted += len(out.reply.shards)
        if not granted:
            return got


def test_near_the_end_pieces_shrink_and_follow_each_nodes_rate() -> None:
    # 100 shards of 320 records, two nodes, one three times as fast.
    js, _ = new_job(spec(records=32_000, batch_size=10, batches_per_shard=32, shuffle=False))
    got = _drain(js, {"fast": 300.0, "slow": 100.0})
    covered_exactly(sorted(got["fast"] + got["slow"]), 32_000)
    check_invariants(js)
    assert js.status(DS).finished
    sizes = {n: [b - a for a, b in r] for n, r in got.items()}
    # Early on whole shards; at the end pieces, never longer than the node's share of what was left / 2.
    assert sizes["fast"][0] == sizes["slow"][0] == 320
    assert min(sizes["fast"]) < 320 and min(sizes["slow"]) < 320
    # The slow node's last pieces are a third of the fast node's (to the batch).
    tail_fast, tail_slow = sizes["fast"][-4:], sizes["slow"][-4:]
    assert max(tail_slow) < max(tail_fast)
    # No piece is shorter than a batch or than the smallest piece at the mean rate x the node's share.
    assert min(sizes["slow"]) >= max(10, 320 * 0.5 // TAIL_MIN_PIECES)


def test_a_piece_is_the_requesters_share_of_what_is_left_over_the_factor() -> None:
    js, _ = new_job(spec(records=4_000, batch_size=10, batches_per_shard=100, shuffle=False))  # 4 shards of 1000
    js.lease(req("b", rate=100.0), 0.0)
    # a: 300/s of 400/s in all; 4000 left -> 3000 / TAIL_FACTOR = 1500 >= a shard: a whole one.
    first = js.lease(req("a", want=1, rate=300.0), 0.0).reply.shards[0]
    assert lease_len(first) == 1000
    # b: 100/400 of the 3000 left / 2 = 375 -> 380 (whole batches).
    le = js.lease(req("b", want=1, rate=100.0), 0.0).reply.shards[0]
    assert lease_len(le) == -(-3000 * 100 // (400 * TAIL_FACTOR) // 10) * 10 == 380


def test_one_node_alone_or_tail_split_off_gets_whole_shards() -> None:
    for sp, rates in ((spec(records=3_200, batch_size=10, batches_per_shard=32), {"a": 50.0}),
                      (spec(records=3_200, batch_size=10, batches_per_shard=32, tail_split=False),
                       {"a": 50.0, "b": 5.0})):
        js, _ = new_job(sp)
        got = _drain(js, rates)
        assert all(b - a == 320 for r in got.values() for a, b in r), got
        assert js.status(DS).todo == 0 and js.status(DS).finished


def test_nodes_without_a_rate_count_as_the_mean_and_expired_nodes_not_at_all() -> None:
    js, _ = new_job(spec(records=2_000, batch_size=10, batches_per_shard=100, lease_s=5.0, shuffle=False))
    js.lease(req("gone", rate=1000.0), 0.0)
    js.expire(10.0)  # its lease ran out: no longer one of the nodes that share the rest
    js.lease(req("new"), 10.0)  # no rate yet: counts as the mean of the known ones
    le = js.lease(req("a", want=1, rate=100.0), 10.0).reply.shards[0]
    assert lease_len(le) == 500  # half of 2000 / TAIL_FACTOR, not a tenth of it


def test_a_bad_rate_is_refused() -> None:
    js, _ = new_job(spec())
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="rate"):
            js.lease(req("a", want=1, rate=bad), 0.0)
    assert js.status(DS).doing == 0


# =========================================================================== the tail (work stealing)
def _one_slow_holder(**kw: Any) -> JobShards:
    """One shard of 1000 records (100 batches of 10); lease 4 s, so a holder reports at least every
    second.  ``slow`` (10 records/s) holds it from 0 s and reported 20 records consumed at 1 s."""
    base: dict[str, Any] = dict(records=1000, batch_size=10, batches_per_shard=100, lease_s=4.0)
    base.update(kw)
    js, _ = new_job(spec(**base))
    (le,) = js.lease(req("slow", want=1, rate=10.0), 0.0).reply.shards
    assert (le.start, le.end) == (0, 1000), "a node alone gets whole shards"
    js.lease(req("slow", held=[0], progress=[ShardProgress(0, 20)], rate=10.0), 1.0)
    return js


def _stolen_at_120() -> tuple[JobShards, ShardLease]:
    """``fast`` (90 records/s) asks at 1.5 s and gets [120, 1000) of shard 0; ``slow`` keeps [20, 120)."""
    js = _one_slow_holder()
    out = js.lease(req("fast", want=1, rate=90.0), 1.5)
    (piece,) = out.reply.shards
    return js, piece


def test_an_idle_node_takes_the_end_of_a_slow_holders_shard_split_by_their_rates() -> None:
    js = _one_slow_holder()
    out = js.lease(req("fast", want=1, rate=90.0), 1.5)
    # 980 records left, shared 10:90 -> 882 for fast, in whole batches 880; slow keeps a margin of
    # 10/s x (1 s until its next report + 2 s) = 30 records past its last report, far less than 100.
    assert out.records == [["steal", DS, 0, 120, 1, "fast"]]
    (piece,) = out.reply.shards
    assert (piece.shard, piece.epoch, piece.start, piece.end, piece.offset, piece.attempt) == (1, 0, 120, 1000, 120, 0)
    assert not out.reply.exhausted and out.reply.shortened == []
    assert abs((120 - 20) / 10.0 - (1000 - 120) / 90.0) < 10 / 10.0, "both finish together, to a batch of slow's"
    st_ = js.status(DS)
    assert (st_.todo, st_.doing, st_.records_duplicated) == (0, 2, 0)
    assert {n.node: n.doing for n in st_.nodes} == {"slow": 1, "fast": 1}
    check_invariants(js)
    # at most one steal per request, and the stolen piece is not cut again for its own holder's sake
    again = js.lease(req("other", want=4, rate=90.0), 1.5)
    assert ops(again) == ["steal"] and len(again.reply.shards) == 1
    check_invariants(js)


def test_the_holder_is_told_in_every_reply_until_it_is_done_and_the_dataset_finishes() -> None:
    js, piece = _stolen_at_120()
    out = js.lease(req("slow", held=[0], rate=10.0), 2.0)
    cut = ShardLease(shard=0, epoch=0, start=20, end=120, offset=0, seed=out.reply.shortened[0].seed, attempt=0)
    assert out.reply.shortened == [cut] and out.reply.shards == []
    assert out.records == [["told", DS, 0]], "the first reply that tells it is logged"
    out = js.lease(req("slow", held=[0], progress=[ShardProgress(0, 60)], rate=10.0), 3.0)
    assert out.reply.shortened == [dataclasses.replace(cut, start=60)], "again: a lost reply loses nothing"
    assert ops(out) == ["prog"]
    assert js.lease(req("fast", held=[1], rate=90.0), 3.0).reply.shortened == [], "only the holder is told"
    out = js.lease(req("slow", done=[0], rate=10.0), 11.0)
    assert ops(out) == ["done"] and out.reply.shortened == [] and not out.reply.finished
    out = js.lease(req("fast", done=[piece.shard], rate=90.0), 11.5)
    st_ = js.status(DS)
    assert out.reply.finished and st_.finished and kinds(out) == ["finished"]
    assert (st_.records_done, st_.records_duplicated, st_.done) == (1000, 0, 2)
    assert {n.node: n.records for n in st_.nodes} == {"slow": 120, "fast": 880}
    check_invariants(js)


def test_progress_past_the_new_end_is_accepted_and_counted_duplicated() -> None:
    js, _piece = _stolen_at_120()
    # slow read on before it learnt of the cut: 30 records of fast's piece are read twice
    out = js.lease(req("slow", held=[0], progress=[ShardProgress(0, 150)], rate=10.0), 2.0)
    assert out.reply.rejected == [] and out.records == [["prog", DS, 0, 150], ["told", DS, 0]]
    assert out.reply.shortened[0].end == 120
    sh = js.datasets[DS].shards[0]
    assert (sh.consumed, sh.length, sh.over) == (120, 120, 30)
    assert js.status(DS).records_duplicated == 30
    assert {n.node: n.records for n in js.status(DS).nodes}["slow"] == 120, "consumed up to the new end"
    check_invariants(js)
    # the same report again changes nothing; further past counts only what is new
    assert js.lease(req("slow", held=[0], progress=[ShardProgress(0, 150)]), 2.1).records == []
    assert ops(js.lease(req("slow", held=[0], progress=[ShardProgress(0, 160)]), 2.2)) == ["prog"]
    assert js.status(DS).records_duplicated == 40
    # past the end it was granted is a bad report, as ever
    out = js.lease(req("slow", held=[0], progress=[ShardProgress(0, 1001)]), 2.3)
    assert out.reply.rejected == [Rejected(0, "bad_progress")] and out.records == []
    # how far it read, beside its done (the client keeps a report past the new end for that)
    out = js.lease(req("slow", done=[0], progress=[ShardProgress(0, 170)]), 2.4)
    assert out.records == [["prog", DS, 0, 170], ["done", DS, 0]] and out.reply.rejected == []
    st_ = js.status(DS)
    assert (st_.records_duplicated, st_.done, st_.records_done) == (50, 1, 120)
    check_invariants(js)


def test_a_discard_past_the_new_end_is_left_to_the_stealer() -> None:
    js, _piece = _stolen_at_120()
    out = js.lease(req("slow", held=[0], progress=[ShardProgress(0, 150)],
                       discarded=[ShardRange(0, 100, 140), ShardRange(0, 140, 150)]), 2.0)
    # [100, 120) is served again; [120, 150) is the stealer's, which trains it: neither refused nor re-served
    assert ops(out) == ["prog", "disc", "told"] and out.reply.rejected == []
    assert out.records[1] == ["disc", DS, 0, 100, 120, 2, "slow"]
    assert js.status(DS).records_reserved == 20
    check_invariants(js)


@pytest.mark.parametrize("end", ["done", "died", "expired", "released"])
def test_a_holder_that_was_not_told_may_have_read_the_whole_cut(end: str) -> None:
    """Its shard leaves it before any reply told it of the cut: it may have read up to the end it was
    granted, so the cut counts as duplicated (an upper bound, as a re-grant after a loss)."""
    js, _piece = _stolen_at_120()
    if end == "done":
        js.lease(req("slow", done=[0]), 2.0)
    elif end == "died":
        js.node_died("slow")
    elif end == "expired":
        js.lease(req("fast", held=[1]), 4.0)
        assert ops(js.expire(5.5)) == ["lost"]
    else:
        js.lease(req("slow", released=[0]), 2.0)
    assert js.status(DS).records_duplicated == 880
    check_invariants(js)


def test_a_holder_that_was_told_counts_nothing_more_when_it_goes() -> None:
    js, _piece = _stolen_at_120()
    js.lease(req("slow", held=[0], progress=[ShardProgress(0, 125)]), 2.0)  # told in this reply
    js.node_died("slow")
    st_ = js.status(DS)
    assert st_.records_duplicated == 5 and st_.done == 1, "fully consumed up to its new end: done"
    check_invariants(js)


def test_a_shard_cut_twice_tells_its_holder_again() -> None:
    js, _piece = _stolen_at_120()
    js.lease(req("slow", held=[0], rate=1.0), 2.0)  # told of 120; and it is slower still
    out = js.lease(req("fast", done=[1], want=1, rate=90.0), 2.5)
    assert ops(out) == ["done", "steal"]
    new_end = out.records[1][3]
    assert 20 < new_end < 120
    out = js.lease(req("slow", held=[0], rate=1.0), 3.0)
    assert out.records == [["told", DS, 0]] and out.reply.shortened[0].end == new_end
    # it read to 120 (the end it knew) before this reply: only [new_end, 120) counts twice
    js.lease(req("slow", done=[0], progress=[ShardProgress(0, 120)]), 3.5)
    assert js.status(DS).records_duplicated == 120 - new_end
    check_invariants(js)


@pytest.mark.parametrize(
    "case",
    ["todo_left", "tail_split_off", "stream", "too_little_left", "requester_slower", "max_records", "requester_busy",
     "no_rate_known"],
)
def test_no_steal(case: str) -> None:
    if case == "no_rate_known":  # clients that report no rate: nobody can tell who finishes last
        js, _ = new_job(spec(records=1000, batch_size=10, batches_per_shard=100, lease_s=4.0))
        js.lease(req("slow", want=1), 0.0)
        out = js.lease(req("fast", want=1), 1.5)
    elif case == "stream":
        js, _ = new_job(stream_spec(records=1000, batch_size=10, batches_per_shard=100, lease_s=4.0))
        js.lease(req("slow", want=1, rate=10.0), 0.0)
        out = js.lease(req("fast", want=1, rate=90.0), 1.5)
    elif case == "todo_left":
        js = _one_slow_holder(records=2000)  # a second shard is still TODO
        out = js.lease(req("fast", want=1, rate=90.0), 1.5)
        assert ops(out) == ["split", "grant"] and out.reply.shards[0].offset == 1000
    else:
        js = _one_slow_holder(tail_split=case != "tail_split_off")
        kw: dict[str, Any] = dict(want=1, rate=90.0)
        if case == "too_little_left":  # 30 left, all of it within slow's margin
            js.lease(req("slow", held=[0], progress=[ShardProgress(0, 970)], rate=10.0), 1.0)
        elif case == "requester_slower":  # 1 record/s: slow would be done with the rest long before
            kw["rate"] = 1.0
        elif case == "max_records":  # a piece as short as the requester asks would be under two batches
            kw["max_records"] = 15
        elif case == "requester_busy":  # as fast as slow, it holds more work than slow has left
            js.apply(["steal", DS, 0, 500, 1, "fast"])  # made up: a piece cut for it by hand
            kw.update(held=[1], rate=10.0)
        out = js.lease(req("fast", **kw), 1.5)
    assert "steal" not in ops(out)
    assert out.reply.shards == [] or case == "todo_left"
    check_invariants(js)


def test_steals_replay_and_snapshot_exactly_and_old_snapshots_load() -> None:
    import msgpack
    from pacer.codec import decode, encode

    js, log = new_job(spec(records=1000, batch_size=10, batches_per_shard=100, lease_s=4.0))
    snap0 = copy.deepcopy(js.snapshot())
    at0 = len(log)
    log += js.lease(req("slow", want=1, rate=10.0), 0.0).records
    log += js.lease(req("slow", held=[0], progress=[ShardProgress(0, 20)], rate=10.0), 1.0).records
    old = copy.deepcopy(js.snapshot())  # before any cut: what a snapshot of the previous version holds
    log += js.lease(req("fast", want=1, rate=90.0), 1.5).records
    log += js.lease(req("slow", held=[0], progress=[ShardProgress(0, 130)]), 2.0).records
    log += js.lease(req("other", want=1, rate=50.0), 2.5).records  # cuts fast's piece
    assert [r[0] for r in log].count("steal") == 2 and "told" in [r[0] for r in log]
    live = js.snapshot()
    assert fold(JOB, log).snapshot() == live
    assert replay(log[at0:], {}, base=snap0).snapshot() == live
    assert JobShards.from_snapshot(copy.deepcopy(live)).snapshot() == live
    for d in old["datasets"].values():
        for k in ("cut", "told", "over"):
            del d[k]
    rebuilt = JobShards.from_snapshot(old)
    check_invariants(rebuilt)
    assert all((sh.cut, sh.told, sh.over) == (0, 0, 0) for sh in rebuilt.datasets[DS].shards.values())
    # a reply of a sender that knows nothing of steals
    wire = msgpack.unpackb(encode(LeaseReply(shards=[], lease_s=4.0, finished=False)), raw=False)
    del wire["shortened"]
    assert decode(LeaseReply, msgpack.packb(wire)).shortened == []


def test_a_bad_steal_record_is_refused() -> None:
    js, _piece = _stolen_at_120()
    for bad in (["steal", DS, 0, 20, 2, "x"],  # not past what the holder consumed
                ["steal", DS, 0, 120, 2, "x"],  # nothing left to take
                ["steal", DS, 0, 60, 9, "x"],  # new id out of sequence
                ["steal", DS, 0, 60, 2, "slow"]):  # from itself
        with pytest.raises(IllegalTransition, match="bad steal"):
            js.apply(bad)
    js.lease(req("slow", done=[0]), 2.0)
    with pytest.raises(IllegalTransition, match="bad steal"):
        js.apply(["steal", DS, 0, 60, 2, "x"])  # not DOING any more
    with pytest.raises(IllegalTransition, match="nothing to tell"):
        js.apply(["told", DS, 1])  # never cut


class Timed:
    """Nodes reading at their own rates in simulated time, one tick a second: each reads, then reports
    its progress every ``report_every`` ticks (its heartbeat), asks for a shard when it has none, reports
    a shard done once it read to the end it knows, and applies ``shortened``.  ``reads`` counts how
    often each record was read."""

    def __init__(self, js: JobShards, report_every: int = 1) -> None:
        self.js = js
        self.report_every = report_every
        self.reads: Counter[int] = Counter()
        self.holding: dict[str, list[Any]] = {}  # node -> [lease as known, next record, last report tick]
        self.log: list[list[Any]] = []
        self.steals = 0

    def tick(self, t: int, node: str, reads: int, reports: float) -> None:
        h = self.holding.get(node)
        kw: dict[str, Any] = {}
        if h is not None:
            le, pos, last = h
            k = min(reads, le.end - pos)
            self.reads.update(range(pos, pos + k))
            h[1] = pos = pos + k
            if pos >= le.end:
                kw = dict(done=[le.shard], want=1)
                if pos > le.end:  # read past the end it was told its shard was cut to
                    kw["progress"] = [ShardProgress(le.shard, pos - le.offset)]
                del self.holding[node]
            elif t - last >= self.report_every:
                kw = dict(progress=[ShardProgress(le.shard, pos - le.offset)])
                h[2] = t
            else:
                return
        else:
            kw = dict(want=1)
        out = self.js.lease(req(node, rate=reports, **kw), float(t))
        self.log += out.records
        self.steals += ops(out).count("steal")
        for le in out.reply.shards:
            self.holding[node] = [le, le.start, t]
        for le in out.reply.shortened:
            cur = self.holding[node]
            assert le.shard == cur[0].shard and le.end <= cur[0].end  # every reply: the same end again
            cur[0] = dataclasses.replace(cur[0], end=le.end)  # already there or past it: done next tick

    def run(self, reads: Callable[[str, int], int], reports: Callable[[str, int], float], nodes: list[str],
            ticks: int = 100_000) -> int:
        """Until the dataset is finished; returns the tick it finished at."""
        for t in range(ticks):
            for n in nodes:
                self.tick(t, n, reads(n, t), reports(n, t))
            if t % 50 == 0:
                check_invariants(self.js)
            if self.js.datasets[DS].finished():
                return t
        raise AssertionError("did not finish")


def test_work_stealing_ends_a_stragglers_tail_with_every_record_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes at 50 records/s; b turns 10x slower at 2 s, holding a piece it took while fast (the
    tail pieces cannot foresee that).  a takes the end of b's piece instead of idling."""
    def finish(steal: bool) -> tuple[int, Timed]:
        if not steal:
            monkeypatch.setattr(core, "STEAL_MIN_BATCHES", 10**9)
        js, _ = new_job(spec(records=2_000, batch_size=10, batches_per_shard=50, shuffle=False, lease_s=4.0))
        sim = Timed(js)
        rate = lambda n, t: 5 if n == "b" and t >= 2 else 50  # noqa: E731
        return sim.run(rate, lambda n, t: float(rate(n, t)), ["a", "b"]), sim

    t_steal, sim = finish(steal=True)
    st_ = sim.js.status(DS)
    assert st_.finished and st_.records_done == 2_000 and sim.steals >= 1
    assert set(sim.reads) == set(range(2_000)) and set(sim.reads.values()) == {1}, "every record read once"
    assert st_.records_duplicated == 0
    check_invariants(sim.js)
    assert fold(JOB, new_job(sim.js.datasets[DS].spec)[1] + sim.log).snapshot() == sim.js.snapshot()
    t_wait, other = finish(steal=False)
    assert other.steals == 0 and other.js.status(DS).finished
    assert t_steal < 0.8 * t_wait, (t_steal, t_wait)


@PROPS
@given(
    records=st.integers(100, 3_000),
    batch_size=st.integers(1, 10),
    bps=st.integers(4, 40),
    speeds=st.lists(st.integers(2, 60), min_size=2, max_size=4),
    drops=st.lists(st.tuples(st.integers(0, 40), st.sampled_from([1, 5, 20])), min_size=4, max_size=4),
    under=st.sampled_from([1.0, 1.0, 0.5, 0.2]),
    report_every=st.sampled_from([1, 2]),
    shuffle=st.booleans(),
)
def test_steals_cover_every_record_and_count_every_record_read_twice(
    records: int, batch_size: int, bps: int, speeds: list[int], drops: list[tuple[int, int]], under: float,
    report_every: int, shuffle: bool,
) -> None:
    """Nodes of different speeds, some of which turn slower at some point, report their rates
    truthfully or too low (``under``: they then read past the end their shard was cut to before they
    learn of it).  Every record is read, records_done is exact, and records_duplicated is exactly
    the number of extra reads; truthful rates read nothing twice."""
    js, log = new_job(spec(records=records, batch_size=batch_size, batches_per_shard=bps, shuffle=shuffle,
                           lease_s=4.0 * report_every))
    nodes = [f"n{i}" for i in range(len(speeds))]

    def rate(n: str, t: int) -> int:
        i = nodes.index(n)
        at, factor = drops[i]
        return max(1, speeds[i] // factor) if t >= at else speeds[i]

    sim = Timed(js, report_every)
    sim.run(rate, lambda n, t: rate(n, t) * under, nodes)
    st_ = js.status(DS)
    assert st_.finished and st_.records_done == st_.records_total == records
    assert set(sim.reads) == set(range(records)), "a record was never read"
    assert sum(n - 1 for n in sim.reads.values()) == st_.records_duplicated
    if under == 1.0:
        assert st_.records_duplicated == 0, "a truthful holder learns of a cut before it reaches it"
    assert sum(n.records for n in st_.nodes) == records
    check_invariants(js)
    assert fold(JOB, log + sim.log).snapshot() == js.snapshot()

