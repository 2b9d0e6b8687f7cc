"""The brain-optimizer service: first plans from the config DB, and the config DB itself.

* ``pacer.rpc.brain.<job>.plan`` (brain.PlanRequest -> jobs.ResourcePlan):
  DLRover-RM Alg. 1 warm start (:mod:`.core.warmstart`): the top-k most
  similar finished jobs' final plans, exponentially smoothed (mu), fitted to
  the spec's own ``resources`` and ``limits``; on a cold start (no similar
  job) the documented default plan, marked as such.
* ``pacer.rpc.brain._all.history`` (brain.HistoryQuery -> brain.HistoryList):
  the config DB, newest first (``pacer brain history``).
* The config DB is the KV bucket ``pacer-brain-history`` (one JSON record per
  finished job: features, plans, observed throughput); a durable consumer of
  the job lifecycle events (``completed``, ``failed``) adds to it, so a job
  that ends while the brain is down is recorded when it comes back.

* OOM prevention (DLRover-RM §5.3, :mod:`.core.oom`): from the monitor's
  statistics (``pacer.events.monitor.<job>.statistics``) the brain keeps each
  node's RSS over time, forecasts it to the job's end (remaining records over
  the current throughput), and when a PS would cross its memory limit it
  publishes a new plan with more PS memory; the executor applies it as a
  seamless PS migration, before the OOM.  One such plan per job per
  ``oom_cooldown_s``.

Not yet here (issue 6 continues): the sample/optimize/adjust stages and
online model fitting during a job (the cores exist in :mod:`.core`), cluster-
level selection and placement applied to running jobs; worker memory is
forecast but only new worker pods get a raised limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import replace

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode
from pacer.consumer import DurableConsumer
from pacer.contracts.brain import HistoryEntry, HistoryList, HistoryQuery, PlanRequest
from pacer.contracts.executor import ExecutorJob
from pacer.contracts.jobs import JobEvent, JobRecord, JobState, PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics, NodeState
from pacer.errors import PacerError, ValidationError
from pacer.runtime import RuntimeConfig, dispatch_rpc
from pacer.subjects import BrainOp
from pacer.telemetry import Counters
from pacer_services.brain.core.history import JobFeatures, JobHistory
from pacer_services.brain.core.oom import (
    DEFAULT_OOM,
    MemorySample,
    OomConfig,
    forecast_oom,
    prevent_oom,
)
from pacer_services.brain.core.warmstart import warm_start

log = logging.getLogger("pacer.brain")


class BrainService:
    name = subjects.BRAIN_SERVICE

    def __init__(self, bus: Bus, durable: str = "brain", oom: OomConfig = DEFAULT_OOM,
                 oom_cooldown_s: float = 300.0) -> None:
        self.bus = bus
        self.counters = Counters(self.name)
        self.history: dict[str, JobHistory] = {}
        self.oom, self.oom_cooldown_s = oom, oom_cooldown_s
        self.memory: dict[str, dict[str, deque[MemorySample]]] = {}  # job -> node -> RSS over time
        self.plans: dict[str, ResourcePlan] = {}  # job -> the plan the brain last published
        self.oom_at: dict[str, float] = {}  # job -> when its last OOM-prevention plan went out
        self.rpc = {BrainOp.PLAN: self._plan, BrainOp.HISTORY: self._history}
        self.consumer = DurableConsumer(
            bus, self.name, durable,
            [subjects.events_of("job", kind=JobState.COMPLETED.value),
             subjects.events_of("job", kind=JobState.FAILED.value)],
            self._on_job_end, self.counters)
        self._kv: KeyValue | None = None
        self._jobs_kv: KeyValue | None = None
        self._sub: Subscription | None = None
        self._stats_sub: Subscription | None = None

    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.bus.ensure_streams()
        self._kv = await self.bus.kv(subjects.BRAIN_BUCKET, "Pacer brain: the config DB of finished jobs")
        self._jobs_kv = await self.bus.kv(subjects.JOB_BUCKET, "Pacer jobs: one JobRecord per job")
        for key, value in (await self.bus.kv_items(subjects.BRAIN_BUCKET)).items():
            try:
                self.history[key] = JobHistory.from_dict(json.loads(value))
            except (ValueError, KeyError, TypeError):
                self.counters.inc("bad_records")
                log.error("unreadable config DB record %s; ignored", key)
        self._sub = await self.bus.nc.subscribe(subjects.rpc_wildcard(self.name), queue=self.name, cb=self._on_rpc)
        self._stats_sub = await self.bus.nc.subscribe(
            subjects.events_of(subjects.MONITOR_SERVICE, kind="statistics"), queue=self.name, cb=self._on_statistics)
        await self.bus.nc.flush()
        tg.create_task(self.consumer.run(), name="pacer:brain:jobs")
        log.info("brain ready", extra={"fields": {"history": len(self.history)}})

    async def drain(self) -> None:
        for sub in (self._sub, self._stats_sub):
            if sub is not None:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        await self.consumer.stop()

    async def _on_rpc(self, msg: Msg) -> None:
        await dispatch_rpc(self.bus, self.counters, self.rpc, msg)

    # ---------------------------------------------------------------- rpc
    async def _plan(self, job: str, msg: Msg) -> None:
        req = decode(PlanRequest, msg.data)
        if req.job != job or req.spec.name != job:
            raise ValidationError(f"job: the request names {req.job!r} / spec {req.spec.name!r}, the subject {job!r}")
        ws = warm_start(req.spec, self.history.values(), records=req.records or None)
        self.counters.inc("plans", start="cold" if ws.cold else "warm")
        await self.bus.respond(msg, replace(ws.plan, job=job))

    async def _history(self, job: str, msg: Msg) -> None:
        q = decode(HistoryQuery, msg.data)
        if not 1 <= q.limit <= 1000:
            raise ValidationError(f"limit: must be 1..1000, got {q.limit}")
        rows = sorted(self.history.values(), key=lambda h: h.finished_at, reverse=True)
        out = []
        for h in rows:
            plan = h.final_plan
            if plan is None or (q.model and h.features.model != q.model):
                continue
            out.append(HistoryEntry(h.job, h.features.model, h.features.dataset, h.features.records, plan.workers,
                                    plan.ps, plan.worker_cpu, plan.ps_cpu, h.throughput, h.finished_at,
                                    h.succeeded))
        await self.bus.respond(msg, HistoryList(out[: q.limit]))

    # ---------------------------------------------------------------- OOM prevention
    async def _on_statistics(self, msg: Msg) -> None:
        try:
            stats = decode(JobStatistics, msg.data)
            await self.prevent_oom(stats)
        except PacerError as exc:
            self.counters.inc("bad_events", code=exc.code)
        except Exception:  # the subscription's boundary: the next window tries again
            self.counters.inc("internal_errors", op="oom")
            log.exception("OOM prevention failed")

    async def prevent_oom(self, stats: JobStatistics) -> ResourcePlan | None:
        """Feed one statistics window; publish (and return) a plan with more memory if an OOM is coming."""
        nodes = self.memory.setdefault(stats.job, {})
        for n in stats.nodes:
            if n.state is NodeState.RUNNING and n.rss_bytes > 0:
                q = nodes.setdefault(n.node, deque(maxlen=self.oom.window))
                if not q or stats.ts > q[-1].at:
                    q.append(MemorySample(stats.ts, n.rss_bytes / (1 << 20)))
        sh = stats.shards
        if sh is None or sh.finished or stats.throughput_samples_per_s <= 0 or sh.records_total <= sh.records_done:
            return None
        if stats.ts - self.oom_at.get(stats.job, -1e18) < self.oom_cooldown_s:
            return None
        plan = self.plans.get(stats.job) or await self._current_plan(stats.job)
        if plan is None:
            return None
        end_at = stats.ts + (sh.records_total - sh.records_done) / stats.throughput_samples_per_s
        roles = {n.node: n.role for n in stats.nodes}
        forecasts = [forecast_oom(node, list(q), plan.ps_memory_mb if roles.get(node) == "ps"
                                  else plan.worker_memory_mb, end_at, self.oom, role=roles.get(node, "worker"))
                     for node, q in nodes.items() if node in roles]
        raised = prevent_oom(plan, [f for f in forecasts if f.role == "ps"])  # PS move seamlessly (§5.2)
        if raised is None:
            return None
        new_plan: ResourcePlan = replace(raised, source=PlanSource.BRAIN)
        self.plans[stats.job], self.oom_at[stats.job] = new_plan, stats.ts
        await self.bus.publish_durable(subjects.job_event(stats.job, subjects.JobEventKind.PLAN), new_plan)
        self.counters.inc("oom_plans")
        log.info("OOM prevention plan", extra={"fields": {"job": stats.job, "reason": new_plan.reason}})
        return new_plan

    async def _current_plan(self, job: str) -> ResourcePlan | None:
        assert self._jobs_kv is not None
        rec = await Bus.kv_get(self._jobs_kv, job, JobRecord)
        return rec.plan if rec is not None and rec.state is JobState.RUNNING else None

    # ---------------------------------------------------------------- config DB
    async def _on_job_end(self, m: Msg) -> None:
        ev = decode(JobEvent, m.data)
        assert self._jobs_kv is not None and self._kv is not None
        rec = await Bus.kv_get(self._jobs_kv, ev.job, JobRecord)
        if rec is None:
            self.counters.inc("unknown_jobs")
            return
        if rec.plan is None:
            return
        span = (rec.finished_at or ev.ts) - (rec.started_at or rec.submitted_at)
        throughput = rec.progress.records_done / span if span > 0 else 0.0
        final = await self._as_run(rec.plan)
        plans = (rec.plan,) if final == rec.plan else (rec.plan, final)
        h = JobHistory(job=rec.job, features=JobFeatures.from_spec(rec.spec, rec.records or None),
                       plans=plans, throughput=throughput, finished_at=ev.ts,
                       succeeded=ev.state is JobState.COMPLETED)
        await self._kv.put(rec.job, json.dumps(h.to_dict()).encode())
        self.history[rec.job] = h
        self.counters.inc("recorded", state=ev.state.value)


    async def _as_run(self, plan: ResourcePlan) -> ResourcePlan:
        """The plan as the job really ran at the end: the executor's nodes (after OOM relaunches with
        more memory, migrations, scaling) — what a similar job should start from (DLRover-RM Alg. 1's A^i)."""
        ej = await Bus.kv_get(await self.bus.kv(subjects.EXECUTOR_BUCKET), plan.job, ExecutorJob)
        if ej is None:
            return plan
        # its latest plan's slots (teardown marks every node removed)
        workers = [n for n in ej.nodes if n.role == "worker" and n.index < ej.plan.workers]
        ps = [n for n in ej.nodes if n.role == "ps" and n.index < ej.plan.ps]
        if not workers or not ps:
            return plan
        return replace(plan, workers=len(workers), ps=len(ps),
                       worker_cpu=max(n.cpu for n in workers), worker_memory_mb=max(n.memory_mb for n in workers),
                       ps_cpu=max(n.cpu for n in ps), ps_memory_mb=max(n.memory_mb for n in ps),
                       reason="as run (executor's final nodes)")


async def create(bus: Bus, rc: RuntimeConfig) -> BrainService:
    """App factory."""
    return BrainService(bus)
