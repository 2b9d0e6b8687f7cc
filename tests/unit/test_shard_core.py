"""Unit tests of the pure shard-service core (services/shard_service/core.py).

The core is a fold of log records; these tests drive it only through its
decision methods (and ``apply`` for replay), then check what it *computed*:
record coverage per epoch, state invariants recomputed from the shards
themselves, replay equality, at-least-once delivery under failures.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pacer.contracts.shards import (
    DatasetMode,
    DatasetSpec,
    LeaseReply,
    LeaseRequest,
    Rejected,
    ShardLease,
    ShardProgress,
    ShardRange,
)
from pacer.errors import Conflict, NotFound, ValidationError
from pacer_services.shard_service import core
from pacer_services.shard_service.core import (
    MAX_WANT,
    TAIL_FACTOR,
    TAIL_MIN_PIECES,
    TRANSITIONS,
    Dataset,
    IllegalTransition,
    JobShards,
    Outcome,
    Shard,
    ShardState,
    fold,
    validate_spec,
)

S = ShardState
JOB = "j"
DS = "d"

PROPS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# =========================================================================== helpers
def spec(**kw: Any) -> DatasetSpec:
    base: dict[str, Any] = dict(
        job=JOB, dataset=DS, records=100, batch_size=10, batches_per_shard=1
    )
    base.update(kw)
    return DatasetSpec(**base)


def stream_spec(**kw: Any) -> DatasetSpec:
    base: dict[str, Any] = dict(records=0, mode=DatasetMode.STREAMING, epochs=1)
    base.update(kw)
    return spec(**base)


def req(node: str, dataset: str = DS, **kw: Any) -> LeaseRequest:
    return LeaseRequest(job=JOB, dataset=dataset, node=node, **kw)


def new_job(*specs: DatasetSpec) -> tuple[JobShards, list[list[Any]]]:
    js = JobShards(JOB)
    log: list[list[Any]] = []
    for sp in specs:
        log += js.register(sp).records
    return js, log


def kinds(out: Outcome) -> list[str]:
    return [e.kind for e in out.events]


def ops(out: Outcome) -> list[str]:
    return [r[0] for r in out.records]


def lease_len(le: ShardLease) -> int:
    return le.end - le.start


def check_invariants(js: JobShards) -> None:
    """Recompute every derived index/count of every dataset from the shards themselves."""
    for name, ds in js.datasets.items():
        shards = ds.shards
        by_state = Counter(sh.state for sh in shards.values())
        todo = list(ds.todo)
        assert len(set(todo)) == len(todo), f"{name}: duplicate id in TODO queue {todo}"
        assert set(todo) == {i for i, sh in shards.items() if sh.state is S.TODO}
        assert {(n, s) for n, ss in ds.doing.items() for s in ss} == {
            (sh.node, i) for i, sh in shards.items() if sh.state is S.DOING
        }
        assert all(ds.doing.values()), "an empty holder set was left behind"
        assert ds.failed == {i for i, sh in shards.items() if sh.state is S.FAILED}
        assert ds.todo_records == sum(shards[i].length - shards[i].consumed for i in todo), "todo_records drifted"
        assert ds.next_id == len(shards) and set(shards) == set(range(len(shards)))
        for sid, sh in shards.items():
            assert sh.id == sid
            assert sh.length > 0
            assert 0 <= sh.consumed <= sh.length
            # discarded ranges are disjoint, below the floor, and the floor below what was consumed
            assert 0 <= sh.given <= sh.floor <= sh.consumed, (sid, sh.given, sh.floor, sh.consumed)
            if sh.state is S.DOING:
                assert sh.node != "" and sh.grants >= 1
                # cut by work stealing: told of at most the cut, past its end at most the cut
                assert 0 <= sh.told <= sh.cut and 0 <= sh.over <= sh.cut, (sid, sh.cut, sh.told, sh.over)
                assert not sh.over or sh.consumed == sh.length
            if sh.state in (S.TODO, S.FAILED):
                assert sh.node == ""
            if sh.state is S.DONE:
                assert sh.consumed == sh.length
            if sh.state is S.FAILED:
                assert sh.failures >= ds.spec.max_failures
            else:
                assert sh.failures < ds.spec.max_failures
        # the shards of every epoch (not the re-served pieces) partition exactly [0, records of the epoch)
        epochs = sorted({sh.epoch for sh in shards.values()})
        if ds.records_known:
            assert epochs == list(range(ds.epoch + 1))
        for ep in epochs:
            pos = 0
            of_epoch = [s for s in shards.values() if s.epoch == ep]
            for sh in sorted((s for s in of_epoch if not s.discarder), key=lambda s: s.offset):
                assert sh.offset == pos, f"{name} epoch {ep}: gap/overlap at {pos} (shard {sh.id})"
                pos += sh.length
            assert pos == ds.records_known
            for sh in of_epoch:
                assert 0 <= sh.offset < sh.offset + sh.length <= ds.records_known, "a piece outside its epoch"
            # each record is counted by exactly one shard: discarded records by their piece, not their shard
            assert sum(s.length - s.given for s in of_epoch) == ds.records_known
        # every re-served record is one a node discarded, and sits in exactly one piece
        pieces = sum(sh.length for sh in shards.values() if sh.discarder)
        assert ds.records_reserved == pieces == sum(sh.given for sh in shards.values())
        assert ds.records_reserved == sum(ds.node_discarded.values())
        if ds.spec.mode is DatasetMode.FINITE:
            assert ds.records_known == ds.spec.records
        # every consumed record was credited to exactly one node
        assert sum(ds.node_records.values()) == sum(sh.consumed for sh in shards.values())
        assert sum(ds.node_done.values()) <= by_state[S.DONE]
        assert ds.records_duplicated >= 0
        # status agrees with the shards
        st_ = ds.status(js.job, name)
        assert (st_.todo, st_.doing, st_.done, st_.failed) == (
            by_state[S.TODO],
            by_state[S.DOING],
            by_state[S.DONE],
            by_state[S.FAILED],
        )
        assert st_.records_done == sum(sh.length - sh.given for sh in shards.values() if sh.state is S.DONE)
        assert st_.records_reserved == ds.records_reserved
        assert sum(n.records_discarded for n in st_.nodes) == ds.records_reserved
        assert st_.failed_shards == sorted(i for i, sh in shards.items() if sh.state is S.FAILED)
        assert st_.records_done <= st_.records_total
        last = ds.spec.epochs - 1 if ds.spec.mode is DatasetMode.FINITE else 0
        expect_fin = (
            ds.closed
            and ds.epoch >= last
            and by_state[S.TODO] == by_state[S.DOING] == by_state[S.FAILED] == 0
        )
        assert st_.finished is expect_fin
        if st_.finished:
            assert st_.records_done == st_.records_total
        assert sum(n.doing for n in st_.nodes) == by_state[S.DOING]
        assert sum(n.records for n in st_.nodes) == sum(ds.node_records.values())


def covered_exactly(ranges: list[tuple[int, int]], total: int) -> None:
    """The [start, end) ranges tile [0, total) with no gap and no overlap."""
    pos = 0
    for a, b in sorted(ranges):
        assert a == pos, f"gap or overlap at {pos}: next range {(a, b)}"
        assert b > a, f"empty range {(a, b)}"
        pos = b
    assert pos == total


class Client:
    """A well-behaved reader node: reads its leases, reports, tops up its prefetch."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.leases: dict[
            int, list[Any]
        ] = {}  # sid -> [ShardLease, next record to read, reported pos]
        self.discarded = 0  # records whose discard the server accepted
        # Records of its leases it never got to read: the ends cut off its shards by work stealing
        # (``LeaseReply.shortened``), less what it had read past the new end before it learnt of it.
        self.cut_back = 0

    def read(self, rng: random.Random, n: int, reads: Counter[tuple[int, int]] | None) -> None:
        for sid in sorted(self.leases):
            if n <= 0:
                return
            le, pos, _rep = self.leases[sid]
            k = min(n, le.end - pos)
            if reads is not None:
                for r in range(pos, pos + k):
                    reads[(le.epoch, r)] += 1
            self.leases[sid][1] = pos + k
            n -= k

    def request(
        self,
        js: JobShards,
        now: float,
        rng: random.Random,
        *,
        want: int,
        max_records: int = 0,
        rate: float = 0.0,
        fail_p: float = 0.0,
        release_p: float = 0.0,
        discard_p: float = 0.0,
        dataset: str = DS,
    ) -> tuple[Outcome, list[tuple[int, int, int]]]:
        """Send one report-and-get; return the outcome and the ranges the server confirmed trained.

        With ``discard_p``, some of the records read since the last report had their
        gradients discarded: reported as ``discarded``, they are not confirmed trained.
        """
        done, progress, failed, released, held = [], [], [], [], []
        discarded: list[ShardRange] = []
        reserve: dict[int, int] = {}  # sid -> records of its discarded range the server will serve again
        pending: dict[int, tuple[int, list[tuple[int, int]], int]] = {}  # sid -> (epoch, kept ranges, new pos)
        for sid, (le, pos, rep) in sorted(self.leases.items()):
            roll = rng.random()
            if pos >= le.end or (pos > rep and roll >= fail_p + release_p):
                kept = [(rep, pos)]
                if discard_p and rng.random() < discard_p:
                    a = rng.randint(rep, pos - 1)
                    b = rng.randint(a + 1, pos)
                    discarded.append(ShardRange(sid, a - le.offset, b - le.offset))
                    kept = [(x, y) for x, y in ((rep, a), (b, pos)) if y > x]
                    # records past the end the shard was cut to are its stealer's: never served again
                    sh = js.datasets[dataset].shards[sid]
                    reserve[sid] = max(0, min(b, sh.offset + sh.length) - a)
                pending[sid] = (le.epoch, kept, pos)
            if pos >= le.end:
                done.append(sid)
                if pos > le.end:  # read past the end it learnt its shard was cut to: say how far
                    progress.append(ShardProgress(sid, pos - le.offset))
            elif roll < fail_p:
                failed.append(sid)
            elif roll < fail_p + release_p:
                released.append(sid)
            else:
                held.append(sid)
                if pos > rep:
                    progress.append(ShardProgress(sid, pos - le.offset))
        out = js.lease(
            req(
                self.node,
                dataset,
                want=want,
                held=held,
                done=done,
                progress=progress,
                discarded=discarded,
                failed=failed,
                released=released,
                max_records=max_records,
                rate=rate,
            ),
            now,
        )
        reply: LeaseReply = out.reply
        bad = {r.shard for r in reply.rejected}
        confirmed = [(ep, a, b) for s, (ep, kept, _) in pending.items() if s not in bad for a, b in kept]
        self.discarded += sum(reserve[r.shard] for r in discarded if r.shard not in bad)
        for s in done + failed + released:
            self.leases.pop(s, None)
        for s in bad:
            self.leases.pop(s, None)
        for s, (_ep, _kept, pos) in pending.items():
            if s in self.leases and s not in bad:
                self.leases[s][2] = pos
        for le in reply.shards:
            self.leases[le.shard] = [le, le.start, le.start]
        for le in reply.shortened:  # work stealing took the end of a shard it holds: stop there
            old, pos, _rep = self.leases[le.shard]
            assert le.end <= old.end and (le.offset, le.epoch) == (old.offset, old.epoch)
            self.cut_back += old.end - max(le.end, min(pos, old.end))
            self.leases[le.shard][0] = dataclasses.replace(old, end=le.end)
        return out, confirmed


