"""Deterministic discrete-event simulator of a parameter-server job, driving Pacer's real decision code.

What is real (imported, never copied): the shard service's :class:`JobShards`
(every lease, progress report, DONE and node death goes through it, so
``records_duplicated`` and the DONE counts are the core's own), the monitor's
:class:`MonitorCore` (fed :class:`AgentMetrics`, heartbeats, node events,
cluster and shard information; it computes the BPT windows and straggler
kinds), the pod-executor core (``reconcile`` makes the initial nodes,
``on_exit`` answers each KILL_RESTART), and the straggler policy (any
``decide(PolicyRequest) -> PolicyDecision``; the built-in ones come from the
controller's policy registry when it exists) plus an optional reviewer (the
controller's ``review``) that turns a decision into the actions executed.

The model (all times are simulated seconds from 0; no wall clock anywhere):

* Nodes: ``worker-i`` and ``ps-j``.  A step of worker i takes, by AntDT Eq. 1,
  ``BPT_i = T_w + T_s + T_m`` with ``T_w = C_i * B_i / worker_speed + d_i(t)``
  (linear compute, AntDT Fig. 8; C_i the gradient accumulations of AntDT-DD,
  1 unless a policy sets them), ``T_s = max_j (ps_time_s + d_j(t))`` (the
  slowest PS, AntDT §III: max_j T_ij^s) and ``T_m = comm_s``.
* Stragglers (AntDT §VII-A4): ``d(t) = sleep_s * intensity`` while the pattern
  is on.  Persistent: on from ``start_s``.  Transient: time from ``start_s`` is
  cut into ``period_s`` periods; in each, one draw of a per-(seed, node, spec)
  ``random.Random`` with ``probability`` decides whether the node is slow for
  the first ``on_s`` seconds.  A KILL_RESTART lands the node on a healthy
  machine: its patterns end unless ``follows_restart``.
* BSP: all live workers that hold data start a step together; it ends when the
  slowest of the n - b kept workers finishes (b backup workers: the b slowest
  gradients are dropped; their shard position does not advance, so those
  samples are trained again later and counted in ``records_dropped``).
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
  speed go to the monitor as :class:`AgentMetrics`; consecutive reports of a
  chunk are merged into one with ``steps = chunk`` (the monitor's windows are
  step-weighted, so window means are unchanged; only where inside a window a
  sample sits is coarser, by at most ``report_span_s``).  PS report their own
  BPT ``ps_time_s + d_j`` every ``report_span_s``.  At each monitor tick all up
  nodes heartbeat (an idle worker waiting for data is alive, not dead).
* Monitor ticks every ``interval_s``: cluster info (``busy`` -> one queued
  pod), shard status, ``statistics``, then the policy and the reviewer; the
  actions apply at once (BSP: from the next step):
  ADJUST_BS sets B_i (and C_i), BACKUP_WORKERS sets b, ADJUST_LR and NONE only
  count, KILL_RESTART stops the node now.
* KILL_RESTART of a worker: the executor core's ``on_exit`` with exit code 75
  decides the relaunch; the shard core's ``node_died`` requeues its DOING
  shard; the monitor sees ``died`` and ``created``; the worker is back after
  ``pending_s + init_s`` (``running``) and asks for a shard.  Meanwhile the
  other workers go on with their own B_i (the step's batch is smaller).
  KILL_RESTART of a PS pauses every worker for ``pending_s + init_s`` (they
  cannot push or pull); no data is lost (the shard log and flash checkpoints
  keep the state, DESIGN.md).
* Determinism: events are a heap of (time, seq, kind, payload); every random
  draw comes from ``random.Random`` instances seeded from the scenario seed.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from pacer.contracts.agent import ActionKind, AgentMetrics, Heartbeat
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest
from pacer.contracts.shards import DatasetSpec, LeaseReply, LeaseRequest, ShardLease, ShardProgress
from pacer.errors import PacerError
from pacer_services.monitor.core import MonitorConfig, MonitorCore
from pacer_services.pod_executor.core import EXIT_RESTART, ExitInfo, Node, Plan, on_exit, reconcile
from pacer_services.shard_service.core import JobShards, Outcome, ShardState

from .scenario import Scenario, StragglerSpec

Policy = Callable[[PolicyRequest], PolicyDecision]
Reviewer = Callable[[PolicyRequest, PolicyDecision, float], Sequence[PolicyAction]]

JOB = "sim"
DATASET = "train"
# A run that has not finished after this much simulated time is stuck (a bug or a policy that starves the job).
MAX_SIM_S = 1e8


class SimulationError(PacerError):
    """The simulated job cannot make progress (every worker waits on nothing)."""

    code = "simulation"


def none_policy(req: PolicyRequest) -> PolicyDecision:
    """The dummy policy: never acts (AntDT's NONE)."""
    return PolicyDecision(job=req.job, policy="none", actions=[], reason="no mitigation")


def pass_through(req: PolicyRequest, decision: PolicyDecision, now: float) -> Sequence[PolicyAction]:
    """Reviewer used when none is given: execute what the policy decided."""
    return decision.actions


def _controller_core() -> Any:
    """A ControllerCore for the simulated job, or None while the controller does not exist (lazy import)."""
    try:
        from pacer_services.controller.core import ControllerCore
    except ImportError:
        return None
    return ControllerCore(JOB)


def resolve_policy(method: str) -> Policy:
    """A policy by name: the controller's registry when present, else only ``none``."""
    try:
        from pacer_services.controller.policies import registry  # lazy: written separately
    except ImportError:
        registry = None
    if registry is not None:
        builtins: dict[str, Any] = getattr(registry, "BUILTINS", {})
        if method in builtins:
            found: Policy = builtins[method]
            return found
    if method == "none":
        return none_policy
    known = ["none"] if registry is None else sorted(getattr(registry, "BUILTINS", {}))
    raise PacerError(f"method: unknown policy {method!r} (known: {', '.join(known)})", code="invalid")


@dataclass(frozen=True, slots=True)
class Result:
    """What one simulated run produced."""

    scenario: str
    method: str
    seed: int
    mode: str
    jct_s: float
    ideal_jct_s: float | None
    actions: dict[str, int]
    steps: int  # BSP: global steps; ASP: worker steps summed
    restarts: int
    shards_total: int
    shards_done: int
    records_done: int
    records_duplicated: int  # the shard core's count: re-granted records
    records_recomputed: int  # consumed since the last progress report when a worker died
    records_dropped: int  # BSP samples whose gradient a backup-worker step dropped
    decisions: int
    refused: int  # actions the controller refused (cool-down, busy cluster, inconsistent batch sizes)
    events: int
    wall_s: float
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "method": self.method,
            "seed": self.seed,
            "mode": self.mode,
            "jct_s": round(self.jct_s, 3),
            "ideal_jct_s": None if self.ideal_jct_s is None else round(self.ideal_jct_s, 3),
            "slowdown": None if not self.ideal_jct_s else round(self.jct_s / self.ideal_jct_s, 4),
            "actions": dict(sorted(self.actions.items())),
            "steps": self.steps,
            "restarts": self.restarts,
            "shards_total": self.shards_total,
            "shards_done": self.shards_done,
            "records_done": self.records_done,
            "records_duplicated": self.records_duplicated,
            "records_recomputed": self.records_recomputed,
            "records_dropped": self.records_dropped,
            "decisions": self.decisions,
            "refused": self.refused,
            "events": self.events,
        }


