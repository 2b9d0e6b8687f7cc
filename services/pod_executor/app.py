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

What to do about an exit is decided by the pure :mod:`.core` (AntDT §V-D
retryable vs unretryable; DLRover's x2 memory after an OOM; a relaunch
budget per node).

A plan that changes the PS (count, CPU, memory) moves them by a seamless
migration (DLRover-RM §5.2, :meth:`ExecutorService.start_migration`).  A
plan that changes the workers' CPU or memory replaces the running workers
of another size, a batch at a time (:func:`.core.resize_targets`,
:func:`.core.resize_batch`): each gets ``intent = resize``, its pod stops
(its shards go back to TODO through its ``died`` event, reason
``resized``), a pod of the new size takes the slot, and the next batch
starts once the replacements run.  ``applied`` comes when the last one runs.

Crash safety
------------
The executor's record of each job (KV ``pacer-executor``) is written
*before* the action it describes: a relaunch first bumps the node's
generation and saves it, then creates the pod; a worker replacement first
saves the new size it is due and its ``resize`` intent, then stops the pod.
After a kill -9 the executor
reloads the records, lists the pods (a local pod is a supervisor process in
its own session, so it outlived the executor; on Kubernetes the pods simply
stay), and a reconcile pass every ``reconcile_s`` creates whatever pod a
record names but the backend does not have, stops again a pod whose
replacement was decided but whose stop this executor did not send, and
starts the next batch of a rolling replacement.  Exits are handled once per
generation (``NodeRecord.handled``), so the backend's replay of every pod at
watch start is harmless.

One instance per backend: two executors would both relaunch the same node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from pacer import subjects
from pacer.bus import NO_RETRY, Bus
from pacer.codec import decode, encode
from pacer.consumer import DurableConsumer
from pacer.contracts.agent import ActionKind, ActionResult, NodeCommand
from pacer.contracts.executor import (
    ClusterStatus,
    CommandKind,
    CommandResult,
    ExecutorCommand,
    ExecutorEvent,
    ExecutorEventKind,
    ExecutorJob,
    ExecutorStatus,
    JobQuery,
    LogsQuery,
    LogsReply,
    MachineInfo,
    NodeInfo,
    NodeRecord,
    PodPhase,
    PodSpec,
    PodStatus,
)
from pacer.contracts.jobs import JobEvent, JobRecord, JobState, ResourcePlan
from pacer.contracts.nodes import NodeEvent
from pacer.errors import Conflict, NotFound, PacerError, ValidationError
from pacer.runtime import RuntimeConfig, dispatch_rpc, guard
from pacer.shards.client import ShardAdmin
from pacer.subjects import ExecutorOp, JobEventKind, NodeEventKind
from pacer.telemetry import Counters
from pacer.trainer.cluster import ClusterDesc
from pacer.trainer.straggler import StragglerSpec
from pacer_services.pod_executor import core, launch
from pacer_services.pod_executor.backend import Backend

log = logging.getLogger("pacer.executor")

PodBuilder = Callable[..., PodSpec]

# Job states of the executor's record.
STARTING, RUNNING, COMPLETING, TEARING, FAILED, TORN_DOWN = (
    "starting", "running", "completing", "tearing_down", "failed", "torn_down")
ACTIVE = frozenset({STARTING, RUNNING})
RESTART = "restart"  # NodeRecord.intent: the pod is being stopped to be started again
MIGRATE = "migrate"  # NodeRecord.intent: the pod stops to move to the next cluster
RESIZE = "resize"  # NodeRecord.intent: the pod stops to be replaced with the node's resize_cpu / resize_memory_mb
STARTING_PS, DRAINING = "starting_ps", "draining"  # ExecutorJob.migration phases

# Last words of a trainer that lost its PS / connection (pacer.trainer.worker prints this).
NETWORK_MARKERS = ("TensorFlow error", "UnavailableError", "Socket closed", "Connection reset")


@dataclass
class ExecutorConfig:
    backend: str = "local"  # local | kubernetes
    root: Path = Path(".pacer/pods")  # local backend: where pod directories live
    checkpoint_root: str = ""  # where chiefs write checkpoints ("": none)
    checkpoint_every: int = 500
    durable: str = "pod-executor"
    reconcile_s: float = 1.0
    completion_grace_s: float = 300.0  # after the job completed, workers get this long to exit by themselves
    delete_grace_s: float = 10.0
    cluster_every_s: float = 5.0  # how often ClusterStatus is published
    orphan_grace_s: float = 300.0  # a pod of no known job is deleted after this long
    agents: bool = True
    max_worker_slots: int = 0  # TF worker slots per job (0: the first plan's workers, or limits.max_workers)
    stragglers: dict[str, str] = field(default_factory=dict)  # fault injection: node or "*" -> StragglerSpec JSON
    policy: core.ExecutorPolicy = field(default_factory=core.ExecutorPolicy)

    @classmethod
    def from_env(cls) -> ExecutorConfig:
        env = os.environ
        data = Path(env.get("PACER_DATA_DIR", ".pacer"))
        return cls(
            backend=env.get("PACER_EXECUTOR_BACKEND", "local"),
            root=Path(env.get("PACER_EXECUTOR_ROOT", str(data / "pods"))),
            checkpoint_root=env.get("PACER_CHECKPOINT_ROOT", str(data / "checkpoints")),
            checkpoint_every=int(env.get("PACER_CHECKPOINT_EVERY", "500")),
            stragglers=_stragglers(env.get("PACER_INJECT_STRAGGLERS", "")),
            policy=core.ExecutorPolicy(
                relaunch_budget=int(env.get("PACER_RELAUNCH_BUDGET", "3")),
                oom_memory_factor=float(env.get("PACER_OOM_MEMORY_FACTOR", "2.0")),
                resize_fraction=float(env.get("PACER_WORKER_RESIZE_FRACTION", "0.25")),
            ),
        )