# =========================================================================== transitions
def test_done_is_terminal_and_table_is_small() -> None:
    assert not [t for (f, t) in TRANSITIONS if f is S.DONE]
    assert all(f is not t for (f, t) in TRANSITIONS), "no self-loops"
    assert {f for (f, _) in TRANSITIONS} == {S.TODO, S.DOING, S.FAILED}
    assert {t for (_, t) in TRANSITIONS} == set(S), "every state is reachable"
    # a FAILED shard is never silently dropped nor completed without a new grant
    assert [t for (f, t) in TRANSITIONS if f is S.FAILED] == [S.TODO]


def _shard_in(ds: Dataset, state: ShardState) -> Shard:
    sh = Shard(0, 0, 0, 10, 7)
    ds.shards[0] = sh
    sh.state = state
    if state is S.DOING:
        sh.node = "n1"
        sh.grants = 1
        ds.doing["n1"] = {0}
    elif state is S.FAILED:
        ds.failed.add(0)
    elif state is S.DONE:
        sh.consumed = 10
    return sh


@pytest.mark.parametrize(("frm", "to"), list(itertools.product(S, S)), ids=lambda s: s.value)
def test_move_accepts_exactly_the_table(frm: ShardState, to: ShardState) -> None:
    ds = Dataset(spec())
    sh = _shard_in(ds, frm)
    done0, recs0 = ds.done_count, ds.records_done
    if (frm, to) in TRANSITIONS:
        ds.move(sh, to)
        assert sh.state is to
        if frm is S.DOING:
            assert "n1" not in ds.doing
        assert (0 in ds.failed) is (to is S.FAILED)
        assert ds.done_count == done0 + (to is S.DONE)
        assert ds.records_done == recs0 + (10 if to is S.DONE else 0)
    else:
        with pytest.raises(IllegalTransition, match=f"{frm.value} -> {to.value}"):
            ds.move(sh, to)
        assert sh.state is frm
        assert ds.done_count == done0 and ds.records_done == recs0
        assert (0 in ds.failed) is (frm is S.FAILED)
        assert ("n1" in ds.doing) is (frm is S.DOING)


def test_apply_rejects_corrupt_records() -> None:
    js, _ = new_job(spec())
    with pytest.raises(IllegalTransition, match="unknown log record"):
        js.apply(["bogus", DS])
    with pytest.raises(IllegalTransition, match="checkpoint"):
        js.apply(["restore", DS, "cp"])
    head = js.datasets[DS].todo[0]
    with pytest.raises(IllegalTransition, match="bad split"):
        js.apply(["split", DS, head, 10, js.datasets[DS].next_id])  # keep == length
    with pytest.raises(IllegalTransition, match="bad split"):
        js.apply(["split", DS, head, 5, 999])  # new id out of sequence
    # a DONE shard cannot be granted again (DONE is terminal), even from a log
    js.lease(req("n1", want=1), 0.0)
    sid = next(iter(js.datasets[DS].doing["n1"]))
    js.lease(req("n1", done=[sid]), 0.0)
    js.datasets[DS].todo.appendleft(sid)  # corrupt the queue as a bad log would
    with pytest.raises(IllegalTransition):
        js.apply(["grant", DS, sid, "n2"])


# =========================================================================== full consumption
@PROPS
@given(
    records=st.integers(1, 400),
    batch_size=st.integers(1, 9),
    bps=st.integers(1, 4),
    epochs=st.integers(1, 3),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
    nnodes=st.integers(1, 5),
    split=st.booleans(),
    rseed=st.integers(0, 2**32),
)
def test_nodes_consume_every_record_exactly_once(
    records: int,
    batch_size: int,
    bps: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    nnodes: int,
    split: bool,
    rseed: int,
) -> None:
    rnd = random.Random(rseed)
    sp = spec(
        records=records,
        batch_size=batch_size,
        batches_per_shard=bps,
        epochs=epochs,
        shuffle=shuffle,
        seed=seed,
    )
    js, _ = new_job(sp)
    clients = [Client(f"n{i}") for i in range(nnodes)]
    granted: dict[int, tuple[int, int, int]] = {}  # shard -> (epoch, start, end as last told)
    reads: Counter[tuple[int, int]] = Counter()
    events: list[str] = []
    now = 0.0
    finished_seen = False
    for _step in range(20_000):
        c = rnd.choice(clients)
        c.read(rnd, rnd.randint(0, 3 * batch_size * bps), reads)
        prefetch = rnd.randint(0, 4)
        max_rec = rnd.randint(1, batch_size * bps + 2) if split and rnd.random() < 0.5 else 0
        want = max(0, prefetch - len(c.leases))
        out, _ = c.request(js, now, rnd, want=want, max_records=max_rec)
        reply: LeaseReply = out.reply
        events += kinds(out)
        assert not reply.rejected
        # a new shard is granted from TODO, or cut off the end of another node's (work stealing)
        assert ops(out).count("grant") + ops(out).count("steal") == len(reply.shards), (
            "a lease was re-returned without a lost reply"
        )
        for le in reply.shards:
            assert le.attempt == 0
            assert le.start == le.offset
            if max_rec:
                assert lease_len(le) <= max_rec
            granted[le.shard] = (le.epoch, le.start, le.end)
        for le in reply.shortened:
            granted[le.shard] = (le.epoch, granted[le.shard][1], le.end)
        ds = js.datasets[DS]
        all_done = all(sh.state is S.DONE for sh in ds.shards.values()) and ds.epoch == epochs - 1
        assert reply.finished is all_done
        assert reply.exhausted is (not reply.shards and not reply.finished and want > 0)
        if reply.finished:
            finished_seen = True
            break
        now += 0.5
        if _step % 50 == 0:
            check_invariants(js)
    assert finished_seen
    check_invariants(js)
    # the leases as their holders last knew them; one holder reported its last shard done before it
    # heard of its cut (it read up to the end it knew): its stealer's piece is the truth
    ends = {sid: (sh.epoch, sh.offset, sh.offset + sh.length) for sid, sh in js.datasets[DS].shards.items()}
    assert all(granted[sid][:2] == ends[sid][:2] and granted[sid][2] >= ends[sid][2] for sid in ends)
    for e in range(epochs):
        covered_exactly([(a, b) for ep, a, b in ends.values() if ep == e], records)
    st_ = js.status(DS)
    assert (st_.todo, st_.doing, st_.failed) == (0, 0, 0)
    assert st_.done == len(js.datasets[DS].shards)
    assert st_.records_done == st_.records_total == records * epochs
    assert set(reads) == {(e, r) for e in range(epochs) for r in range(records)}
    # no failure: a record is read twice only when a holder read past the end its shard was cut to
    assert st_.records_duplicated == sum(n - 1 for n in reads.values())
    assert st_.epoch == epochs - 1 and st_.finished
    assert sum(n.records for n in st_.nodes) == records * epochs
    assert sum(n.shards_done for n in st_.nodes) == st_.done
    assert events.count("finished") == 1 and events[-1] == "finished"
    assert events.count("epoch_started") == epochs - 1
    # further requests on a finished dataset grant nothing and do not re-announce it
    out = js.lease(req("n0", want=3), now + 1)
    assert out.reply.shards == [] and out.reply.finished and not out.reply.exhausted
    assert out.records == [] and "finished" not in kinds(out)


def test_shuffle_is_seeded_and_differs_per_epoch() -> None:
    def order(sp: DatasetSpec) -> list[list[int]]:
        js, _ = new_job(sp)
        per_epoch: dict[int, list[int]] = {}
        while True:
            out = js.lease(req("n1", want=MAX_WANT), 0.0)
            for le in out.reply.shards:
                per_epoch.setdefault(le.epoch, []).append(le.offset)
            js.lease(req("n1", done=[le.shard for le in out.reply.shards]), 0.0)
            if not out.reply.shards:
                break
        return [per_epoch[e] for e in sorted(per_epoch)]

    shuffled = order(spec(records=1000, batch_size=10, epochs=2, seed=3))
    assert len(shuffled) == 2
    assert shuffled[0] != sorted(shuffled[0]) and shuffled[1] != sorted(shuffled[1])
    assert shuffled[0] != shuffled[1], "each epoch must get its own order"
    assert shuffled == order(spec(records=1000, batch_size=10, epochs=2, seed=3)), (
        "not deterministic"
    )
    assert shuffled != order(spec(records=1000, batch_size=10, epochs=2, seed=4)), "seed ignored"
    plain = order(spec(records=1000, batch_size=10, epochs=2, shuffle=False))
    assert plain == [list(range(0, 1000, 10))] * 2


