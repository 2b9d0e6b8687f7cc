"""What the shard-core tests share: specs, a request builder, the invariants recomputed from the shards, a client.

The core is a fold of log records; the tests drive it only through its
decision methods (and ``apply`` for replay), then check what it *computed*:
record coverage per epoch, state invariants recomputed from the shards
themselves, replay equality, at-least-once delivery under failures.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings
from pacer.contracts.shards import (
    DatasetMode,
    DatasetSpec,
    LeaseReply,
    LeaseRequest,
    ShardLease,
    ShardProgress,
    ShardRange,
)
from pacer_services.shard_service.core import (
    JobShards,
    Outcome,
    ShardState,
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


def replay(
    log: list[list[Any]], cps: dict[str, Any], base: dict[str, Any] | None = None
) -> JobShards:
    js = JobShards.from_snapshot(base) if base is not None else JobShards(JOB)
    for rec in log:
        js.apply(rec, checkpoint=cps[rec[2]] if rec[0] == "restore" else None)
    return js