class _Pattern:
    """One straggler pattern of one node: d(t) and when it next changes."""

    def __init__(self, spec: StragglerSpec, seed: int, idx: int) -> None:
        self.spec = spec
        self.active = spec.pattern != "none" and spec.delay_s > 0
        # String seeds are hashed with sha512 by random.Random: stable across runs and processes.
        self.rng = random.Random(f"{seed}/{spec.node}/{idx}")
        self.draws: list[bool] = []

    def _slow_in(self, period: int) -> bool:
        while len(self.draws) <= period:
            self.draws.append(self.rng.random() < self.spec.probability)
        return self.draws[period]

    def at(self, t: float) -> tuple[float, float]:
        """(delay at t, the next time the delay may change)."""
        s = self.spec
        if not self.active:
            return 0.0, math.inf
        if t < s.start_s:
            return 0.0, s.start_s
        if s.pattern == "persistent":
            return s.delay_s, math.inf
        p = int((t - s.start_s) // s.period_s)
        begin = s.start_s + p * s.period_s
        if t < begin + s.on_s:
            return (s.delay_s if self._slow_in(p) else 0.0), begin + s.on_s
        return 0.0, begin + s.period_s


class Simulation:
    """One run of one scenario under one policy.  Use :func:`run`."""

    def __init__(
        self, sc: Scenario, policy: Policy, method: str, reviewer: Reviewer | None = None, controller: bool = True
    ) -> None:
        self.sc = sc
        self.policy = policy
        self.method = method
        self.reviewer: Reviewer = reviewer or pass_through
        # The controller's core (request + review + cool-downs) when it exists and no reviewer was given.
        self.controller: Any = _controller_core() if controller and reviewer is None else None
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
        ))
        plan = reconcile(Plan(workers=c.workers, ps=c.ps), {})
        self.nodes: dict[str, Node] = {}
        for spec in plan.start:
            node = Node(spec, state="running")
            self.nodes[node.name] = node
        # ---- workers (numpy state; index i is worker-i)
        base, extra = divmod(j.global_batch, self.n)
        self.B = np.array([base + (1 if i < extra else 0) for i in range(self.n)], dtype=np.int64)
        self.C = np.ones(self.n, dtype=np.int64)
        self.speed = np.array(c.speeds(), dtype=np.float64)  # per worker (device groups, AntDT-DD)
        self.alive = np.ones(self.n, dtype=bool)
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
        self.wpat: list[list[_Pattern]] = [[] for _ in range(self.n)]
        self.ppat: list[list[_Pattern]] = [[] for _ in range(self.m)]
        for k, s in enumerate(sc.stragglers):
            pat = _Pattern(s, sc.seed, k)
            (self.wpat[self.windex[s.node]] if s.side == "worker" else self.ppat[self.pindex[s.node]]).append(pat)
        self.wd = np.zeros(self.n)
        self.pd = np.zeros(self.m)
        self.next_change = -1.0  # forces a first refresh
        # ---- bookkeeping
        self.unleased = 0  # records in TODO shards (kept from the core's log records)
        self.steps = 0
        self.restarts = 0
        self.recomputed = 0
        self.dropped = 0
        self.decisions = 0
        self.actions: Counter[str] = Counter()
        self.restarting: set[str] = set()
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

    def _lease(self, i: int, *, done: Sequence[int] = (), progress: Sequence[ShardProgress] = (), want: int = 0) -> LeaseReply:
        req = LeaseRequest(job=JOB, dataset=DATASET, node=self.wnames[i], want=want,
                           held=[] if done or not self.has[i] else [int(self.sid[i])],
                           done=list(done), progress=list(progress))
        out = self.shards.lease(req, self.t)
        self._account(out)
        reply: LeaseReply = out.reply
        if reply.finished and self.finished_at is None:
            self.finished_at = self.t
        return reply

    def _take(self, i: int, lease: ShardLease, carry: int = 0) -> None:
        self.has[i] = True
        self.sid[i] = lease.shard
        self.pos[i] = lease.start - lease.offset + carry
        self.reported[i] = lease.start - lease.offset
        self.length[i] = lease.end - lease.offset

    def _get_shard(self, i: int, carry: int = 0) -> bool:
        """Finish the held shard (if any) and take the next; carry = records of the batch already past its end."""
        while True:
            done = [int(self.sid[i])] if self.has[i] else []
            self.has[i] = False
            reply = self._lease(i, done=done, want=1)
            if not reply.shards:
                self.sid[i] = -1
                return False
            self._take(i, reply.shards[0], carry)
            if self.pos[i] < self.length[i]:
                return True
            carry = int(self.pos[i] - self.length[i])
            self.pos[i] = self.length[i]

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
        m = AgentMetrics(
            job=JOB, node=self.wnames[i], role="worker", ts=self.t,
            local_step=int(self.local_steps[i]), iteration=self.steps,
            bpt_s=busy / steps, batch_size=int(self.B[i]),
            samples_per_s=float(self.acc_samples[i]) / busy if busy > 0 else 0.0,
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
        for i in idx[self.acc_steps[idx] >= c.report_steps].tolist():
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
            self.push(self.t + self.sc.monitor.interval_s, "tick")
        elif kind == "ps_report":
            self._ps_report()
            self.push(self.t + self.sc.cluster.report_span_s, "ps_report")
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
                job=JOB, node=self.pnames[j], role="ps", ts=self.t, local_step=self.steps, iteration=self.steps,
                bpt_s=bpt, batch_size=0, samples_per_s=0.0, samples_total=0, cpu_percent=100.0, rss_bytes=0,
                last_action_seq=0, last_action_iteration=-1, primary=False, steps=k,
            ), self.t)

    def _tick(self) -> None:
        sc, t = self.sc, self.t
        for i in np.flatnonzero(self.alive).tolist():
            self.monitor.observe_heartbeat(Heartbeat(JOB, self.wnames[i], "worker", t, "sim", i == 0, True), t)
        for j in np.flatnonzero(self.ps_up).tolist():
            self.monitor.observe_heartbeat(Heartbeat(JOB, self.pnames[j], "ps", t, "sim", False, True), t)
        self.monitor.observe_cluster(1 if sc.cluster.busy else 0, t)
        self.monitor.observe_shards(self.shards.status(DATASET), t)
        stats = self.monitor.statistics(JOB, t)
        live = np.flatnonzero(self.alive).tolist()
        if self.controller is not None:
            self._controlled_tick(stats)
            return
        req = PolicyRequest(
            job=JOB, stats=stats, mode=sc.job.mode, global_batch=sc.job.global_batch,
            batch_sizes={self.wnames[i]: int(self.B[i]) for i in live},
            accumulations={self.wnames[i]: int(self.C[i]) for i in live if self.C[i] != 1},
            backup_workers=self.backup, min_batch=sc.job.min_batch, max_batch=sc.job.max_batch,
            params=dict(sc.params), restart_blocked=sorted(self.restarting),
        )
        decision = self.policy(req)
        self.decisions += 1
        acts = list(self.reviewer(req, decision, t))
        for a in acts:
            self._apply(a)
        if acts:
            self.timeline.append({"t": round(t, 3), "actions": [f"{a.kind.value}{' ' + a.node if a.node else ''}" for a in acts]})
        if self.sc.job.mode == "asp":
            self._wake_idle()

    def _controlled_tick(self, stats: Any) -> None:
        """The live path: ControllerCore.request -> policy -> ControllerCore.review -> execute -> applied."""
        from pacer_services.controller.core import JobSetup

        sc, t, ctl = self.sc, self.t, self.controller
        setup = JobSetup(
            global_batch=sc.job.global_batch, mode=sc.job.mode,
            batch_sizes={self.wnames[i]: int(self.B[i]) for i in range(self.n)},
            accumulations={self.wnames[i]: int(self.C[i]) for i in range(self.n)},
            backup_workers=self.backup, min_batch=sc.job.min_batch, max_batch=sc.job.max_batch,
            device_groups=sc.cluster.groups(),
            params={**({"max_batch_per_group": {g.name: g.max_batch for g in sc.cluster.device_groups
                                                if g.max_batch}} if sc.cluster.device_groups else {}),
                    **sc.params},
        )
        req = ctl.request(stats, setup, t)
        decision = self.policy(req)
        self.decisions += 1
        review = ctl.review(req, decision, t)
        self.refused += len(review.refused)
        acts = [] if review.fallback else list(review.execute)
        for a in acts:
            self._apply(a)
            ctl.applied(a, t)
        if acts:
            self.timeline.append({"t": round(t, 3), "actions": [f"{a.kind.value}{' ' + a.node if a.node else ''}" for a in acts]})
        if sc.job.mode == "asp":
            self._wake_idle()

    def _apply(self, a: PolicyAction) -> None:
        self.actions[a.kind.value] += 1
        if a.kind is ActionKind.ADJUST_BS:
            for name, b in dict(a.payload.get("batch_sizes", {})).items():
                if name in self.windex:
                    self.B[self.windex[name]] = max(1, int(b))
            for name, cnum in dict(a.payload.get("accumulations", {})).items():
                if name in self.windex:
                    self.C[self.windex[name]] = max(1, int(cnum))
        elif a.kind is ActionKind.BACKUP_WORKERS:
            self.backup = max(0, min(self.n - 1, int(a.payload.get("backup", 0))))
        elif a.kind is ActionKind.KILL_RESTART:
            if a.node in self.windex:
                self._kill_worker(self.windex[a.node])
            elif a.node in self.pindex:
                self._kill_ps(self.pindex[a.node])

    def _relaunch(self, name: str, role: str, pats: list[_Pattern]) -> float:
        """The executor core decides; the monitor sees died + created; returns when the node is back."""
        c = self.sc.cluster
        node = self.nodes[name]
        decision = on_exit(node, ExitInfo(code=EXIT_RESTART))
        if decision.relaunch is None:  # never for exit 75; kept so a changed executor rule shows up here
            raise SimulationError(f"{name}: the executor would not relaunch after KILL_RESTART ({decision.detail})")
        self.nodes[name] = replace(node, spec=decision.relaunch, requested_restarts=node.requested_restarts + 1, state="pending")
        gen = self.nodes[name].requested_restarts + self.nodes[name].restarts
        self.monitor.observe_node_event(NodeEvent(JOB, name, "died", self.t, reason=decision.reason.value, role=role,
                                                  exit_code=EXIT_RESTART, relaunch=True, generation=gen - 1), self.t)
        self.monitor.observe_node_event(NodeEvent(JOB, name, "created", self.t, role=role, generation=gen), self.t)
        for p in pats:
            if not p.spec.follows_restart:
                p.active = False  # the relaunched node runs on a healthy machine
        self.next_change = -1.0
        self.restarting.add(name)
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
        back = self._relaunch(name, "worker", self.wpat[i])
        self._account(self.shards.node_died(name))
        self.push(back, "return", i)
        if self.sc.job.mode == "asp":
            self._wake_idle()

    def _return(self, i: int) -> None:
        name = self.wnames[i]
        self.alive[i] = True
        self.last_prog[i] = self.t
        self.restarting.discard(name)
        self.nodes[name] = replace(self.nodes[name], state="running")
        self.monitor.observe_node_event(NodeEvent(JOB, name, "running", self.t, role="worker",
                                                  pending_s=self.sc.cluster.pending_s), self.t)
        if self._get_shard(i) and self.sc.job.mode == "asp":
            self._start_leg(i)

    def _kill_ps(self, j: int) -> None:
        name = self.pnames[j]
        if not self.ps_up[j] or name in self.migrating:
            return
        c = self.sc.cluster
        if c.ps_migration == "seamless":
            # Pacer's seamless migration (DLRover-RM §5.2): the replacement starts while the old
            # PS keeps serving (slowly); the pause comes only when the workers move (_ps_swap).
            self.migrating.add(name)
            self.push(self.t + c.pending_s + c.ps_start_s, "ps_swap", j)
            return
        self._ps_down(j, self._relaunch(name, "ps", self.ppat[j]))

    def _ps_swap(self, j: int) -> None:
        """The new PS runs: checkpoint, the workers restart on the new cluster (init_s), old PS stops."""
        name = self.pnames[j]
        self.migrating.discard(name)
        self._relaunch(name, "ps", self.ppat[j])  # executor decision + died/created; the new PS is healthy
        self._ps_down(j, self.t + self.sc.cluster.init_s)

    def _ps_down(self, j: int, back: float) -> None:
        """PS j is out until ``back``: training pauses until then."""
        self.ps_up[j] = False
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
        self.restarting.discard(name)
        self.nodes[name] = replace(self.nodes[name], state="running")
        self.monitor.observe_node_event(NodeEvent(JOB, name, "running", self.t, role="ps",
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
        c = self.sc.cluster
        while self.finished_at is None:
            if self.t > MAX_SIM_S:
                raise SimulationError(f"not finished after {MAX_SIM_S} simulated seconds")
            if self.t < self.ps_down_until:
                self.t = min(self.ps_down_until, self.heap[0][0]) if self.heap else self.ps_down_until
                self._run_due()
                continue
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
            limit = min(self.heap[0][0] if self.heap else math.inf, self.next_change)
            s = max(1, min(int((limit - self.t) / step) if limit < math.inf else 1 << 30,
                           max(c.report_steps, int(c.report_span_s / step))))
            per_step = self.C[kept] * self.B[kept]
            left = self.length[kept] - self.pos[kept]
            need = int(np.maximum(0, per_step * s - left).sum())
            if need > 0 and need > self._future_records():
                s = 1  # near the end of the data: one step at a time so nobody trains past it
            self.t += s * step
            self.steps += s
            self.pos[kept] += per_step * s
            self.dropped += int((self.C[dropped] * self.B[dropped]).sum()) * s
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
        steps = min(steps, max(c.report_steps, int(c.report_span_s / bpt)))
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
        if self.has[i]:
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
                           batches_per_shard=sc.job.batches_per_shard, epochs=sc.job.epochs, shuffle=True, seed=sc.seed)
        self._account(self.shards.register(spec))
        self.push(sc.monitor.interval_s, "tick")
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
            records_recomputed=self.recomputed, records_dropped=self.dropped,
            decisions=self.decisions, refused=self.refused, events=self.events, wall_s=time.perf_counter() - wall,
            timeline=self.timeline,
        )


def run(
    scenario: Scenario,
    method: str | None = None,
    *,
    policy: Policy | None = None,
    reviewer: Reviewer | None = None,
    ideal: bool = True,
    controller: bool = True,
) -> Result:
    """Simulate ``scenario`` under ``method`` (default: the scenario's), or under ``policy`` if given.

    With ``ideal`` the same job is run again with every straggler removed and
    no policy, and its JCT is returned as ``ideal_jct_s``.  With ``controller``
    (and no ``reviewer``) decisions go through the controller's core exactly as
    live: ``ControllerCore.request`` builds the request, ``review`` guards it
    (cool-downs, busy cluster, consistent batch sizes), ``applied`` records it.
    """
    name = method or scenario.method
    pol = policy if policy is not None else resolve_policy(name)
    res = Simulation(scenario, pol, name, reviewer, controller).run()
    if not ideal:
        return res
    base = Simulation(replace(scenario, stragglers=()), none_policy, "none").run()
    return replace(res, ideal_jct_s=base.jct_s, wall_s=res.wall_s + base.wall_s)