def test_shard_size_and_short_last_shard() -> None:
    js, _ = new_job(spec(records=25, batch_size=4, batches_per_shard=2, shuffle=False))
    out = js.lease(req("n1", want=10), 0.0)
    assert [(le.start, le.end) for le in out.reply.shards] == [(0, 8), (8, 16), (16, 24), (24, 25)]
    assert len({le.seed for le in out.reply.shards}) == 4


# =========================================================================== fold / snapshots
NODES = ["n0", "n1", "n2", "n3"]
FIN, STR = "fin", "str"


def replay(
    log: list[list[Any]], cps: dict[str, Any], base: dict[str, Any] | None = None
) -> JobShards:
    js = JobShards.from_snapshot(base) if base is not None else JobShards(JOB)
    for rec in log:
        js.apply(rec, checkpoint=cps[rec[2]] if rec[0] == "restore" else None)
    return js


def _random_lease(js: JobShards, data: st.DataObject, name: str, node: str, now: float) -> Outcome:
    ds = js.datasets[name]
    mine = sorted(ds.doing.get(node, ()))
    kw: dict[str, list[Any]] = {
        "done": [],
        "progress": [],
        "discarded": [],
        "failed": [],
        "released": [],
        "held": [],
    }
    for sid in mine:
        sh = ds.shards[sid]
        tag = data.draw(
            st.sampled_from(["done", "progress", "failed", "released", "held", "held", "forget"])
        )
        consumed = sh.length if tag == "done" else sh.consumed
        if tag == "progress":
            # a cut shard's holder may report up to the end it was granted (past the new end)
            consumed = data.draw(st.integers(-1, sh.length + sh.cut + 1))
            kw["progress"].append(ShardProgress(sid, consumed))
            if data.draw(st.booleans()):
                kw["held"].append(sid)
        elif tag != "forget":
            kw[tag].append(sid)
            if tag == "done" and sh.cut and data.draw(st.booleans()):  # and how far past the new end it read
                kw["progress"].append(ShardProgress(sid, data.draw(st.integers(sh.length, sh.length + sh.cut))))
        # gradients of some of what it consumed discarded: mostly a valid range, sometimes not
        how = data.draw(st.sampled_from(["none", "valid", "valid", "any"]))
        if how == "valid" and tag == "held" and consumed <= sh.floor < sh.length:
            consumed = data.draw(st.integers(sh.floor + 1, sh.length))  # consumed more first
            kw["progress"].append(ShardProgress(sid, consumed))
        if how == "valid" and sh.floor < consumed <= sh.length:
            a = data.draw(st.integers(sh.floor, consumed - 1))
            kw["discarded"].append(ShardRange(sid, a, data.draw(st.integers(a + 1, consumed))))
        elif how == "any":
            a = data.draw(st.integers(-1, sh.length + 1))
            kw["discarded"].append(ShardRange(sid, a, data.draw(st.integers(a - 1, sh.length + 2))))
    if data.draw(st.integers(0, 5)) == 0:  # a report about someone else's or a bogus shard
        bogus = data.draw(st.integers(0, ds.next_id + 2))
        where = data.draw(st.sampled_from(["done", "failed", "released", "discarded"]))
        kw[where].append(ShardRange(bogus, 0, 1) if where == "discarded" else bogus)
    return js.lease(
        req(
            node,
            name,
            want=data.draw(st.integers(0, 4)),
            max_records=data.draw(st.sampled_from([0, 0, 1, 2, 3, 7])),
            rate=data.draw(st.sampled_from([0.0, 0.1, 1.0, 5.0])),  # slow holders' shards get stolen
            **kw,
        ),
        now,
    )


fin_specs = st.builds(
    spec,
    dataset=st.just(FIN),
    records=st.integers(1, 60),
    batch_size=st.integers(1, 7),
    batches_per_shard=st.integers(1, 6),
    epochs=st.integers(1, 3),
    shuffle=st.booleans(),
    seed=st.integers(0, 1000),
    max_failures=st.integers(1, 3),
    lease_s=st.sampled_from([3.0, 10.0]),
)
str_specs = st.builds(
    stream_spec,
    dataset=st.just(STR),
    records=st.integers(0, 30),
    batch_size=st.integers(1, 7),
    batches_per_shard=st.integers(1, 2),
    max_failures=st.integers(1, 3),
    lease_s=st.sampled_from([3.0, 10.0]),
)


