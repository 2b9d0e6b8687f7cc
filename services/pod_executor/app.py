"""The pod-executor service: plans and node commands in, pods and node events out.

Inputs
------
* ``pacer.events.job.<job>.plan`` (a ResourcePlan) and the job's terminal
  lifecycle events (``completed``, ``stopped``, ``failed``), read with a
  durable consumer: a plan published while the executor was down is applied
  when it comes back;
* ``pacer.rpc.executor.<job>.<op>``: ``command`` (restart / migrate / stop a
  node), ``status``, ``logs``, ``teardown``;
* the backend's pod status changes (:meth:`Backend.watch`).

Outputs
-------
* ``pacer.events.node.<job>.<kind>`` NodeEvents: ``created`` (pending),
  ``running`` (with the pending time), ``died`` (classified reason, whether
  a relaunch follows: the shard service puts the node's shards back),
  ``finished`` (with the chief's result);
* ``pacer.events.executor.<job>.<kind>``: ``applied`` (every node of the
  plan running, with the overhead paid), ``failed`` (an unretryable error:
  the job service fails the job), ``torn_down`` (no pod of the job is left).

Layout
------
Every decision is the pure :mod:`.core`'s: what a plan starts, stops,
replaces and migrates (:func:`.core.plan_change`), what follows an exit
(:func:`.core.answer_exit`: AntDT §V-D retryable vs unretryable, DLRover's
x2 memory after an OOM, a relaunch budget per node), the rolling
replacement's batches (:func:`.core.resize_batch`), the PS migration's
phases (:func:`.core.migration_step`) and a node's legal state changes
(:data:`.core.TRANSITIONS`), and every change of a job's record
(:mod:`.core.record`).  :mod:`.applier` applies them (KV record, pods,
events); :mod:`.handlers` answers requests, :mod:`.moves` runs rolling
replacements and PS migrations, :mod:`.reconciling` the reconcile pass;
this module wires inputs to them; :mod:`.backends` are where pods run.

A plan that changes the PS (count, CPU, memory) moves them by a seamless
migration (DLRover-RM §5.2, :func:`.moves.start_migration`).  A
plan that changes the workers' CPU or memory replaces the running workers
of another size, a batch at a time: each gets ``intent = resize``, its pod
stops (its shards go back to TODO through its ``died`` event, reason
``resized``), a pod of the new size takes the slot, and the next batch
starts once the replacements run.  ``applied`` comes when the last one runs.

Concurrency
-----------
One worker task per job (:class:`pacer.owned.queues.JobQueues`): a job's plans, lifecycle
events, node commands, pod status changes and reconcile passes run one at a
time in arrival order; different jobs run in parallel.  No lock is shared
across jobs, so a backend call or bus request that waits (5-10 s timeouts)
holds up only its own job.  A job event is acked once its job's worker has
applied it (a crash redelivers it); the events of one fetched batch are
handled per job in parallel (:class:`~pacer.consumer.DurableConsumer`'s
``key``), so a slow job holds up another job's events at most until that
batch ends.  Each request runs in a task of its own, so a slow job never
delays another job's reply.  What several jobs share (the pod cache, the
orphan list) is only read or written between two awaits.

Crash safety and two instances
------------------------------
Every record write is a compare-and-set made *before* the action it
describes, a reconcile pass heals what a kill -9 interrupted, and exits are
handled once per generation; with two instances only a job's owner acts for
it, fenced by a term marker on take-over.  How, step by step:
docs/ha.md, "The pod-executor".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pacer import subjects
from pacer.agent import bucket as agent_bucket
from pacer.bus import Bus
from pacer.codec import decode
from pacer.consumer import DurableConsumer
from pacer.contracts.common import Role
from pacer.contracts.executor import (
    ClusterStatus,
    ExecutorEventKind,
    ExecutorJob,
    MachineInfo,
    MigrationPhase,
    NodePhase,
    NodeRecord,
    PodPhase,
    PodStatus,
)
from pacer.contracts.executor import ExecutorJobState as JS
from pacer.contracts.jobs import JobEvent, JobRecord, JobState, ResourcePlan
from pacer.errors import NotFound, PacerError, StaleRevision, ValidationError
from pacer.extras import require
from pacer.lease import Lease, LeaseLost
from pacer.owned.queues import JobQueues
from pacer.owned.router import Router, Work
from pacer.ownership import Ownership
from pacer.runtime import RuntimeConfig, guard
from pacer.subjects import JobEventKind, NodeEventKind
from pacer.telemetry import Counters
from pacer.trainer.cluster import ClusterDesc
from pacer_services.pod_executor import core, handlers, launch, moves, reconciling
from pacer_services.pod_executor.applier import Effects, NotOwner, PodBuilder
from pacer_services.pod_executor.backends import Backend
from pacer_services.pod_executor.config import ExecutorConfig, bus_url
from pacer_services.pod_executor.core import record
from pacer_services.pod_executor.core.record import move, node_view

log = logging.getLogger("pacer.executor")
T = TypeVar("T")

__all__ = ["ExecutorConfig", "ExecutorService", "PodBuilder", "create", "make_backend"]

# Last words of a trainer that lost its PS / connection (pacer.trainer.worker prints this).
# The trainer's last words that name a lost connection: to a PS (TensorFlow's), or to the control plane (a bus
# request that kept failing: pacer.errors.Unavailable; nats-py's closed connection).
NETWORK_MARKERS = ("TensorFlow error", "UnavailableError", "Socket closed", "Connection reset",
                   "pacer.errors.Unavailable", "ConnectionClosedError")


# A worker that exits with a lost PS within this long after a PS of its job died unasked is
# collateral damage: relaunched without spending its own budget (core.on_exit).  A PS relaunch
# (pending + TF start) and the workers' reconnect attempts fit well inside it.
PS_LOSS_WINDOW_S = 300.0


class ExecutorService:
    name = subjects.EXECUTOR_SERVICE

    def __init__(self, bus: Bus, backend: Backend, cfg: ExecutorConfig | None = None,
                 clock: Callable[[], float] = time.time, pod_builder: PodBuilder = launch.pod_spec) -> None:
        self.bus = bus
        self.backend = backend
        self.cfg = cfg or ExecutorConfig()
        self.clock = clock
        self.counters = Counters(self.name)
        self.jobs: dict[str, ExecutorJob] = {}
        self.orphans: dict[str, float] = {}  # pod -> when first seen without a job record
        self.plan_seq: dict[str, int] = {}  # job -> stream sequence of the last plan applied (owned jobs)
        self.launch = launch.LaunchConfig(bus_url(bus), self.cfg.checkpoint_root, self.cfg.checkpoint_every,
                                          agents=self.cfg.agents, stragglers=tuple(self.cfg.stragglers.items()),
                                          agent_secret=self.cfg.agent_secret,
                                          token_ttl_s=self.cfg.agent_token_ttl_s)  # wall time: the callout's
        # pod_builder: what runs in a pod (tests run small stand-in programs)
        self.io = Effects(bus, backend, self.counters, clock, pod_builder, self.launch, self.cfg.delete_grace_s)
        self.pods = self.io.pods  # newest status of every pod we know
        self.rpc = handlers.build(self)
        self.consumer = DurableConsumer(
            bus, self.name, self.cfg.durable,
            [subjects.events_of("job", kind=k) for k in
             (JobEventKind.PLAN, JobState.COMPLETED.value, JobState.STOPPED.value, JobState.FAILED.value)],
            self._on_job_event, self.counters, key=lambda m: m.subject.split(".")[3],  # by job
            retry_delay_s=self.cfg.job_event_retry_s)  # an event for the other instance goes back soon
        self.own = Ownership(bus, self.name, self._acquired, self._lost, instance=self.cfg.instance,
                             ttl_s=self.cfg.lease_ttl_s)
        self.io.may_act = self.own.owns
        self.io.fail_job = self._fail  # a FailJob effect (core.record.apply_exit)
        self.router = Router(bus, self.own, self.counters, self.rpc, check_job=handlers.check_job, unknown=self._unknown,
                             run=self._spawn)
        self.queues: JobQueues | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._rpc_sub: Subscription | None = None
        self._draining = False

    @property
    def records(self) -> dict[str, JobRecord]:
        records: dict[str, JobRecord] = self.io.records
        return records

    # ================================================================ lifecycle
    async def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        self.queues = JobQueues(lambda coro, name: tg.create_task(coro, name=name), self.counters, name="executor")
        await self.bus.ensure_streams()
        self.io.kv = await self.bus.kv(subjects.EXECUTOR_BUCKET, "Pacer pod-executor: its record of each job")
        self.io.jobs_kv = await self.bus.kv(subjects.JOB_BUCKET, "Pacer jobs: one JobRecord per job")
        # The pods' agents elect their primary in this bucket but may not make it (pacer.security).
        await agent_bucket.ensure(self.bus.js, self.bus.replicas)
        await self.own.start(tg, on_forwarded=self.router.on_forwarded)
        for st in await self.backend.list():
            self.pods[st.name] = st
        # Compete for every job of the bucket with work left; the ones we win are loaded by _acquired (a
        # job whose owner was killed is free one TTL later: not waited for here).
        known = [job for job, ej in (await self.io.load()).items() if ej.state is not JS.TORN_DOWN]
        self.io.revisions.clear()  # only an owner's revisions count (read again by _acquired)
        await asyncio.gather(*(self.own.claim(job, within=self.cfg.claim_at_start_s) for job in known))
        self._rpc_sub = await self.bus.nc.subscribe(subjects.rpc_wildcard(self.name), queue=self.name,
                                                    cb=self.router.on_rpc)
        await self.bus.nc.flush()
        tg.create_task(guard("watch", self._watch_loop), name="pacer:executor:watch")
        tg.create_task(guard("jobs", self.consumer.run), name="pacer:executor:jobs")
        tg.create_task(guard("reconcile", self._reconcile_loop), name="pacer:executor:reconcile")
        tg.create_task(guard("cluster", self._cluster_loop), name="pacer:executor:cluster")
        log.info("executor ready", extra={"fields": {"backend": self.backend.name, "jobs": len(self.jobs),
                                                      "known": len(known), "pods": len(self.pods),
                                                      "instance": self.own.instance}})

    async def drain(self) -> None:
        self._draining = True  # no more reconcile passes are queued: finish what is in hand
        if self._rpc_sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._rpc_sub.unsubscribe()
        await self.consumer.stop()
        if self.queues is not None and not await self.queues.join(self.cfg.drain_s):
            log.warning("executor stopping with work still queued (it is decided again after a restart)")
        await self.own.close()  # the other instance takes the jobs over at once

    # ================================================================ ownership
    async def _acquired(self, job: str, lease: Lease) -> None:
        """We own ``job`` now: take its record over (rewritten at the revision read, so the previous
        owner's next write is refused), then replay its pods and run a reconcile pass on its worker:
        they finish what the previous owner began (an exit it did not handle, a pod it did not create)."""
        ej = await self.io.mark(job)
        self.io.records.pop(job, None)
        state = await self.own.get_state(job)
        try:
            self.plan_seq[job] = int(json.loads(state or b"{}").get("plan_seq", 0))
        except (ValueError, AttributeError):
            self.plan_seq[job] = 0
        if ej is None:
            self.jobs.pop(job, None)
        else:
            self.jobs[job] = ej
        self.counters.inc("jobs_acquired")
        log.info("job acquired", extra={"fields": {"job": job, "instance": self.own.instance,
                                                   "token": lease.token, "record": ej is not None}})
        # Last, with no await after it: the work runs once Ownership marked the job owned.
        self._post(job, functools.partial(self._adopt, job), "adopt")

    async def _adopt(self, job: str) -> None:
        for st in [p for p in self.pods.values() if p.job == job]:
            await self._act_on_pod(st, None)
        await self._reconcile_job(job)

    async def _lost(self, job: str) -> None:
        """Stop acting for ``job`` at once: its queued work finds it not owned (``unavailable``)."""
        self.counters.inc("jobs_lost")
        self.jobs.pop(job, None)
        self.plan_seq.pop(job, None)
        self.io.revisions.pop(job, None)
        self.io.records.pop(job, None)
        for name in [n for n, st in self.pods.items() if st.job == job]:
            self.orphans.pop(name, None)

    async def _give_up(self, job: str) -> None:
        """Our write was refused and the lease names another instance: drop the job at once (on_lost),
        then compete again as a standby."""
        self.counters.inc("jobs_given_up")
        log.warning("executor record written by the job's new owner; dropping the job",
                    extra={"fields": {"job": job, "instance": self.own.instance}})
        await self.own.drop(job)
        if not self._draining:
            self.own.want(job)

    async def _still_owner(self, job: str) -> bool:
        """Whether the lease (read from KV, not our belief) still names this instance."""
        if not self.own.owns(job):
            return False
        try:
            return await self.own.owner_of(job) == self.own.instance
        except (nats.errors.Error, TimeoutError):
            return True  # cannot tell: the next compare-and-set decides

    def _queues(self) -> JobQueues:
        assert self.queues is not None, "the service is not started"
        return self.queues

    async def _in_job(self, job: str, work: Callable[[], Awaitable[T]], what: str) -> T:
        """Run ``work`` on the job's own worker (in order with the job's other work) and return its result."""
        result: T = await self._queues().run(job, functools.partial(self._decide, job, work), what)
        return result

    def _post(self, job: str, work: Callable[[], Awaitable[None]], what: str) -> None:
        """Queue ``work`` on the job's own worker; its errors are logged and counted there."""
        self._queues().post(job, functools.partial(self._decide, job, work), what)

    async def _decide(self, job: str, work: Callable[[], Awaitable[T]]) -> T:
        """``work``, decided again from a fresh read of the record if its compare-and-set write lost.

        Every piece of work looks its job up by name, so a second run decides
        from what KV holds now.  Losing twice is a temporary error: a job
        event is redelivered, a request answered with it, a reconcile pass
        comes again.  Only the job's owner works for it: otherwise, or once a
        lost write shows that another instance took the job over, the work
        stops with :class:`NotOwner` (temporary too).
        """
        self.io.guard(job)
        try:
            return await work()
        except StaleRevision:
            await self._after_conflict(job)
        try:
            return await work()
        except StaleRevision as exc:
            await self._after_conflict(job)
            raise PacerError(f"job {job!r}: its executor record keeps changing under this executor "
                             f"({exc.message})", code="conflict", temporary=True) from exc

    async def _after_conflict(self, job: str) -> None:
        if not await self._still_owner(job):
            assert self._tg is not None
            self._tg.create_task(self._give_up(job), name=f"pacer:executor:give-up:{job}")
            raise NotOwner(f"job {job!r}: another executor instance took it over; retry")
        await self._reload(job)

    async def _reload(self, job: str) -> None:
        ej = await self.io.reread(job)
        if ej is None:
            self.jobs.pop(job, None)
        else:
            self.jobs[job] = ej

    # ================================================================ plans
    async def _on_job_event(self, m: Msg) -> None:
        parts = m.subject.split(".")  # pacer.events.job.<job>.<kind>
        job, kind = parts[3], parts[4]
        if kind == JobEventKind.PLAN:
            plan = decode(ResourcePlan, m.data)
            if plan.job != job:
                raise ValidationError(f"job: plan names {plan.job!r} but the subject is for {job!r}")
            await self._owner_only(job)
            seq = _stream_seq(m)
            await self._in_job(job, lambda: self._plan_in_order(plan, seq), "plan")
            return
        ev = decode(JobEvent, m.data)
        await self._owner_only(job)
        await self._in_job(job, lambda: self._job_ended(job, ev), "job event")

    async def _plan_in_order(self, plan: ResourcePlan, seq: int | None) -> None:
        """Apply a plan unless a later one (by stream sequence) was applied already: with two instances
        an event handed back for the owner may come after the next one (saved beside the lease, fenced)."""
        job = plan.job
        if seq is not None and seq <= self.plan_seq.get(job, 0):
            self.counters.inc("plans_ignored")
            log.info("plan skipped: a later one was applied", extra={"fields": {"job": job, "seq": seq}})
            return
        await self.apply_plan(plan)
        if seq is not None:
            self.plan_seq[job] = seq
            try:
                await self.own.put_state(job, json.dumps({"plan_seq": seq}).encode())
            except LeaseLost as exc:  # applied under a lease that just moved: the new owner decides again
                raise NotOwner(f"job {job!r}: the lease moved while its plan was applied; retry") from exc

    async def _owner_only(self, job: str) -> None:
        """A job event is applied by the job's owner: claim the job if nobody owns it, else hand the
        event back (:class:`NotOwner`: the consumer naks it, ``job_event_retry_s``) for the owner."""
        if self.own.owns(job):
            return
        handlers.check_job(job)
        owner = await self.own.owner_of(job)
        if (owner is None or owner == self.own.instance) and await self.own.claim(
                job, within=max(1.0, self.cfg.lease_ttl_s / 3)):
            return
        self.own.want(job)  # a standby from now on: takes the job over if its owner dies
        self.counters.inc("job_events_passed")
        raise NotOwner(f"job {job!r} is owned by {owner or 'nobody yet'}: the event is left for its owner")

    async def _job_ended(self, job: str, ev: JobEvent) -> None:
        ej = self.jobs.get(job)
        if ej is None or ej.state in (JS.TEARING_DOWN, JS.TORN_DOWN, JS.FAILED):
            return
        if ev.state is JobState.COMPLETED:
            if ej.state.active:
                ej.state, ej.completing_since = JS.COMPLETING, self.clock()
                await self.io.save(ej)
        else:  # stopped or failed by the job service
            await self._teardown(ej, f"job {ev.state.value}: {ev.reason}")

    async def apply_plan(self, plan: ResourcePlan) -> None:
        """Make the job's nodes match ``plan`` (on the job's worker): :func:`.core.plan_change` decides."""
        _check_plan(plan)
        rec = await self.io.record(plan.job)
        if rec.state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED):
            self.counters.inc("plans_ignored")
            return  # a late plan of a finished job (e.g. replayed history)
        now = self.clock()
        ej = self.jobs.get(plan.job)
        if ej is None:
            slots = self.cfg.max_worker_slots or max(plan.workers, (rec.spec.limits.max_workers or 0)
                                                     if rec.spec.limits else 0)
            cluster = self.backend.cluster(plan.job, plan.ps, max(slots, plan.workers))
            ej = ExecutorJob(plan.job, JS.STARTING, plan, cluster.to_json(), plan_at=now)
            self.jobs[plan.job] = ej
        elif not ej.state.active:
            self.counters.inc("plans_ignored")
            return
        cluster = ClusterDesc.from_json(ej.cluster)
        workers = min(plan.workers, len(cluster.workers))
        reasons = []
        if workers < plan.workers:
            reasons.append(f"workers clamped to the job's {len(cluster.workers)} TF worker slots")
        old = ej.plan
        before = core.Plan(old.workers, len(cluster.ps), core.NodeSpec(Role.WORKER, 0, old.worker_cpu,
                                                                       old.worker_memory_mb),
                           core.NodeSpec(Role.PS, 0, old.ps_cpu, old.ps_memory_mb))
        after = core.Plan(workers, plan.ps, core.NodeSpec(Role.WORKER, 0, plan.worker_cpu, plan.worker_memory_mb),
                          core.NodeSpec(Role.PS, 0, plan.ps_cpu, plan.ps_memory_mb))
        change = core.plan_change(before, after, {n.node: node_view(n) for n in ej.nodes}, self.cfg.policy,
                                  migrating=ej.migration is not MigrationPhase.NONE)
        if change.grow:
            if await moves.grow(self, ej, change.grow):
                reasons.append(f"memory raised in place on {len(change.grow)} running node(s)")
            else:  # the backend cannot: the same plan the way that needs no in-place resize
                change = core.plan_change(before, after, {n.node: node_view(n) for n in ej.nodes},
                                          replace(self.cfg.policy, memory_in_place=False),
                                          migrating=ej.migration is not MigrationPhase.NONE)
        if change.ps_deferred:
            reasons.append("PS changes wait: a migration is under way")
        if change.resize and not change.migrate_ps:
            reasons.append(f"replacing {len(change.resize)} running worker(s) with {plan.worker_cpu:g} CPU / "
                           f"{plan.worker_memory_mb} MiB, at most "
                           f"{core.resize_batch_size(workers, self.cfg.policy)} at a time")
        await self.io.apply(ej, record.apply_change(ej, plan, change, now, "; ".join(reasons)))
        started = [f"{s.role}-{s.index}" for s in change.start]
        if change.migrate_ps:
            await moves.start_migration(self, ej, {i: (plan.ps_cpu, plan.ps_memory_mb) for i in range(plan.ps)},
                                       f"plan: {plan.ps} PS x {plan.ps_cpu:g} CPU / {plan.ps_memory_mb} MiB")
        await moves.resize_step(self, ej)
        self.counters.inc("plans_applied")
        log.info("plan applied", extra={"fields": {"job": plan.job, "workers": workers, "ps": len(cluster.ps),
                                                    "started": started, "stopped": list(change.stop),
                                                    "resizing": len(change.resize),
                                                    "migrate_ps": change.migrate_ps}})

    # ================================================================ pods
    async def _watch_loop(self) -> None:
        async for st in self.backend.watch():
            self._queues().post(st.job, functools.partial(self._on_pod, st), "pod")

    async def _on_pod(self, st: PodStatus) -> None:
        """Every instance keeps every pod's newest status; only the owner of the pod's job acts on it
        (another instance competes for the job of a live pod: a standby for its owner)."""
        prev = self.pods.get(st.name)
        self.pods[st.name] = st
        if st.phase is PodPhase.EXITED:
            self.io.stops_sent.discard(st.name)
        if not self.own.owns(st.job):
            if st.phase is not PodPhase.EXITED and not self._draining:
                with contextlib.suppress(ValidationError):
                    handlers.check_job(st.job)
                    self.own.want(st.job)
            return
        await self._decide(st.job, functools.partial(self._act_on_pod, st, prev))

    async def _act_on_pod(self, st: PodStatus, prev: PodStatus | None) -> None:
        ej = self.jobs.get(st.job)
        n = next((x for x in ej.nodes if x.node == st.node), None) if ej else None
        if ej is None or n is None:
            if st.phase is not PodPhase.EXITED and st.name not in self.orphans:
                self.orphans[st.name] = self.clock()  # deleted by reconcile if it stays unknown
                self.counters.inc("orphan_pods")
                log.warning("pod %s belongs to no known job", st.name)
            return
        if st.generation != n.generation:
            if st.phase is PodPhase.EXITED and st.name in n.deleting:
                n.deleting.remove(st.name)
                await self.io.save(ej)
            if (st.phase is PodPhase.EXITED and n.role == Role.PS and prev is not None
                    and prev.phase is not PodPhase.EXITED):
                # A PS replaced by a migration has now stopped (PS hold no shards: no requeue to fear).
                await self.io.node_event(ej.job, n, NodeEventKind.DIED, pod=st.name, generation=st.generation,
                                         exit_code=st.exit_code, reason="replaced", detail="old PS of a migration")
            return  # an older incarnation: its death was handled when it was replaced
        if st.phase is PodPhase.RUNNING and not n.running_at:
            n.running_at = st.started_at or self.clock()
            if n.state is NodePhase.PENDING:
                move(n, NodePhase.RUNNING)
            await self.io.save(ej)
            pending = max(0.0, n.running_at - (st.created_at or n.created_at))
            await self.io.node_event(ej.job, n, NodeEventKind.RUNNING, pod=st.name, pending_s=pending)
        if st.phase is PodPhase.EXITED and n.handled < st.generation:
            if prev is not None and prev.phase is not PodPhase.RUNNING and not n.running_at and st.started_at:
                n.running_at = st.started_at
            await self._on_exit(ej, n, st)

    async def _on_exit(self, ej: ExecutorJob, n: NodeRecord, st: PodStatus) -> None:
        # A stale owner (the job taken over, the record rewritten) stops here, before its died event.
        await self.io.check(ej)
        n.handled = st.generation
        by_us = st.name in n.deleting
        if by_us:
            n.deleting.remove(st.name)
        tail = ""
        if st.exit_code not in (None, 0) or (st.exit_code == 0 and n.role == Role.WORKER and n.index == 0):
            with contextlib.suppress(Exception):
                tail = await self.backend.logs(st.name, 40)
        info = core.ExitInfo(code=st.exit_code, signal=st.signal, k8s_reason=st.reason, oom=st.oom,
                             by_executor=by_us, network_error=any(k in tail for k in NETWORK_MARKERS))
        removed = n.state is NodePhase.REMOVED
        due = core.NodeSpec(n.role, n.index, n.resize_cpu, n.resize_memory_mb) if n.resize_memory_mb else None
        now = self.clock()
        if n.role == Role.PS and not by_us and st.exit_code != 0:
            ej.ps_lost_at = now  # saved with the record below, whatever the answer
        ps_lost = bool(ej.ps_lost_at) and now - ej.ps_lost_at <= PS_LOSS_WINDOW_S
        ans = core.answer_exit(node_view(n), info, intent=n.intent, removed=removed,
                               active=ej.state.active or ej.state is JS.COMPLETING, resize_to=due,
                               policy=self.cfg.policy, ps_lost=ps_lost)
        n.last_reason = ans.decision.reason.value
        self.counters.inc("exits", reason=ans.decision.reason.value)
        await self.io.apply(ej, record.apply_exit(ej, n, ans, pod=st.name, exit_code=st.exit_code,
                                                  result=launch.parse_result(tail)))

    async def _fail(self, ej: ExecutorJob, reason: str) -> None:
        log.warning("job failed", extra={"fields": {"job": ej.job, "reason": reason}})
        await self.io.executor_event(ej, ExecutorEventKind.FAILED, reason)
        await self._teardown(ej, reason, state=JS.FAILED)

    async def _teardown(self, ej: ExecutorJob, reason: str, state: JS = JS.TEARING_DOWN) -> None:
        ej.state, ej.reason = state, reason
        for n in ej.nodes:
            if n.state is not NodePhase.FINISHED:
                move(n, NodePhase.REMOVED)
        await self.io.save(ej)
        for n in ej.nodes:
            await self.io.delete(ej, n)
        for name in ej.retiring:
            await self.io.delete_pod(ej, name)
        self.counters.inc("teardowns")

    # ================================================================ reconcile
    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reconcile_s)
            await reconciling.reap_orphans(self)
            for job in self.own.owned():
                ej = self.jobs.get(job)
                if ej is None or ej.state is JS.TORN_DOWN:
                    self._maybe_release(job)
                # a pass still queued will see the newest state; a torn-down job has nothing left to do
                elif self._queues().pending(job) == 0 and not self._draining:
                    self._post(job, functools.partial(self._reconcile_job, job), "reconcile")

    def _maybe_release(self, job: str) -> None:
        """Give up the lease of an owned job with nothing left to do: no record (or torn down), no live
        pod, no work for a while (the job's worker ended).  The other instance may take it, finds the
        same, and gives it up too; a later event or live pod of the job makes both compete again."""
        if self._draining or self._queues().busy(job):
            return
        if any(p.job == job and p.phase is not PodPhase.EXITED for p in self.pods.values()):
            return
        assert self._tg is not None
        self.counters.inc("jobs_released")
        self._tg.create_task(self.own.drop(job), name=f"pacer:executor:release:{job}")

    async def _reconcile_job(self, job: str) -> None:
        ej = self.jobs.get(job)
        if ej is not None and ej.state is not JS.TORN_DOWN:  # a torn-down job has nothing left to do
            await reconciling.reconcile(self, ej)

    # ================================================================ cluster
    def cluster_status(self, machines: Sequence[MachineInfo] = ()) -> ClusterStatus:
        """The backend's queue and free capacity now (:func:`.core.cluster_status`)."""
        status: ClusterStatus = core.cluster_status(self.clock(), self.backend.name, self.pods.values(),
                                                    self.backend.capacity(), self.backend.reserves_capacity,
                                                    machines)
        return status

    async def _cluster_loop(self) -> None:
        while True:
            machines = await self.backend.machines()  # [] when unknown: the brain then places nothing
            await self.bus.publish(subjects.cluster_status(), self.cluster_status(machines))
            await asyncio.sleep(self.cfg.cluster_every_s)

    # ================================================================ rpc
    async def _spawn(self, job: str, msg: Msg, work: Work) -> None:
        # nats-py runs one subscription's callbacks one after the other: a request that waits for its
        # job's worker must not hold up the requests of other jobs, so each runs in a task of its own.
        assert self._tg is not None
        self._tg.create_task(work(), name="pacer:executor:rpc")

    async def _unknown(self, job: str, op: str) -> bool:
        """A job nobody owns or wants and without a record is answered here (not found), unclaimed."""
        return (not self.own.wanted(job) and await self.own.owner_of(job) is None
                and await self.io.reread(job, track=False) is None)

    def _job(self, job: str) -> ExecutorJob:
        ej = self.jobs.get(job)
        if ej is None:
            raise NotFound(f"job {job!r} has no nodes on this executor")
        return ej


