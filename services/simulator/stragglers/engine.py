"""Deterministic discrete-event simulator of a parameter-server job, driving Pacer's real decision code.

What is real (imported, never copied; only cores, policies and pure libs,
never a service's IO module): the shard service's :class:`JobShards` (every
lease, progress report, DONE and node death goes through it, so
``records_duplicated`` and the DONE counts are the core's own), the monitor's
:class:`MonitorCore` (fed :class:`AgentMetrics`, heartbeats, node events,
cluster and shard information; it computes the BPT windows and straggler
kinds), the pod-executor core (``reconcile`` makes the initial nodes,
``answer_exit`` answers each KILL_RESTART and ``record.apply_exit`` books it), the controller's
:class:`ControllerCore` (the same round as the live controller: request,
review with its cool-downs and fallback, the batch-size re-send after a
relaunch, what was applied), the straggler policy (any
``decide(PolicyRequest) -> PolicyDecision``; the built-in ones from the
controller's registry) and the straggler patterns
(:class:`pacer.trainer.straggler.Pattern`, the generator of the real
trainer's injected sleep).

The model (all times are simulated seconds from 0; no wall clock anywhere):

* Nodes: ``worker-i`` and ``ps-j``.  A step of worker i takes, by AntDT Eq. 1,
  ``BPT_i = T_w + T_s + T_m`` with ``T_w = C_i * B_i / worker_speed + d_i(t)``
  (linear compute, AntDT Fig. 8; C_i the gradient accumulations of AntDT-DD,
  1 unless a policy sets them), ``T_s = max_j (ps_time_s + d_j(t))`` (the
  slowest PS, AntDT §III: max_j T_ij^s) and ``T_m = comm_s``.
* Stragglers (AntDT §VII-A4): ``d(t) = sleep_s * intensity`` while the pattern
  is on, from :class:`~pacer.trainer.straggler.Pattern` on simulated time.
  Persistent: on from ``start_s``.  Transient: time from ``start_s`` is cut
  into ``period_s`` periods; in each, one draw seeded by (scenario seed, node,
  period) with ``probability`` decides whether the node is slow for the first
  ``on_s`` seconds (a second pattern on the same node is named
  ``<node>#<n>``).  A KILL_RESTART lands the node on a healthy machine: its
  patterns end unless ``follows_restart``.
* BSP: all live workers that hold data start a step together; it ends when the
  slowest of the n - b kept workers finishes (b backup workers: the b slowest
  gradients are discarded).  A discarding worker consumed its batch as the
  real worker does; it reports the records as discarded
  (``LeaseRequest.discarded``) and the shard core serves them again, to
  another worker when one can take them (``records_reserved``);
  ``records_dropped`` counts discarded records that were not served again
  (0 unless the core lost them).
  Worker i consumes C_i * B_i records of its shard per kept step.  Because
  every delay is piecewise constant, steps are advanced in *chunks* of
  identical steps (numpy over the workers) that end at the next event (monitor
  tick, node return, PS report), the next change of any straggler pattern, or
  after ``max(k, report_span_s / step)`` steps; so a 1,000-worker job costs
  O(chunks x workers) array work, not one event per worker per step.
* ASP: each worker runs its own steps; one event per *leg* (steps until its
  shard ends, a straggler pattern changes, or a report is due).  Dynamic data
  sharding makes fast workers take more shards; JCT = when every shard is DONE.
* Data: one finite dataset of ``records`` x ``epochs``, shards of M local
  batches (local batch = B // n).  A worker holds one shard at a time and asks
  for the next when it finished it (``lease(done=[s], want=1)``); a batch that
  crosses the end of a shard continues in the next.  Progress is reported every
  ``progress_s``; after a death the shard core re-grants from the last report,
  so the work since then is recomputed (``records_recomputed``) and the core
  counts the re-granted remainder in ``records_duplicated``.  Leases never
  expire here (deaths are explicit events), so ``expire`` is not called.
* Agent reports: every k (``report_steps``) steps a worker's BPT, batch and
  speed go to the monitor as :class:`AgentMetrics` (the BPT times 1 + N(0,
  ``report_noise``): measurement noise, seeded); consecutive reports of a
  chunk are merged into one with ``steps = chunk`` (the monitor's windows are
  step-weighted, so window means are unchanged; only where inside a window a
  sample sits is coarser, by at most ``report_span_s``).  PS report their own
  BPT ``ps_time_s + d_j`` every ``report_span_s``.  At each monitor tick all up
  nodes heartbeat (an idle worker waiting for data is alive, not dead).
* Monitor ticks every ``stats_s`` (default ``interval_s``): cluster info (``busy`` -> one queued
  pod), shard status, ``statistics``; when ``min(interval_s, statistics.window_short_s)``
  has passed since the last round (the live controller's cadence: one round
  per fresh short window, at most ``PACER_CONTROLLER_EVERY_S`` apart), one controller round
  (``ControllerCore.request`` -> the policy -> ``ControllerCore.round`` ->
  execute -> ``ControllerCore.applied``); the actions apply at once (BSP:
  from the next step): ADJUST_BS sets B_i (and C_i), BACKUP_WORKERS sets b,
  ADJUST_LR only counts, KILL_RESTART stops the node now.  An ADJUST_BS costs
  nothing unless ``cluster.adjust_bs_s`` says so (BSP: every worker waits that long).
* KILL_RESTART of a worker: the executor core's ``answer_exit`` with exit code 75
  decides the relaunch and ``record.apply_exit`` books it; the shard core's ``node_died`` requeues its DOING
  shard; the monitor sees ``died`` and ``created``; the pod runs after
  ``pending_s`` (``running``; its agent heartbeats from then on, as live), the
  trainer is back after another ``init_s`` and asks for a shard (the monitor
  measures that start-up, which ``pacer-adaptive`` prices a relaunch with).  Meanwhile the
  other workers go on with their own B_i (the step's batch is smaller).  The
  relaunched worker starts, like a live pod, with the job's B / n and C = 1,
  until the controller re-sends the current batch sizes.
  KILL_RESTART of a PS (a stop-and-restart, or a seamless migration when the
  action's payload says ``migration: seamless`` or, without one, the
  cluster's ``ps_migration`` does) pauses every worker for ``pending_s + init_s`` (they
  cannot push or pull; they restart on the new cluster, so every worker is
  back at B / n, C = 1); no data is lost (the shard log and flash
  checkpoints keep the state, docs/design.md).
* Determinism: events are a heap of (time, seq, kind, payload); every random
  draw is seeded from the scenario seed.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from pacer.agent.reporting import window_overdue, window_steps
from pacer.contracts.agent import ActionKind, AgentMetrics, Heartbeat
from pacer.contracts.common import Role
from pacer.contracts.executor import ExecutorJob, ExecutorJobState, NodePhase, NodeRecord
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.policy import PolicyAction
from pacer.contracts.shards import (
    DatasetSpec,
    LeaseReply,
    LeaseRequest,
    ShardLease,
    ShardProgress,
    ShardRange,
)
from pacer.errors import PacerError
from pacer.subjects import NodeEventKind
from pacer.trainer.straggler import Pattern
from pacer_services.controller.core import ControllerConfig, ControllerCore, JobSetup, round_due
from pacer_services.controller.policies.limits import batch_floor
from pacer_services.monitor.core import MonitorConfig, MonitorCore
from pacer_services.pod_executor.core import (
    EXIT_RESTART,
    CreatePod,
    ExitInfo,
    ExitOutcome,
    Plan,
    answer_exit,
    reconcile,
)
from pacer_services.pod_executor.core.effects import PublishNodeEvent
from pacer_services.pod_executor.core.record import apply_exit, move, node_event_of, node_view
from pacer_services.shard_service.core import JobShards, Outcome, ShardState

from .policy import Policy, none_policy, resolve_policy
from .result import Result
from .scenario import Scenario

JOB = "sim"
DATASET = "train"
# A run that has not finished after this much simulated time is stuck (a bug or a policy that starves the job).
MAX_SIM_S = 1e8


class SimulationError(PacerError):
    """The simulated job cannot make progress (every worker waits on nothing)."""

    code = "simulation"


@dataclass(slots=True)
class _Injected:
    """A straggler pattern as placed in the run: on which node, and whether a relaunch left it behind."""

    pattern: Pattern
    follows_restart: bool
    cured: bool = False  # the node was relaunched onto a healthy machine

    def at(self, t: float) -> tuple[float, float]:
        return (0.0, math.inf) if self.cured else self.pattern.at(t)


def job_setup(sc: Scenario) -> JobSetup:
    """What the controller knows of the simulated job at its start (the live one reads it from the job spec):
    the batch floor of :func:`batch_floor` and each device's cap, its group's ``max_batch``."""
    c, j = sc.cluster, sc.job
    limits = {g.name: g.max_batch for g in c.device_groups if g.max_batch}
    groups = c.groups()
    return JobSetup(
        global_batch=j.global_batch, mode=j.mode, backup_workers=j.backup_workers,
        min_batch=batch_floor(j.global_batch, c.workers, j.min_batch), max_batch=j.max_batch,
        device_groups=groups, caps={w: limits[g] for w, g in groups.items() if g in limits},
        params={**({"max_batch_per_group": limits} if c.device_groups else {}), **sc.params},
    )


class Simulation:
    """One run of one scenario under one policy.  Use :func:`run`.

    ``controller`` configures the controller's guards (default: the live
    service's, :class:`ControllerConfig`); tests pass a permissive one to see
    a test policy's actions carried out unguarded.
    """

    def __init__(self, sc: Scenario, policy: Policy, method: str, controller: ControllerConfig | None = None) -> None:
        self.sc = sc
        self.policy = policy
        self.method = method
        self.controller = ControllerCore(JOB, job_setup(sc), controller, policy=method)
        self.refused = 0
        c, j = sc.cluster, sc.job
        self.n, self.m = c.workers, c.ps
        self.wnames = sc.worker_names
        self.pnames = sc.ps_names
        self.windex = {w: i for i, w in enumerate(self.wnames)}
        self.pindex = {p: i for i, p in enumerate(self.pnames)}
        self.t = 0.0
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.events = 0
        self.finished_at: float | None = None
        # ---- the real cores
        self.shards = JobShards(JOB)
        self.monitor = MonitorCore(MonitorConfig(
            window_short_s=sc.monitor.window_short_s,
            window_long_s=sc.monitor.window_long_s,
            slowness_ratio=sc.monitor.lambda_,
            window_short_min_s=sc.monitor.window_short_min_s,
            window_short_rel_error=sc.monitor.window_short_rel_error,
        ))
        plan = reconcile(Plan(workers=c.workers, ps=c.ps), {})
        # The executor's record of the job, changed only as the live executor changes it (core.record).
        self.record = ExecutorJob(JOB, ExecutorJobState.RUNNING, ResourcePlan(
            JOB, c.workers, c.ps, 1.0, 1024, 1.0, 1024, PlanSource.DEFAULT), cluster="")
        self.nodes: dict[str, NodeRecord] = {}
        for spec in plan.start:
            n = NodeRecord(f"{spec.role}-{spec.index}", spec.role, spec.index, spec.cpu, spec.memory_mb,
                           state=NodePhase.RUNNING)
            self.record.nodes.append(n)
            self.nodes[n.node] = n
        for name in self.wnames:
            # Training starts at t = 0; the pods ran init_s before (as live, where the monitor measures
            # the job's start-up from the executor's running events to the first steps).
            # They pended as long as a relaunch would: the job's own start shows the monitor the cluster's queue.
            created = -c.init_s - c.pending_s
            self.monitor.observe_node_event(NodeEvent(JOB, name, NodeEventKind.CREATED, created, role=Role.WORKER),
                                            created)
            self.monitor.observe_node_event(NodeEvent(JOB, name, NodeEventKind.RUNNING, -c.init_s, role=Role.WORKER,
                                                      pending_s=c.pending_s), -c.init_s)
        # ---- workers (numpy state; index i is worker-i)
        base, extra = divmod(j.global_batch, self.n)
        self.B = np.array([base + (1 if i < extra else 0) for i in range(self.n)], dtype=np.int64)
        self.B0 = self.B.copy()  # what a (re)launched pod starts with: the job spec's B / n
        self.C = np.ones(self.n, dtype=np.int64)
        setup = self.controller.setup
        # What a device holds and the floor (the controller's limits): a B_i past them is counted, never run
        # differently (a real device would OOM; the simulation shows how often a policy asked for it).
        self.cap = np.array([setup.limits().hi(w) for w in self.wnames], dtype=np.int64)
        self.floor = setup.limits().floor
        self.cap_violations = 0
        self.floor_violations = 0
        self.speed = np.array(c.speeds(), dtype=np.float64)  # per worker (device groups, AntDT-DD)
        self.alive = np.ones(self.n, dtype=bool)
        self.booting: set[int] = set()  # relaunched workers whose pod runs and whose trainer starts
        self.has = np.zeros(self.n, dtype=bool)
        self.sid = np.full(self.n, -1, dtype=np.int64)
        self.pos = np.zeros(self.n, dtype=np.int64)  # records of the held shard consumed (from its offset)
        self.length = np.zeros(self.n, dtype=np.int64)
        self.reported = np.zeros(self.n, dtype=np.int64)  # progress the shard core knows of
        self.last_prog = np.zeros(self.n)
        self.acc_steps = np.zeros(self.n, dtype=np.int64)
        self.acc_busy = np.zeros(self.n)
        self.acc_samples = np.zeros(self.n)
        self.samples_total = np.zeros(self.n, dtype=np.int64)
        self.local_steps = np.zeros(self.n, dtype=np.int64)
        self.backup = j.backup_workers
        self.ps_up = np.ones(self.m, dtype=bool)
        self.ps_down_until = 0.0
        self.migrating: set[str] = set()  # PS whose seamless replacement is starting
        # ---- stragglers
        self.wpat: list[list[_Injected]] = [[] for _ in range(self.n)]
        self.ppat: list[list[_Injected]] = [[] for _ in range(self.m)]
        for s in sc.stragglers:
            on = self.wpat[self.windex[s.node]] if s.side is Role.WORKER else self.ppat[self.pindex[s.node]]
            name = s.node if not on else f"{s.node}#{len(on)}"  # several patterns on one node draw apart
            on.append(_Injected(s.spec(sc.seed).on(name), s.follows_restart))
        self.wd = np.zeros(self.n)
        self.pd = np.zeros(self.m)
        self.noise_rng = np.random.default_rng([sc.seed, 0x6E6F6973])  # report noise ("nois"), its own stream
        self.next_change = -1.0  # forces a first refresh
        # ---- bookkeeping
        self.unleased = 0  # records in TODO shards (kept from the core's log records)
        self.steps = 0
        self.last_step = 0.0  # BSP: the last global step's time (what a worker's measured rate divides by)
        self.restarts = 0
        self.recomputed = 0
        self.discarded = 0  # records whose gradients a backup-worker step discarded (all reported)
        self.overshoot = np.zeros(self.n, dtype=np.int64)  # records read past a shard's new end (work stealing)
        self.cut: set[int] = set()  # workers whose shard was cut behind their position, to move on
        self.decisions = 0
        self.last_round = 0.0  # when the last controller round ran
        self.actions: Counter[str] = Counter()
        self.timeline: list[dict[str, Any]] = []
        # ASP: the in-flight leg of each worker (generation guards stale events)
        self.gen = np.zeros(self.n, dtype=np.int64)
        self.leg: dict[int, tuple[float, float, int, float]] = {}  # i -> (start, end, steps, bpt)

    # ================================================================ plumbing
    def push(self, at: float, kind: str, payload: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, payload))

    def _account(self, out: Outcome) -> None:
        """Keep ``unleased`` (records in TODO shards) from the core's own log records."""
        ds = self.shards.datasets[DATASET]
        for rec in out.records:
            op = rec[0]
            if op == "grant":
                sh = ds.shards[rec[2]]
                self.unleased -= sh.length - sh.consumed
            elif op == "lost":
                sh = ds.shards[rec[2]]
                if sh.state is ShardState.TODO:
                    self.unleased += sh.length - sh.consumed
            elif op == "epoch":
                self.unleased += ds.spec.records

    def _future_records(self) -> int:
        ds = self.shards.datasets[DATASET]
        return int(self.unleased + (ds.spec.epochs - 1 - ds.epoch) * ds.spec.records)

    def _lease(self, i: int, *, done: Sequence[int] = (), progress: Sequence[ShardProgress] = (), want: int = 0,
               discarded: Sequence[ShardRange] = ()) -> LeaseReply:
        req = LeaseRequest(job=JOB, dataset=DATASET, node=self.wnames[i], want=want,
                           held=[] if done or not self.has[i] else [int(self.sid[i])],
                           done=list(done), progress=list(progress), rate=self._rate(i), discarded=list(discarded))
        out = self.shards.lease(req, self.t)
        self._account(out)
        reply: LeaseReply = out.reply
        if reply.finished and self.finished_at is None:
            self.finished_at = self.t
        for lease in reply.shortened:  # another worker took the end of this one's shard (work stealing)
            if self.has[i] and lease.shard == self.sid[i]:
                self.length[i] = min(int(self.length[i]), lease.end - lease.offset)
                if self.pos[i] >= self.length[i]:
                    # Past the new end already: what it read beyond is trained twice (the core counts it from
                    # the progress sent with the shard's done); it moves on to its next shard.
                    self.overshoot[i] = int(self.pos[i] - self.length[i])
                    self.pos[i] = self.length[i]
                    self.cut.add(i)
        return reply

    def _finish_cut(self) -> None:
        """Workers whose shard was cut behind their position take their next shard (carrying nothing)."""
        for i in sorted(self.cut):
            self.cut.discard(i)
            if self.has[i] and self.pos[i] >= self.length[i]:
                self._get_shard(i)
                if self.sc.job.mode == "asp" and self.has[i] and i not in self.leg:
                    self._start_leg(i)

    def _rate(self, i: int) -> float:
        """The records/s worker i trains now, as its live client reports it (``LeaseRequest.rate``;
        the client measures it, here it is exact): a BSP worker's batch per global step, an ASP
        worker's batch per own step; 0 (not known) before its first step."""
        per_step = float(self.C[i] * self.B[i])
        if self.sc.job.mode == "bsp":
            return per_step / self.last_step if self.last_step > 0 else 0.0
        bpt = float(self._bpt()[i])
        return per_step / bpt if bpt > 0 and self.local_steps[i] > 0 else 0.0

    def _take(self, i: int, lease: ShardLease, carry: int = 0) -> None:
        self.has[i] = True
        self.sid[i] = lease.shard
        self.pos[i] = lease.start - lease.offset + carry
        self.reported[i] = lease.start - lease.offset
        self.length[i] = lease.end - lease.offset

    def _get_shard(self, i: int, carry: int = 0, discarded: Sequence[ShardRange] = ()) -> bool:
        """Finish the held shard (if any) and take the next; carry = records of the batch already past its end;
        ``discarded``: ranges of the finished shard whose gradients were discarded (reported with its done)."""
        while True:
            done = [int(self.sid[i])] if self.has[i] else []
            # A shard cut behind the worker: its true position, so the core counts the overlap as duplicated.
            over = [ShardProgress(done[0], int(self.length[i] + self.overshoot[i]))] if done and self.overshoot[i] else []
            self.overshoot[i] = 0
            self.has[i] = False
            reply = self._lease(i, done=done, want=1, discarded=discarded, progress=over)
            discarded = ()
            if not reply.shards:
                self.sid[i] = -1
                return False
            self._take(i, reply.shards[0], carry)
            if self.pos[i] < self.length[i]:
                return True
            carry = int(self.pos[i] - self.length[i])
            self.pos[i] = self.length[i]

    def _discard(self, i: int, records: int) -> None:
        """Worker i consumed ``records`` whose gradients were discarded: report them, shard by shard."""
        while records > 0 and self.has[i]:
            sid, start = int(self.sid[i]), int(self.pos[i])
            end = min(int(self.length[i]), start + records)
            records -= end - start
            self.discarded += end - start
            rng = [ShardRange(sid, start, end)] if end > start else []
            self.pos[i] = end
            if end >= self.length[i]:
                self._get_shard(i, discarded=rng)  # done with the shard; the rest goes on in the next
            else:
                self._lease(i, progress=[ShardProgress(sid, end)], discarded=rng)
                self.reported[i] = end
                self.last_prog[i] = self.t

    def _refresh_delays(self) -> None:
        if self.t < self.next_change:
            return
        nxt = math.inf
        for arr, pats in ((self.wd, self.wpat), (self.pd, self.ppat)):
            for i, plist in enumerate(pats):
                d = 0.0
                for p in plist:
                    v, ch = p.at(self.t)
                    d += v
                    nxt = min(nxt, ch)
                arr[i] = d
        self.next_change = nxt

    def _span(self, bpt: float) -> int:
        """Steps one chunk (BSP) or leg (ASP) may run before a report is due: the live agent's window
        (:func:`pacer.agent.reporting.window_steps`), or more, merged up to ``report_span_s``."""
        c = self.sc.cluster
        return max(window_steps(c.report_steps, bpt, c.worker_report_s), int(c.report_span_s / bpt))

    def _ts(self) -> float:
        """T_s: the slowest PS's time for this step (AntDT §III: max_j T_ij^s)."""
        return float((self.sc.cluster.ps_time_s + self.pd).max())

    def _bpt(self) -> np.ndarray:
        """AntDT Eq. 1 per worker: T_w + T_s + T_m."""
        c = self.sc.cluster
        tw = self.C * self.B / self.speed + self.wd
        out: np.ndarray = tw + self._ts() + c.comm_s
        return out

    def _metrics(self, i: int) -> AgentMetrics:
        steps = int(self.acc_steps[i])
        busy = float(self.acc_busy[i])
        noise = self.sc.cluster.report_noise
        f = max(0.05, 1.0 + float(self.noise_rng.normal(0.0, noise))) if noise > 0 else 1.0  # measurement only
        m = AgentMetrics(
            job=JOB, node=self.wnames[i], role=Role.WORKER, ts=self.t,
            local_step=int(self.local_steps[i]), iteration=self.steps,
            bpt_s=busy / steps * f, batch_size=int(self.B[i]),
            samples_per_s=float(self.acc_samples[i]) / busy / f if busy > 0 else 0.0,
            samples_total=int(self.samples_total[i]), cpu_percent=100.0, rss_bytes=0,
            last_action_seq=0, last_action_iteration=-1, primary=i == 0,
            steps=steps, steps_total=int(self.local_steps[i]),
        )
        self.acc_steps[i] = 0
        self.acc_busy[i] = 0.0
        self.acc_samples[i] = 0.0
        return m

    def _report_and_progress(self, idx: np.ndarray) -> None:
        """After workers ``idx`` stepped: agent reports (every k steps) and shard progress (every progress_s)."""
        c = self.sc.cluster
        for i in idx.tolist():
            steps, busy = int(self.acc_steps[i]), float(self.acc_busy[i])
            if not steps:
                continue
            # The live agent's rules: k steps, fewer at a slow BPT, or what an overdue window has (its plan
            # here from the mean BPT of the steps in it: the chunks do not keep the last window's).
            want = window_steps(c.report_steps, busy / steps, c.worker_report_s)
            if steps < want and not window_overdue(steps, busy, want * busy / steps, c.worker_report_s):
                continue
            self.monitor.observe_metrics(self._metrics(i), self.t)
        due = idx[self.has[idx] & (self.t - self.last_prog[idx] >= c.progress_s) & (self.pos[idx] > self.reported[idx])]
        for i in due.tolist():
            self._lease(i, progress=[ShardProgress(int(self.sid[i]), int(self.pos[i]))])
            self.reported[i] = self.pos[i]
            self.last_prog[i] = self.t

    # ================================================================ events
    def _handle(self, kind: str, payload: Any) -> None:
        self.events += 1
        if kind == "tick":
            self._tick()
            self.push(self.t + self.sc.monitor.tick_s, "tick")
        elif kind == "ps_report":
            self._ps_report()
            self.push(self.t + self.sc.cluster.report_span_s, "ps_report")
        elif kind == "running":
            self._running(payload)
        elif kind == "return":
            self._return(payload)
        elif kind == "ps_return":
            self._ps_return(payload)
        elif kind == "ps_swap":
            self._ps_swap(payload)
        elif kind == "leg":
            i, g = payload
            if g == self.gen[i]:
                self._leg_end(i)

    def _ps_report(self) -> None:
        if self.t < self.ps_down_until or not (self.alive & self.has).any():
            return
        self._refresh_delays()
        k = self.sc.cluster.report_steps
        for j in np.flatnonzero(self.ps_up).tolist():
            bpt = self.sc.cluster.ps_time_s + float(self.pd[j])
            self.monitor.observe_metrics(AgentMetrics(
                job=JOB, node=self.pnames[j], role=Role.PS, ts=self.t, local_step=self.steps, iteration=self.steps,
                bpt_s=bpt, batch_size=0, samples_per_s=0.0, samples_total=0, cpu_percent=100.0, rss_bytes=0,
                last_action_seq=0, last_action_iteration=-1, primary=False, steps=k,
            ), self.t)

    def _tick(self) -> None:
        sc, t = self.sc, self.t
        for i in sorted(set(np.flatnonzero(self.alive).tolist()) | self.booting):
            self.monitor.observe_heartbeat(Heartbeat(JOB, self.wnames[i], Role.WORKER, t, "sim", i == 0, True), t)
        for j in np.flatnonzero(self.ps_up).tolist():
            self.monitor.observe_heartbeat(Heartbeat(JOB, self.pnames[j], Role.PS, t, "sim", False, True), t)
        self.monitor.observe_cluster(1 if sc.cluster.busy else 0, t)
        self.monitor.observe_shards(self.shards.status(DATASET), t)
        stats = self.monitor.statistics(JOB, t)
        # The controller's cadence: a round per fresh short window, at most interval_s (PACER_CONTROLLER_EVERY_S)
        # apart.
        if round_due(self.last_round, t, sc.monitor.interval_s, stats):
            self.last_round = t
            self._decide(stats)

    def _decide(self, stats: JobStatistics) -> None:
        """One controller round, as live: the core plans it, the simulation carries it out."""
        t, ctl = self.t, self.controller
        req = ctl.request(stats, t)
        rnd = ctl.round(req, self.policy(req), t)
        out = ctl.applied(rnd, [self._apply(a) for a in rnd.execute], t)
        self.decisions += 1
        self.refused += len(out.refused)
        if out.executed:
            self.timeline.append({"t": round(t, 3), "actions": [
                f"{a.kind.value}{' ' + a.node if a.node else ''}" for a in out.executed]})
        if self.sc.job.mode == "asp":
            self._wake_idle()

    def _apply(self, a: PolicyAction) -> str:
        """Carry one planned action out ("" = done; the simulation cannot fail one)."""
        self.actions[a.kind.value] += 1
        if a.kind is ActionKind.ADJUST_BS:
            if self.sc.cluster.adjust_bs_s > 0 and self.sc.job.mode == "bsp":
                # The synchronised step boundary where the new sizes apply: every worker waits.
                self.ps_down_until = max(self.ps_down_until, self.t + self.sc.cluster.adjust_bs_s)
            for name, b in dict(a.payload.get("batch_sizes", {})).items():
                if name in self.windex:
                    self.B[self.windex[name]] = max(1, int(b))
            for name, cnum in dict(a.payload.get("accumulations", {})).items():
                if name in self.windex:
                    self.C[self.windex[name]] = max(1, int(cnum))
            set_ = [self.windex[n] for n in a.payload.get("batch_sizes", {}) if n in self.windex]
            self.cap_violations += int(((self.B[set_] > self.cap[set_]) & (self.cap[set_] > 0)).sum())
            self.floor_violations += int((self.B[set_] < self.floor).sum())
        elif a.kind is ActionKind.BACKUP_WORKERS:
            self.backup = max(0, min(self.n - 1, int(a.payload.get("backup", 0))))
        elif a.kind is ActionKind.KILL_RESTART:
            if a.node in self.windex:
                self._kill_worker(self.windex[a.node])
            elif a.node in self.pindex:
                self._kill_ps(self.pindex[a.node], str(a.payload.get("migration", "")))
        return ""

    def _relaunch(self, name: str, role: Role, pats: list[_Injected]) -> float:
        """The executor core decides; the monitor sees died + created; returns when the node is back."""
        c = self.sc.cluster
        n = self.nodes[name]
        ans = answer_exit(node_view(n), ExitInfo(code=EXIT_RESTART))
        if ans.outcome is not ExitOutcome.RELAUNCH:  # never for exit 75; kept so a changed rule shows up here
            raise SimulationError(f"{name}: the executor would not relaunch after KILL_RESTART ({ans.detail})")
        # The live executor's bookkeeping and effects: its died event, then the next pod (created).
        for e in apply_exit(self.record, n, ans, exit_code=EXIT_RESTART):
            if isinstance(e, PublishNodeEvent):
                self.monitor.observe_node_event(node_event_of(JOB, role, e, self.t, f"{name}-g{e.generation}"), self.t)
            elif isinstance(e, CreatePod):
                self.monitor.observe_node_event(NodeEvent(JOB, name, NodeEventKind.CREATED, self.t, role=role,
                                                          generation=n.generation), self.t)
        for p in pats:
            if not p.follows_restart:
                p.cured = True  # the relaunched node runs on a healthy machine
        self.next_change = -1.0
        self.restarts += 1
        return self.t + c.pending_s + c.init_s

    def _kill_worker(self, i: int) -> None:
        name = self.wnames[i]
        if not self.alive[i]:
            return
        self.alive[i] = False
        self.gen[i] += 1
        self.leg.pop(i, None)
        if self.has[i]:
            # Work since the last progress report is lost and done again by the next holder.
            self.recomputed += int(min(self.pos[i], self.length[i]) - self.reported[i])
        self.has[i] = False
        self.sid[i] = -1
        self.acc_steps[i] = 0
        self.acc_busy[i] = 0.0
        self.acc_samples[i] = 0.0
        self.B[i], self.C[i] = self.B0[i], 1  # the new pod's launch config: the spec's B / n
        back = self._relaunch(name, Role.WORKER, self.wpat[i])
        self._account(self.shards.node_died(name))
        self.push(self.t + self.sc.cluster.pending_s, "running", i)  # the pod runs; the trainer starts
        self.push(back, "return", i)
        if self.sc.job.mode == "asp":
            self._wake_idle()

    def _running(self, i: int) -> None:
        """A relaunched worker's pod runs (after ``pending_s``): its agent heartbeats while the trainer
        starts (``init_s``), and the monitor measures that start-up from here to its first step."""
        name = self.wnames[i]
        self.booting.add(i)
        move(self.nodes[name], NodePhase.RUNNING)
        self.monitor.observe_node_event(NodeEvent(JOB, name, NodeEventKind.RUNNING, self.t, role=Role.WORKER,
                                                  pending_s=self.sc.cluster.pending_s), self.t)

    def _return(self, i: int) -> None:
        self.booting.discard(i)
        self.alive[i] = True
        self.last_prog[i] = self.t
        if self._get_shard(i) and self.sc.job.mode == "asp":
            self._start_leg(i)

    def _kill_ps(self, j: int, how: str = "") -> None:
        """``how``: the action's ``migration`` (restart | seamless); empty: the cluster's ``ps_migration``."""
        name = self.pnames[j]
        if not self.ps_up[j] or name in self.migrating:
            return
        c = self.sc.cluster
        if (how or c.ps_migration) == "seamless":
            # Pacer's seamless migration (DLRover-RM §5.2): the replacement starts while the old
            # PS keeps serving (slowly); the pause comes only when the workers move (_ps_swap).
            self.migrating.add(name)
            self.push(self.t + c.pending_s + c.ps_start_s, "ps_swap", j)
            return
        self._ps_down(j, self._relaunch(name, Role.PS, self.ppat[j]))

    def _ps_swap(self, j: int) -> None:
        """The new PS runs: checkpoint, the workers restart on the new cluster (init_s), old PS stops."""
        name = self.pnames[j]
        self.migrating.discard(name)
        self._relaunch(name, Role.PS, self.ppat[j])  # executor decision + died/created; the new PS is healthy
        self._ps_down(j, self.t + self.sc.cluster.init_s)

    def _ps_down(self, j: int, back: float) -> None:
        """PS j is out until ``back``: training pauses until then; the workers restart on the new cluster."""
        self.ps_up[j] = False
        self.B[:], self.C[:] = self.B0, 1  # relaunched workers: the spec's B / n until the controller re-sends
        pause = back - max(self.t, self.ps_down_until)
        self.ps_down_until = max(self.ps_down_until, back)
        self.push(back, "ps_return", j)
        if self.sc.job.mode == "asp" and pause > 0:
            # Every in-flight step waits for the PS: shift the legs by the pause.
            for i, (start, end, steps, bpt) in sorted(self.leg.items()):
                self.gen[i] += 1
                self.leg[i] = (start, end + pause, steps, bpt)
                self.push(end + pause, "leg", (i, int(self.gen[i])))

    def _ps_return(self, j: int) -> None:
        name = self.pnames[j]
        self.ps_up[j] = True
        move(self.nodes[name], NodePhase.RUNNING)
        self.monitor.observe_node_event(NodeEvent(JOB, name, NodeEventKind.RUNNING, self.t, role=Role.PS,
                                                  pending_s=self.sc.cluster.pending_s), self.t)

    def _run_due(self) -> None:
        """Handle every event due at or before now (in time, then insertion order)."""
        while self.heap and self.heap[0][0] <= self.t and self.finished_at is None:
            _, _, kind, payload = heapq.heappop(self.heap)
            self._handle(kind, payload)

    def _jump(self) -> None:
        """Nothing steps: advance to the next event."""
        if not self.heap:
            raise SimulationError("no worker can step and no event is pending")
        self.t = max(self.t, self.heap[0][0])
        self._run_due()

    # ================================================================ BSP
    def _run_bsp(self) -> None:
        while self.finished_at is None:
            if self.t > MAX_SIM_S:
                raise SimulationError(f"not finished after {MAX_SIM_S} simulated seconds")
            if self.t < self.ps_down_until:
                self.t = min(self.ps_down_until, self.heap[0][0]) if self.heap else self.ps_down_until
                self._run_due()
                continue
            self._finish_cut()
            for i in np.flatnonzero(self.alive & ~self.has).tolist():
                if self._future_records() <= 0:
                    break
                self._get_shard(i)
            if self.finished_at is not None:
                break
            act = np.flatnonzero(self.alive & self.has)
            if act.size == 0:
                self._jump()
                continue
            self._refresh_delays()
            bpt = self._bpt()
            b = min(self.backup, act.size - 1)
            if b > 0:
                order = act[np.argsort(bpt[act], kind="stable")]
                kept, dropped = np.sort(order[:-b]), order[-b:]
            else:
                kept, dropped = act, act[:0]
            step = float(bpt[kept].max())
            self.last_step = step
            limit = min(self.heap[0][0] if self.heap else math.inf, self.next_change)
            s = max(1, min(int((limit - self.t) / step) if limit < math.inf else 1 << 30, self._span(step)))
            per_step = self.C[kept] * self.B[kept]
            left = self.length[kept] - self.pos[kept]
            need = int(np.maximum(0, per_step * s - left).sum())
            if need > 0 and need > self._future_records():
                s = 1  # near the end of the data: one step at a time so nobody trains past it
            self.t += s * step
            self.steps += s
            self.pos[kept] += per_step * s
            for i in dropped.tolist():
                self._discard(i, int(self.C[i] * self.B[i]) * s)
            self.samples_total[kept] += per_step * s
            self.local_steps[act] += s
            self.acc_steps[act] += s
            self.acc_busy[act] += bpt[act] * s
            self.acc_samples[kept] += per_step * s
            for i in kept[self.pos[kept] >= self.length[kept]].tolist():
                carry = int(self.pos[i] - self.length[i])
                self.pos[i] = self.length[i]
                self._get_shard(i, carry)
            if self.finished_at is not None:
                break
            self._report_and_progress(act)
            self._run_due()

    # ================================================================ ASP
    def _start_leg(self, i: int) -> None:
        c = self.sc.cluster
        self._refresh_delays()
        start = max(self.t, self.ps_down_until)
        bpt = float(self.C[i] * self.B[i] / self.speed[i] + self.wd[i] + self._ts() + c.comm_s)
        per = int(self.C[i] * self.B[i])
        steps = -(-int(self.length[i] - self.pos[i]) // per)
        steps = min(steps, self._span(bpt))
        if self.next_change < math.inf:
            steps = min(steps, max(1, math.ceil((self.next_change - start) / bpt)))
        steps = max(1, steps)
        self.gen[i] += 1
        end = start + steps * bpt
        self.leg[i] = (start, end, steps, bpt)
        self.push(end, "leg", (i, int(self.gen[i])))

    def _leg_end(self, i: int) -> None:
        _, _, steps, bpt = self.leg.pop(i)
        per = int(self.C[i] * self.B[i])
        take = min(per * steps, int(self.length[i] - self.pos[i]))
        self.pos[i] += take
        self.samples_total[i] += take
        self.local_steps[i] += steps
        self.steps += steps
        self.acc_steps[i] += steps
        self.acc_busy[i] += bpt * steps
        self.acc_samples[i] += take
        if self.pos[i] >= self.length[i] and not self._get_shard(i):
            pass  # idle until shards come back (a death) or the job ends
        if self.finished_at is not None:
            return
        self._report_and_progress(np.array([i]))
        self._finish_cut()  # its progress report may have told it that its shard was cut behind it
        if self.has[i] and i not in self.leg:
            self._start_leg(i)

    def _wake_idle(self) -> None:
        for i in np.flatnonzero(self.alive & ~self.has).tolist():
            if self._future_records() <= 0:
                return
            if self._get_shard(i):
                self._start_leg(i)

    def _run_asp(self) -> None:
        for i in range(self.n):
            if self._get_shard(i):
                self._start_leg(i)
        while self.finished_at is None:
            if not self.heap:
                raise SimulationError("no worker can step and no event is pending")
            at, _, kind, payload = heapq.heappop(self.heap)
            if at > MAX_SIM_S:
                raise SimulationError(f"not finished after {MAX_SIM_S} simulated seconds")
            self.t = max(self.t, at)
            self._handle(kind, payload)

    # ================================================================ run
    def run(self) -> Result:
        sc = self.sc
        wall = time.perf_counter()
        spec = DatasetSpec(job=JOB, dataset=DATASET, records=sc.job.records, batch_size=int(sc.job.global_batch // self.n),
                           batches_per_shard=sc.job.batches_per_shard, epochs=sc.job.epochs, shuffle=True, seed=sc.seed,
                           tail_split=sc.job.tail_split)
        self._account(self.shards.register(spec))
        self.push(sc.monitor.tick_s, "tick")
        self.push(sc.cluster.report_span_s, "ps_report")
        if sc.job.mode == "bsp":
            self._run_bsp()
        else:
            self._run_asp()
        ds = self.shards.datasets[DATASET]
        assert self.finished_at is not None
        return Result(
            scenario=sc.name, method=self.method, seed=sc.seed, mode=sc.job.mode,
            jct_s=self.finished_at, ideal_jct_s=None, actions=dict(self.actions), steps=self.steps,
            restarts=self.restarts, shards_total=len(ds.shards), shards_done=ds.done_count,
            records_done=ds.records_done, records_duplicated=ds.records_duplicated,
            records_recomputed=self.recomputed, records_dropped=max(0, self.discarded - ds.records_reserved),
            records_reserved=ds.records_reserved,
            cap_violations=self.cap_violations, floor_violations=self.floor_violations,
            decisions=self.decisions, refused=self.refused, events=self.events, wall_s=time.perf_counter() - wall,
            timeline=self.timeline,
        )


def run(
    scenario: Scenario,
    method: str | None = None,
    *,
    policy: Policy | None = None,
    ideal: bool = True,
    controller: ControllerConfig | None = None,
) -> Result:
    """Simulate ``scenario`` under ``method`` (default: the scenario's), or under ``policy`` if given.

    With ``ideal`` the same job is run again with every straggler removed and
    no policy, and its JCT is returned as ``ideal_jct_s``.  Decisions go
    through the controller's core exactly as live, with ``controller`` as its
    guards (default: the live default).
    """
    name = method or scenario.method
    pol = policy if policy is not None else resolve_policy(name)
    res = Simulation(scenario, pol, name, controller).run()
    if not ideal:
        return res
    base = Simulation(replace(scenario, stragglers=()), none_policy, "none").run()
    return replace(res, ideal_jct_s=base.jct_s, wall_s=res.wall_s + base.wall_s)