@PROPS
@given(data=st.data(), fin=fin_specs, stream=str_specs, with_restore=st.booleans())
def test_fold_and_snapshots_rebuild_the_live_state(
    data: st.DataObject, fin: DatasetSpec, stream: DatasetSpec, with_restore: bool
) -> None:
    js, log = new_job(fin, stream)
    cps: dict[str, Any] = {}
    boundaries = [(len(log), js.snapshot())]  # snapshot() returns fresh containers
    now = 0.0
    kinds_ = ["lease"] * 6 + ["hoard", "expire", "died", "retry", "append", "append", "noop"]
    if with_restore:
        kinds_ += ["checkpoint", "restore"]
    for _ in range(data.draw(st.integers(0, 30))):
        kind = data.draw(st.sampled_from(kinds_))
        name = data.draw(st.sampled_from([FIN, STR]))
        before = js.snapshot()
        out: Outcome | None = None
        if kind == "lease":
            out = _random_lease(js, data, name, data.draw(st.sampled_from(NODES)), now)
        elif kind == "hoard":  # a slow node takes many shards: the others, once idle, steal their ends
            want = data.draw(st.sampled_from([8, MAX_WANT]))
            out = js.lease(req(data.draw(st.sampled_from(NODES)), name, want=want, rate=0.1), now)
        elif kind == "expire":
            now += data.draw(st.sampled_from([0.5, 2.0, 4.0, 11.0]))
            out = js.expire(now)
        elif kind == "died":
            out = js.node_died(data.draw(st.sampled_from(NODES)))
        elif kind == "retry":
            out = js.retry_failed(name)
        elif kind == "append":
            n, close = data.draw(st.integers(0, 15)), data.draw(st.booleans())
            if js.datasets[STR].closed and (n or not close):
                with pytest.raises(Conflict):
                    js.append(STR, n, close)
                assert js.snapshot() == before, "a rejected append changed state"
            else:
                out = js.append(STR, n, close)
            with pytest.raises(ValidationError):
                js.append(FIN, 1, False)
        elif kind == "checkpoint":
            cid = f"cp{len(cps)}"
            cps[cid] = copy.deepcopy(js.checkpoint(name))
            assert js.snapshot() == before, "taking a checkpoint changed state"
        elif kind == "restore" and cps:
            cid = data.draw(st.sampled_from(sorted(cps)))
            tgt = cps[cid]["spec"]["dataset"]
            out = js.restore(tgt, cid, copy.deepcopy(cps[cid]))
        if out is not None:
            log += out.records
        check_invariants(js)
        boundaries.append((len(log), js.snapshot()))

    live = js.snapshot()
    rebuilt = replay(log, cps)
    rebuilt.settle()
    assert rebuilt.snapshot() == live
    assert rebuilt.transitions == js.transitions == len(log)
    if not any(r[0] == "restore" for r in log):
        assert fold(JOB, log).snapshot() == live
    check_invariants(rebuilt)
    assert JobShards.from_snapshot(live).snapshot() == live
    assert JobShards.from_snapshot(copy.deepcopy(live)).snapshot() == live
    # snapshot at an earlier decision + replay of the tail == live
    for idx in {0, len(boundaries) // 2, data.draw(st.integers(0, len(boundaries) - 1))}:
        at, snap = boundaries[idx]
        assert replay(log[at:], cps, base=snap).snapshot() == live
    # a rebuilt state decides exactly as the live one once it knows the nodes' rates and lease deadlines: soft
    # state, not logged but reported again with every lease request (tail pieces and steals depend on them)
    rebuilt.rates = copy.deepcopy(js.rates)
    rebuilt.deadlines = dict(js.deadlines)
    for name in (FIN, STR):
        a = js.lease(req("n1", name, want=2, max_records=2), now)
        b = rebuilt.lease(req("n1", name, want=2, max_records=2), now)
        assert a.records == b.records and a.reply == b.reply and a.events == b.events
    check_invariants(js)


def test_snapshot_tail_replay_simple() -> None:
    js, log = new_job(
        spec(records=50, batch_size=5, max_failures=2), stream_spec(dataset="s", records=7)
    )
    snap = copy.deepcopy(js.snapshot())
    cut = len(log)
    log += js.lease(req("a", want=3), 0.0).records
    log += js.lease(req("b", want=2, max_records=2), 0.0).records
    log += js.lease(
        req("a", progress=[ShardProgress(next(iter(js.datasets[DS].doing["a"])), 2)], held=[]), 1.0
    ).records
    log += js.node_died("a").records
    log += js.append("s", 11, close=True).records
    log += js.lease(req("c", "s", want=5), 2.0).records
    log += js.expire(100.0).records
    assert {r[0] for r in log[cut:]} >= {"grant", "split", "prog", "lost", "append", "close"}
    live = js.snapshot()
    assert fold(JOB, log).snapshot() == live
    assert replay(log[cut:], {}, base=snap).snapshot() == live
    assert JobShards.from_snapshot(live).snapshot() == live


# =========================================================================== at-least-once
@PROPS
@given(
    records=st.integers(1, 150),
    batch_size=st.integers(1, 8),
    bps=st.integers(1, 6),
    epochs=st.integers(1, 3),
    nnodes=st.integers(1, 4),
    max_failures=st.integers(1, 5),
    p_die=st.sampled_from([0.0, 0.05, 0.2]),
    p_silence=st.sampled_from([0.0, 0.05, 0.2]),
    p_fail=st.sampled_from([0.0, 0.0, 0.05]),
    p_release=st.sampled_from([0.0, 0.0, 0.05]),
    p_discard=st.sampled_from([0.0, 0.1, 0.4]),
    split=st.booleans(),
    slow=st.sampled_from([1, 4, 30]),
    under=st.sampled_from([1.0, 0.2]),
    rseed=st.integers(0, 2**32),
)
def test_at_least_once_under_failures(
    records: int,
    batch_size: int,
    bps: int,
    epochs: int,
    nnodes: int,
    max_failures: int,
    p_die: float,
    p_silence: float,
    p_fail: float,
    p_release: float,
    p_discard: float,
    split: bool,
    slow: int,
    under: float,
    rseed: int,
) -> None:
    """Every record is trained with a kept gradient at least once, whatever nodes die, fall
    silent, fail, release, have their gradients discarded or the end of their shard stolen by
    an idle node (n0 turns ``slow`` times slower than the others; with ``under`` < 1 every node
    reports a lower rate than it reads at, so the service leaves too small a margin and holders
    read past the end their shard was cut to); the counts say exactly how much was handed out again."""
    rnd = random.Random(rseed)
    lease_s = 5.0
    sp = spec(
        records=records,
        batch_size=batch_size,
        batches_per_shard=bps,
        epochs=epochs,
        max_failures=max_failures,
        lease_s=lease_s,
        seed=rnd.randint(0, 99),
    )
    js, log = new_job(sp)
    clients = {f"n{i}": Client(f"n{i}") for i in range(nnodes)}
    silent_until = dict.fromkeys(clients, -1.0)
    reads: Counter[tuple[int, int]] = Counter()
    confirmed: Counter[tuple[int, int]] = Counter()
    handed_out = 0
    lost = 0
    parked_events = 0
    now = 0.0
    shard_size = batch_size * bps
    steals = 0
    turn = rnd.randint(0, 3)  # n0 turns slow here, with the shards it took while fast
    for step in range(5_000):
        chaos = step < 120
        for name in rnd.sample(sorted(clients), len(clients)):
            c = clients[name]
            pace = slow if name == "n0" and nnodes > 1 and step >= turn else 1  # reads one step in ``pace``
            if rnd.random() * pace < 1:
                c.read(rnd, rnd.randint(0, 2 * shard_size), reads)  # silent nodes keep reading (stall)
            if silent_until[name] >= now:
                continue
            max_rec = rnd.randint(1, shard_size + 1) if split and rnd.random() < 0.3 else 0
            out, conf = c.request(
                js,
                now,
                rnd,
                want=max(0, 2 - len(c.leases)),
                max_records=max_rec,
                rate=shard_size / pace * under,
                fail_p=p_fail if chaos else 0.0,
                release_p=p_release if chaos else 0.0,
                discard_p=p_discard if step < 400 else 0.0,  # then nobody's gradients are discarded any more
            )
            log += out.records
            for ep, a, b in conf:
                for r in range(a, b):
                    confirmed[(ep, r)] += 1
            assert ops(out).count("grant") + ops(out).count("steal") == len(out.reply.shards)
            steals += ops(out).count("steal")
            for le in out.reply.shards:
                assert le.start < le.end
                if max_rec:
                    assert lease_len(le) <= max_rec
                handed_out += lease_len(le)
            if out.reply.finished:
                assert js.datasets[DS].finished()
            lost += ops(out).count("lost")
            parked_events += kinds(out).count("parked")
        if chaos and rnd.random() < p_die:
            victim = rnd.choice(sorted(clients))
            out = js.node_died(victim)
            log += out.records
            lost += ops(out).count("lost")
            parked_events += kinds(out).count("parked")
            clients[victim].leases.clear()
        if chaos and rnd.random() < p_silence:
            silent_until[rnd.choice(sorted(clients))] = now + lease_s + rnd.randint(1, 4)
        out = js.expire(now)
        log += out.records
        lost += ops(out).count("lost")
        parked_events += kinds(out).count("parked")
        st_ = js.status(DS)
        assert st_.failed <= parked_events
        if st_.failed and (not chaos or rnd.random() < 0.2):
            assert not st_.finished
            log += js.retry_failed(DS).records
        if js.datasets[DS].finished():
            break
        now += 1.0
    check_invariants(js)
    st_ = js.status(DS)
    assert st_.finished, "did not finish"
    assert st_.records_done == st_.records_total == records * epochs
    total = records * epochs
    reserved = sum(c.discarded for c in clients.values())
    assert st_.records_reserved == reserved, "re-served records are exactly the discarded ones accepted"
    assert sum(n.records_discarded for n in st_.nodes) == reserved
    assert {n.node: n.records_discarded for n in st_.nodes if n.records_discarded} == {
        c.node: c.discarded for c in clients.values() if c.discarded}
    # consumed = every record once, plus the re-served ones once more
    assert sum(n.records for n in st_.nodes) == total + reserved
    everything = {(e, r) for e in range(epochs) for r in range(records)}
    assert set(confirmed) == everything, "a record was never trained with a kept gradient"
    assert set(reads) == everything
    if lost == 0 and not js.status(DS).records_duplicated:
        assert set(confirmed.values()) == {1}, "without a loss or a steal's overlap, every record is kept exactly once"
    # records_duplicated and records_reserved count exactly the records handed out again (less the ends
    # of shards stolen before their holder read them) ...
    handed_out -= sum(c.cut_back for c in clients.values())
    assert st_.records_duplicated + st_.records_reserved == handed_out - total
    # ... which bounds the records actually read more than once
    assert sum(n - 1 for n in reads.values()) <= st_.records_duplicated + st_.records_reserved
    if lost == 0:
        # without a loss, only a holder that read past the end its shard was cut to reads twice
        assert sum(n - 1 for n in reads.values()) == st_.records_duplicated + st_.records_reserved
        assert sum(n - 1 for n in confirmed.values()) <= st_.records_duplicated
        if steals == 0:
            assert st_.records_duplicated == 0
    assert fold(JOB, log).snapshot() == js.snapshot()


def test_duplicates_zero_without_failures_and_counted_after_one() -> None:
    js, _ = new_job(spec(records=30, batch_size=10))
    a = js.lease(req("a", want=1), 0.0).reply.shards[0]
    js.lease(req("b", want=1), 0.0)
    assert js.status(DS).records_duplicated == 0
    js.lease(req("a", held=[a.shard], progress=[ShardProgress(a.shard, 4)]), 0.0)
    js.node_died("a")
    assert js.status(DS).records_duplicated == 0, "a loss alone re-hands out nothing"
    again = js.lease(req("c", want=1), 0.0).reply.shards[0]
    assert again.shard == a.shard and again.attempt == 1
    assert js.status(DS).records_duplicated == 6 == lease_len(again)


# =========================================================================== parking
def _one_shard_job(**kw: Any) -> tuple[JobShards, int]:
    js, _ = new_job(spec(records=10, batch_size=10, **kw))
    return js, 0


@pytest.mark.parametrize("how", ["died", "expired", "failed"])
def test_shard_parked_after_max_failures_then_retried(how: str) -> None:
    js, sid = _one_shard_job()
    now = 0.0
    for i in range(5):
        node = f"n{i}"
        out = js.lease(req(node, want=1), now)
        assert [le.shard for le in out.reply.shards] == [sid]
        assert out.reply.shards[0].attempt == i
        assert not out.reply.finished and not js.status(DS).finished
        if how == "died":
            out = js.node_died(node)
        elif how == "expired":
            now += 31.0
            out = js.expire(now)
        else:
            out = js.lease(req(node, failed=[sid]), now)
        assert out.records == [["lost", DS, sid, how]]
        if i < 4:
            assert kinds(out) == ["requeued"]
            assert js.datasets[DS].shards[sid].state is S.TODO
        else:
            (ev,) = out.events
            assert (ev.kind, ev.shard, ev.node, ev.epoch) == ("parked", sid, node, 0)
            assert "5 failures" in ev.detail and how in ev.detail
        check_invariants(js)
    st_ = js.status(DS)
    assert (st_.failed, st_.failed_shards, st_.todo, st_.doing, st_.finished) == (
        1,
        [sid],
        0,
        0,
        False,
    )
    out = js.lease(req("late", want=2), now)
    assert out.reply.shards == [] and out.reply.exhausted and not out.reply.finished
    assert "finished" not in kinds(out)
    out = js.retry_failed(DS)
    assert out.records == [["retry", DS]]
    assert out.reply.failed == 0 and out.reply.todo == 1 and not out.reply.finished
    assert js.datasets[DS].shards[sid].failures == 0
    le = js.lease(req("late", want=1), now).reply.shards[0]
    assert le.shard == sid and le.attempt == 5
    out = js.lease(req("late", done=[sid]), now)
    assert out.reply.finished and kinds(out) == ["finished"]
    check_invariants(js)


def test_released_is_not_a_failure_and_other_shards_do_not_finish_a_parked_dataset() -> None:
    js, _ = new_job(spec(records=20, batch_size=10, max_failures=2, shuffle=False))
    for _ in range(10):
        le = js.lease(req("a", want=1), 0.0).reply.shards[0]
        assert le.shard == 0
        out = js.lease(req("a", released=[0]), 0.0)
        assert kinds(out) == ["requeued"]
    assert js.datasets[DS].shards[0].failures == 0
    # shard 0 fails twice -> parked; shard 1 is done; not finished
    for _ in range(2):
        js.lease(req("a", want=1), 0.0)
        out = js.lease(req("a", failed=[0]), 0.0)
    assert kinds(out) == ["parked"]
    js.lease(req("b", want=1), 0.0)
    out = js.lease(req("b", done=[1]), 0.0)
    assert not out.reply.finished and js.status(DS).failed_shards == [0]
    assert js.retry_failed(DS).records
    assert js.retry_failed(DS).records == [], "nothing parked: retry is a no-op"
    js.lease(req("b", want=1), 0.0)
    assert js.lease(req("b", done=[0]), 0.0).reply.finished


def test_retry_failed_puts_parked_first_in_line() -> None:
    js, _ = new_job(spec(records=50, batch_size=10, max_failures=1, shuffle=False))
    js.lease(req("a", want=2), 0.0)
    js.node_died("a")
    assert js.status(DS).failed_shards == [0, 1]
    js.retry_failed(DS)
    got = [le.shard for le in js.lease(req("b", want=2), 0.0).reply.shards]
    assert sorted(got) == [0, 1]


# =========================================================================== leases
def test_expire_only_returns_shards_whose_lease_ran_out() -> None:
    js, _ = new_job(spec(records=100, batch_size=10, lease_s=30.0))
    a = {le.shard for le in js.lease(req("a", want=2), 0.0).reply.shards}
    b = {le.shard for le in js.lease(req("b", want=2), 20.0).reply.shards}
    assert js.expire(29.0).records == []
    out = js.expire(31.0)
    assert {r[2] for r in out.records} == a and {r[3] for r in out.records} == {"expired"}
    assert set(js.datasets[DS].doing) == {"b"} and js.datasets[DS].doing["b"] == b
    assert js.expire(31.0).records == [], "expired twice"
    assert js.expire(49.0).records == []
    out = js.expire(51.0)
    assert {r[2] for r in out.records} == b
    assert js.status(DS).doing == 0 and js.status(DS).todo == 10
    check_invariants(js)


@pytest.mark.parametrize(
    "renewal",
    ["heartbeat", "want_more", "report_done", "rejected_report"],
)
def test_any_lease_request_renews(renewal: str) -> None:
    js, _ = new_job(
        spec(records=100, batch_size=10, lease_s=30.0), spec(dataset="other", lease_s=30.0)
    )
    shards = [le.shard for le in js.lease(req("a", want=3), 0.0).reply.shards]
    r = {
        "heartbeat": req("a", held=shards),
        "want_more": req("a", held=shards, want=1),
        "report_done": req("a", held=shards[1:], done=shards[:1]),
        "rejected_report": req("a", held=shards, done=[999]),
    }[renewal]
    js.lease(r, 25.0)
    assert js.expire(40.0).records == []
    assert js.datasets[DS].doing["a"] >= set(shards[1:])
    assert js.expire(56.0).records, "renewal must be now + lease_s, not forever"
    assert "a" not in js.datasets[DS].doing


def test_node_died_only_touches_that_node() -> None:
    js, _ = new_job(spec(records=100, batch_size=10), spec(dataset="e", records=30, batch_size=10))
    a = {le.shard for le in js.lease(req("a", want=2), 0.0).reply.shards}
    ae = {le.shard for le in js.lease(req("a", "e", want=1), 0.0).reply.shards}
    b = {le.shard for le in js.lease(req("b", want=2), 0.0).reply.shards}
    out = js.node_died("a")
    assert {(r[1], r[2]) for r in out.records} == {(DS, s) for s in a} | {("e", s) for s in ae}
    assert js.datasets[DS].doing == {"b": b} and "a" not in js.datasets["e"].doing
    assert js.node_died("a").records == [] and js.node_died("ghost").records == []
    # requeued work is served first
    got = {le.shard for le in js.lease(req("c", want=2), 0.0).reply.shards}
    assert got == a
    # b's lease is untouched by a's death
    assert js.expire(29.0).records == []
    assert {(r[2], r[3]) for r in js.expire(31.0).records if r[2] in b} == {
        (s, "expired") for s in b
    }


def test_renew_all_after_rebuild() -> None:
    js, log = new_job(
        spec(records=100, batch_size=10, lease_s=30.0), spec(dataset="long", lease_s=100.0)
    )
    log += js.lease(req("a", want=2), 0.0).records
    log += js.lease(req("b", "long", want=1), 0.0).records
    log += js.lease(req("idle", want=0), 0.0).records
    r = fold(JOB, log)
    assert r.expire(1e9).records == [], "deadlines are not logged: a rebuild must not lose anything"
    r.renew_all(500.0)  # each holder gets its dataset's lease from now
    assert r.expire(529.0).records == []
    out = r.expire(531.0)
    assert {(r_[1], r_[3]) for r_ in out.records} == {(DS, "expired")} and len(out.records) == 2
    assert r.expire(599.0).records == []
    out = r.expire(601.0)
    assert [(r_[0], r_[1]) for r_ in out.records] == [("lost", "long")]
    assert r.snapshot()["datasets"][DS] != js.snapshot()["datasets"][DS]
    check_invariants(r)


def test_lease_is_kept_per_dataset() -> None:
    # The core keeps one lease per (dataset, node): a request renews the node's
    # shards of the dataset it names, and never shortens another dataset's lease.
    js, _ = new_job(spec(dataset="long", lease_s=100.0), spec(dataset="short", lease_s=1.0))
    assert js.lease(req("a", "long", want=1), 0.0).reply.lease_s == 100.0
    js.lease(req("a", "short", want=1), 0.0)
    out = js.expire(50.0)
    assert [(r[1], r[3]) for r in out.records] == [("short", "expired")]
    js.lease(req("a", "short"), 90.0)  # a heartbeat on "short" only
    out = js.expire(101.0)
    assert [(r[1], r[3]) for r in out.records] == [("long", "expired")]


def test_request_on_short_lease_dataset_does_not_shorten_long_lease() -> None:
    js, _ = new_job(spec(dataset="long", lease_s=100.0), spec(dataset="short", lease_s=1.0))
    held = js.lease(req("a", "long", want=1), 0.0).reply
    assert held.lease_s == 100.0
    js.lease(req("a", "short"), 0.0)  # a plain heartbeat on the other dataset
    assert js.expire(50.0).records == [], "the long dataset's shard was promised 100 s"


# =========================================================================== progress
def test_regrant_resumes_after_progress() -> None:
    js, _ = new_job(spec(records=10, batch_size=10))
    le = js.lease(req("a", want=1), 0.0).reply.shards[0]
    out = js.lease(req("a", held=[0], progress=[ShardProgress(0, 4)]), 0.0)
    assert out.records == [["prog", DS, 0, 4]]
    for c in (4, 3, 0):  # not forward: nothing logged
        assert js.lease(req("a", held=[0], progress=[ShardProgress(0, c)]), 0.0).records == []
    js.lease(req("a", held=[0], progress=[ShardProgress(0, 6)]), 0.0)
    js.node_died("a")
    le2 = js.lease(req("b", want=1), 0.0).reply.shards[0]
    assert (le2.shard, le2.start, le2.end, le2.offset, le2.seed) == (
        0,
        le.offset + 6,
        le.end,
        le.offset,
        le.seed,
    )
    assert le2.attempt == 1
    js.lease(req("b", held=[0], progress=[ShardProgress(0, 8)]), 0.0)
    out = js.lease(req("b", done=[0]), 0.0)
    assert out.reply.finished
    st_ = js.status(DS)
    assert {n.node: (n.records, n.shards_done) for n in st_.nodes} == {"a": (6, 0), "b": (4, 1)}
    assert st_.records_done == 10 and st_.records_duplicated == 4


@pytest.mark.parametrize("loss", ["died", "expired", "failed", "released"])
def test_fully_consumed_then_lost_is_done(loss: str) -> None:
    js, _ = new_job(spec(records=20, batch_size=10, max_failures=1, shuffle=False))
    js.lease(req("b", want=1), 0.0)  # shard 0 to b, so a's loss is not the last one
    js.lease(req("a", want=1), 0.0)
    js.lease(req("a", held=[1], progress=[ShardProgress(1, 10)]), 0.0)
    if loss == "died":
        out = js.node_died("a")
    elif loss == "expired":
        js.lease(req("b", held=[0]), 40.0)
        out = js.expire(35.0)
    else:
        kw: dict[str, Any] = {loss: [1]}
        out = js.lease(req("a", **kw), 0.0)
    assert out.records == [["lost", DS, 1, loss]]
    sh = js.datasets[DS].shards[1]
    assert sh.state is S.DONE and sh.failures == 0, "not parked although max_failures=1"
    assert "requeued" not in kinds(out) and "parked" not in kinds(out)
    assert js.status(DS).records_done == 10
    out = js.lease(req("b", done=[0]), 40.0)
    assert out.reply.finished and "finished" in kinds(out)
    check_invariants(js)


def test_loss_of_last_fully_consumed_shard_finishes_dataset() -> None:
    js, _ = new_job(spec(records=10, batch_size=10))
    js.lease(req("a", want=1), 0.0)
    js.lease(req("a", held=[0], progress=[ShardProgress(0, 10)]), 0.0)
    out = js.node_died("a")
    assert kinds(out) == ["finished"] and js.status(DS).finished


# =========================================================================== lost replies
def test_lost_reply_returns_unacknowledged_shards() -> None:
    js, _ = new_job(spec(records=100, batch_size=10))
    first = js.lease(req("a", want=3), 0.0).reply.shards
    ids = sorted(le.shard for le in first)
    dup0 = js.status(DS).records_duplicated
    out = js.lease(req("a"), 1.0)  # the client never saw the reply
    assert out.records == []
    assert sorted(out.reply.shards, key=lambda le: le.shard) == sorted(
        first, key=lambda le: le.shard
    )
    out = js.lease(req("a", held=ids[:1]), 1.0)
    assert sorted(le.shard for le in out.reply.shards) == ids[1:]
    out = js.lease(req("a", held=ids, want=2), 1.0)
    new = {le.shard for le in out.reply.shards}
    assert len(new) == 2 and not new & set(ids)
    out = js.lease(req("a", held=ids, want=3), 1.0)  # forgot the two of the last reply
    got = {le.shard for le in out.reply.shards}
    assert len(got) == 3 and got > new and not got & set(ids)
    assert ops(out) == ["grant"], "re-returned shards count against want"
    assert js.status(DS).records_duplicated == dup0
    # another node's shards are never returned to this node
    out = js.lease(req("b"), 1.0)
    assert out.reply.shards == []


def test_lost_reply_resumes_from_progress() -> None:
    js, _ = new_job(spec(records=10, batch_size=10))
    js.lease(req("a", want=1), 0.0)
    js.lease(req("a", held=[0], progress=[ShardProgress(0, 3)]), 0.0)
    le = js.lease(req("a"), 0.0).reply.shards[0]
    assert (le.start, le.end, le.attempt) == (3, 10, 0)


def test_progress_reported_shard_is_not_returned_again() -> None:
    # LeaseRequest: DOING shards "neither in held nor reported" are returned again.
    js, _ = new_job(spec(records=20, batch_size=10, shuffle=False))
    js.lease(req("a", want=2), 0.0)
    out = js.lease(req("a", progress=[ShardProgress(0, 3)]), 0.0)
    assert [le.shard for le in out.reply.shards] == [1], "only the unreported, unheld shard"
    assert ops(out) == ["prog"]


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


# =========================================================================== streaming
def test_streaming_lifecycle() -> None:
    js, log = new_job(stream_spec(records=0, batch_size=10))
    out = js.lease(req("a", want=2), 0.0)
    assert out.reply.shards == [] and out.reply.exhausted and not out.reply.finished
    st_ = js.status(DS)
    assert (st_.epoch, st_.records_total, st_.closed, st_.finished) == (0, 0, False, False)
    log += js.append(DS, 25, close=False).records
    assert js.status(DS).records_total == 25 and js.status(DS).todo == 3
    got = js.lease(req("a", want=5), 0.0).reply.shards
    covered_exactly([(le.start, le.end) for le in got], 25)
    assert {le.epoch for le in got} == {0}
    out = js.lease(req("a", done=[le.shard for le in got], want=1), 0.0)
    assert out.reply.exhausted and not out.reply.finished, "all done but the stream is open"
    log += out.records
    out = js.append(DS, 15, close=False)
    log += out.records
    assert out.reply.records_total == 40 and not out.reply.finished
    got2 = js.lease(req("a", want=5), 0.0).reply.shards
    covered_exactly([(le.start, le.end) for le in got + got2], 40)
    out = js.append(DS, 0, close=True)
    assert out.records == [["close", DS]]
    assert out.reply.closed and not out.reply.finished, "closed but shards are DOING"
    assert "finished" not in kinds(out)
    out = js.lease(req("a", done=[le.shard for le in got2]), 0.0)
    assert out.reply.finished and kinds(out) == ["finished"]
    assert js.status(DS).records_done == js.status(DS).records_total == 40
    # closing again is idempotent; appending after close is not allowed
    assert js.append(DS, 0, close=True).records == []
    with pytest.raises(Conflict):
        js.append(DS, 1, close=False)
    with pytest.raises(Conflict):
        js.append(DS, 1, close=True)
    with pytest.raises(Conflict):
        js.append(DS, 0, close=False)
    check_invariants(js)


def test_streaming_close_with_nothing_pending_finishes_at_once_and_initial_records() -> None:
    js, _ = new_job(stream_spec(records=12, batch_size=5))
    assert js.status(DS).records_total == 12 and js.status(DS).todo == 3
    got = js.lease(req("a", want=9), 0.0).reply.shards
    covered_exactly([(le.start, le.end) for le in got], 12)
    js.lease(req("a", done=[le.shard for le in got]), 0.0)
    assert not js.status(DS).finished
    out = js.append(DS, 0, close=True)
    assert out.reply.finished and kinds(out) == ["finished"]


def test_append_rejections() -> None:
    js, _ = new_job(spec(), stream_spec(dataset="s"))
    before = js.snapshot()
    with pytest.raises(ValidationError, match="finite"):
        js.append(DS, 5, close=False)
    with pytest.raises(ValidationError, match="records"):
        js.append("s", -1, close=False)
    with pytest.raises(NotFound):
        js.append("nope", 1, close=False)
    assert js.snapshot() == before
    assert js.append("s", 0, close=False).records == []


# =========================================================================== checkpoint / restore
def test_checkpoint_restore() -> None:
    js, log = new_job(spec(records=100, batch_size=10, shuffle=False, max_failures=1))

    def run(out: Outcome) -> Outcome:
        log.extend(out.records)
        return out

    run(js.lease(req("a", want=3), 0.0))  # 0,1,2
    run(js.lease(req("a", held=[1, 2], done=[0], progress=[ShardProgress(1, 4)]), 0.0))
    run(js.lease(req("b", want=1), 0.0))  # 3
    run(js.node_died("b"))  # 3 parked (max_failures=1)
    before = js.snapshot()
    cp = js.checkpoint(DS)
    assert js.snapshot() == before, "checkpoint must not touch the live state"
    state_of = dict(zip(cp["id"], cp["state"], strict=True))
    live_state = {i: sh.state for i, sh in js.datasets[DS].shards.items()}
    assert {live_state[i] for i in (1, 2)} == {S.DOING}
    # DOING -> TODO (code 0); DONE (2) and FAILED (3) kept as they are
    assert (state_of[0], state_of[1], state_of[2], state_of[3]) == (2, 0, 0, 3)
    assert cp["todo"][:2] == [1, 2] and sorted(cp["todo"]) == [1, 2, *range(4, 10)]
    assert all(n == "" for i, n in zip(cp["id"], cp["node"], strict=True) if i in (1, 2))
    saved = copy.deepcopy(cp)
    # the job goes on after the checkpoint ...
    run(js.lease(req("a", done=[1, 2], want=4), 0.0))
    assert js.status(DS).done == 3
    # ... and is rolled back
    out = run(js.restore(DS, "cp1", copy.deepcopy(saved)))
    assert out.records == [["restore", DS, "cp1"]] and kinds(out) == ["restored"]
    assert [e.detail for e in out.events] == ["cp1"]
    st_ = out.reply
    assert (st_.done, st_.doing, st_.failed, st_.failed_shards, st_.todo) == (1, 0, 1, [3], 8)
    assert st_.records_done == 10
    check_invariants(js)
    # replaying a log holding a restore (given the checkpoint data) gives the same state
    assert replay(log, {"cp1": copy.deepcopy(saved)}).snapshot() == js.snapshot()
    # reports of pre-restore holders are refused
    out = run(js.lease(req("a", done=[0, 5], progress=[ShardProgress(1, 9)]), 1.0))
    assert out.reply.rejected == [
        Rejected(0, "not_doing:done"),
        Rejected(5, "not_doing:todo"),
        Rejected(1, "not_doing:todo"),
    ]
    # the restored DOING shards come first, resuming from their progress
    got = run(js.lease(req("c", want=2), 1.0)).reply.shards
    assert [(le.shard, le.start, le.end) for le in got] == [(1, 14, 20), (2, 20, 30)]
    # and it finishes, covering exactly the records not DONE at the checkpoint
    ranges = [(le.start, le.end) for le in got]
    run(js.lease(req("c", done=[1, 2]), 2.0))
    run(js.retry_failed(DS))
    while True:
        o = run(js.lease(req("c", want=4), 2.0))
        ranges += [(le.start, le.end) for le in o.reply.shards]
        if not o.reply.shards:
            break
        run(js.lease(req("c", done=[le.shard for le in o.reply.shards]), 2.0))
    covered_exactly([(0, 14), *ranges], 100)
    assert js.status(DS).finished and js.status(DS).records_done == 100
    assert replay(log, {"cp1": copy.deepcopy(saved)}).snapshot() == js.snapshot()


def test_restore_bad_input() -> None:
    js, _ = new_job(spec(), spec(dataset="other"))
    cp = js.checkpoint("other")
    with pytest.raises(ValidationError, match="not of dataset"):
        js.restore(DS, "x", cp)
    with pytest.raises(NotFound):
        js.restore("nope", "x", cp)
    with pytest.raises(NotFound):
        js.checkpoint("nope")


def test_checkpoint_of_fully_consumed_doing_shard_is_done() -> None:
    # As a live loss would: consumed == length -> DONE, never an empty [end, end) lease.
    js, _ = new_job(spec(records=20, batch_size=10, shuffle=False))
    js.lease(req("a", want=2), 0.0)
    js.lease(req("a", held=[0, 1], progress=[ShardProgress(0, 10), ShardProgress(1, 4)]), 0.0)
    cp = js.checkpoint(DS)
    assert cp["state"] == [2, 0] and cp["todo"] == [1] and cp["node"] == ["", ""]
    out = js.restore(DS, "c", cp)
    assert (out.reply.done, out.reply.todo, out.reply.records_done) == (1, 1, 10)
    check_invariants(js)
    got = js.lease(req("b", want=2), 0.0).reply.shards
    assert [(le.shard, le.start, le.end) for le in got] == [(1, 14, 20)]
    assert all(le.start < le.end for le in got)
    assert js.lease(req("b", done=[1]), 0.0).reply.finished


def test_rebuilt_state_does_not_announce_finished_twice() -> None:
    js, log = new_job(spec(records=10, batch_size=10))
    snap, cut = copy.deepcopy(js.snapshot()), len(log)
    log += js.lease(req("a", want=1), 0.0).records
    out = js.lease(req("a", done=[0]), 0.0)
    log += out.records
    assert kinds(out) == ["finished"]
    assert kinds(js.lease(req("a"), 0.0)) == []  # live: announced once
    assert kinds(fold(JOB, log).lease(req("a"), 0.0)) == []
    # snapshot taken before the end + a tail that finishes it, then settle() (as the service does)
    tail = replay(log[cut:], {}, base=snap)
    tail.settle()
    assert kinds(tail.lease(req("a"), 0.0)) == []
    assert kinds(JobShards.from_snapshot(js.snapshot()).lease(req("a"), 0.0)) == []


# =========================================================================== bad input
@pytest.mark.parametrize(
    ("field_", "kw"),
    [
        ("job", {"job": ""}),
        ("job", {"job": "a b"}),
        ("job", {"job": "x" * 65}),
        ("job", {"job": "a.b"}),
        ("dataset", {"dataset": ""}),
        ("dataset", {"dataset": "d*"}),
        ("batch_size", {"batch_size": 0}),
        ("batch_size", {"batch_size": -3}),
        ("batches_per_shard", {"batches_per_shard": 0}),
        ("records", {"records": 0}),
        ("records", {"records": -1}),
        ("records", {"records": -1, "mode": DatasetMode.STREAMING}),
        ("epochs", {"epochs": 0}),
        ("epochs", {"epochs": 2, "mode": DatasetMode.STREAMING, "records": 0}),
        ("max_failures", {"max_failures": 0}),
        ("lease_s", {"lease_s": 0.0}),
        ("lease_s", {"lease_s": -1.0}),
        ("lease_s", {"lease_s": 86_400.5}),
        ("lease_s", {"lease_s": math.nan}),
        ("lease_s", {"lease_s": math.inf}),
    ],
)
def test_invalid_spec_names_the_field(field_: str, kw: dict[str, Any]) -> None:
    bad = spec(**kw)
    with pytest.raises(ValidationError) as ei:
        validate_spec(bad)
    assert str(ei.value).startswith(f"{field_}:")
    js = JobShards(bad.job if "job" in kw else JOB)
    with pytest.raises(ValidationError, match=rf"^{field_}:"):
        js.register(bad)
    assert js.datasets == {} and js.transitions == 0


def test_size_limits_name_the_field() -> None:
    from pacer_services.shard_service.core import DEFAULT_LIMITS, MAX_RECORDS

    max_shards = DEFAULT_LIMITS.shards_per_epoch
    # one epoch may not need more than shards_per_epoch shards (validated, not built)
    validate_spec(spec(records=max_shards * 3, batch_size=3))
    with pytest.raises(ValidationError, match=r"^records:"):
        validate_spec(spec(records=max_shards * 3 + 1, batch_size=3))
    # records * epochs must fit an int64
    big = 2**62
    validate_spec(spec(records=big, batch_size=2**50, epochs=1))
    with pytest.raises(ValidationError, match=r"^epochs:"):
        validate_spec(spec(records=big, batch_size=2**50, epochs=2))
    # appends are bounded the same way
    js, _ = new_job(stream_spec(records=0, batch_size=1))
    with pytest.raises(ValidationError, match=r"^records:"):
        js.append(DS, max_shards + 1, close=False)
    js2, _ = new_job(stream_spec(records=MAX_RECORDS - 10, batch_size=2**62))
    assert js2.status(DS).todo == 2
    snap = js2.snapshot()
    with pytest.raises(ValidationError, match=r"^records:"):
        js2.append(DS, 11, close=False)
    assert js2.snapshot() == snap
    assert ops(js2.append(DS, 10, close=True)) == ["append", "close"]


@pytest.mark.parametrize(
    "kw",
    [
        {"job": "x" * 64},
        {"lease_s": 86_400.0},
        {"records": 0, "mode": DatasetMode.STREAMING},
        {"max_failures": 1, "epochs": 1, "batch_size": 1, "batches_per_shard": 1, "records": 1},
    ],
)
def test_valid_edge_specs(kw: dict[str, Any]) -> None:
    sp = spec(**kw)
    validate_spec(sp)
    js = JobShards(sp.job)
    assert ops(js.register(sp)) == ["reg", "epoch"]


def test_register_errors_and_idempotence() -> None:
    js = JobShards(JOB)
    with pytest.raises(ValidationError, match=r"^job:"):
        js.register(spec(job="other"))
    out = js.register(spec())
    assert ops(out) == ["reg", "epoch"] and kinds(out) == ["registered"]
    assert out.reply.todo == 10 and out.reply.records_total == 100
    snap = js.snapshot()
    again = js.register(spec())
    assert again.records == [] and again.events == [] and again.reply == js.status(DS)
    with pytest.raises(Conflict):
        js.register(spec(records=101))
    with pytest.raises(Conflict):
        js.register(spec(lease_s=31.0))
    assert js.snapshot() == snap
    with pytest.raises(NotFound):
        js.status("nope")
    with pytest.raises(NotFound):
        js.lease(req("a", "nope"), 0.0)
    with pytest.raises(NotFound):
        js.retry_failed("nope")
    with pytest.raises(NotFound):
        js.append("nope", 1, False)
    with pytest.raises(NotFound):
        js.checkpoint("nope")


@pytest.mark.parametrize(
    ("field_", "r"),
    [
        ("want", req("a", want=-1)),
        ("want", req("a", want=MAX_WANT + 1)),
        ("max_records", req("a", max_records=-1)),
        ("node", req("")),
        ("node", req("a.b")),
        ("node", req("n" * 65)),
        ("node", req(">")),
    ],
)
def test_bad_lease_request(field_: str, r: LeaseRequest) -> None:
    js, _ = new_job(spec())
    snap = js.snapshot()
    with pytest.raises(ValidationError, match=rf"^{field_}:"):
        js.lease(r, 0.0)
    assert js.snapshot() == snap


def test_want_max_is_allowed() -> None:
    js, _ = new_job(spec(records=10_000, batch_size=10))
    assert len(js.lease(req("a", want=MAX_WANT), 0.0).reply.shards) == MAX_WANT


def test_reports_for_shards_not_held_are_rejected() -> None:
    js, _ = new_job(spec(records=50, batch_size=10, shuffle=False, max_failures=1))
    js.lease(req("a", want=2), 0.0)  # 0, 1
    js.lease(req("b", want=1), 0.0)  # 2
    js.lease(req("a", held=[1], done=[0]), 0.0)  # 0 DONE
    js.lease(req("c", want=1), 0.0)  # 3
    js.node_died("c")  # 3 FAILED
    snap = js.snapshot()
    out = js.lease(
        req(
            "a",
            held=[1],
            done=[99, 2, 0, 3, 4],
            progress=[
                ShardProgress(2, 1),
                ShardProgress(1, 11),
                ShardProgress(1, -1),
                ShardProgress(77, 1),
            ],
            failed=[2, 0],
            released=[4, 99],
        ),
        0.0,
    )
    assert out.reply.rejected == [
        Rejected(99, "unknown_shard"),
        Rejected(2, "not_holder"),
        Rejected(0, "not_doing:done"),
        Rejected(3, "not_doing:failed"),
        Rejected(4, "not_doing:todo"),
        Rejected(2, "not_holder"),
        Rejected(1, "bad_progress"),
        Rejected(1, "bad_progress"),
        Rejected(77, "unknown_shard"),
        Rejected(2, "not_holder"),
        Rejected(0, "not_doing:done"),
        Rejected(4, "not_doing:todo"),
        Rejected(99, "unknown_shard"),
    ]
    assert out.records == [] and out.events == []
    assert js.snapshot() == snap
    # a report of the same shard twice: the second sees it DONE
    out = js.lease(req("a", done=[1, 1]), 0.0)
    assert ops(out) == ["done"] and out.reply.rejected == [Rejected(1, "not_doing:done")]


def test_done_then_progress_in_one_request_and_request_order() -> None:
    js, _ = new_job(spec(records=30, batch_size=10, shuffle=False))
    js.lease(req("a", want=3), 0.0)
    out = js.lease(
        req(
            "a",
            done=[0],
            progress=[ShardProgress(0, 5), ShardProgress(1, 5)],
            failed=[1],
            released=[2],
        ),
        0.0,
    )
    assert out.records == [
        ["done", DS, 0],
        ["prog", DS, 1, 5],
        ["lost", DS, 1, "failed"],
        ["lost", DS, 2, "released"],
    ]
    assert out.reply.rejected == [Rejected(0, "not_doing:done")]
    assert js.datasets[DS].shards[1].failures == 1 and js.datasets[DS].shards[2].failures == 0
    # lost work is served first, resuming shard 1 at its progress
    got = js.lease(req("b", want=2), 0.0).reply.shards
    assert {(le.shard, le.start) for le in got} == {(1, 15), (2, 20)}


# =========================================================================== discarded gradients
def _discard_job(records: int = 30) -> JobShards:
    """Shards of 10 records (two batches of 5), in order, never cut near the end; node b has a live
    lease, holding nothing."""
    js, _ = new_job(spec(records=records, batch_size=5, batches_per_shard=2, shuffle=False, tail_split=False))
    js.lease(req("b"), 0.0)
    return js


def test_discarded_records_are_served_again_to_another_node() -> None:
    js = _discard_job()
    assert [le.shard for le in js.lease(req("a", want=1), 0.0).reply.shards] == [0]
    out = js.lease(req("a", held=[0], progress=[ShardProgress(0, 6)], discarded=[ShardRange(0, 2, 6)]), 0.0)
    assert out.records == [["prog", DS, 0, 6], ["disc", DS, 0, 2, 6, 3, "a"]] and not out.reply.rejected
    st_ = js.status(DS)
    assert (st_.records_reserved, st_.records_done, st_.todo) == (4, 0, 3)
    assert {n.node: n.records_discarded for n in st_.nodes} == {"a": 4}
    check_invariants(js)
    # served before untouched shards, but not to the node whose gradients were discarded ...
    assert [le.shard for le in js.lease(req("a", held=[0], want=1), 0.0).reply.shards] == [1]
    # ... to the next one that asks: exactly those records, of the same epoch, a first grant
    piece = js.lease(req("b", want=1), 0.0).reply.shards
    assert piece == [ShardLease(shard=3, epoch=0, start=2, end=6, offset=2, seed=piece[0].seed, attempt=0)]
    js.lease(req("a", done=[0, 1]), 0.0)
    assert js.status(DS).records_done == 10 + 10 - 4, "the discarded records count as done in their piece only"
    js.lease(req("b", done=[3]), 0.0)
    assert js.status(DS).records_done == 20
    rest = js.lease(req("b", want=1), 0.0).reply.shards
    out = js.lease(req("b", done=[le.shard for le in rest]), 0.0)
    st_ = js.status(DS)
    assert out.reply.finished and st_.finished and kinds(out) == ["finished"]
    assert st_.records_done == st_.records_total == 30
    assert (st_.records_reserved, st_.records_duplicated) == (4, 0)
    assert {n.node: (n.records, n.records_discarded) for n in st_.nodes} == {"a": (20, 4), "b": (14, 0)}
    check_invariants(js)


def test_discards_reported_with_done_keep_the_dataset_unfinished_until_their_piece_is_done() -> None:
    js = _discard_job(records=10)
    js.lease(req("a", want=1), 0.0)
    out = js.lease(req("a", done=[0], discarded=[ShardRange(0, 0, 5), ShardRange(0, 7, 10)]), 0.0)
    assert ops(out) == ["done", "disc", "disc"] and not out.reply.finished
    st_ = js.status(DS)
    assert (st_.done, st_.todo, st_.records_done, st_.records_reserved, st_.finished) == (1, 2, 2, 8, False)
    check_invariants(js)
    got = js.lease(req("b", want=2), 0.0).reply.shards
    assert sorted((le.start, le.end) for le in got) == [(0, 5), (7, 10)]
    out = js.lease(req("b", done=[got[0].shard]), 0.0)
    assert not out.reply.finished and js.status(DS).records_done == 2 + lease_len(got[0])
    out = js.lease(req("b", done=[got[1].shard]), 0.0)
    assert out.reply.finished and kinds(out) == ["finished"]
    assert js.status(DS).records_done == 10
    check_invariants(js)


def test_a_piece_discarded_again_is_served_again() -> None:
    js = _discard_job(records=10)
    js.lease(req("a", want=1), 0.0)
    js.lease(req("a", done=[0], discarded=[ShardRange(0, 0, 10)]), 0.0)
    piece = js.lease(req("b", want=1), 0.0).reply.shards[0]
    assert (piece.start, piece.end) == (0, 10)
    js.lease(req("b", done=[piece.shard], discarded=[ShardRange(piece.shard, 4, 6)]), 0.0)
    again = js.lease(req("a", want=1), 0.0).reply.shards[0]  # b's piece may go to a
    assert (again.start, again.end, again.epoch) == (4, 6, 0)
    out = js.lease(req("a", done=[again.shard]), 0.0)
    st_ = js.status(DS)
    assert out.reply.finished and st_.records_done == 10 and st_.records_reserved == 12
    assert {n.node: n.records_discarded for n in st_.nodes} == {"a": 10, "b": 2}
    check_invariants(js)


def test_a_node_alone_gets_its_own_discarded_records_back() -> None:
    js, _ = new_job(spec(records=20, batch_size=5, batches_per_shard=2, shuffle=False, lease_s=5.0,
                         tail_split=False))
    js.lease(req("a", want=1), 0.0)
    js.lease(req("b"), 0.0)
    js.lease(req("a", done=[0], discarded=[ShardRange(0, 0, 5)]), 1.0)
    assert [le.shard for le in js.lease(req("a", want=1), 1.0).reply.shards] == [1], "b can take a's piece"
    js.lease(req("a", held=[1]), 7.0)
    assert ops(js.expire(10.0)) == []  # b's lease ran out (it held nothing): nobody else can take a's piece
    got = js.lease(req("a", held=[1], want=1), 10.0).reply.shards
    assert [(le.start, le.end) for le in got] == [(0, 5)]


def test_only_own_pieces_left_means_nothing_now_not_a_finished_dataset() -> None:
    js = _discard_job(records=10)
    js.lease(req("a", want=1), 0.0)
    out = js.lease(req("a", done=[0], discarded=[ShardRange(0, 0, 10)], want=1), 0.0)
    assert out.reply.shards == [] and out.reply.exhausted and not out.reply.finished
    assert [le.shard for le in js.lease(req("b", want=1), 0.0).reply.shards] == [1]


def _holding_a_after_one_discard() -> JobShards:
    """a holds shard 0 (10 records) with progress 6 and [0, 2) discarded; b holds 1; 2 is DONE by b."""
    js = _discard_job()
    js.lease(req("a", want=1), 0.0)
    js.lease(req("b", want=2), 0.0)
    js.lease(req("b", held=[1], done=[2]), 0.0)
    out = js.lease(req("a", held=[0], progress=[ShardProgress(0, 6)], discarded=[ShardRange(0, 0, 2)]), 0.0)
    assert ops(out) == ["prog", "disc"]
    return js


@pytest.mark.parametrize(
    ("rng", "reason"),
    [
        (ShardRange(0, 6, 8), "discard_not_consumed"),  # beyond its reported progress
        (ShardRange(0, 4, 7), "discard_not_consumed"),
        (ShardRange(0, 3, 3), "bad_discard"),  # empty
        (ShardRange(0, 4, 2), "bad_discard"),
        (ShardRange(0, -1, 2), "bad_discard"),
        (ShardRange(0, 5, 11), "bad_discard"),  # past the shard's end
        (ShardRange(0, 0, 2), "discard_repeated"),  # the same range again (a retried request that landed)
        (ShardRange(0, 1, 4), "discard_repeated"),  # overlapping it
        (ShardRange(1, 0, 1), "not_holder"),
        (ShardRange(2, 0, 1), "not_doing:done"),  # done in an earlier request
        (ShardRange(3, 0, 1), "not_doing:todo"),  # the piece itself, not granted yet
        (ShardRange(99, 0, 1), "unknown_shard"),
    ],
)
def test_bad_discards_are_rejected_one_by_one_and_change_nothing(rng: ShardRange, reason: str) -> None:
    js = _holding_a_after_one_discard()
    snap = js.snapshot()
    out = js.lease(req("a", held=[0], discarded=[rng]), 0.0)
    assert out.reply.rejected == [Rejected(rng.shard, reason)]
    assert out.records == [] and js.snapshot() == snap
    # the next valid range of the same request still counts
    out = js.lease(req("a", held=[0], discarded=[rng, ShardRange(0, 2, 6)]), 0.0)
    assert out.reply.rejected == [Rejected(rng.shard, reason)] and ops(out) == ["disc"]
    check_invariants(js)


def test_a_new_holder_cannot_discard_what_the_previous_one_consumed() -> None:
    js = _discard_job()
    js.lease(req("a", want=1), 0.0)
    js.lease(req("a", held=[0], progress=[ShardProgress(0, 6)]), 0.0)
    js.node_died("a")
    assert js.lease(req("b", want=1), 0.0).reply.shards[0].start == 6  # resumes after a's progress
    out = js.lease(req("b", held=[0], progress=[ShardProgress(0, 8)], discarded=[ShardRange(0, 4, 8)]), 0.0)
    assert out.reply.rejected == [Rejected(0, "discard_repeated")] and ops(out) == ["prog"]
    out = js.lease(req("b", held=[0], discarded=[ShardRange(0, 6, 8)]), 0.0)
    assert ops(out) == ["disc"] and not out.reply.rejected


def test_discard_limits() -> None:
    from pacer_services.shard_service.core import ShardLimits

    js = JobShards(JOB, limits=ShardLimits(report_ids=2, shards_per_job=4))
    js.register(spec(records=30, batch_size=5, batches_per_shard=2, shuffle=False))
    js.lease(req("a", want=1), 0.0)
    snap = js.snapshot()
    with pytest.raises(ValidationError, match=r"^discarded: 3 entries"):
        js.lease(req("a", done=[0], discarded=[ShardRange(0, i, i + 1) for i in range(3)]), 0.0)
    assert js.snapshot() == snap
    # the job may hold 4 shards: 3 of the epoch and one piece, then no more
    out = js.lease(req("a", done=[0], discarded=[ShardRange(0, 0, 1), ShardRange(0, 2, 3)]), 0.0)
    assert ops(out) == ["done", "disc"] and out.reply.rejected == [Rejected(0, "shard_limit")]
    check_invariants(js)


def test_checkpoint_and_restore_keep_pieces_and_what_they_took() -> None:
    js = _holding_a_after_one_discard()
    cp = copy.deepcopy(js.checkpoint(DS))
    js.lease(req("b", want=3), 0.0)  # takes the piece, a's shard goes on elsewhere
    js.restore(DS, "cp", cp)
    check_invariants(js)
    st_ = js.status(DS)
    assert (st_.records_reserved, st_.doing, st_.records_done) == (2, 0, 10)
    # everything left is consumed once more: the dataset finishes with every record counted once
    c = Client("c")
    for step in range(50):
        c.read(random.Random(step), 100, None)
        if c.request(js, 1.0, random.Random(step), want=4)[0].reply.finished:
            break
    st_ = js.status(DS)
    assert st_.finished and st_.records_done == st_.records_total == 30
    check_invariants(js)


def test_snapshots_and_messages_from_before_discards_still_load() -> None:
    import msgpack
    from pacer.codec import decode, encode
    from pacer.contracts.shards import DatasetStatus, NodeShardStats

    js = _discard_job()
    js.lease(req("a", want=2), 0.0)
    js.lease(req("a", held=[1], done=[0], progress=[ShardProgress(1, 3)]), 0.0)
    snap = js.snapshot()
    old = copy.deepcopy(snap)
    for d in old["datasets"].values():  # what a snapshot of the previous version holds
        for k in ("given", "floor", "discarder", "records_reserved", "node_discarded"):
            del d[k]
    rebuilt = JobShards.from_snapshot(old)
    check_invariants(rebuilt)
    assert rebuilt.status(DS) == js.status(DS)
    # messages of senders that know nothing of discards
    wire = msgpack.unpackb(encode(req("a", held=[1])), raw=False)
    del wire["discarded"]
    assert decode(LeaseRequest, msgpack.packb(wire)).discarded == []
    st_ = msgpack.unpackb(encode(js.status(DS)), raw=False)
    del st_["records_reserved"]
    for n in st_["nodes"]:
        del n["records_discarded"]
    back = decode(DatasetStatus, msgpack.packb(st_))
    assert back.records_reserved == 0 and all(isinstance(n, NodeShardStats) for n in back.nodes)
