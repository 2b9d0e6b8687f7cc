"""Thin handlers of the brain: decode -> the service's core step -> publish / store; errors never crash it.

* RPC (``pacer.rpc.brain.<job>.<op>``): :func:`plan` and :func:`history`,
  dispatched by :func:`pacer.runtime.dispatch_rpc` (errors become error
  replies) at the job's owner (the service routes them there).
* Plain subscriptions (no acks, no queue group: every instance hears every
  message; the next message supersedes a lost one): the monitor's
  statistics (acted on by the job's owner, or by the instance that claims
  a job nobody owns; the others only keep the memory trend) and the
  executor's ClusterStatus.
* The durable consumer of each instance (explicit acks, in stream order):
  job ends (the config DB), the executor's ``applied`` events and node
  events (the plan in force and as run, :mod:`.core.running`).  Every
  instance folds every event (compare-and-set, so the second fold of an
  event changes nothing); what an event does to the job's autoscaler is
  done by the owner once (:meth:`~.app.BrainService.effect`).  A handler
  returns to ack, raises a permanent :class:`~pacer.errors.PacerError` to
  dead-letter, a temporary one to be redelivered; a redelivered event is
  recognised by its stream sequence and changes nothing twice.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from pacer import subjects
from pacer.codec import decode
from pacer.contracts.brain import HistoryEntry, HistoryList, HistoryQuery, PlanRequest, RunningJob
from pacer.contracts.executor import ClusterStatus, ExecutorEvent
from pacer.contracts.jobs import JobEvent, JobState
from pacer.contracts.monitor import JobStatistics
from pacer.contracts.nodes import NodeEvent
from pacer.errors import PacerError, Unavailable, ValidationError
from pacer_services.brain.core.autoscaler import same_resources
from pacer_services.brain.core.capacity import status_problem
from pacer_services.brain.core.history import JobFeatures, JobHistory
from pacer_services.brain.core.running import as_run, is_new, on_applied, on_node
from pacer_services.brain.core.warmstart import warm_start

if TYPE_CHECKING:
    from pacer_services.brain.app import BrainService

log = logging.getLogger("pacer.brain")

Handler = Callable[[str, Msg], Awaitable[None]]


# ---------------------------------------------------------------- rpc
def rpc(svc: BrainService) -> dict[str, Handler]:
    async def plan(job: str, msg: Msg) -> None:
        req = decode(PlanRequest, msg.data)
        if req.job != job or req.spec.name != job:
            raise ValidationError(f"job: the request names {req.job!r} / spec {req.spec.name!r}, the subject {job!r}")
        await svc.load_history()  # what every instance recorded
        ws = warm_start(req.spec, svc.history.values(), records=req.records or None)
        svc.counters.inc("plans", start="cold" if ws.cold else "warm")
        first = replace(ws.plan, job=job)
        if svc.config.autoscale and req.spec.resources is None and svc.own.owns(job):
            svc.adopt(job, svc.config.autoscaler(req.spec, first, warm=not ws.cold, prior=ws.coefficients,
                                                 prior_calibration=ws.calibration, namespace=req.namespace))
            await svc.save(job)  # a new owner goes on from here (refused: the new owner resumes from the record)
        await svc.bus.respond(msg, await svc.placed(first))

    async def history(job: str, msg: Msg) -> None:
        q = decode(HistoryQuery, msg.data)
        if not 1 <= q.limit <= 1000:
            raise ValidationError(f"limit: must be 1..1000, got {q.limit}")
        await svc.load_history()
        out = []
        for h in sorted(svc.history.values(), key=lambda h: h.finished_at, reverse=True):
            p = h.final_plan
            if p is None or (q.model and h.features.model != q.model):
                continue
            out.append(HistoryEntry(h.job, h.features.model, h.features.dataset, h.features.records, p.workers,
                                    p.ps, p.worker_cpu, p.ps_cpu, h.throughput, h.finished_at, h.succeeded))
        await svc.bus.respond(msg, HistoryList(out[: q.limit]))

    return {subjects.BrainOp.PLAN: plan, subjects.BrainOp.HISTORY: history}


# ---------------------------------------------------------------- plain subscriptions
async def on_statistics(svc: BrainService, msg: Msg) -> None:
    """A monitor window: to the next cluster round, the job's autoscaler, or OOM prevention."""
    try:
        stats = decode(JobStatistics, msg.data)
        if not svc.own.owns(stats.job):
            if svc.held_elsewhere(stats.job):
                svc.standby(stats)
                svc.counters.inc("statistics", path="standby")
                return
            autoscaled, rec = await svc.is_autoscaled(stats.job)
            running = autoscaled or (rec is not None and rec.state is JobState.RUNNING) or stats.job in svc.running
            if not running or not await svc.take(stats.job, autoscaled):
                svc.standby(stats)
                svc.counters.inc("statistics", path="standby")
                return
        elif not await svc.take(stats.job, (await svc.is_autoscaled(stats.job))[0]):
            svc.standby(stats)
            return
        await svc.flush(stats.job)  # a plan whose publication failed before goes out first
        auto = await svc.autoscaler_of(stats.job)
        if auto is not None and svc.capacity() is not None:
            svc.latest[stats.job] = stats  # planned with the others in the next cluster round
            svc.round_due.set()
            svc.counters.inc("statistics", path="round")
        elif auto is not None:
            await svc.autoscale(auto, stats)
            svc.counters.inc("statistics", path="job")
        else:
            await svc.prevent_oom(stats)
            svc.counters.inc("statistics", path="oom")
    except PacerError as exc:
        svc.counters.inc("bad_events", code=exc.code)
    except Exception:  # the subscription's boundary: the next window tries again
        svc.counters.inc("internal_errors", op="statistics")
        log.exception("re-planning from statistics failed")


