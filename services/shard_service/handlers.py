"""Thin request handlers: decode -> core -> submit for commit (reply after it).

Each handler raises :class:`~pacer.errors.PacerError` for bad input; the
service turns that into an error reply and a counter, never a crash.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from pacer import subjects
from pacer.codec import decode
from pacer.contracts.shards import (
    AppendRequest,
    CheckpointReply,
    CheckpointRequest,
    DatasetRef,
    DatasetSpec,
    LeaseRequest,
    ShardEvent,
)
from pacer.errors import PacerError, ValidationError
from pacer.ids import is_token
from pacer.subjects import ShardOp
from pacer_services.shard_service.core import Outcome, validate_spec

if TYPE_CHECKING:
    from pacer_services.shard_service.app import ShardService

Handler = Callable[[str, Msg], Awaitable[None]]


def _same_job(job: str, body_job: str) -> None:
    if body_job != job:
        raise ValidationError(f"job: body names {body_job!r} but the subject is for {job!r}")


def build(svc: ShardService) -> dict[str, Handler]:
    async def register(job: str, msg: Msg) -> None:
        spec = decode(DatasetSpec, msg.data)
        _same_job(job, spec.job)
        validate_spec(spec, svc.cfg.limits)  # before the job exists: a refused spec must not leave an empty job behind
        rt = svc.job(job, create=True)
        out = rt.core.register(spec)
        svc.submit(rt, out, svc.reply_after_commit(msg, out.reply))

    async def lease(job: str, msg: Msg) -> None:
        req = decode(LeaseRequest, msg.data)
        _same_job(job, req.job)
        rt = svc.job(job)
        out = rt.core.lease(req, svc.clock())
        if req.done:
            svc.counters.inc("shards_done", len(req.done))
        if out.reply.rejected:
            svc.counters.inc("reports_rejected", len(out.reply.rejected))
        for rec in out.records:
            if rec[0] == "steal":  # work stealing near the end: the requester took the end of another's shard
                svc.counters.inc("shards_stolen")
                svc.counters.inc("records_stolen", rt.core.datasets[req.dataset].shards[rec[4]].length)
        if req.discarded:
            reserved = sum(r[4] - r[3] for r in out.records if r[0] == "disc")
            svc.counters.inc("discards_rejected", len(req.discarded) - sum(r[0] == "disc" for r in out.records))
            svc.counters.inc("records_reserved", reserved)
        svc.submit(rt, out, svc.reply_after_commit(msg, out.reply))

    async def status(job: str, msg: Msg) -> None:
        ref = decode(DatasetRef, msg.data)
        _same_job(job, ref.job)
        rt = svc.job(job)
        svc.submit(rt, Outcome(), svc.reply_after_commit(msg, rt.core.status(ref.dataset)))

    async def checkpoint(job: str, msg: Msg) -> None:
        req = decode(CheckpointRequest, msg.data)
        _same_job(job, req.job)
        if not is_token(req.checkpoint):
            raise ValidationError(f"checkpoint: {req.checkpoint!r} is not a valid id (1-64 of [A-Za-z0-9_-])")
        rt = svc.job(job)
        snap = rt.core.checkpoint(req.dataset)  # taken now, in request order
        st = rt.core.status(req.dataset)
        reply = CheckpointReply(job, req.dataset, req.checkpoint, len(snap["id"]), st.records_done)

        async def store(err: PacerError | None) -> None:
            # Runs once everything decided before the snapshot is durable.
            if err is None:
                try:
                    await svc.store.put_checkpoint(job, req.dataset, req.checkpoint, snap)
                except Exception as exc:  # object store down: tell the caller to retry
                    err = PacerError(f"checkpoint not stored: {exc}", code="unavailable", temporary=True)
            if err is None:
                svc.counters.inc("checkpoints")
                await svc.bus.respond(msg, reply)
                await svc.bus.publish(
                    subjects.event("shard", job, subjects.ShardEventKind.CHECKPOINTED),
                    ShardEvent(job, req.dataset, subjects.ShardEventKind.CHECKPOINTED, svc.wall(),
                               detail=req.checkpoint),
                )
            else:
                await svc.bus.respond_error(msg, err)

        svc.submit(rt, Outcome(), store)

    async def restore(job: str, msg: Msg) -> None:
        req = decode(CheckpointRequest, msg.data)
        _same_job(job, req.job)
        svc.job(job).core.status(req.dataset)  # unknown job/dataset: fail before IO
        snap = await svc.store.get_checkpoint(job, req.dataset, req.checkpoint)
        rt = svc.job(job)
        out = rt.core.restore(req.dataset, req.checkpoint, snap)
        svc.submit(rt, out, svc.reply_after_commit(msg, out.reply))

    async def append(job: str, msg: Msg) -> None:
        req = decode(AppendRequest, msg.data)
        _same_job(job, req.job)
        rt = svc.job(job)
        out = rt.core.append(req.dataset, req.records, req.close)
        svc.submit(rt, out, svc.reply_after_commit(msg, out.reply))

    async def retry_failed(job: str, msg: Msg) -> None:
        ref = decode(DatasetRef, msg.data)
        _same_job(job, ref.job)
        rt = svc.job(job)
        out = rt.core.retry_failed(ref.dataset)
        svc.submit(rt, out, svc.reply_after_commit(msg, out.reply))

    return {
        ShardOp.REGISTER: register,
        ShardOp.LEASE: lease,
        ShardOp.STATUS: status,
        ShardOp.CHECKPOINT: checkpoint,
        ShardOp.RESTORE: restore,
        ShardOp.APPEND: append,
        ShardOp.RETRY_FAILED: retry_failed,
    }
