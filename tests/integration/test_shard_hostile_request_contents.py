"""Valid-looking requests with hostile contents (lease reports, an oversized reply, dataset specs,
re-registrations, appends) are refused or answered with rejections and change nothing; afterwards the
state is intact and the dataset still finishes with every record covered exactly once.
(The module's nats-server and shard service, and the checks: shard_hostile_support.)"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import msgpack
import pytest
import shard_hostile_support
from hypothesis import given
from hypothesis import strategies as st
from pacer.codec import encode
from pacer.contracts.common import decode_reply
from pacer.contracts.shards import (
    AppendRequest,
    DatasetMode,
    DatasetRef,
    DatasetSpec,
    DatasetStatus,
    LeaseReply,
    LeaseRequest,
    ShardProgress,
    ShardRange,
)
from pacer.errors import Conflict, DecodeError, NotFound, PacerError, ValidationError
from pacer.ids import is_token
from pacer.shards.client import ShardAdmin
from pacer.subjects import ShardOp
from pacer_services.shard_service.core import MAX_WANT
from shard_hostile_support import (
    BAD_IDS,
    DS,
    EDGE_INTS,
    JOB,
    LIMITS,
    MAX_PAYLOAD,
    N_SHARDS,
    NODE,
    RECORDS,
    SETTINGS,
    SHARD_LEN,
    SPEC,
    STREAM,
    STREAM_BIG,
    TOKENS,
    Harness,
    consume,
    expect_error,
    rpc,
)

# The fixtures of shard_hostile_support (pytest finds them as attributes of this module).
h = shard_hostile_support.h


# ====================================================================== hostile lease requests
SHARD_IDS = st.one_of(st.integers(0, N_SHARDS - 1), st.integers(-(2**63), 2**64 - 1), st.integers(N_SHARDS, 10**6))
CONSUMED = st.one_of(
    st.integers(-(2**63), -1), st.integers(SHARD_LEN + 1, 2**64 - 1), st.integers(0, SHARD_LEN), EDGE_INTS
)


@st.composite
def hostile_leases(draw: st.DrawFn) -> dict[str, Any]:
    ids = st.lists(SHARD_IDS, max_size=20)
    huge = draw(st.sampled_from([0] * 12 + [20_000, 60_000]))
    done = draw(ids) + list(range(-huge, huge, 2))  # a huge report: every id unknown
    return {
        "job": draw(st.sampled_from([JOB] * 6 + ["other", "", "x" * 1000])),
        "dataset": draw(st.sampled_from([DS] * 6 + ["nope", "", "a.b", "x" * 1000])),
        "node": draw(st.one_of(st.sampled_from([NODE, NODE, "mallory", "w1"]), TOKENS, BAD_IDS)),
        "want": draw(
            st.one_of(st.integers(0, MAX_WANT), st.integers(-(2**63), -1), st.integers(MAX_WANT + 1, 2**64 - 1))
        ),
        "held": draw(ids),
        "done": done,
        "progress": draw(st.lists(st.builds(ShardProgress, SHARD_IDS, CONSUMED), max_size=8)),
        "discarded": draw(st.lists(st.builds(ShardRange, SHARD_IDS, CONSUMED, CONSUMED), max_size=8)),
        "failed": draw(ids),
        "released": draw(ids),
        "max_records": draw(st.one_of(st.just(0), st.integers(1, 1000), st.integers(-(2**63), -1))),
    }


def first_bad_field(req: dict[str, Any]) -> str | None:
    """What the service must complain about first, or None if the request is acceptable."""
    if req["job"] != JOB:
        return "job"
    if req["dataset"] != DS:
        return "dataset"
    if not is_token(req["node"]):
        return "node"
    if not 0 <= req["want"] <= MAX_WANT:
        return "want"
    if req["max_records"] < 0:
        return "max_records"
    for key in ("held", "done", "progress", "discarded", "failed", "released"):
        if len(req[key]) > LIMITS.report_ids:
            return key
    return None


@SETTINGS
@given(req=hostile_leases())
def test_hostile_lease_requests_are_refused_or_rejected_without_effect(h: Harness, req: dict[str, Any]) -> None:
    bad = first_bad_field(req)
    if bad is not None:
        err = expect_error(h, rpc(JOB, ShardOp.LEASE), encode(LeaseRequest(**req)), (ValidationError, NotFound))
        if bad == "dataset":
            assert isinstance(err, NotFound) and "dataset" in err.message, err.message
        else:
            assert err.message.startswith(f"{bad}:"), f"expected the message to name {bad!r}: {err.message}"
    else:
        # Acceptable: make it a pure report that cannot legitimately change anything
        # (no grants; never report the honest worker's shards in its name).
        held = set(h.held) if req["node"] == NODE else set()
        req["want"] = 0
        for k in ("done", "failed", "released"):
            req[k] = [s for s in req[k] if s not in held]
        req["progress"] = [p for p in req["progress"] if p.shard not in held or not 0 <= p.consumed <= SHARD_LEN]
        req["discarded"] = [r for r in req["discarded"] if r.shard not in held or not 0 <= r.start < r.end <= SHARD_LEN]
        before = h.counters()
        reply = decode_reply(LeaseReply, h.raw(rpc(JOB, ShardOp.LEASE), encode(LeaseRequest(**req))))
        reported = (len(req["done"]) + len(req["progress"]) + len(req["discarded"]) + len(req["failed"])
                    + len(req["released"]))
        assert len(reply.rejected) == reported, "every hostile report must be rejected"
        for p in req["progress"]:
            if p.shard in held:
                assert any(r.shard == p.shard and r.reason == "bad_progress" for r in reply.rejected)
        for d in req["discarded"]:
            if d.shard in held:
                assert any(r.shard == d.shard and r.reason == "bad_discard" for r in reply.rejected)
        resent = sorted(set(held) - set(req["held"]))  # shards the node holds but did not list
        assert sorted(s.shard for s in reply.shards) == resent
        assert not reply.finished and not reply.exhausted
        after = h.counters()
        assert after.get("internal_errors", 0) == before.get("internal_errors", 0)
        assert after.get("errors", 0) == before.get("errors", 0)
    assert h.status() == h.baseline


def test_reply_too_big_for_the_bus_still_gets_an_error_reply(h: Harness) -> None:
    """45k unknown ids: the rejection list exceeds max_payload; the caller must hear so, and so must
    requests decided in the same group commit."""
    n = 45_000
    big = encode(LeaseRequest(JOB, DS, "mallory", done=list(range(10**6, 10**6 + n))))
    assert len(big) < MAX_PAYLOAD

    async def go() -> list[bytes]:
        return await asyncio.gather(
            h._raw(rpc(JOB, ShardOp.LEASE), big, 15.0),
            *(h._raw(rpc(JOB, ShardOp.STATUS), encode(DatasetRef(JOB, DS)), 15.0) for _ in range(5)),
        )

    before = h.counters()
    replies = h.run(go(), 40)
    with pytest.raises(PacerError) as ei:
        decode_reply(LeaseReply, replies[0])
    assert "reply" in ei.value.message, ei.value.message
    for r in replies[1:]:
        assert decode_reply(DatasetStatus, r) == h.baseline
    after = h.counters()
    assert after["errors"] == before.get("errors", 0) + 1
    assert h.status() == h.baseline and h.service_alive()


# ====================================================================== dataset specs
NEW_JOB = "newjob"  # a valid, unregistered job: a refused spec must not create it
BASE_SPEC: dict[str, Any] = dict(
    job=JOB, dataset="fresh", records=1000, batch_size=10, batches_per_shard=10, epochs=1,
    shuffle=True, seed=0, mode="finite", max_failures=5, lease_s=30.0,
)
MISSING = object()
BAD_SPEC_FIELDS: list[tuple[str, dict[str, Any]]] = [
    *[("job", {"job": v}) for v in ["", "a.b", "*", ">", "w0 ", "x" * 65, "x" * 1000, "é", 7, None, [JOB], MISSING]],
    *[("dataset", {"dataset": v}) for v in ["", "a.b", "*", ">", "x" * 65, "é", "节点", 7, [], MISSING]],
    *[("records", {"records": v}) for v in [0, -1, -(2**63), "100", 1.5, None, MISSING]],
    ("records", {"records": -1, "mode": "streaming"}),
    *[("batch_size", {"batch_size": v}) for v in [0, -1, -(2**63), 2.0, True, "10", MISSING]],
    *[("batches_per_shard", {"batches_per_shard": v}) for v in [0, -5, -(2**63), "x", 1.0]],
    *[("epochs", {"epochs": v}) for v in [0, -1, -(2**63), 1.0, "2"]],
    ("epochs", {"epochs": 2, "mode": "streaming"}),
    *[("shuffle", {"shuffle": v}) for v in [1, "yes", None]],
    *[("seed", {"seed": v}) for v in [1.5, "x", None, math.nan]],
    *[("mode", {"mode": v}) for v in ["bogus", "", "FINITE", 1, None]],
    *[("max_failures", {"max_failures": v}) for v in [0, -1, -(2**63), 2.5]],
    *[("lease_s", {"lease_s": v}) for v in [0.0, 0, -1.0, math.nan, math.inf, -math.inf, 86_400.5, 1e300, "30"]],
    # Valid-looking but hostile sizes: 2**62 one-record shards would take the service
    # forever to build; records * epochs beyond 64 bits cannot even be reported.
    ("records", {"records": 2**62, "batch_size": 1, "batches_per_shard": 1}),
    ("records", {"records": 2**63 - 1, "batch_size": 2, "batches_per_shard": 3}),
    ("epochs", {"records": 2**62, "batch_size": 2**40, "batches_per_shard": 2**20, "epochs": 2**62}),
]


@SETTINGS
@given(case=st.sampled_from(BAD_SPEC_FIELDS), job=st.sampled_from([JOB, NEW_JOB]), ints=st.integers(-(2**63), 0))
def test_dataset_specs_with_an_invalid_field_are_refused(
    h: Harness, case: tuple[str, dict[str, Any]], job: str, ints: int
) -> None:
    field_, overrides = case
    body = {**BASE_SPEC, "job": job, **overrides}
    if field_ in ("batch_size", "batches_per_shard", "max_failures") and overrides[field_] == 0:
        body[field_] = ints  # any value <= 0, drawn
    body = {k: v for k, v in body.items() if v is not MISSING}
    subject_job = job
    if field_ == "job":
        j = body.get("job")
        # The subject carries the (bad) job when it can; otherwise the body disagrees with the subject.
        subject_job = j if isinstance(j, str) and j and not any(c in j for c in ". \n") else job
    err = expect_error(h, rpc(subject_job, ShardOp.REGISTER), msgpack.packb(body, use_bin_type=True),
                       (DecodeError, ValidationError))
    assert field_ in err.message, f"the message should name {field_!r}: {err.message}"
    assert h.jobs() == h.jobs_before, "a refused registration left a job behind"


def test_conflicting_reregistration_is_refused(h: Harness) -> None:
    for change in ({"records": RECORDS + 1}, {"seed": 1}, {"lease_s": 30.0}, {"shuffle": False}):
        err = expect_error(h, rpc(JOB, ShardOp.REGISTER), encode(dataclasses.replace(SPEC, **change)), (Conflict,))
        assert DS in err.message
    assert h.status() == h.baseline


def test_hostile_appends_are_refused(h: Harness) -> None:
    admin = ShardAdmin(h.b)
    small = DatasetSpec(JOB, STREAM, 0, batch_size=10, batches_per_shard=10, mode=DatasetMode.STREAMING)
    big = dataclasses.replace(small, dataset=STREAM_BIG, batch_size=2**30, batches_per_shard=2**30)
    h.run(admin.register(small))
    h.run(admin.register(big))
    before = h.status(STREAM)
    cases: list[tuple[str, AppendRequest]] = [
        ("finite", AppendRequest(JOB, DS, 10)),
        ("records", AppendRequest(JOB, STREAM, -1)),
        ("records", AppendRequest(JOB, STREAM, -(2**63))),
        ("records", AppendRequest(JOB, STREAM, 2**62)),  # 2**62 / 100 shards: would stall the service
        ("dataset", AppendRequest(JOB, "nope", 10)),
    ]
    for word, req in cases:
        err = expect_error(h, rpc(JOB, ShardOp.APPEND), encode(req))
        assert word in err.message, err.message
    assert h.status(STREAM) == before
    # Appends of few (2**60-record) shards each, whose sum no longer fits a 64-bit integer:
    # the dataset's status could not even be encoded any more.
    h.run(admin.append(JOB, STREAM_BIG, 2**62))
    grown = h.status(STREAM_BIG)
    assert grown.records_total == 2**62
    err = expect_error(h, rpc(JOB, ShardOp.APPEND), encode(AppendRequest(JOB, STREAM_BIG, 2**64 - 1)))
    assert "records" in err.message
    assert h.status(STREAM_BIG) == grown
    assert h.status() == h.baseline


# ====================================================================== afterwards
def test_after_the_junk_state_is_intact_and_the_dataset_still_finishes(h: Harness) -> None:
    assert h.service_alive()
    assert h.status() == h.baseline, "junk changed the shard state"
    assert h.jobs() == h.jobs_before
    health = h.health()
    assert health.status == "ready"
    assert health.counters.get("internal_errors", 0) == 0
    assert health.counters.get("errors", 0) > 0
    # The honest worker comes back: its 5 kept shards are re-sent, the rest is granted.
    done, _ = h.run(consume(h.b, NODE), 60)
    assert {s.shard for s in done} >= set(h.held)
    ranges = sorted((s.start, s.end) for s in h.got_before + done)
    pos = 0
    for a, b in ranges:
        assert a == pos, f"gap or overlap at record {pos} (next range starts at {a})"
        pos = b
    assert pos == RECORDS
    st_ = h.status()
    assert st_.finished and st_.done == N_SHARDS and st_.records_done == RECORDS and st_.doing == 0
    assert h.health().status == "ready"
