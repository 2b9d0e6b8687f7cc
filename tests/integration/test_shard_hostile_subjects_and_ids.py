"""Hostile subjects and ids: unknown operations, bad or unknown job tokens, subjects with extra levels and
hostile checkpoint ids are refused (or never reach the service) and change nothing.
(The module's nats-server and shard service, and the checks: shard_hostile_support.)"""

from __future__ import annotations

import dataclasses

import nats.errors
import shard_hostile_support
from hypothesis import assume, given
from hypothesis import strategies as st
from pacer.codec import encode
from pacer.contracts.shards import AppendRequest, CheckpointRequest, DatasetRef, LeaseRequest
from pacer.errors import NotFound, ValidationError
from pacer.ids import is_token
from pacer.subjects import ShardOp
from shard_hostile_support import (
    BAD_IDS,
    DS,
    JOB,
    OPS,
    SETTINGS,
    SPEC,
    STREAM,
    TOKENS,
    Harness,
    expect_error,
    rpc,
)

# The fixtures of shard_hostile_support (pytest finds them as attributes of this module).
h = shard_hostile_support.h


# One level of a subject that nats-server will route: no '.', no whitespace or control characters.
SUBJECT_TOKENS = st.text(
    st.characters(exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp"), exclude_characters="."),
    min_size=1,
    max_size=80,
)


def valid_body(op: str, job: str) -> bytes:
    """A well-formed request of ``op`` naming ``job`` (refused only for what the job/subject is)."""
    if op == ShardOp.REGISTER:
        return encode(dataclasses.replace(SPEC, job=job, dataset="fresh"))
    if op == ShardOp.LEASE:
        return encode(LeaseRequest(job, DS, "mallory", want=1))
    if op in (ShardOp.CHECKPOINT, ShardOp.RESTORE):
        return encode(CheckpointRequest(job, DS, "ck1"))
    if op == ShardOp.APPEND:
        return encode(AppendRequest(job, STREAM, 10))
    return encode(DatasetRef(job, DS))


# ====================================================================== subjects
@SETTINGS
@given(op=SUBJECT_TOKENS.filter(lambda s: s not in ShardOp.ALL), job=st.one_of(st.just(JOB), SUBJECT_TOKENS))
def test_unknown_operations_are_refused(h: Harness, op: str, job: str) -> None:
    err = expect_error(h, rpc(job, op), encode(DatasetRef(JOB, DS)), (NotFound,))
    assert "unknown operation" in err.message and repr(op) in err.message


@SETTINGS
@given(op=OPS, job=st.one_of(SUBJECT_TOKENS, TOKENS).filter(lambda j: j != JOB))
def test_bad_or_unknown_job_tokens_are_refused(h: Harness, op: str, job: str) -> None:
    assume(op != ShardOp.REGISTER or not is_token(job))  # registering a valid new job is legitimate
    err = expect_error(h, rpc(job, op), valid_body(op, job), (NotFound, ValidationError))
    assert "job" in err.message, err.message
    if is_token(job):
        assert isinstance(err, NotFound) and "unknown job" in err.message
    # The body must name the subject's job: a request for JOB sent on another job's subject is refused.
    err = expect_error(h, rpc(job, op), valid_body(op, JOB), (ValidationError,))
    assert err.message.startswith("job:"), err.message
    assert h.jobs() == h.jobs_before


def test_subjects_with_extra_levels_never_reach_the_service(h: Harness) -> None:
    async def go(subject: str) -> type[Exception] | None:
        try:
            await h.b.nc.request(subject, encode(DatasetRef(JOB, DS)), timeout=2.0)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            return type(exc)
        return None

    before = h.counters()
    for subject in (f"pacer.rpc.shard.{JOB}.x.status", f"pacer.rpc.shard.{JOB}", "pacer.rpc.shard.a.b.c.d"):
        assert h.run(go(subject)) is nats.errors.NoRespondersError, subject
    after = h.counters()
    for name in ("requests", "errors", "internal_errors"):
        assert after.get(name, 0) == before.get(name, 0), name


@SETTINGS
@given(ckpt=st.one_of(BAD_IDS, st.sampled_from(["x" * 5000, "../snap." + JOB, "*.>"])), op=st.sampled_from(
    [ShardOp.CHECKPOINT, ShardOp.RESTORE]), dataset=st.sampled_from([DS, "nope"]))
def test_hostile_checkpoint_ids_are_refused(h: Harness, ckpt: str, op: str, dataset: str) -> None:
    err = expect_error(h, rpc(JOB, op), encode(CheckpointRequest(JOB, dataset, ckpt)), (ValidationError, NotFound))
    assert "checkpoint" in err.message or "dataset" in err.message, err.message
    assert h.status() == h.baseline
