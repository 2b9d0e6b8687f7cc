"""The brain-optimizer service: first plans, the config DB, and re-planning running jobs.

Parts (as the shard service): :mod:`.main` starts and stops it; :func:`create`
is the app factory; :mod:`.handlers` decode and dispatch; :mod:`.effects`
does the IO (KV, publishing); :mod:`.core` decides (pure).

* ``pacer.rpc.brain.<job>.plan`` (brain.PlanRequest -> jobs.ResourcePlan):
  DLRover-RM Alg. 1 warm start (:mod:`.core.warmstart`), or on a cold
  start the documented default plan, marked as such.
* ``pacer.rpc.brain._all.history`` (brain.HistoryQuery -> brain.HistoryList):
  the config DB (KV ``pacer-brain-history``), newest first.
* What the executor runs: a durable consumer of each instance
  (``brain-events-<instance>``) of the executor's ``applied`` events and the
  node events folds them into one ``brain.RunningJob`` per job
  (:mod:`.core.running`), kept in the brain's own KV ``pacer-brain-jobs``:
  the plan in force, and the plan as run (with the memory of OOM-relaunched
  nodes) that the config DB records when the job ends (the same consumer's
  ``completed`` / ``failed`` job events).  A restarted brain loads the
  records and the consumer delivers what it missed; it never reads the
  executor's KV.
* Zero-config jobs (no ``resources``) are re-planned while they run by a
  :class:`~.core.autoscaler.JobAutoscaler` each (DLRover 2023 §4.2 stages,
  DLRover-RM's model; each re-plan a plan event and a ``BrainDecision``).
  The autoscaler is saved after every change (:mod:`.state`); a job with
  no saved autoscaler (saved by an older brain) is picked up from its
  RunningJob record and the job's spec, in the adjust stage.  The quota (C_total) and node size
  (C_max) come from :class:`BrainConfig`.
* Across jobs (DLRover-RM §4.3): when the capacity the autoscaled jobs
  share is known (``PACER_BRAIN_CLUSTER_CPU`` / ``_MEMORY_MB``, else a
  ClusterStatus where requests reserve capacity, :mod:`.core.capacity`),
  each job's latest window waits for the rest of the monitor's burst and
  one :func:`.core.round.cluster_round` (the round the simulator runs too)
  plans them together within it.
* OOM prevention (DLRover-RM §5.3, :mod:`.core.oom`) for the jobs it does
  not autoscale; an OOM while a zero-config job samples gets DLRover 2023
  §4.2's answer (:func:`.core.stages.on_sample_oom`).
* Placement (Dike, :mod:`.core.placement`) over the machines of the
  executor's latest ClusterStatus, for every plan the brain returns or
  publishes when two machines or more are known.

Several instances (issue 13)
----------------------------
* **One owner per job** (:class:`pacer.ownership.Ownership`, lease
  ``brain.<job>`` in ``pacer-leases``, ``PACER_INSTANCE``,
  ``PACER_LEASE_TTL_S``).  Only the owner steps the job's autoscaler,
  prevents its OOMs, answers its requests (the others forward them:
  ``Ownership.route``) and publishes its plans and decisions.  A job is
  claimed by its plan request or by the first statistics window of a
  running job that reaches an instance while nobody owns it.
* **Hot standby.** Statistics and ClusterStatus come without a queue
  group: every instance hears every job; a non-owner only feeds its
  memory watch of the job.  Every instance folds every event through its
  own durable consumer (a consumer shared by two instances would split a
  job's events between them, out of order, and the fold's ``seq``
  idempotence would drop the older ones); ``RunningJob`` writes are
  compare-and-set, so the second fold of an event changes nothing.
* **State beside the lease** (:mod:`.state`, ``state.brain.<job>``,
  written with the lease's ``fenced_put``): the autoscaler (stage,
  samples, plan in force and plan decided, pauses, memory trend), the
  pending OOM plan and its time, and the stream sequence of the last
  event whose effect (an applied plan learnt, an OOM answered) was
  applied.  It is saved after every window and every effect; the next
  owner loads it in ``on_acquired`` and goes on in the same stage with the
  same samples.  Effects of events a standby saw are kept (the last
  :data:`BACKLOG` per job) and applied on acquiring the job when they are
  newer than the saved sequence.
* **Once per decision.** A plan (and its decision) is first saved in the
  state's outbox with its message ids, then published with those ids
  (``Nats-Msg-Id``), then the outbox is cleared.  A stale owner's save is
  refused by the server, so it publishes nothing; a new owner publishes
  an outbox it finds under the same ids, which the stream stores once
  (within its 2-min duplicate window).
* **Cluster rounds** are cross-job: the holder of the lease
  ``brain._cluster`` runs them.  While the capacity is known (cluster
  mode), the autoscaled jobs belong to that holder: another instance does
  not claim them and hands over (drops) those it owns at their next
  window; the holder claims them at the window after.  Each hand-over
  loses that one window (statistics are periodic).  Without a known
  capacity every owner plans its jobs alone, as before.
* **Job ends.** The owner records the job in the config DB (the
  autoscaler's coefficients are in its memory); if nobody owns the job,
  the instance that gets the end claims it and records it.  Every
  instance drops the job's running record (compare-and-set) and what it
  kept.  The config DB is read from KV for every plan and history request.

Concurrency contract
--------------------
* Each input arrives in order on its own path: the RPC and the two plain
  subscriptions (statistics, ClusterStatus) run one callback at a time
  each; the durable consumer handles its events one at a time in stream
  order, so a job's ``applied``, node and end events are folded in the
  order the executor and the job service published them.
* ``locks`` (:class:`pacer.owned.queues.JobLocks`) guards each job's
  autoscaler, which is stepped in a worker thread (NSGA-II takes a while)
  by the per-job path, the cluster round and the ``applied`` / sample-OOM
  handlers.  A job's lock is held only around that CPU work and in-memory
  updates, never across a network call: KV reads and writes, publishes and
  placement happen before or after it, so a slow server never stalls a
  job's decisions.  No lock is shared by every job: one job's NSGA-II step
  delays only that job's saves; a cluster round holds the locks of the jobs
  it steps (taken in sorted order).
* Everything else (``running``, ``history``, ``latest``, ``machines``, the
  per-job owner state) is touched only on the event loop, between awaits;
  ``on_acquired`` applies a job's backlog until it is empty with no await
  after the last check, so no effect falls between it and ``owns()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from pacer import subjects, tracing
from pacer.bus import Bus
from pacer.consumer import DurableConsumer
from pacer.contracts.brain import BrainDecision, RunningJob
from pacer.contracts.executor import ClusterStatus, MachineInfo
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics
from pacer.contracts.nodes import NodeEvent
from pacer.errors import PacerError
from pacer.lease import Lease, LeaseLost
from pacer.owned.queues import JobLocks
from pacer.owned.router import Router
from pacer.ownership import Ownership
from pacer.runtime import RuntimeConfig, guard
from pacer.subjects import NodeEventKind
from pacer.telemetry import Counters
from pacer_services.brain import handlers
from pacer_services.brain.config import BrainConfig, namespace_quotas
from pacer_services.brain.core.autoscaler import (
    Decision,
    JobAutoscaler,
    Stage,
    load_autoscaler_state,
    same_resources,
)
from pacer_services.brain.core.capacity import cluster_capacity
from pacer_services.brain.core.cluster import (
    Resources,
    ScalingKind,
    ScalingRecord,
    plan_resources,
)
from pacer_services.brain.core.history import JobHistory
from pacer_services.brain.core.oom import DEFAULT_OOM, MemoryWatch, OomConfig, prevention_plan
from pacer_services.brain.core.placement import after_placement, machines_for, place_plan
from pacer_services.brain.core.round import ReadyJob, cluster_round
from pacer_services.brain.effects import BrainStore
from pacer_services.brain.state import (
    JobInMemory,
    Outgoing,
    OwnedJob,
    decode_state,
    encode_state,
    seed_of,
)

log = logging.getLogger("pacer.brain")

__all__ = ["BrainConfig", "BrainService", "create", "namespace_quotas"]


CLUSTER = "_cluster"  # the lease brain._cluster: its holder runs the cluster rounds
BACKLOG = 64  # effects of events kept per job owned elsewhere, for when this instance takes it over

# The durable consumer's events, in stream order.  Named "brain-events": the consumer "brain" of earlier
# versions followed job ends only, and an existing durable keeps the filters it was created with.
EVENT_FILTERS = [
    subjects.events_of("job", kind=JobState.COMPLETED.value),
    subjects.events_of("job", kind=JobState.FAILED.value),
    subjects.events_of(subjects.EXECUTOR_SERVICE, kind="applied"),
    subjects.events_of("node", kind=NodeEventKind.CREATED),
    subjects.events_of("node", kind=NodeEventKind.RUNNING),
    subjects.events_of("node", kind=NodeEventKind.DIED),
]


class _InstanceConsumer(DurableConsumer):
    """The brain's durable consumer, one per instance, deleted by the server ``inactive_s`` after its instance is gone."""

    def __init__(self, *args: Any, inactive_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inactive_s = inactive_s

    async def bind(self) -> JetStreamContext.PullSubscription:
        return await self.bus.js.pull_subscribe(
            "", durable=self.durable, stream=subjects.EVENTS_STREAM,
            config=ConsumerConfig(durable_name=self.durable, ack_policy=AckPolicy.EXPLICIT,
                                  deliver_policy=self.deliver, ack_wait=self.ack_wait_s, max_deliver=-1,
                                  filter_subjects=list(self.filters), inactive_threshold=self.inactive_s))


Effect = Callable[[], Awaitable[None]]


class BrainService:
    name = subjects.BRAIN_SERVICE

    def __init__(self, bus: Bus, durable: str | None = None, oom: OomConfig = DEFAULT_OOM,
                 oom_cooldown_s: float = 300.0, config: BrainConfig | None = None) -> None:
        self.bus = bus
        self.counters = Counters(self.name)
        self.store = BrainStore(bus)
        self.config = config or BrainConfig()
        self.oom, self.oom_cooldown_s = oom, oom_cooldown_s
        self.own = Ownership(bus, self.name, self._acquired, self._lost, instance=self.config.instance,
                             ttl_s=self.config.lease_ttl_s,  # balance: never the rounds nor jobs that follow them
                             movable=lambda job: job != CLUSTER and self.capacity() is None)
        self.history: dict[str, JobHistory] = {}  # the config DB (a cache of its KV, read again when used)
        self.running: dict[str, RunningJob] = {}  # what the executor runs, from its events (every job)
        self.memory: dict[str, MemoryWatch] = {}  # OOM prevention of the jobs not autoscaled (every job: standby)
        # Only for the jobs this instance owns (dropped when it loses one): one object per job.
        self.jobs: dict[str, JobInMemory] = {}
        self.backlog: dict[str, deque[tuple[int, Effect]]] = {}  # effects of events of jobs owned elsewhere
        self.cluster: ClusterStatus | None = None  # the executor's latest (valid) ClusterStatus
        self.machines: list[MachineInfo] = []  # its machines, minus what plans placed since
        self.latest: dict[str, JobStatistics] = {}  # cluster mode: each job's newest window not yet fed
        self.locks = JobLocks()  # each job's autoscaler's (module docstring); never held across a network call
        self.round_due = asyncio.Event()
        self.rpc = handlers.rpc(self)
        # local_ok: with no owner to be found or claimed (the lease bucket unreachable), the first plan is
        # still answered here (it needs only the config DB); the job is then autoscaled from its record by
        # whichever instance claims it at its first window.  The cluster's and every job's (_all) requests
        # are answered by any instance.
        self.router = Router(bus, self.own, self.counters, self.rpc, local_ok=True,
                             local_jobs=(subjects.ALL_JOBS, CLUSTER), before=self._claim_first)
        self.consumer = _InstanceConsumer(
            bus, self.name, durable or f"brain-events-{self.own.instance}", EVENT_FILTERS, handlers.events(self),
            self.counters, inactive_s=self.config.inactive_s)
        self._subs: list[Subscription] = []

    def _job(self, job: str) -> JobInMemory:
        """The in-memory state of a job we own (made empty on first use)."""
        rt = self.jobs.get(job)
        if rt is None:
            rt = self.jobs[job] = JobInMemory()
        return rt

    @property
    def autoscalers(self) -> dict[str, JobAutoscaler]:
        """The running zero-config jobs we own and their autoscalers (a view: read only)."""
        return {job: rt.autoscaler for job, rt in self.jobs.items() if rt.autoscaler is not None}

    @property
    def oom_plans(self) -> dict[str, ResourcePlan]:
        """OOM-prevention plans published and not yet applied, per job we own (a view: read only)."""
        return {job: rt.oom_plan for job, rt in self.jobs.items() if rt.oom_plan is not None}

    # ---------------------------------------------------------------- lifecycle
    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.bus.ensure_streams()
        await self.store.open()
        await self.load_history()
        self.running = await self.store.running()
        await self.own.start(tg, on_forwarded=self.router.on_forwarded)
        # The cluster rounds' lease: whoever holds it runs them (and owns the autoscaled jobs while the
        # capacity is known).  Waited for briefly, so that a lone instance holds it before its first window.
        await self.own.claim(CLUSTER, within=2.0)
        nc = self.bus.nc

        async def on_statistics(msg: Msg) -> None:
            await handlers.on_statistics(self, msg)

        async def on_cluster_status(msg: Msg) -> None:
            await handlers.on_cluster_status(self, msg)

        # Statistics and ClusterStatus without a queue group: every instance hears every job (the owner acts,
        # the others keep their memory watches warm); requests in a queue group, routed to the job's owner.
        self._subs = [
            await nc.subscribe(subjects.rpc_wildcard(self.name), queue=self.name, cb=self.router.on_rpc),
            await nc.subscribe(subjects.events_of(subjects.MONITOR_SERVICE, kind="statistics"),
                               cb=tracing.traced("consume brain.statistics", on_statistics)),
            await nc.subscribe(subjects.cluster_status(),
                               cb=tracing.traced("consume brain.cluster_status", on_cluster_status)),
        ]
        await nc.flush()
        tg.create_task(self.consumer.run(), name="pacer:brain:events")
        tg.create_task(guard("cluster-rounds", self._round_loop), name="pacer:brain:rounds")
        log.info("brain ready", extra={"fields": {"history": len(self.history), "running": len(self.running),
                                                  "instance": self.own.instance}})

    async def drain(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        await self.consumer.stop()
        await self.own.close()  # hand the jobs over at once (their state is saved after every change)

    async def load_history(self) -> None:
        """The config DB from its KV (the other instances record jobs too)."""
        for key, value in (await self.store.history()).items():
            try:
                self.history[key] = JobHistory.from_dict(json.loads(value))
            except (ValueError, KeyError, TypeError):
                self.counters.inc("bad_records")
                log.error("unreadable config DB record %s; ignored", key)

    async def _claim_first(self, job: str) -> None:
        """A job nobody owns yet (or that is being loaded here) is claimed here first: its request is
        answered by its owner, not without one."""
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            if await self.own.owner_of(job) in (None, self.own.instance):
                await self.own.claim(job, within=max(2.0, self.config.lease_ttl_s))

    # ---------------------------------------------------------------- ownership (issue 13)
    async def _acquired(self, job: str, lease: Lease) -> None:
        """We own ``job`` now: its state from beside the lease, its outbox published, the effects of the
        events we saw while another instance owned it applied."""
        if job == CLUSTER:
            log.info("cluster rounds are ours", extra={"fields": {"instance": self.own.instance}})
            return
        rec = await self.store.running_of(job)
        if rec is not None:
            self.running[job] = rec
        data = await self.own.get_state(job)
        st = OwnedJob()
        if data:
            try:
                st = decode_state(data)
            except ValueError:
                self.counters.inc("bad_state")
                log.warning("unreadable brain state; the job starts afresh", extra={"fields": {"job": job}})
        rt = self._job(job)
        rt.seq, rt.published, rt.oom_plan, rt.oom_at = st.seq, st.published, st.oom_plan, st.oom_at
        if st.auto is not None:
            seed = st.auto
            auto = self.config.autoscaler(seed.spec, seed.first, warm=seed.warm, prior=seed.prior,
                                          prior_calibration=seed.prior_calibration, namespace=seed.namespace)
            try:
                await asyncio.to_thread(load_autoscaler_state, auto, seed.state)
                self.adopt(job, auto)
                self.counters.inc("autoscalers_handed_over")
            except (ValueError, KeyError, TypeError, PacerError):
                self.counters.inc("bad_state")
                log.warning("unreadable autoscaler state; resumed from the record", extra={"fields": {"job": job}})
        if st.outbox:  # the last owner's: published again under the same ids (stored once)
            rt.unsent = list(st.outbox)
            await self.flush(job)
        # Effects of events the last owner may not have applied (we saw them as a standby), until none is
        # left after the save: no await between that check and owns() turning true (module docstring).
        while True:
            backlog = self.backlog.pop(job, deque())
            while backlog:
                seq, effect = backlog.popleft()
                if seq > rt.seq:
                    rt.seq = seq  # first, as in effect()
                    await effect()
                backlog.extend(self.backlog.pop(job, ()))  # arrived meanwhile
            if not await self.save(job):
                raise LeaseLost(f"{job}: the lease moved on while the job was loaded")
            if not self.backlog.get(job):
                break
        self.counters.inc("jobs_acquired")

    async def _lost(self, job: str) -> None:
        """Another instance owns ``job`` now (or we stop): its decisions are no longer ours to make."""
        if job == CLUSTER:
            return
        self.jobs.pop(job, None)
        self.latest.pop(job, None)
        self.counters.inc("jobs_lost")

    def _drop_decisions(self, job: str) -> None:
        """What only the job's owner holds to decide for it: its autoscaler, OOM plans, unsent plans, last window."""
        rt = self.jobs.get(job)
        if rt is not None:
            rt.drop_decisions()
        self.latest.pop(job, None)

    def state_of(self, job: str, outbox: list[Outgoing] | None = None) -> OwnedJob:
        rt = self.jobs.get(job) or JobInMemory()
        auto = rt.autoscaler
        return OwnedJob(seq=rt.seq, oom_plan=rt.oom_plan, oom_at=rt.oom_at, published=rt.published,
                        outbox=[*rt.unsent, *(outbox or ())], auto=seed_of(auto) if auto is not None else None)

    async def save(self, job: str, outbox: list[Outgoing] | None = None) -> bool:
        """Write the job's state through our lease; False (counted) if refused or not stored."""
        async with self.locks.hold(job):  # the autoscaler may be stepping in a worker thread: read it between steps
            data = encode_state(self.state_of(job, outbox))
        try:
            await self.own.put_state(job, data)
            return True
        except LeaseLost:
            self.counters.inc("fenced")
            log.warning("state write refused: the job has another owner", extra={"fields": {"job": job}})
        except (nats.errors.Error, TimeoutError) as exc:
            self.counters.inc("errors", op="state")
            log.warning("state not stored: %s", exc, extra={"fields": {"job": job}})
        return False

    async def effect(self, job: str, seq: int, fn: Effect) -> None:
        """Apply the effect of the event at ``seq`` on ``job`` if we own it and no owner applied it yet;
        as a standby, keep it for when we acquire the job."""
        if self.own.owns(job):
            rt = self._job(job)
            if seq <= rt.seq:
                return
            rt.seq = seq  # first: an effect cut short is not applied twice (its plan is in the outbox)
            await fn()
            await self.save(job)
            return
        self.backlog.setdefault(job, deque(maxlen=BACKLOG)).append((seq, fn))

    def held_elsewhere(self, job: str) -> bool:
        """Whether we compete for ``job`` and have seen another instance hold it (our lease loop takes it over
        if that one dies)."""
        st = self.own.jobs.get(job)
        return st is not None and st.attempted.is_set() and not self.own.owns(job)

    async def take(self, job: str, autoscaled: bool) -> bool:
        """Whether we act for ``job`` (a running job's window came): we own it, or claimed it now.  While the
        capacity is shared (cluster rounds), an autoscaled job is the cluster-round holder's."""
        rounds = autoscaled and self.capacity() is not None
        if self.own.owns(job):
            if rounds and not self.own.owns(CLUSTER):
                await self.own.drop(job)  # to the rounds' holder (its state is saved): it claims it next window
                self.counters.inc("jobs_handed_to_rounds")
                return False
            return True
        if self.held_elsewhere(job):
            return False
        if rounds and not self.own.owns(CLUSTER):
            # Not ours to plan; but stand by for it once the holder has it, so that if the holder dies the
            # job moves with the rounds (both leases expire together) rather than a TTL after them.
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                holder = await self.own.owner_of(job)
                if holder is not None and holder != self.own.instance:
                    self.own.want(job)
            return False
        return await self.own.claim(job, within=2.0)

    # ---------------------------------------------------------------- the jobs it follows
    def adopt(self, job: str, auto: JobAutoscaler) -> None:
        """``job`` is re-planned by ``auto`` from now on (its first plan was just given)."""
        rt = self._job(job)
        rt.autoscaler, rt.not_autoscaled = auto, False

    def forget(self, job: str) -> None:
        """``job`` ended: nothing of it stays in memory but its config DB record."""
        self.running.pop(job, None)
        self.memory.pop(job, None)
        self.backlog.pop(job, None)
        self._drop_decisions(job)

    def in_force(self, job: str) -> ResourcePlan | None:
        """The plan the executor last applied for ``job`` (from its events), if any."""
        rec = self.running.get(job)
        return rec.plan if rec is not None else None

    async def is_autoscaled(self, job: str) -> tuple[bool, JobRecord | None]:
        """Whether ``job`` runs and is the brain's to re-plan (a zero-config job); and its record."""
        rt = self.jobs.get(job)
        if rt is not None and rt.autoscaler is not None:
            return True, None
        if not self.config.autoscale or (rt is not None and rt.not_autoscaled):
            return False, None
        rec = await self.store.job(job)
        ours = (rec is not None and rec.state is JobState.RUNNING and rec.spec.resources is None
                and rec.spec.policies.optimizer == subjects.BRAIN_SERVICE)
        return ours, rec

    async def autoscaler_of(self, job: str) -> JobAutoscaler | None:
        """The job's autoscaler (we own the job); without a saved one, rebuilt for a running zero-config
        job from its record and the plan in force, in the adjust stage."""
        rt = self._job(job)
        if rt.autoscaler is not None or not self.config.autoscale or rt.not_autoscaled:
            return rt.autoscaler
        ours, rec = await self.is_autoscaled(job)
        rt = self._job(job)  # (again: dropped and made afresh if the job changed hands meanwhile)
        if not ours:
            rt.not_autoscaled = True
        plan = self.in_force(job)
        if rec is None or not ours or plan is None or rt.autoscaler is not None:
            return rt.autoscaler
        auto = self.config.autoscaler(rec.spec, plan, warm=True,  # measured afresh, in the adjust stage
                                      namespace=rec.namespace)
        auto.applied(plan, 0.0)
        rt.autoscaler = auto
        self.counters.inc("autoscalers_resumed")
        return auto

    async def applied(self, job: str, plan: ResourcePlan, ts: float, overhead_s: float) -> None:
        """The executor applied ``plan``: the job's autoscaler learns it and the pause it cost (Eq. 8)."""
        rt = self.jobs.get(job)
        if rt is not None:
            rt.oom_plan = None
        auto = rt.autoscaler if rt is not None else None
        if auto is None:
            return
        async with self.locks.hold(job):
            kind = ScalingKind.between(auto.plan, plan)
            if auto.plan is not None and kind is not ScalingKind.NONE:
                auto.paused(ScalingRecord(kind, max(0.0, overhead_s)))  # DLRover-RM Eq. 8: from history
            auto.applied(plan, ts)

    # ---------------------------------------------------------------- decisions
    async def autoscale(self, auto: JobAutoscaler, stats: JobStatistics) -> Decision | None:
        """Feed one window to a job's autoscaler, within its own quota; publish its re-plan, if any."""
        async with self.locks.hold(stats.job):
            before = auto.plan
            d = await asyncio.to_thread(auto.step, stats.ts, stats)  # NSGA-II: not on the event loop
        if d is None or before is None or same_resources(d.plan, before):
            await self.save(stats.job)  # what the window taught it
            return None
        await self.publish_decision(auto, stats.job, stats.ts, before, d)
        return d

    async def sample_oom(self, ev: NodeEvent) -> None:
        """An OOM while a zero-config job samples: DLRover 2023 §4.2's answer as the job's next plan.

        The executor has relaunched the node with twice its memory already
        (its own rule); the sample stage's plan makes that the plan (a
        worker's memory doubled) or doubles the PS so that the partitioned
        model gets twice the memory (:func:`.core.stages.on_sample_oom`).
        After the sample stage the executor's relaunch and the OOM
        prediction are the answer.
        """
        auto = self.autoscalers.get(ev.job)
        if auto is None or auto.stage is not Stage.SAMPLE or auto.plan is None:
            return
        async with self.locks.hold(ev.job):
            before = auto.plan
            plan = auto.on_oom(ev.role or ev.node.rsplit("-", 1)[0])
            d = auto.decisions[-1] if plan is not None and auto.decisions else None
        if d is not None and not same_resources(d.plan, before):
            await self.publish_decision(auto, ev.job, ev.ts, before, d)

    def standby(self, stats: JobStatistics) -> None:
        """A window of a job another instance owns: only the memory trend is kept (hot standby)."""
        self.memory.setdefault(stats.job, MemoryWatch(self.oom)).feed(stats)

    async def prevent_oom(self, stats: JobStatistics) -> ResourcePlan | None:
        """Feed one window; publish (and return) a plan with more memory if an OOM is coming."""
        job = stats.job
        watch = self.memory.setdefault(job, MemoryWatch(self.oom))
        rt = self._job(job)
        plan = rt.oom_plan or self.in_force(job)
        raised = prevention_plan(watch, stats, plan, last_at=rt.oom_at, cooldown_s=self.oom_cooldown_s)
        if raised is None:
            return None
        new_plan = await self.placed(replace(raised, source=PlanSource.BRAIN))
        rt = self._job(job)
        old_plan, old_at = rt.oom_plan, rt.oom_at
        rt.oom_plan, rt.oom_at = new_plan, stats.ts
        if not await self.send(job, plan=new_plan):  # nothing published: as if not decided
            rt.oom_plan, rt.oom_at = old_plan, old_at
            return None
        self.counters.inc("oom_plans")
        log.info("OOM prevention plan", extra={"fields": {"job": job, "reason": new_plan.reason}})
        return new_plan

    async def publish_decision(self, auto: JobAutoscaler, job: str, ts: float, before: ResourcePlan,
                               d: Decision) -> ResourcePlan | None:
        """The re-plan as a plan event (placed, if machines are known) and a BrainDecision saying why;
        None if our lease was lost first (nothing published: the new owner decides)."""
        measured = auto.measured.get((before.workers, before.ps, before.worker_cpu, before.ps_cpu))
        plan = await self.placed(replace(d.plan, job=job, source=PlanSource.BRAIN))
        decision = BrainDecision(job, ts, d.stage, d.rule, plan, before,
                                 measured.throughput if measured is not None else 0.0, d.predicted_throughput)
        if not await self.send(job, plan=plan, decision=decision):
            async with self.locks.hold(job):
                auto.withdraw(d)  # not carried out: decided again later (or by the job's new owner)
            return None
        self.counters.inc("replans", rule=d.rule.value)
        log.info("re-plan", extra={"fields": {"job": job, "rule": d.rule.value, "reason": plan.reason}})
        return plan

    async def send(self, job: str, plan: ResourcePlan, decision: BrainDecision | None = None) -> bool:
        """Save the state with the plan (and decision) as its outbox, fenced; publish them under message ids
        that a later owner would use too; clear the outbox.  False: refused (a stale owner), nothing published."""
        n = self._job(job).published + 1
        base = f"brain-{job}-{n}"
        outbox = [Outgoing(f"{base}-plan", plan=plan)]
        if decision is not None:
            outbox.append(Outgoing(f"{base}-decision", decision=decision))
        if not await self.save(job, outbox):
            return False
        rt = self._job(job)
        rt.published = n
        rt.unsent.extend(outbox)
        await self.flush(job)
        return True

    async def flush(self, job: str) -> None:
        """Publish what the job's outbox holds (saved, not yet acknowledged by the stream), under its ids; what
        fails stays there for the next try (the next window) or the next owner."""
        rt = self.jobs.get(job)
        pending = rt.unsent if rt is not None else None
        if not pending:
            return
        try:
            while pending:
                out = pending[0]
                if out.plan is not None:
                    await self.store.publish_plan(out.plan, out.msg_id)
                if out.decision is not None:
                    await self.store.publish_decision(out.decision, out.msg_id)
                pending.pop(0)
        except (PacerError, nats.errors.Error, TimeoutError) as exc:
            self.counters.inc("errors", op="publish")
            log.warning("plan not published yet: %s", exc, extra={"fields": {"job": job}})
            return
        await self.save(job)  # the outbox is empty

    # ---------------------------------------------------------------- the cluster: rounds and placement
    def _fresh_cluster(self) -> ClusterStatus | None:
        """The latest ClusterStatus unless it is too old to describe the cluster (the executor is gone?)."""
        cs = self.cluster
        if cs is None or time.time() - cs.ts > self.config.cluster_status_ttl_s:
            return None
        return cs

    def _held(self) -> Resources:
        """What the autoscaled jobs' plans in force hold together."""
        return sum((plan_resources(a.plan) for a in self.autoscalers.values()), Resources())

    def namespace_free(self) -> dict[str, Resources]:
        """Per namespace with a CPU quota (``namespace_cpu``), what it has left after what its autoscaled
        jobs' plans in force hold (memory is not bounded per team)."""
        held: dict[str, float] = {}
        for a in self.autoscalers.values():
            held[a.namespace] = held.get(a.namespace, 0.0) + plan_resources(a.plan).cpu
        return {ns: Resources(cpu - held.get(ns, 0.0), math.inf) for ns, cpu in self.config.namespace_cpu.items()}

    def capacity(self) -> Resources | None:
        """S of DLRover-RM Eq. 13 for the autoscaled jobs together; None: unknown (plan each job alone).
        Unknown with teams' quotas (``namespace_cpu``): unbounded, so that the jobs are planned together, in
        cluster rounds that keep each team within its quota."""
        s = cluster_capacity(self._fresh_cluster(), self._held(), cpu=self.config.cluster_cpu,
                             memory_mb=self.config.cluster_memory_mb)
        if s is None and self.config.namespace_cpu:
            return Resources(math.inf, math.inf)
        return s

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
            await self.round_due.wait()
            await asyncio.sleep(self.config.round_delay_s)  # the rest of the monitor's burst
            self.round_due.clear()
            try:
                await self.cluster_round()
            except PacerError as exc:  # a publish that failed: the next round decides afresh
                self.counters.inc("round_errors", code=exc.code)
                log.warning("cluster round failed: %s", exc)
            except Exception:  # the loop's boundary: the next burst of windows starts a new round
                self.counters.inc("internal_errors", op="round")
                log.exception("cluster round failed")

    async def cluster_round(self) -> dict[str, ResourcePlan]:
        """One DLRover-RM §4.3 round (:func:`.core.round.cluster_round`) over the autoscaled jobs with a
        new window; its decisions are published like the per-job path's, in the round's order.  Should
        the capacity have become unknown meanwhile, the windows go through the per-job path instead.
        The live brain has no admission queue (a job's first plan is answered at submission), so the
        round gets no waiting jobs."""
        batch, self.latest = self.latest, {}
        ready = {job: (self.autoscalers[job], stats) for job, stats in sorted(batch.items())
                 if job in self.autoscalers and self.autoscalers[job].plan is not None and self.own.owns(job)}
        if not ready:
            return {}
        capacity = self.capacity()
        if capacity is None:
            for auto, stats in ready.values():
                await self.autoscale(auto, stats)
            return {}
        cfg = self.config.autoscale_config
        now = max(stats.ts for _, stats in ready.values())  # one burst: its windows are a moment apart
        async with self.locks.hold(*ready):
            before = {job: auto.plan for job, (auto, _) in ready.items() if auto.plan is not None}
            outcome = await asyncio.to_thread(
                cluster_round, [ReadyJob(auto, stats) for auto, stats in ready.values()],
                capacity - self._held(), now, prices=cfg.prices, rho=cfg.rho, namespace_free=self.namespace_free())
        out: dict[str, ResourcePlan] = {}
        for job, d in outcome.decisions.items():
            if job in before and not same_resources(d.plan, before[job]):
                auto, stats = ready[job]
                plan = await self.publish_decision(auto, job, stats.ts, before[job], d)
                if plan is not None:
                    out[job] = plan
        for job in ready:
            if job not in out and job in self.autoscalers:
                await self.save(job)  # what the window taught its autoscaler
        self.counters.inc("cluster_rounds")
        self.counters.inc("cluster_round_jobs", len(ready))
        return out


async def create(bus: Bus, rc: RuntimeConfig) -> BrainService:
    """App factory."""
    return BrainService(bus, config=BrainConfig.from_env())