class ExecutorService:
    name = subjects.EXECUTOR_SERVICE

    def __init__(self, bus: Bus, backend: Backend, cfg: ExecutorConfig | None = None,
                 clock: Callable[[], float] = time.time, pod_builder: PodBuilder = launch.pod_spec) -> None:
        self.bus = bus
        self.pod_builder = pod_builder  # what runs in a pod (tests run small stand-in programs)
        self.backend = backend
        self.cfg = cfg or ExecutorConfig()
        self.clock = clock
        self.counters = Counters(self.name)
        self.jobs: dict[str, ExecutorJob] = {}
        self.records: dict[str, JobRecord] = {}  # the job service's records, read from KV
        self.pods: dict[str, PodStatus] = {}  # newest status of every pod we know
        self.orphans: dict[str, float] = {}  # pod -> when first seen without a job record
        self.stops_sent: set[str] = set()  # pods this executor (not a crashed predecessor) asked to stop
        self.lock = asyncio.Lock()
        self.launch = launch.LaunchConfig(bus_url(bus), self.cfg.checkpoint_root, self.cfg.checkpoint_every,
                                          agents=self.cfg.agents, stragglers=tuple(self.cfg.stragglers.items()))
        self.rpc = {
            ExecutorOp.COMMAND: self._rpc_command,
            ExecutorOp.STATUS: self._rpc_status,
            ExecutorOp.LOGS: self._rpc_logs,
            ExecutorOp.TEARDOWN: self._rpc_teardown,
        }
        self.consumer = DurableConsumer(
            bus, self.name, self.cfg.durable,
            [subjects.events_of("job", kind=k) for k in
             (JobEventKind.PLAN, JobState.COMPLETED.value, JobState.STOPPED.value, JobState.FAILED.value)],
            self._on_job_event, self.counters)
        self._kv: KeyValue | None = None
        self._jobs_kv: KeyValue | None = None
        self._rpc_sub: Subscription | None = None

    # ================================================================ lifecycle
    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.bus.ensure_streams()
        self._kv = await self.bus.kv(subjects.EXECUTOR_BUCKET, "Pacer pod-executor: its record of each job")
        self._jobs_kv = await self.bus.kv(subjects.JOB_BUCKET, "Pacer jobs: one JobRecord per job")
        await self._load()
        for st in await self.backend.list():
            self.pods[st.name] = st
        self._rpc_sub = await self.bus.nc.subscribe(subjects.rpc_wildcard(self.name), queue=self.name,
                                                    cb=self._on_rpc)
        await self.bus.nc.flush()
        tg.create_task(guard("watch", self._watch_loop), name="pacer:executor:watch")
        tg.create_task(guard("jobs", self.consumer.run), name="pacer:executor:jobs")
        tg.create_task(guard("reconcile", self._reconcile_loop), name="pacer:executor:reconcile")
        tg.create_task(guard("cluster", self._cluster_loop), name="pacer:executor:cluster")
        log.info("executor ready", extra={"fields": {"backend": self.backend.name, "jobs": len(self.jobs),
                                                      "pods": len(self.pods)}})

    async def drain(self) -> None:
        if self._rpc_sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._rpc_sub.unsubscribe()
        await self.consumer.stop()
        async with self.lock:  # what is in hand is saved; pods keep running
            pass

    async def _load(self) -> None:
        for key, value in (await self.bus.kv_items(subjects.EXECUTOR_BUCKET)).items():
            try:
                self.jobs[key] = decode(ExecutorJob, value)
            except PacerError:
                self.counters.inc("bad_records")
                log.error("unreadable executor record %s; ignored", key)

    async def _save(self, job: ExecutorJob) -> None:
        assert self._kv is not None
        await self._kv.put(job.job, encode(job))

    async def _record(self, job: str) -> JobRecord:
        """The job service's record of ``job`` (cached; it never changes what the pods run)."""
        rec = self.records.get(job)
        if rec is None:
            assert self._jobs_kv is not None
            rec = await Bus.kv_get(self._jobs_kv, job, JobRecord)
            if rec is None:
                raise NotFound(f"job {job!r}: no job record (submit it through the job service)")
            self.records[job] = rec
        return rec

    # ================================================================ events out
    async def _node_event(self, job: str, n: NodeRecord, kind: str, *, reason: str = "", pod: str = "",
                          exit_code: int | None = None, pending_s: float = 0.0, relaunch: bool = False,
                          detail: str = "", result: dict[str, object] | None = None,
                          generation: int | None = None) -> None:
        gen = n.generation if generation is None else generation
        ev = NodeEvent(job=job, node=n.node, kind=kind, ts=self.clock(), reason=reason, role=n.role,
                       pod=pod or launch.pod_name(job, n.node, gen), generation=gen,
                       exit_code=exit_code, pending_s=pending_s, restarts=n.restarts + n.requested_restarts,
                       cpu=n.cpu, memory_mb=n.memory_mb, relaunch=relaunch, detail=detail,
                       result=dict(result or {}))
        await self.bus.publish_durable(subjects.node_event(job, kind), ev)
        self.counters.inc("node_events", kind=kind)

    async def _executor_event(self, job: ExecutorJob, kind: ExecutorEventKind, reason: str = "",
                              overhead_s: float = 0.0, started: list[str] | None = None,
                              stopped: list[str] | None = None) -> None:
        ev = ExecutorEvent(job.job, kind, self.clock(), reason, job.plan, overhead_s, started or [], stopped or [])
        await self.bus.publish_durable(subjects.executor_event(job.job, kind.value), ev)

    # ================================================================ plans
    async def _on_job_event(self, m: Msg) -> None:
        parts = m.subject.split(".")  # pacer.events.job.<job>.<kind>
        job, kind = parts[3], parts[4]
        async with self.lock:
            if kind == JobEventKind.PLAN:
                plan = decode(ResourcePlan, m.data)
                if plan.job != job:
                    raise ValidationError(f"job: plan names {plan.job!r} but the subject is for {job!r}")
                await self.apply_plan(plan)
                return
            ev = decode(JobEvent, m.data)
            ej = self.jobs.get(job)
            if ej is None or ej.state in (TEARING, TORN_DOWN, FAILED):
                return
            if ev.state is JobState.COMPLETED:
                if ej.state in ACTIVE:
                    ej.state, ej.completing_since = COMPLETING, self.clock()
                    await self._save(ej)
            else:  # stopped or failed by the job service
                await self._teardown(ej, f"job {ev.state.value}: {ev.reason}")

    async def apply_plan(self, plan: ResourcePlan) -> None:
        """Make the job's nodes match ``plan`` (called with the lock held)."""
        _check_plan(plan)
        rec = await self._record(plan.job)
        if rec.state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED):
            self.counters.inc("plans_ignored")
            return  # a late plan of a finished job (e.g. replayed history)
        now = self.clock()
        ej = self.jobs.get(plan.job)
        if ej is None:
            slots = self.cfg.max_worker_slots or max(plan.workers, (rec.spec.limits.max_workers or 0)
                                                     if rec.spec.limits else 0)
            cluster = self.backend.cluster(plan.job, plan.ps, max(slots, plan.workers))
            ej = ExecutorJob(plan.job, STARTING, plan, cluster.to_json(), plan_at=now)
            self.jobs[plan.job] = ej
        elif ej.state not in ACTIVE:
            self.counters.inc("plans_ignored")
            return
        cluster = ClusterDesc.from_json(ej.cluster)
        workers = min(plan.workers, len(cluster.workers))
        reason = ""
        if workers < plan.workers:
            reason = f"workers clamped to the job's {len(cluster.workers)} TF worker slots"
        ps = len(cluster.ps)
        old_plan = ej.plan
        migrate = bool(ej.nodes) and (plan.ps != ps or (plan.ps_cpu, plan.ps_memory_mb)
                                      != (old_plan.ps_cpu, old_plan.ps_memory_mb))
        if migrate and ej.migration:
            reason = (reason + "; " if reason else "") + "PS changes wait: a migration is under way"
            migrate = False
        ej.plan, ej.plan_at, ej.applied = plan, now, False
        ej.state = STARTING if ej.state == STARTING else RUNNING
        ej.reason = reason
        have = {n.node: n for n in ej.nodes}
        started: list[str] = []
        stopped: list[str] = []
        for role, count, cpu, mem in (("ps", ps, plan.ps_cpu, plan.ps_memory_mb),
                                      ("worker", workers, plan.worker_cpu, plan.worker_memory_mb)):
            for i in range(count):
                name = f"{role}-{i}"
                n = have.get(name)
                if n is None:
                    n = NodeRecord(name, role, i, cpu, mem)
                    ej.nodes.append(n)
                    started.append(name)
                elif n.removed and not n.finished:  # scaled back up: a fresh pod, nothing pending on it
                    n.removed, n.generation, n.intent = False, n.generation + 1, ""
                    n.cpu, n.memory_mb = cpu, mem
                    started.append(name)
            for n in ej.nodes:
                if n.role == role and n.index >= count and not n.removed:
                    n.removed = True
                    stopped.append(n.node)
        resized = self._queue_resize(ej, plan)
        if resized:
            ej.reason = (ej.reason + "; " if ej.reason else "") + (
                f"replacing {resized} running worker(s) with {plan.worker_cpu:g} CPU / {plan.worker_memory_mb} MiB, "
                f"at most {core.resize_batch_size(workers, self.cfg.policy)} at a time")
        await self._save(ej)  # intent first: a crash from here on is healed by reconcile
        for n in ej.nodes:
            if n.node in started:
                await self._create(ej, n)
            elif n.node in stopped:
                await self._delete(ej, n)
        if migrate:
            await self.start_migration(ej, {i: (plan.ps_cpu, plan.ps_memory_mb) for i in range(plan.ps)},
                                       f"plan: {plan.ps} PS x {plan.ps_cpu:g} CPU / {plan.ps_memory_mb} MiB")
        await self._resize_step(ej)
        self.counters.inc("plans_applied")
        log.info("plan applied", extra={"fields": {"job": plan.job, "workers": workers, "ps": ps,
                                                    "started": started, "stopped": stopped,
                                                    "resizing": resized}})

    # ================================================================ rolling worker replacement
    def _queue_resize(self, ej: ExecutorJob, plan: ResourcePlan) -> int:
        """Mark every live worker whose size differs from ``plan`` with the size it is due (not saved).

        A later plan overrides what an earlier one queued; a worker scaled away
        or finished has nothing due.  Returns how many are due.
        """
        wanted = core.NodeSpec("worker", 0, plan.worker_cpu, plan.worker_memory_mb)
        live = [n for n in ej.nodes if n.role == "worker" and not n.removed and not n.finished]
        nodes = [core.Node(core.NodeSpec(n.role, n.index, n.cpu, n.memory_mb), n.restarts, n.requested_restarts,
                           oom_memory_mb=n.oom_memory_mb) for n in live]
        due = {t.index: t for t in core.resize_targets(wanted, nodes)}
        for n in ej.nodes:
            t = due.get(n.index) if n.role == "worker" and not n.removed and not n.finished else None
            n.resize_cpu, n.resize_memory_mb = (t.cpu, t.memory_mb) if t is not None else (0.0, 0)
        return len(due)

    def _worker_phase(self, ej: ExecutorJob, n: NodeRecord) -> core.WorkerPhase:
        st = self._current(ej, n)
        if st is None or st.phase is PodPhase.EXITED:
            return core.WorkerPhase.GONE
        if n.intent in (RESTART, RESIZE, MIGRATE):
            return core.WorkerPhase.STOPPING
        return core.WorkerPhase.RUNNING if n.running_at else core.WorkerPhase.PENDING

    async def _resize_step(self, ej: ExecutorJob) -> None:
        """Start the next batch of a rolling worker replacement, if one is due and there is room.

        Called with the lock held, after a plan and on every reconcile pass.
        Not while a PS migration runs: it restarts every worker anyway and
        gives each the size it is due (:meth:`_migrate_step`).
        """
        if ej.state not in ACTIVE or ej.migration:
            return
        live = [n for n in ej.nodes if n.role == "worker" and not n.removed and not n.finished]
        if not any(n.resize_memory_mb for n in live):
            return
        views = [core.ResizeView(n.index, self._worker_phase(ej, n), bool(n.resize_memory_mb) and not n.intent)
                 for n in live]
        picked = set(core.resize_batch(views, self.cfg.policy))
        batch = [n for n in live if n.index in picked]
        if not batch:
            return
        for n in batch:
            n.intent = RESIZE
        await self._save(ej)  # intent first: reconcile stops a pod whose stop a crash swallowed
        for n in batch:
            await self._delete(ej, n)
        self.counters.inc("workers_resized", len(batch))
        log.info("replacing workers with their new size", extra={"fields": {
            "job": ej.job, "nodes": [n.node for n in batch],
            "size": [(n.resize_cpu, n.resize_memory_mb) for n in batch]}})

    # ================================================================ pods
    def _current(self, ej: ExecutorJob, n: NodeRecord) -> PodStatus | None:
        return self.pods.get(launch.pod_name(ej.job, n.node, n.generation))

    def _cluster_of(self, ej: ExecutorJob, n: NodeRecord) -> ClusterDesc:
        """During a migration the new PS pods belong to the next cluster; the workers move last."""
        if ej.migration and n.role == "ps":
            return ClusterDesc.from_json(ej.next_cluster)
        return ClusterDesc.from_json(ej.cluster)

    async def _create(self, ej: ExecutorJob, n: NodeRecord) -> None:
        rec = await self._record(ej.job)
        cluster = self._cluster_of(ej, n)
        spec = self.pod_builder(rec, ej.plan, cluster, n.role, n.index, n.generation, n.cpu, n.memory_mb,
                               self.backend.pod_port(cluster, n.role, n.index), self.launch, restore=n.restore)
        n.created_at, n.running_at = self.clock(), 0.0
        await self._save(ej)
        try:
            await self.backend.create(spec)
        except Conflict:
            pass  # made before a crash: the watch reports it
        self.pods.setdefault(spec.name, PodStatus(spec.name, ej.job, n.node, n.role, n.generation,
                                                  PodPhase.PENDING, n.created_at, cpu=n.cpu,
                                                  memory_mb=n.memory_mb))
        self.counters.inc("pods_created", role=n.role)
        await self._node_event(ej.job, n, NodeEventKind.CREATED, pod=spec.name)

    async def _delete(self, ej: ExecutorJob, n: NodeRecord) -> None:
        st = self._current(ej, n)
        if st is None or st.phase is PodPhase.EXITED:
            return
        if st.name not in n.deleting:
            n.deleting.append(st.name)
            await self._save(ej)
        await self.backend.delete(st.name, self.cfg.delete_grace_s)
        self.stops_sent.add(st.name)
        self.counters.inc("pods_deleted")

    async def _watch_loop(self) -> None:
        async for st in self.backend.watch():
            async with self.lock:
                try:
                    await self._on_pod(st)
                except PacerError as exc:
                    self.counters.inc("errors", code=exc.code, op="pod")
                    log.warning("pod status not applied: %s", exc.message)

    async def _on_pod(self, st: PodStatus) -> None:
        prev = self.pods.get(st.name)
        self.pods[st.name] = st
        if st.phase is PodPhase.EXITED:
            self.stops_sent.discard(st.name)
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
                await self._save(ej)
            if (st.phase is PodPhase.EXITED and n.role == "ps" and prev is not None
                    and prev.phase is not PodPhase.EXITED):
                # A PS replaced by a migration has now stopped (PS hold no shards: no requeue to fear).
                await self._node_event(ej.job, n, NodeEventKind.DIED, pod=st.name, generation=st.generation,
                                       exit_code=st.exit_code, reason="replaced", detail="old PS of a migration")
            return  # an older incarnation: its death was handled when it was replaced
        if st.phase is PodPhase.RUNNING and not n.running_at:
            n.running_at = st.started_at or self.clock()
            await self._save(ej)
            pending = max(0.0, n.running_at - (st.created_at or n.created_at))
            await self._node_event(ej.job, n, NodeEventKind.RUNNING, pod=st.name, pending_s=pending)
        if st.phase is PodPhase.EXITED and n.handled < st.generation:
            if prev is not None and prev.phase is not PodPhase.RUNNING and not n.running_at and st.started_at:
                n.running_at = st.started_at
            await self._on_exit(ej, n, st)

    async def _on_exit(self, ej: ExecutorJob, n: NodeRecord, st: PodStatus) -> None:
        n.handled = st.generation
        by_us = st.name in n.deleting
        if by_us:
            n.deleting.remove(st.name)
        tail = ""
        if st.exit_code not in (None, 0) or (st.exit_code == 0 and n.role == "worker" and n.index == 0):
            with contextlib.suppress(Exception):
                tail = await self.backend.logs(st.name, 40)
        info = core.ExitInfo(code=st.exit_code, signal=st.signal, k8s_reason=st.reason, oom=st.oom,
                             by_executor=by_us, network_error=any(k in tail for k in NETWORK_MARKERS))
        decision = core.on_exit(core.Node(core.NodeSpec(n.role, n.index, n.cpu, n.memory_mb), n.restarts,
                                          n.requested_restarts), info, self.cfg.policy)
        n.last_reason = decision.reason.value
        self.counters.inc("exits", reason=decision.reason.value)
        if decision.reason is core.ExitReason.COMPLETED:
            n.finished = True
            await self._save(ej)
            await self._node_event(ej.job, n, NodeEventKind.FINISHED, pod=st.name, exit_code=0,
                                   reason=decision.reason.value, detail=decision.detail,
                                   result=launch.parse_result(tail))
            return
        if n.intent == MIGRATE:  # stopped to move to the new cluster: started again by the migration
            ckpt = launch.parse_result(tail).get("checkpoint")
            if n.role == "worker" and n.index == 0 and isinstance(ckpt, str) and ckpt:
                ej.checkpoint = ckpt
            await self._save(ej)
            await self._node_event(ej.job, n, NodeEventKind.DIED, pod=st.name, exit_code=st.exit_code,
                                   reason="migrating", relaunch=True, detail=decision.detail)
            return
        restart = by_us and n.intent in (RESTART, RESIZE) and not n.removed
        active = ej.state in ACTIVE or ej.state == COMPLETING
        relaunch: core.NodeSpec | None = None
        if restart:  # a restart (KILL_RESTART), migration command or replacement stopped it: start it again
            relaunch = core.NodeSpec(n.role, n.index, n.cpu, n.memory_mb)
        elif not n.removed and active and not by_us:
            relaunch = decision.relaunch
        oom = not restart and decision.reason is core.ExitReason.OOM
        reason, detail = ("restart_requested" if restart else decision.reason.value), decision.detail
        if relaunch is not None and n.resize_memory_mb:  # a replacement was due: this relaunch is it
            relaunch = core.relaunch_resized(
                relaunch, core.NodeSpec(n.role, n.index, n.resize_cpu, n.resize_memory_mb), oom)
            if n.intent == RESIZE and restart:
                reason = "resized"
            detail = f"{detail}; relaunched with {relaunch.cpu:g} CPU / {relaunch.memory_mb} MiB (plan)"
        await self._node_event(ej.job, n, NodeEventKind.DIED, pod=st.name, exit_code=st.exit_code,
                               reason=reason, relaunch=relaunch is not None, detail=detail)
        if relaunch is not None:
            if restart or decision.reason is core.ExitReason.RESTART_REQUESTED:
                n.requested_restarts += 1
            else:
                n.restarts += 1
            if oom:
                n.oom_memory_mb = max(n.oom_memory_mb, relaunch.memory_mb)
            n.intent = ""
            n.cpu, n.memory_mb = relaunch.cpu, relaunch.memory_mb
            n.resize_cpu, n.resize_memory_mb = 0.0, 0
            n.restore = (n.role == "worker" and n.index == 0 and decision.reason is core.ExitReason.NETWORK)
            n.generation += 1
            await self._create(ej, n)
            n.restore = False
            await self._save(ej)
        elif decision.fail_job and active and not n.removed and not by_us:
            await self._save(ej)
            await self._fail(ej, decision.detail)
        else:
            await self._save(ej)

    async def _fail(self, ej: ExecutorJob, reason: str) -> None:
        log.warning("job failed", extra={"fields": {"job": ej.job, "reason": reason}})
        await self._executor_event(ej, ExecutorEventKind.FAILED, reason)
        await self._teardown(ej, reason, state=FAILED)

    async def _teardown(self, ej: ExecutorJob, reason: str, state: str = TEARING) -> None:
        ej.state, ej.reason = state, reason
        for n in ej.nodes:
            n.removed = True
        await self._save(ej)
        for n in ej.nodes:
            await self._delete(ej, n)
        for name in ej.retiring:
            await self.backend.delete(name, self.cfg.delete_grace_s)
        self.counters.inc("teardowns")

    # ================================================================ reconcile
    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reconcile_s)
            async with self.lock:
                await self._reap_orphans()
                for ej in list(self.jobs.values()):
                    try:
                        await self._reconcile(ej)
                    except PacerError as exc:
                        self.counters.inc("errors", code=exc.code, op="reconcile")
                        log.warning("reconcile of %s: %s", ej.job, exc.message)

    async def _reap_orphans(self) -> None:
        """Delete pods of no known job once they stayed unknown for ``orphan_grace_s``."""
        now = self.clock()
        for name, since in list(self.orphans.items()):
            st = self.pods.get(name)
            known = st is not None and any(n.node == st.node for n in getattr(self.jobs.get(st.job), "nodes", []))
            if st is None or st.phase is PodPhase.EXITED or known:
                del self.orphans[name]
            elif now - since >= self.cfg.orphan_grace_s:
                log.warning("deleting pod %s: it belongs to no known job", name)
                await self.backend.delete(name, self.cfg.delete_grace_s)
                del self.orphans[name]

    async def _reconcile(self, ej: ExecutorJob) -> None:
        if ej.state == TORN_DOWN:
            return
        live = [n for n in ej.nodes if not n.removed and not n.finished]
        if ej.state in ACTIVE or ej.state == COMPLETING:
            for n in live:  # a pod the record names but nobody created (crash between save and create)
                if self._current(ej, n) is None and n.handled < n.generation:
                    self.counters.inc("pods_recreated")
                    if n.resize_memory_mb:  # a replacement was due: the new pod is it
                        n.cpu, n.memory_mb, n.resize_cpu, n.resize_memory_mb = n.resize_cpu, n.resize_memory_mb, 0.0, 0
                    await self._create(ej, n)
            for n in live:  # a replacement decided, but a crash swallowed the stop
                st = self._current(ej, n)
                if (n.intent == RESIZE and st is not None and st.phase is not PodPhase.EXITED
                        and st.name not in self.stops_sent):
                    self.counters.inc("stops_resent")
                    await self._delete(ej, n)
        resizing = any(n.resize_memory_mb or n.intent == RESIZE for n in live)
        if (ej.state in ACTIVE and not ej.migration and not ej.applied and not resizing and live
                and all(n.running_at for n in live)):
            ej.applied, ej.state = True, RUNNING
            await self._save(ej)
            overhead = max(n.running_at for n in live) - ej.plan_at
            await self._executor_event(ej, ExecutorEventKind.APPLIED, ej.reason, max(0.0, overhead),
                                       started=[n.node for n in live])
        if ej.migration and ej.state in ACTIVE:
            await self._migrate_step(ej)
        await self._resize_step(ej)
        workers = [n for n in ej.nodes if n.role == "worker" and not n.removed]
        if ej.state in ACTIVE | {COMPLETING} and workers and all(n.finished for n in workers):
            await self._teardown(ej, "every worker finished")
        elif ej.state == COMPLETING and self.clock() - ej.completing_since > self.cfg.completion_grace_s:
            await self._teardown(ej, f"workers still running {self.cfg.completion_grace_s:.0f}s after completion")
        if ej.state in (TEARING, FAILED):
            for n in ej.nodes:  # a delete may have been lost in a crash
                st = self._current(ej, n)
                if st is not None and st.phase is not PodPhase.EXITED and st.name not in n.deleting:
                    await self._delete(ej, n)
            if all(p.phase is PodPhase.EXITED for p in self.pods.values() if p.job == ej.job):
                try:
                    await self.backend.release(ej.job)
                except PacerError as exc:  # leftovers cost memory, not correctness: say so, go on
                    self.counters.inc("errors", code=exc.code, op="release")
                    log.warning("resources of %s not released: %s", ej.job, exc.message)
                ej.state = TORN_DOWN
                await self._save(ej)
                await self._executor_event(ej, ExecutorEventKind.TORN_DOWN, ej.reason)
                self.records.pop(ej.job, None)

    # ================================================================ PS migration
    async def start_migration(self, ej: ExecutorJob, ps: dict[int, tuple[float, int]], reason: str) -> None:
        """Move the job's PS to new resources (or a new PS count) without stopping training first.

        DLRover-RM §5.2, seamless migration: (2) the new PS pods are created
        and initialised while the old PS and workers keep training; only
        when every new PS runs does the short pause begin: (1) the chief
        checkpoints the shard state and the model (flash checkpoint, in
        shared memory) and every worker stops; (3) the shard state is
        restored to that checkpoint, the workers start again on the new
        cluster and the chief restores the model into the new PS (re-cut for
        a new PS count), and the old PS pods are stopped.  Records trained
        between the checkpoint and the stop are trained again, none is lost.
        Called with the lock held.
        """
        if ej.migration:
            raise Conflict(f"job {ej.job!r}: a PS migration is already under way ({ej.migration})")
        if not self.cfg.checkpoint_root or not self.cfg.agents:
            raise Conflict("PS migration needs checkpoints (PACER_CHECKPOINT_ROOT) and agent sidecars")
        old = ClusterDesc.from_json(ej.cluster)
        new = self.backend.cluster(ej.job, len(ps), len(old.workers))
        ej.migration, ej.next_cluster, ej.migration_at, ej.checkpoint = STARTING_PS, new.to_json(), self.clock(), ""
        ej.reason = f"migrating PS: {reason}"
        by_index = {n.index: n for n in ej.nodes if n.role == "ps"}
        for i, (cpu, mem) in sorted(ps.items()):
            n = by_index.get(i)
            if n is None:
                n = NodeRecord(f"ps-{i}", "ps", i, cpu, mem, generation=-1)
                ej.nodes.append(n)
            else:
                cur = self._current(ej, n)
                if cur is not None and cur.phase is not PodPhase.EXITED:
                    ej.retiring.append(cur.name)
                n.handled = n.generation  # the old pod's end is the migration's doing
            n.generation += 1
            n.cpu, n.memory_mb, n.removed, n.running_at = cpu, mem, False, 0.0
        for i, n in by_index.items():
            if i not in ps and not n.removed:
                cur = self._current(ej, n)
                if cur is not None and cur.phase is not PodPhase.EXITED:
                    ej.retiring.append(cur.name)
                n.removed = True
        await self._save(ej)
        for n in ej.nodes:
            if n.role == "ps" and not n.removed:
                await self._create(ej, n)
        self.counters.inc("migrations")
        log.info("PS migration started", extra={"fields": {"job": ej.job, "reason": reason}})

    async def _migrate_step(self, ej: ExecutorJob) -> None:
        ps = [n for n in ej.nodes if n.role == "ps" and not n.removed]
        workers = [n for n in ej.nodes if n.role == "worker" and not n.removed and not n.finished]
        if ej.migration == STARTING_PS:
            if not all(n.running_at for n in ps):
                return  # the old cluster keeps training meanwhile
            chief = next((n for n in workers if n.index == 0), None)
            if chief is not None:
                try:  # the chief checkpoints shard state + model, then exits (75)
                    await self.bus.request(
                        subjects.agent_command(ej.job, chief.node),
                        NodeCommand(ej.job, chief.node, ActionKind.KILL_RESTART, "PS migration",
                                    payload={"checkpoint": True}),
                        ActionResult, timeout=5.0, retry=NO_RETRY)
                except PacerError as exc:
                    self.counters.inc("migration_retries")
                    log.warning("migration of %s waits: the chief's agent did not take the checkpoint "
                                "command (%s); training goes on", ej.job, exc.message)
                    return
                chief.intent = MIGRATE
            ej.migration = DRAINING
            for n in workers:
                if n.index != 0:
                    n.intent = MIGRATE
            await self._save(ej)
            for n in workers:
                if n.index != 0:
                    await self._delete(ej, n)
            return
        if ej.migration == DRAINING:
            if any(n.intent == MIGRATE and (p := self._current(ej, n)) is not None
                   and p.phase is not PodPhase.EXITED for n in workers):
                return
            if not ej.checkpoint:
                raise Conflict(f"job {ej.job!r}: the chief stopped without a checkpoint; migration stuck")
            rec = await self._record(ej.job)
            await ShardAdmin(self.bus, timeout=10.0).restore(ej.job, rec.spec.dataset.name, ej.checkpoint)
            ej.cluster, ej.next_cluster, ej.migration = ej.next_cluster, "", ""
            ej.plan_at, ej.applied = ej.migration_at, False
            for n in workers:
                n.intent, n.generation, n.restore = "", n.generation + 1, n.index == 0
                if n.resize_memory_mb:  # a worker resize of the same plan rides on this restart
                    n.cpu, n.memory_mb, n.resize_cpu, n.resize_memory_mb = n.resize_cpu, n.resize_memory_mb, 0.0, 0
            retiring, ej.retiring = ej.retiring, []
            await self._save(ej)
            for n in workers:
                await self._create(ej, n)
                n.restore = False
            for name in retiring:
                await self.backend.delete(name, self.cfg.delete_grace_s)
            await self._save(ej)
            log.info("PS migration: workers restarted on the new cluster",
                     extra={"fields": {"job": ej.job, "checkpoint": ej.checkpoint}})

    # ================================================================ cluster
    def cluster_status(self, machines: Sequence[MachineInfo] = ()) -> ClusterStatus:
        """The backend's queue and what is left of its capacity after the limits of live pods.

        Only where limits reserve capacity (Kubernetes): locally nothing is reserved and no
        pod ever queues, so the cluster is "busy" only while pods are pending (starting).
        Where the backend lists its ``machines`` and reserves capacity, the totals are theirs
        (their free capacity counts every tenant's pods, not only ours).
        """
        live = [p for p in self.pods.values() if p.phase is not PodPhase.EXITED]
        pending = sum(1 for p in live if p.phase is PodPhase.PENDING)
        cpu, mem = self.backend.capacity()
        reserved = self.backend.reserves_capacity
        used_cpu = sum(p.cpu for p in live) if reserved else 0.0
        used_mem = sum(p.memory_mb for p in live) if reserved else 0
        free_cpu, free_mem = max(0.0, cpu - used_cpu) if cpu else 0.0, max(0, mem - used_mem) if mem else 0
        if reserved and machines:
            cpu, mem = sum(m.cpu for m in machines), sum(m.memory_mb for m in machines)
            free_cpu, free_mem = sum(m.free_cpu for m in machines), sum(m.free_memory_mb for m in machines)
        return ClusterStatus(self.clock(), self.backend.name, pending, len(live) - pending, cpu, free_cpu, mem,
                             free_mem, reserves_capacity=reserved, machines=list(machines))

    async def _cluster_loop(self) -> None:
        while True:
            machines = await self.backend.machines()  # [] when unknown: the brain then places nothing
            await self.bus.publish(subjects.cluster_status(), self.cluster_status(machines))
            await asyncio.sleep(self.cfg.cluster_every_s)

    # ================================================================ rpc
    async def _on_rpc(self, msg: Msg) -> None:
        await dispatch_rpc(self.bus, self.counters, self.rpc, msg)

    def _job(self, job: str) -> ExecutorJob:
        ej = self.jobs.get(job)
        if ej is None:
            raise NotFound(f"job {job!r} has no nodes on this executor")
        return ej

    async def _rpc_command(self, job: str, msg: Msg) -> None:
        cmd = decode(ExecutorCommand, msg.data)
        _same_job(job, cmd.job)
        async with self.lock:
            ej = self._job(job)
            n = next((x for x in ej.nodes if x.node == cmd.node), None)
            if n is None:
                raise NotFound(f"job {job!r} has no node {cmd.node!r}; nodes: {[x.node for x in ej.nodes]}")
            if cmd.command_id and cmd.command_id in ej.commands:
                await self.bus.respond(msg, CommandResult(job, n.node, cmd.command_id, True,
                                                          launch.pod_name(job, n.node, n.generation),
                                                          "already done"))
                return
            if ej.state not in ACTIVE:
                raise Conflict(f"job {job!r} is {ej.state}: no node commands")
            if n.removed or n.finished:
                raise Conflict(f"node {n.node} of job {job!r} is {'finished' if n.finished else 'stopped'}")
            st = self._current(ej, n)
            detail = ""
            if cmd.kind is CommandKind.STOP:
                n.removed = True
                detail = "stopping"
            elif cmd.kind is CommandKind.MIGRATE and n.role == "ps":
                ps = {x.index: (x.cpu, x.memory_mb) for x in ej.nodes if x.role == "ps" and not x.removed}
                ps[n.index] = (cmd.cpu if cmd.cpu is not None else n.cpu,
                               cmd.memory_mb if cmd.memory_mb is not None else n.memory_mb)
                await self.start_migration(ej, ps, f"{n.node} to {ps[n.index][0]:g} CPU / "
                                                   f"{ps[n.index][1]} MiB: {cmd.reason}")
                if cmd.command_id:
                    ej.commands = [*ej.commands[-63:], cmd.command_id]
                    await self._save(ej)
                await self.bus.respond(msg, CommandResult(job, n.node, cmd.command_id, True,
                                                          launch.pod_name(job, n.node, n.generation),
                                                          "migration started"))
                return
            else:  # RESTART, or MIGRATE of a worker: stop it, start it again (with new resources)
                if cmd.kind is CommandKind.MIGRATE:
                    n.cpu = cmd.cpu if cmd.cpu is not None else n.cpu
                    n.memory_mb = cmd.memory_mb if cmd.memory_mb is not None else n.memory_mb
                n.intent = RESTART
                detail = f"{cmd.kind.value}: {cmd.reason}".strip(": ")
            if cmd.command_id:
                ej.commands = [*ej.commands[-63:], cmd.command_id]
            await self._save(ej)
            if st is not None and st.phase is not PodPhase.EXITED:
                await self._delete(ej, n)
            elif cmd.kind is not CommandKind.STOP:  # nothing running to stop: start the next pod now
                n.intent = ""
                n.requested_restarts += 1
                n.generation += 1
                await self._create(ej, n)
            self.counters.inc("commands", kind=cmd.kind.value)
            # A restart is under way when the old pod is still stopping: its successor is the next generation.
            serving = n.generation + 1 if n.intent == RESTART else n.generation
            await self.bus.respond(msg, CommandResult(job, n.node, cmd.command_id, True,
                                                      launch.pod_name(job, n.node, serving), detail))

    def _status(self, ej: ExecutorJob) -> ExecutorStatus:
        nodes = []
        now = self.clock()
        for n in sorted(ej.nodes, key=lambda x: (x.role != "ps", x.index)):
            st = self._current(ej, n)
            phase = st.phase if st else PodPhase.EXITED
            pending = (n.running_at or now) - n.created_at if n.created_at else 0.0
            nodes.append(NodeInfo(n.node, n.role, launch.pod_name(ej.job, n.node, n.generation), phase, n.cpu,
                                  n.memory_mb, n.restarts, n.requested_restarts, n.generation,
                                  max(0.0, pending), n.last_reason))
        return ExecutorStatus(ej.job, ej.state, ej.plan, nodes, self.backend.name, ej.reason)

    async def _rpc_status(self, job: str, msg: Msg) -> None:
        q = decode(JobQuery, msg.data)
        _same_job(job, q.job)
        await self.bus.respond(msg, self._status(self._job(job)))

    async def _rpc_logs(self, job: str, msg: Msg) -> None:
        q = decode(LogsQuery, msg.data)
        _same_job(job, q.job)
        if not 1 <= q.tail <= 5000:
            raise ValidationError(f"tail: must be 1..5000, got {q.tail}")
        if q.container not in ("trainer", "agent"):
            raise ValidationError(f"container: must be trainer or agent, got {q.container!r}")
        ej = self._job(job)
        n = next((x for x in ej.nodes if x.node == q.node), None)
        if n is None:
            raise NotFound(f"job {job!r} has no node {q.node!r}; nodes: {[x.node for x in ej.nodes]}")
        pod = launch.pod_name(job, n.node, n.generation)
        text = await self.backend.logs(pod, q.tail, q.container)
        await self.bus.respond(msg, LogsReply(job, n.node, pod, text))

    async def _rpc_teardown(self, job: str, msg: Msg) -> None:
        q = decode(JobQuery, msg.data)
        _same_job(job, q.job)
        async with self.lock:
            ej = self._job(job)
            if ej.state != TORN_DOWN:
                await self._teardown(ej, "teardown requested", state=FAILED if ej.state == FAILED else TEARING)
            await self.bus.respond(msg, self._status(ej))