async def on_cluster_status(svc: BrainService, msg: Msg) -> None:
    """The executor's ClusterStatus: kept unless malformed or older than the one in hand."""
    try:
        status = decode(ClusterStatus, msg.data)
        problem = status_problem(status)
        if problem:
            raise ValidationError(f"ClusterStatus from {status.backend!r}: {problem}")
    except PacerError as exc:
        svc.counters.inc("bad_events", code=exc.code)
        log.warning("cluster status ignored: %s", exc)
        return
    if svc.cluster is not None and status.ts < svc.cluster.ts:
        return  # an older one, late
    svc.cluster, svc.machines = status, list(status.machines)


# ---------------------------------------------------------------- the durable consumer
def events(svc: BrainService) -> Callable[[Msg], Awaitable[None]]:
    """The durable consumer's handler: by the event's domain and kind."""

    async def handle(msg: Msg) -> None:
        parts = msg.subject.split(".")  # pacer.events.<domain>.<job>.<kind>
        domain = parts[2] if len(parts) >= 5 else ""
        seq = msg.metadata.sequence.stream
        if domain == "job":
            await on_job_end(svc, decode(JobEvent, msg.data), seq)
        elif domain == subjects.EXECUTOR_SERVICE:
            await on_applied_event(svc, decode(ExecutorEvent, msg.data), seq)
        elif domain == "node":
            await on_node_event(svc, decode(NodeEvent, msg.data), seq)
        else:
            raise ValidationError(f"subject {msg.subject!r}: not an event the brain follows")

    return handle


async def on_applied_event(svc: BrainService, ev: ExecutorEvent, seq: int) -> None:
    """The executor applied a plan: the plan in force (stored, by whichever instance folds it first), and
    (the owner, once per event) the autoscaler's plan and Eq. 8 pause."""
    rec, _ = await svc.store.update_running(ev.job, lambda r: on_applied(r, ev, seq) if is_new(r, seq) else None)
    if rec is not None:
        svc.running[ev.job] = rec
    plan = ev.plan
    if plan is not None:
        async def learn() -> None:
            await svc.applied(ev.job, plan, ev.ts, ev.overhead_s)

        await svc.effect(ev.job, seq, learn)


async def on_node_event(svc: BrainService, ev: NodeEvent, seq: int) -> None:
    """A node event: its pod's size (the plan as run); an OOM while sampling gets the sample stage's answer
    (from the owner, once per event)."""
    rec, _ = await svc.store.update_running(ev.job, lambda r: on_node(r, ev, seq) if is_new(r, seq) else None)
    if rec is not None:
        svc.running[ev.job] = rec
    if ev.kind == subjects.NodeEventKind.DIED and ev.reason == "oom":
        async def answer() -> None:
            await svc.sample_oom(ev)

        await svc.effect(ev.job, seq, answer)


async def on_job_end(svc: BrainService, ev: JobEvent, seq: int) -> None:
    """A job ended: its record in the config DB (DLRover-RM Alg. 1's D), by the job's owner (its autoscaler
    knows the coefficients) or, if nobody owns it, by whoever claims it; its running state dropped everywhere."""
    current = await svc.store.running_of(ev.job)
    if current is not None and current.seq > seq:
        return  # the end of an earlier job of the same name (a new instance's consumer replays the stream)
    if await svc.store.recorded_at(ev.job) == ev.ts:  # recorded already (another instance, or a redelivery)
        await _dropped(svc, ev.job)
        return
    if not svc.own.owns(ev.job):
        holder = await svc.own.owner_of(ev.job)
        if holder is not None and holder != svc.own.instance:
            svc.forget(ev.job)  # the owner records it
            await svc.own.drop(ev.job)
            return
        if not await svc.own.claim(ev.job, within=2.0):
            raise Unavailable(f"{ev.job}: changing owner; the job end is retried")
    rec = await svc.store.job(ev.job)
    if rec is None:
        svc.counters.inc("unknown_jobs")
        await _dropped(svc, ev.job)
        return
    running: RunningJob | None = svc.running.get(ev.job)
    if rec.plan is not None:
        span = (rec.finished_at or ev.ts) - (rec.started_at or rec.submitted_at)
        throughput = rec.progress.records_done / span if span > 0 else 0.0
        final = as_run(running, rec.plan)
        plans = (rec.plan,) if same_resources(final, rec.plan) else (rec.plan, final)
        auto = svc.autoscalers.get(rec.job)
        h = JobHistory(job=rec.job, features=JobFeatures.from_spec(rec.spec, rec.records or None),
                       plans=plans, throughput=throughput, finished_at=ev.ts,
                       succeeded=ev.state is JobState.COMPLETED,
                       coefficients=auto.learnt() if auto is not None else None,
                       calibration=auto.learnt_calibration() if auto is not None else None)
        await svc.store.record(h)
        svc.history[rec.job] = h
        svc.counters.inc("recorded", state=ev.state.value)
    await _dropped(svc, ev.job)


async def _dropped(svc: BrainService, job: str) -> None:
    """The job's running record, its owner's state and lease, and what this instance kept of it: gone."""
    await svc.store.drop_running(job)
    await svc.own.delete_state(job)
    await svc.own.drop(job)
    svc.forget(job)