def _stream_seq(m: Msg) -> int | None:
    """The event's sequence in its stream (None when the message carries no JetStream metadata)."""
    try:
        return int(m.metadata.sequence.stream)
    except Exception:
        return None


def _check_plan(plan: ResourcePlan) -> None:
    problems = []
    if plan.workers < 1:
        problems.append(f"workers: must be >= 1, got {plan.workers}")
    if plan.ps < 1:
        problems.append(f"ps: must be >= 1, got {plan.ps}")
    for name in ("worker_cpu", "ps_cpu"):
        if not getattr(plan, name) > 0:
            problems.append(f"{name}: must be > 0")
    for name in ("worker_memory_mb", "ps_memory_mb"):
        if getattr(plan, name) < 64:
            problems.append(f"{name}: must be >= 64 MiB")
    if problems:
        raise ValidationError(f"plan of job {plan.job}: " + "; ".join(problems))


def make_backend(cfg: ExecutorConfig) -> Backend:
    if cfg.backend == "local":
        from pacer_services.pod_executor.backends.local import LocalBackend

        return LocalBackend(cfg.root)
    if cfg.backend == "kubernetes":
        require("k8s", "the executor's Kubernetes backend (PACER_EXECUTOR_BACKEND=kubernetes)")
        from pacer_services.pod_executor.backends.kubernetes import from_env

        return from_env(checkpoint_root=cfg.checkpoint_root)
    raise ValueError(f"PACER_EXECUTOR_BACKEND: unknown backend {cfg.backend!r} (local or kubernetes)")


async def create(bus: Bus, rc: RuntimeConfig) -> ExecutorService:
    """App factory: the only place that builds an ExecutorService from configuration."""
    cfg = ExecutorConfig.from_env()
    return ExecutorService(bus, make_backend(cfg), cfg)