def _same_job(job: str, body_job: str) -> None:
    if body_job != job:
        raise ValidationError(f"job: body names {body_job!r} but the subject is for {job!r}")


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


def bus_url(bus: Bus) -> str:
    """The URL pods use to reach the bus (the executor's own, unless PACER_POD_NATS_URL says otherwise)."""
    url = os.environ.get("PACER_POD_NATS_URL", "")
    if url:
        return url
    srv = bus.nc.connected_url
    return f"nats://{srv.hostname}:{srv.port}" if srv is not None else "nats://127.0.0.1:4222"


def _stragglers(text: str) -> dict[str, str]:
    """``PACER_INJECT_STRAGGLERS``: ``{"worker-1": {"kind": "persistent", "sleep_s": 0.2}, "*": {...}}``."""
    if not text.strip():
        return {}
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("PACER_INJECT_STRAGGLERS must be a JSON map of node -> StragglerSpec fields")
    out = {}
    for node, fields in raw.items():
        sticky = bool(fields.pop("sticky", False))
        spec = json.loads(StragglerSpec(**fields).to_json())
        out[str(node)] = json.dumps({**spec, "sticky": sticky})
    return out


def make_backend(cfg: ExecutorConfig) -> Backend:
    if cfg.backend == "local":
        from pacer_services.pod_executor.local import LocalBackend

        return LocalBackend(cfg.root)
    if cfg.backend == "kubernetes":
        from pacer_services.pod_executor.kubernetes import from_env

        return from_env()
    raise ValueError(f"PACER_EXECUTOR_BACKEND: unknown backend {cfg.backend!r} (local or kubernetes)")


async def create(bus: Bus, rc: RuntimeConfig) -> ExecutorService:
    """App factory: the only place that builds an ExecutorService from configuration."""
    cfg = ExecutorConfig.from_env()
    return ExecutorService(bus, make_backend(cfg), cfg)
