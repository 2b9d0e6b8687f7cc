"""Streaming datasets, checkpoints and restores, bad input, and discarded gradients in the shard core.  (How these tests drive the core: shard_core_support.)"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import pytest
from pacer.contracts.shards import (
    DatasetMode,
    LeaseRequest,
    Rejected,
    ShardLease,
    ShardProgress,
    ShardRange,
)
from pacer.errors import Conflict, NotFound, ValidationError
from pacer_services.shard_service.core import (
    MAX_WANT,
    JobShards,
    Outcome,
    fold,
    validate_spec,
)

from .shard_core_support import (
    DS,
    JOB,
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

