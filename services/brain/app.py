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

Not yet here (issue 6 continues): the sample/optimize/adjust stages and
online model fitting during a job (the cores exist in :mod:`.core`), cluster-
level selection, OOM prevention and placement applied to running jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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
from pacer.contracts.jobs import JobEvent, JobRecord, JobState, ResourcePlan
from pacer.errors import ValidationError
from pacer.runtime import RuntimeConfig, dispatch_rpc
from pacer.subjects import BrainOp
from pacer.telemetry import Counters
from pacer_services.brain.core.history import JobFeatures, JobHistory
from pacer_services.brain.core.warmstart import warm_start

log = logging.getLogger("pacer.brain")


class BrainService:
    name = subjects.BRAIN_SERVICE

    def __init__(self, bus: Bus, durable: str = "brain") -> None:
        self.bus = bus
        self.counters = Counters(self.name)
        self.history: dict[str, JobHistory] = {}
        self.rpc = {BrainOp.PLAN: self._plan, BrainOp.HISTORY: self._history}
        self.consumer = DurableConsumer(
            bus, self.name, durable,
            [subjects.events_of("job", kind=JobState.COMPLETED.value),
             subjects.events_of("job", kind=JobState.FAILED.value)],
            self._on_job_end, self.counters)
        self._kv: KeyValue | None = None
        self._jobs_kv: KeyValue | None = None
        self._sub: Subscription | None = None

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
        await self.bus.nc.flush()
        tg.create_task(self.consumer.run(), name="pacer:brain:jobs")
        log.info("brain ready", extra={"fields": {"history": len(self.history)}})

    async def drain(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
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

    # ---------------------------------------------------------------- config DB
    async def _on_job_end(self, m: Msg) -> None:
        ev = decode(JobEvent, m.data)
        assert self._jobs_kv is not None and self._kv is not None
        try:
            entry = await self._jobs_kv.get(ev.job)
        except nats.js.errors.KeyNotFoundError:
            self.counters.inc("unknown_jobs")
            return
        if not entry.value:
            return
        rec = decode(JobRecord, entry.value)
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
        try:
            kv = await self.bus.kv(subjects.EXECUTOR_BUCKET)
            entry = await kv.get(plan.job)
        except nats.js.errors.KeyNotFoundError:
            return plan
        if not entry.value:
            return plan
        ej = decode(ExecutorJob, entry.value)  # its latest plan's slots (teardown marks every node removed)
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
