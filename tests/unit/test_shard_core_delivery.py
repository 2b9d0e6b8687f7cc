"""The shard core's at-least-once delivery: failures, parking, leases, progress and lost replies.  (How these tests drive the core: shard_core_support.)"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pacer.contracts.shards import (
    ShardProgress,
)
from pacer_services.shard_service.core import (
    JobShards,
    fold,
)

from .shard_core_support import (
    DS,
    JOB,
    PROPS,
    Client,
    S,
    check_invariants,
    kinds,
    lease_len,
    new_job,
    ops,
    req,
    spec,
)


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

