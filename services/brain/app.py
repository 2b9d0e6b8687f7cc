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

* An OOM while a zero-config job samples (``pacer.events.node.<job>.died``
  with reason ``oom``) gets DLRover 2023 §4.2's answer as the job's next
  plan: a worker's memory doubled, or twice the PS (the executor has
  relaunched the node with twice its memory already).

* Zero-config jobs (no ``resources`` in the spec) are re-planned while they
  run by a :class:`~.core.autoscaler.JobAutoscaler` each: the first plan
  (warm start, or on a cold start the default plan, measured as the sample)
  -> optimize (DLRover 2023 Eq. 10-11) -> adjust every ``adjust_interval_s``
  (hot PS, the online-fitted DLRover-RM model with Pareto candidates and the
  Eq. 8-14 choice within the job's quota, idle PS).  Each re-plan goes out as
  a plan event, which the executor applies, and a ``BrainDecision`` event
  (``pacer.events.brain.<job>.decision``) saying why.  The executor's
  ``applied`` events tell the autoscaler the plan in force and the pause it
  cost (Eq. 8's overhead from history).  A brain restart picks up running
  zero-config jobs from the executor's record, in the adjust stage.
  The quota (C_total) and node size (C_max) come from :class:`BrainConfig`
  (``PACER_BRAIN_CPU_QUOTA``, ``PACER_BRAIN_NODE_CPU``): a job's
  ``limits.max_cpu`` lowers the quota.

* Placement (Dike, :mod:`.core.placement`): the brain keeps the executor's
  latest ``ClusterStatus`` (``pacer.events.cluster._cluster.status``, a
  plain subscription with no acks: the next status, a few seconds later,
  supersedes a lost one; a malformed one is counted and ignored).  When it
  lists two machines or more, every plan the brain returns or publishes
  (first plans, re-plans, OOM-prevention plans) carries a placement, node ->
  machine, computed over each machine's free capacity plus what the job's
  own pods hold there; the executor turns it into soft node affinity.  No
  placement fits: the plan goes out without one and its reason says why.

* Across jobs (DLRover-RM §4.3, Eq. 11-14): when the capacity the
  autoscaled jobs share is known (``PACER_BRAIN_CLUSTER_CPU`` /
  ``PACER_BRAIN_CLUSTER_MEMORY_MB``, else a ClusterStatus where requests
  reserve capacity: its free capacity plus what these jobs hold,
  :mod:`.core.capacity`), statistics are not stepped job by job: each job's
  latest window is kept and, shortly after a burst of windows (the monitor
  publishes every job's at once), one round of
  :func:`.core.autoscaler.plan_cluster` runs over every autoscaled job with
  a new window: rule decisions first, then the model requests share what is
  left by the weighted greedy choice.  The core paces each job to
  ``adjust_interval_s`` itself, as in the simulator's ``PacerCluster``,
  which drives it the same way.  Decisions are published as in the per-job
  path; together they stay within the capacity (a job that declines its
  share keeps what it holds, and the others grow only while they fit).
  Rounds run in a worker thread (NSGA-II takes
  a while), under the lock that also guards the executor's ``applied``
  events to the same autoscalers.

OOM prevention raises worker memory too: the executor then replaces the
running workers with the new memory, a batch at a time.

Not yet here: nodes already running are not pinned where they run (the
placement of a re-plan treats all the job's pods as movable; only the pods
created after it follow it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode
from pacer.consumer import DurableConsumer
from pacer.contracts.brain import (
    BrainDecision,
    HistoryEntry,
    HistoryList,
    HistoryQuery,
    PlanRequest,
)
from pacer.contracts.executor import (
    ClusterStatus,
    ExecutorEvent,
    ExecutorEventKind,
    ExecutorJob,
    MachineInfo,
)
from pacer.contracts.jobs import JobEvent, JobRecord, JobSpec, JobState, PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics
from pacer.contracts.nodes import NodeEvent
from pacer.errors import PacerError, ValidationError
from pacer.runtime import RuntimeConfig, dispatch_rpc, guard
from pacer.subjects import BrainOp
from pacer.telemetry import Counters
from pacer_services.brain.core.autoscaler import (
    AutoscaleConfig,
    Decision,
    JobAutoscaler,
    Stage,
    same_resources,
)
from pacer_services.brain.core.capacity import (
    cluster_capacity,
    status_problem,
)
from pacer_services.brain.core.cluster import (
    OverheadModel,
    Resources,
    ScalingKind,
    ScalingRecord,
    plan_resources,
)
from pacer_services.brain.core.fitting import Coefficients
from pacer_services.brain.core.history import JobFeatures, JobHistory
from pacer_services.brain.core.oom import ALL_ROLES, DEFAULT_OOM, MemoryWatch, OomConfig
from pacer_services.brain.core.placement import after_placement, machines_for, place_plan
from pacer_services.brain.core.round import ReadyJob, cluster_round
from pacer_services.brain.core.warmstart import warm_start

log = logging.getLogger("pacer.brain")


@dataclass(frozen=True, slots=True)
class BrainConfig:
    """What the brain re-plans running jobs with (env: ``PACER_BRAIN_*``)."""

    autoscale: bool = True  # re-plan zero-config jobs while they run
    cpu_quota: float = 64.0  # C_total of a job without limits.max_cpu (DLRover 2023 §4.2)
    node_cpu: float = 16.0  # C_max: CPUs of one node
    adjust_interval_s: float = 180.0  # DLRover-RM §6: every 3 min
    settle_s: float = 30.0  # a plan counts as measured after its nodes ran this long
    autoscale_config: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    # What the autoscaled jobs share (DLRover-RM Eq. 13's S); None: from the executor's ClusterStatus.
    cluster_cpu: float | None = None
    cluster_memory_mb: float | None = None
    cluster_status_ttl_s: float = 60.0  # an older ClusterStatus (the executor is gone?) is not used
    round_delay_s: float = 0.5  # a cluster round waits this long for the rest of the monitor's burst

    @classmethod
    def from_env(cls) -> BrainConfig:
        env = os.environ
        return cls(autoscale=env.get("PACER_BRAIN_AUTOSCALE", "1") not in ("0", "false", "no"),
                   cpu_quota=float(env.get("PACER_BRAIN_CPU_QUOTA", "64")),
                   node_cpu=float(env.get("PACER_BRAIN_NODE_CPU", "16")),
                   adjust_interval_s=float(env.get("PACER_BRAIN_ADJUST_S", "180")),
                   settle_s=float(env.get("PACER_BRAIN_SETTLE_S", "30")),
                   cluster_cpu=_amount(env.get("PACER_BRAIN_CLUSTER_CPU")),
                   cluster_memory_mb=_amount(env.get("PACER_BRAIN_CLUSTER_MEMORY_MB")),
                   # Eq. 8's pauses until the executor has reported real ones: a pod's start where Pacer runs
                   autoscale_config=AutoscaleConfig(overhead=OverheadModel(
                       worker_pause_s=float(env.get("PACER_BRAIN_WORKER_PAUSE_S", "30")),
                       ps_pause_s=float(env.get("PACER_BRAIN_PS_PAUSE_S", "120")))))

    def autoscaler(self, spec: JobSpec, first: ResourcePlan, warm: bool,
                   prior: Coefficients | None = None) -> JobAutoscaler:
        stages = replace(self.autoscale_config.stages, c_total=self.cpu_quota, c_max=self.node_cpu,
                         ps_cpu_target=min(self.autoscale_config.stages.ps_cpu_target, self.node_cpu))
        cfg = replace(self.autoscale_config, stages=stages, adjust_interval_s=self.adjust_interval_s,
                      settle_s=self.settle_s)
        # m of DLRover-RM Eq. 1 is per worker; the spec's batch is global (launch divides it).
        m = max(1, spec.batch_size // max(1, first.workers))
        return JobAutoscaler(spec, m, cfg, first=first, warm=warm, prior=prior)


def _amount(text: str | None) -> float | None:
    """An optional amount from the environment: unset or empty is None."""
    return float(text) if text not in (None, "") else None


class BrainService:
    name = subjects.BRAIN_SERVICE

    def __init__(self, bus: Bus, durable: str = "brain", oom: OomConfig = DEFAULT_OOM,
                 oom_cooldown_s: float = 300.0, config: BrainConfig | None = None) -> None:
        self.bus = bus
        self.counters = Counters(self.name)
        self.history: dict[str, JobHistory] = {}
        self.oom, self.oom_cooldown_s = oom, oom_cooldown_s
        self.config = config or BrainConfig()
        self.memory: dict[str, MemoryWatch] = {}  # job -> its nodes' RSS over time (jobs not autoscaled)
        self.autoscalers: dict[str, JobAutoscaler] = {}  # running zero-config jobs
        self.not_autoscaled: set[str] = set()  # jobs looked up and found not to be ours to re-plan
        self.plans: dict[str, ResourcePlan] = {}  # job -> the plan the brain last published
        self.oom_at: dict[str, float] = {}  # job -> when its last OOM-prevention plan went out
        self.cluster: ClusterStatus | None = None  # the executor's latest (valid) ClusterStatus
        self.machines: list[MachineInfo] = []  # its machines, minus what plans placed since
        self.latest: dict[str, JobStatistics] = {}  # cluster mode: each job's newest window not yet fed
        self.lock = asyncio.Lock()  # autoscalers are stepped in a worker thread: one writer at a time
        self._round_due = asyncio.Event()
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
        self._applied_sub: Subscription | None = None
        self._cluster_sub: Subscription | None = None
        self._died_sub: Subscription | None = None

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
        self._applied_sub = await self.bus.nc.subscribe(
            subjects.events_of(subjects.EXECUTOR_SERVICE, kind=ExecutorEventKind.APPLIED.value),
            queue=self.name, cb=self._on_applied)
        self._cluster_sub = await self.bus.nc.subscribe(subjects.cluster_status(), queue=self.name,
                                                        cb=self._on_cluster_status)
        self._died_sub = await self.bus.nc.subscribe(subjects.events_of("node", kind="died"), queue=self.name,
                                                     cb=self._on_node_died)
        await self.bus.nc.flush()
        tg.create_task(self.consumer.run(), name="pacer:brain:jobs")
        tg.create_task(guard("cluster-rounds", self._round_loop), name="pacer:brain:rounds")
        log.info("brain ready", extra={"fields": {"history": len(self.history)}})

    async def drain(self) -> None:
        for sub in (self._sub, self._stats_sub, self._applied_sub, self._cluster_sub, self._died_sub):
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
        plan = replace(ws.plan, job=job)
        if self.config.autoscale and req.spec.resources is None:
            self.autoscalers[job] = self.config.autoscaler(req.spec, plan, warm=not ws.cold, prior=ws.coefficients)
            self.not_autoscaled.discard(job)
        await self.bus.respond(msg, await self.placed(plan))

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
            auto = await self._autoscaler_of(stats.job)
            if auto is not None and self.capacity() is not None:
                self.latest[stats.job] = stats  # planned with the others in the next cluster round
                self._round_due.set()
                self.counters.inc("statistics", path="round")
            elif auto is not None:
                await self.autoscale(auto, stats)
                self.counters.inc("statistics", path="job")
            else:
                await self.prevent_oom(stats)
                self.counters.inc("statistics", path="oom")
        except PacerError as exc:
            self.counters.inc("bad_events", code=exc.code)
        except Exception:  # the subscription's boundary: the next window tries again
            self.counters.inc("internal_errors", op="statistics")
            log.exception("re-planning from statistics failed")

    async def prevent_oom(self, stats: JobStatistics) -> ResourcePlan | None:
        """Feed one statistics window; publish (and return) a plan with more memory if an OOM is coming."""
        watch = self.memory.setdefault(stats.job, MemoryWatch(self.oom))
        watch.feed(stats)
        sh = stats.shards
        if sh is None or sh.finished or stats.throughput_samples_per_s <= 0 or sh.records_total <= sh.records_done:
            return None
        if stats.ts - self.oom_at.get(stats.job, -1e18) < self.oom_cooldown_s:
            return None
        plan = self.plans.get(stats.job) or await self._current_plan(stats.job)
        if plan is None:
            return None
        end_at = stats.ts + (sh.records_total - sh.records_done) / stats.throughput_samples_per_s
        # PS and workers (oom.ALL_ROLES): a PS moves seamlessly (DLRover-RM §5.2), the executor replaces
        # workers a batch at a time; either way the new memory is in place before the OOM.
        raised = watch.plan_for(plan, end_at, roles=ALL_ROLES)
        if raised is None:
            return None
        new_plan = await self.placed(replace(raised, source=PlanSource.BRAIN))
        self.plans[stats.job], self.oom_at[stats.job] = new_plan, stats.ts
        await self.bus.publish_durable(subjects.job_event(stats.job, subjects.JobEventKind.PLAN), new_plan)
        self.counters.inc("oom_plans")
        log.info("OOM prevention plan", extra={"fields": {"job": stats.job, "reason": new_plan.reason}})
        return new_plan

    # ---------------------------------------------------------------- re-planning running jobs
    async def _autoscaler_of(self, job: str) -> JobAutoscaler | None:
        """The job's autoscaler; after a brain restart, rebuilt for a running zero-config job."""
        auto = self.autoscalers.get(job)
        if auto is not None or not self.config.autoscale or job in self.not_autoscaled:
            return auto
        assert self._jobs_kv is not None
        rec = await Bus.kv_get(self._jobs_kv, job, JobRecord)
        ej = await Bus.kv_get(await self.bus.kv(subjects.EXECUTOR_BUCKET), job, ExecutorJob)
        ours = (rec is not None and rec.state is JobState.RUNNING and rec.spec.resources is None
                and rec.spec.policies.optimizer == subjects.BRAIN_SERVICE)
        if not ours:
            self.not_autoscaled.add(job)
        if rec is None or not ours or ej is None:
            return None
        auto = self.config.autoscaler(rec.spec, ej.plan, warm=True)  # measured afresh, in the adjust stage
        auto.applied(ej.plan, 0.0)
        self.autoscalers[job] = auto
        self.counters.inc("autoscalers_resumed")
        return auto

    async def autoscale(self, auto: JobAutoscaler, stats: JobStatistics) -> Decision | None:
        """Feed one statistics window to a job's autoscaler, within its own quota; publish its re-plan, if any."""
        async with self.lock:
            before = auto.plan
            d = await asyncio.to_thread(auto.step, stats.ts, stats)  # NSGA-II: not on the event loop
        if d is None or before is None or same_resources(d.plan, before):
            return None
        await self._publish_decision(auto, stats.job, stats.ts, before, d)
        return d

    async def _publish_decision(self, auto: JobAutoscaler, job: str, ts: float, before: ResourcePlan,
                                d: Decision) -> ResourcePlan:
        """The re-plan as a plan event (placed, if machines are known) and a BrainDecision saying why."""
        measured = auto.measured.get((before.workers, before.ps, before.worker_cpu, before.ps_cpu))
        plan = await self.placed(replace(d.plan, job=job, source=PlanSource.BRAIN))
        await self.bus.publish_durable(subjects.job_event(job, subjects.JobEventKind.PLAN), plan)
        await self.bus.publish_durable(subjects.brain_decision(job), BrainDecision(
            job, ts, d.stage, d.rule, plan, before,
            measured.throughput if measured is not None else 0.0, d.predicted_throughput))
        self.counters.inc("replans", rule=d.rule.value)
        log.info("re-plan", extra={"fields": {"job": job, "rule": d.rule.value, "reason": plan.reason}})
        return plan

    # ---------------------------------------------------------------- the cluster: rounds and placement
    async def _on_cluster_status(self, msg: Msg) -> None:
        try:
            status = decode(ClusterStatus, msg.data)
            problem = status_problem(status)
            if problem:
                raise ValidationError(f"ClusterStatus from {status.backend!r}: {problem}")
        except PacerError as exc:
            self.counters.inc("bad_events", code=exc.code)
            log.warning("cluster status ignored: %s", exc)
            return
        if self.cluster is not None and status.ts < self.cluster.ts:
            return  # an older one, late
        self.cluster, self.machines = status, list(status.machines)

    def _fresh_cluster(self) -> ClusterStatus | None:
        """The latest ClusterStatus unless it is too old to describe the cluster (the executor is gone?)."""
        cs = self.cluster
        if cs is None or time.time() - cs.ts > self.config.cluster_status_ttl_s:
            return None
        return cs

    def _held(self, jobs: list[str] | None = None) -> Resources:
        """What the autoscaled jobs' plans in force hold (all of them, or ``jobs``)."""
        total = Resources()
        for job, auto in self.autoscalers.items():
            if jobs is None or job in jobs:
                total = total + plan_resources(auto.plan)
        return total

    def capacity(self) -> Resources | None:
        """S of DLRover-RM Eq. 13 for the autoscaled jobs together; None: unknown (plan each job alone)."""
        return cluster_capacity(self._fresh_cluster(), self._held(), cpu=self.config.cluster_cpu,
                                memory_mb=self.config.cluster_memory_mb)

    async def placed(self, plan: ResourcePlan) -> ResourcePlan:
        """``plan`` with a Dike placement over the known machines (none with fewer than two, or stale ones)."""
        machines = self.machines if self._fresh_cluster() is not None else []
        out: ResourcePlan
        if len(machines) < 2:
            out = place_plan(plan, [])  # drops any placement it carried from an earlier plan
            return out
        out = await asyncio.to_thread(place_plan, plan, machines_for(plan.job, machines))
        self.counters.inc("placements", placed=str(bool(out.placement)).lower())
        # The next plan placed before the executor's next report must not count on the same room.
        self.machines = after_placement(self.machines, out)
        return out

    async def _round_loop(self) -> None:
        while True:
            await self._round_due.wait()
            await asyncio.sleep(self.config.round_delay_s)  # the rest of the monitor's burst
            self._round_due.clear()
            try:
                await self.cluster_round()
            except PacerError as exc:  # a publish that failed: the next round decides afresh
                self.counters.inc("round_errors", code=exc.code)
                log.warning("cluster round failed: %s", exc)
            except Exception:  # the loop's boundary: the next burst of windows starts a new round
                self.counters.inc("internal_errors", op="round")
                log.exception("cluster round failed")

    async def cluster_round(self) -> dict[str, ResourcePlan]:
        """One DLRover-RM §4.3 round over the autoscaled jobs with a new window; returns what was published.

        Every job's window goes to :func:`plan_cluster` with the round's
        share of the capacity (:func:`.core.capacity.round_total`), within
        which its decisions stay; they are published like the per-job
        path's.  Should the capacity have become unknown meanwhile, the
        windows go through the per-job path instead.
        """
        batch, self.latest = self.latest, {}
        ready = {job: (self.autoscalers[job], stats) for job, stats in sorted(batch.items())
                 if job in self.autoscalers and self.autoscalers[job].plan is not None}
        if not ready:
            return {}
        capacity = self.capacity()
        if capacity is None:
            for auto, stats in ready.values():
                await self.autoscale(auto, stats)
            return {}
        cfg = self.config.autoscale_config
        now = max(stats.ts for _, stats in ready.values())
        async with self.lock:
            before = {job: auto.plan for job, (auto, _) in ready.items() if auto.plan is not None}
            outcome = await asyncio.to_thread(
                cluster_round, [ReadyJob(auto, stats) for auto, stats in ready.values()],
                capacity - self._held(), now, prices=cfg.prices, rho=cfg.rho)
        decided = outcome.decisions
        out: dict[str, ResourcePlan] = {}
        for job in (j for j, d in decided.items() if j in before and not same_resources(d.plan, before[j])):
            auto, stats = ready[job]
            out[job] = await self._publish_decision(auto, stats.job, stats.ts, before[job], decided[job])
        self.counters.inc("cluster_rounds")
        self.counters.inc("cluster_round_jobs", len(ready))
        return out

    async def _on_node_died(self, msg: Msg) -> None:
        """An OOM while a zero-config job samples: DLRover 2023 §4.2's answer as the job's next plan.

        The executor has relaunched the node with twice its memory already
        (its own rule); the sample stage's plan makes that the plan (a
        worker's memory doubled) or doubles the PS so that the partitioned
        model gets twice the memory (:func:`.core.stages.on_sample_oom`).
        After the sample stage the executor's relaunch and the OOM
        prediction are the answer.
        """
        try:
            ev = decode(NodeEvent, msg.data)
            auto = self.autoscalers.get(ev.job)
            if ev.reason != "oom" or auto is None or auto.stage is not Stage.SAMPLE or auto.plan is None:
                return
            async with self.lock:
                before = auto.plan
                plan = auto.on_oom(ev.role or ev.node.split("-")[0])
                d = auto.decisions[-1] if plan is not None and auto.decisions else None
            if d is None or same_resources(d.plan, before):
                return
            await self._publish_decision(auto, ev.job, ev.ts, before, d)
        except (PacerError, ValueError) as exc:
            self.counters.inc("bad_events", code=getattr(exc, "code", "invalid"))

    async def _on_applied(self, msg: Msg) -> None:
        try:
            ev = decode(ExecutorEvent, msg.data)
            auto = self.autoscalers.get(ev.job)
            if auto is None or ev.plan is None:
                return
            async with self.lock:
                kind = ScalingKind.between(auto.plan, ev.plan)
                if auto.plan is not None and kind is not ScalingKind.NONE:
                    auto.paused(ScalingRecord(kind, max(0.0, ev.overhead_s)))  # DLRover-RM Eq. 8: from history
                auto.applied(ev.plan, ev.ts)
        except PacerError as exc:
            self.counters.inc("bad_events", code=exc.code)

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
        auto = self.autoscalers.get(rec.job)
        h = JobHistory(job=rec.job, features=JobFeatures.from_spec(rec.spec, rec.records or None),
                       plans=plans, throughput=throughput, finished_at=ev.ts,
                       succeeded=ev.state is JobState.COMPLETED,
                       coefficients=auto.learnt() if auto is not None else None)
        await self._kv.put(rec.job, json.dumps(h.to_dict()).encode())
        self.history[rec.job] = h
        self.autoscalers.pop(rec.job, None)
        self.memory.pop(rec.job, None)
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
    return BrainService(bus, config=BrainConfig.from_env())
