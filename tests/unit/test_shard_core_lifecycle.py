"""The shard core's states and their transitions, a dataset consumed in full, and the fold of its log (replay, snapshots).  (How these tests drive the core: shard_core_support.)"""

from __future__ import annotations

import copy
import itertools
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pacer.contracts.shards import (
    DatasetSpec,
    LeaseReply,
    ShardProgress,
    ShardRange,
)
from pacer.errors import Conflict, ValidationError
from pacer_services.shard_service.core import (
    MAX_WANT,
    TRANSITIONS,
    Dataset,
    IllegalTransition,
    JobShards,
    Outcome,
    Shard,
    ShardState,
    fold,
)

from .shard_core_support import (
    DS,
    JOB,
    PROPS,
    Client,
    S,
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

