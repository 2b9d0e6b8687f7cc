"""One simulated job: its nodes, progress, checkpoints and costs, advanced tick by tick by the runners.

Runtime (DLRover-RM §6 setup): a 200-CPU quota per job, pods of at most 32
CPUs, a decision every 3 minutes, a new pod pending ~20 s and initialising
~100 s (``restart_s`` = pending + init).  Time advances in fixed ticks.

A plan change costs what the executor really does, because the executor's
own decision says what that is (:func:`pacer_services.pod_executor.core.plan_change`,
the function behind the live executor's ``apply_plan``):

* new workers start (``restart_s``) while the others go on training;
  removed workers stop at once;
* workers that stay but get another size are replaced by the rolling
  replacement's batches (``resize_batches``, DLRover-RM §5.1: a quarter at a
  time, the chief last): each batch is down ``restart_s`` while the rest
  train, then the next batch goes;
* a change that only raises a role's memory grows the running nodes' limits
  in place (``grow``): no pause;
* any other change of the PS (count, CPU or memory) is a seamless migration
  (DLRover-RM §5.2): the new PS start beside the old ones while training
  goes on (``restart_s``), then every worker restarts once from the chief's
  checkpoint (taken then, nothing lost) with its new size, and the job
  trains on the new PS.  A PS change asked for during a migration waits
  for it to end (``ps_deferred``), then migrates again.

A job whose workers have two sizes (during a replacement) runs at the
worker-weighted mean of the two sizes' throughputs (:func:`.truth.throughput`
is for one size).

An OOM (a node over its memory) kills the job's training: it restarts from
the last periodic checkpoint (the progress since is lost) once the executor
relaunches the node.  The relaunch is the executor core's answer
(:func:`pacer_services.pod_executor.core.answer_exit`, booked by
:func:`pacer_services.pod_executor.core.record.apply_exit`: the memory times the
policy's factor, capped, within the node's relaunch budget; past the cap or
the budget the job fails), given to the whole role's plan.

The record of a change (:class:`ScalingRecord`) carries what the live
executor reports as its overhead: the time from the plan until every node
of it trains.  CPU allocated is the plan's.

Scalers see what the brain service sees: the monitor core's statistics
(:class:`pacer_services.monitor.core.MonitorCore`), fed the node events the
executor publishes (created, running, died), the agents' reports and the
shard counts (:meth:`JobSim.stats`).

Pure: no IO, no clock; measurement noise comes from the job's own seeded
generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
from pacer.contracts.agent import AgentMetrics, Heartbeat
from pacer.contracts.common import Role
from pacer.contracts.executor import ExecutorJob, ExecutorJobState, NodePhase, NodeRecord
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetMode, DatasetStatus
from pacer.subjects import NodeEventKind
from pacer_services.brain.core.cluster import ScalingKind, ScalingRecord, plan_resources
from pacer_services.monitor.core import MonitorConfig, MonitorCore
from pacer_services.pod_executor.core import (
    ExecutorPolicy,
    ExitDecision,
    ExitInfo,
    Node,
    NodeSpec,
    Plan,
    answer_exit,
    plan_change,
)
from pacer_services.pod_executor.core.record import apply_exit

from .truth import JobTruth, cores_used, ps_rss_mb, throughput
from .types import JobRun, SimConfig, SimJob, plan_summary

__all__ = ["JobSim", "executor_plan"]

_SHARD = 100  # batches per shard, for the shard counts of the statistics
# A node's phase, as the monitor learns it from the executor's events and the agents' reports.
_ABSENT, _PENDING, _INIT, _TRAINING = 0, 1, 2, 3  # no pod / pod pending / trainer starting / training
_OOM_EXIT = ExitInfo(code=137, oom=True)  # what a backend reports of a node killed over its memory limit
_NO_PLAN = ResourcePlan("sim", 0, 0, 0.0, 0, 0.0, 0, PlanSource.DEFAULT)  # a record's plan before the first


def executor_plan(plan: ResourcePlan) -> Plan:
    """The executor core's view of a resource plan."""
    return Plan(plan.workers, plan.ps, NodeSpec(Role.WORKER.value, 0, plan.worker_cpu, plan.worker_memory_mb),
                NodeSpec(Role.PS.value, 0, plan.ps_cpu, plan.ps_memory_mb))


@dataclass(frozen=True, slots=True)
class _PsSet:
    """The PS that serve the model: how many, their size, and when they came up (trainers running)."""

    count: int
    cpu: float
    memory_mb: int
    up_at: float


@dataclass(frozen=True, slots=True)
class _Migration:
    """A PS migration under way: at ``switch_at`` the new PS take over and every worker restarts."""

    switch_at: float
    ps: _PsSet
    worker_cpu: dict[int, float]  # slot -> the size it restarts with
    worker_memory_mb: dict[int, int]


class JobSim:
    """The state of one running job; advanced tick by tick by the runners."""

    def __init__(self, job: SimJob, truth: JobTruth, cfg: SimConfig, noise_rng: np.random.Generator,
                 *, window_s: float | None = None) -> None:
        self.job, self.truth, self.cfg, self.rng = job, truth, cfg, noise_rng
        self.policy: ExecutorPolicy = cfg.executor
        # The monitor's windows hold each node's last report (short) and last two (long): reports come
        # every ``window_s`` (:meth:`stats`), a window half a tick shorter leaves the previous one out.
        w = cfg.adjust_interval_s if window_s is None else window_s
        self.monitor = MonitorCore(MonitorConfig(window_short_s=w - cfg.tick_s / 2,
                                                 window_long_s=2 * w - cfg.tick_s / 2))
        self._w_phase = np.zeros(0, dtype=np.int64)  # per worker slot: the phase the monitor was told
        self._ps_told: tuple[_PsSet | None, int] = (None, _ABSENT)  # the PS set and phase the monitor was told
        self.plan: ResourcePlan | None = None
        # per worker slot (index = slot): size, and its current outage [down, ready) (trains outside it)
        self.w_cpu = np.zeros(0)
        self.w_mem = np.zeros(0, dtype=np.int64)
        self.w_down = np.zeros(0)
        self.ready = np.zeros(0)
        self.w_oom_mb = np.zeros(0, dtype=np.int64)  # memory an OOM relaunch gave the slot (Node.oom_memory_mb)
        self.worker_samples = np.zeros(0)  # per worker: samples since its (re)start
        self.worker_interval = np.zeros(0)  # per worker: samples since the last report (this incarnation)
        self.worker_busy = np.zeros(0)  # per worker: seconds trained since the last report (this incarnation)
        self.ps: _PsSet | None = None
        self.migration: _Migration | None = None
        self.node_restarts: dict[str, int] = {}  # relaunches after failures, per node (the executor's budget)
        self.done = 0.0
        self.trained_s = 0.0
        self.ckpt = (0.0, 0.0)  # (samples, trained_s) of the last checkpoint
        self.last_ckpt_t = 0.0
        self.finished_at: float | None = None
        self.failed = ""  # why the executor failed the job ("" while it has not)
        self.started_at: float | None = None
        self.interval_t0 = 0.0
        self.timeline: list[tuple[float, float, str]] = []
        self.core_h_alloc = 0.0
        self.core_h_used = 0.0
        self.scalings = 0
        self.oom_failures = 0
        self.pause_total_s = 0.0
        self.rejected = 0
        self.last_psi = -1.0
        self.last_stats: JobStatistics | None = None

    @property
    def over(self) -> bool:
        """Finished or failed: nothing more happens to it."""
        return self.finished_at is not None or bool(self.failed)

    # -- plans

    def valid(self, plan: ResourcePlan, quota_cpu: float | None = None) -> bool:
        c = self.cfg
        quota = c.quota_cpu if quota_cpu is None else quota_cpu
        res = plan_resources(plan)
        return (plan.workers >= 1 and plan.ps >= 1 and 0 < plan.worker_cpu <= c.max_pod_cpu
                and 0 < plan.ps_cpu <= c.max_pod_cpu and plan.worker_memory_mb > 0 and plan.ps_memory_mb > 0
                and res.cpu <= quota + 1e-9
                and (c.quota_memory_mb is None or res.memory_mb <= c.quota_memory_mb + 1e-9))

    def nodes(self, now: float) -> dict[str, Node]:
        """The job's nodes as the executor tracks them."""
        out: dict[str, Node] = {}
        for i in range(len(self.ready)):
            spec = NodeSpec(Role.WORKER.value, i, float(self.w_cpu[i]), int(self.w_mem[i]))
            state = NodePhase.RUNNING if now >= self.w_down[i] + self.cfg.pending_s or now >= self.ready[i] \
                else NodePhase.PENDING
            out[f"worker-{i}"] = Node(spec, restarts=self.node_restarts.get(f"worker-{i}", 0), state=state.value,
                                      oom_memory_mb=int(self.w_oom_mb[i]))
        if self.ps is not None:
            for j in range(self.ps.count):
                spec = NodeSpec(Role.PS.value, j, self.ps.cpu, self.ps.memory_mb)
                out[f"ps-{j}"] = Node(spec, restarts=self.node_restarts.get(f"ps-{j}", 0),
                                      state=NodePhase.RUNNING.value)
        return out

    def _resize_workers(self, n: int) -> None:
        """Keep the first ``n`` worker slots (new ones empty)."""
        have = len(self.ready)
        if n <= have:
            for a in ("w_cpu", "w_mem", "w_down", "ready", "w_oom_mb", "worker_samples", "worker_interval",
                      "worker_busy"):
                setattr(self, a, getattr(self, a)[:n])
            return
        extra = n - have
        self.w_cpu = np.concatenate([self.w_cpu, np.zeros(extra)])
        self.w_mem = np.concatenate([self.w_mem, np.zeros(extra, dtype=np.int64)])
        self.w_down = np.concatenate([self.w_down, np.zeros(extra)])
        self.ready = np.concatenate([self.ready, np.zeros(extra)])
        self.w_oom_mb = np.concatenate([self.w_oom_mb, np.zeros(extra, dtype=np.int64)])
        self.worker_samples = np.concatenate([self.worker_samples, np.zeros(extra)])
        self.worker_interval = np.concatenate([self.worker_interval, np.zeros(extra)])
        self.worker_busy = np.concatenate([self.worker_busy, np.zeros(extra)])

    def _down(self, i: int, at: float) -> None:
        """Worker slot ``i`` stops at ``at`` and trains again ``restart_s`` later (a new pod)."""
        self.w_down[i] = at
        self.ready[i] = at + self.cfg.restart_s
        self.worker_samples[i] = 0.0

    def apply(self, plan: ResourcePlan, now: float, *, restart: bool = False) -> ScalingRecord | None:
        """Apply a plan; the record of what it cost (None when nothing changed).

        ``restart``: an OOM relaunch (:meth:`oom`): every node restarts and
        the job resumes from its last checkpoint.
        """
        old = self.plan
        kind = ScalingKind.between(old, plan)
        if kind is ScalingKind.NONE and not restart:
            return None
        cfg = self.cfg
        if old is None or restart:
            # the first start, or a relaunch after an OOM: every node (re)starts
            self._resize_workers(plan.workers)
            self.w_cpu[:] = plan.worker_cpu
            self.w_mem[:] = np.maximum(plan.worker_memory_mb, self.w_oom_mb)
            self.w_down[:] = now
            self.ready[:] = now + cfg.restart_s
            self.worker_samples[:] = 0.0
            self.ps = _PsSet(plan.ps, plan.ps_cpu, plan.ps_memory_mb, now + cfg.restart_s)
            self.migration = None
            done_at = now + cfg.restart_s
            if kind is ScalingKind.NONE:
                kind = ScalingKind.PS
        else:
            done_at = self._change(old, plan, now)
        self.plan = plan
        return ScalingRecord(kind=kind, pause_s=done_at - now)

    def _change(self, old: ResourcePlan, plan: ResourcePlan, now: float) -> float:
        """What the executor does for a re-plan (:func:`plan_change`); when every node of ``plan`` trains."""
        cfg = self.cfg
        ch = plan_change(executor_plan(old), executor_plan(plan), self.nodes(now), self.policy,
                         migrating=self.migration is not None)
        done_at = now
        # scale-down stops the highest slots, scale-up fills the next ones
        self._resize_workers(plan.workers)
        for spec in ch.start:
            if spec.role == Role.WORKER:
                self.w_cpu[spec.index], self.w_mem[spec.index] = spec.cpu, spec.memory_mb
                self.w_oom_mb[spec.index] = 0
                self._down(spec.index, now)
                done_at = max(done_at, now + cfg.restart_s)
        for spec in ch.grow:  # more memory in place: no restart, no pause
            if spec.role == Role.WORKER:
                self.w_mem[spec.index] = spec.memory_mb
            elif self.ps is not None:
                self.ps = replace(self.ps, memory_mb=max(self.ps.memory_mb, spec.memory_mb))
        sizes = {s.index: s for s in ch.resize}
        # the rolling replacement: a batch at a time, each down restart_s while the others train
        for k, batch in enumerate(ch.resize_batches):
            at = now + k * cfg.restart_s
            for i in batch:
                self.w_cpu[i], self.w_mem[i] = sizes[i].cpu, sizes[i].memory_mb
                self._down(i, at)
            done_at = max(done_at, at + cfg.restart_s)
        if ch.migrate_ps:
            done_at = max(done_at, self._migrate(plan, now, {s.index: s for s in ch.resize}))
        return done_at

    def _migrate(self, plan: ResourcePlan, now: float, sizes: dict[int, NodeSpec]) -> float:
        """Start a seamless PS migration to ``plan``'s PS; when its workers train again."""
        cfg = self.cfg
        switch = now + cfg.restart_s  # the new PS start beside the old ones
        cpu = {i: s.cpu for i, s in sizes.items()}  # plan_change's sizes for the workers that differ
        mem = {i: s.memory_mb for i, s in sizes.items()}
        self.migration = _Migration(switch, _PsSet(plan.ps, plan.ps_cpu, plan.ps_memory_mb, switch), cpu, mem)
        return switch + cfg.restart_s

    def _advance(self, now: float) -> None:
        """A migration whose new PS are up switches: checkpoint, every worker restarts on the new PS."""
        mig = self.migration
        if mig is None or now + 1e-9 < mig.switch_at:
            return
        self.migration = None
        self.ckpt = (self.done, self.trained_s)  # the chief's checkpoint: nothing is lost
        self.last_ckpt_t = now
        self.ps = mig.ps
        for i in range(len(self.ready)):
            self.w_cpu[i] = mig.worker_cpu.get(i, self.w_cpu[i])
            self.w_mem[i] = mig.worker_memory_mb.get(i, self.w_mem[i])
            self._down(i, mig.switch_at)
        plan = self.plan
        if plan is not None and (plan.ps, plan.ps_cpu, plan.ps_memory_mb) != (
                self.ps.count, self.ps.cpu, self.ps.memory_mb):
            self._migrate(plan, now, {})  # a PS change that waited for this migration (ps_deferred)

    # -- OOM

    def oom_node(self, now: float) -> tuple[str, str] | None:
        """The first node over its memory limit, if any (only training processes can OOM)."""
        if self.plan is None or self.ps is None:
            return None
        mask = self._training(now)
        if not mask.any():
            return None
        over = np.nonzero(mask & (self.w_mem < self.truth.worker_base_mb))[0]
        if len(over):
            return f"worker-{int(over[0])}", Role.WORKER.value
        for j, rss in enumerate(ps_rss_mb(self.truth, self.ps.count, self.trained_s)):
            if rss > self.ps.memory_mb:
                return f"ps-{j}", Role.PS.value
        return None

    def on_exit(self, node: str, now: float) -> ExitDecision:
        """The executor core's answer to ``node`` dying of OOM (its relaunch budget spent by one)."""
        n = self.nodes(now)[node]
        ans = answer_exit(n, _OOM_EXIT, policy=self.policy)
        # The live executor's bookkeeping of the exit, on a record of this node (core.record).
        rec = NodeRecord(node, n.spec.role, n.spec.index, n.spec.cpu, n.spec.memory_mb, restarts=n.restarts,
                         requested_restarts=n.requested_restarts, oom_memory_mb=n.oom_memory_mb,
                         state=NodePhase(n.state))
        job = ExecutorJob("sim", ExecutorJobState.RUNNING, self.plan or _NO_PLAN, cluster="", nodes=[rec])
        apply_exit(job, rec, ans, exit_code=_OOM_EXIT.code)
        self.node_restarts[node] = rec.restarts
        if n.spec.role == Role.WORKER:
            self.w_oom_mb[n.spec.index] = rec.oom_memory_mb
        return ans.decision

    def relaunch_plan(self, node: str, now: float) -> ResourcePlan | None:
        """The plan after the executor relaunches OOM-killed ``node`` (its role's memory as
        :meth:`on_exit` says), or None when the executor fails the job instead (:attr:`failed`)."""
        assert self.plan is not None
        d = self.on_exit(node, now)
        if d.relaunch is None:
            self.failed = d.detail or f"{node}: {d.reason.value}"
            return None
        if d.relaunch.role == Role.PS:
            return replace(self.plan, ps_memory_mb=d.relaunch.memory_mb, reason=f"OOM relaunch: {d.detail}")
        return replace(self.plan, worker_memory_mb=d.relaunch.memory_mb, reason=f"OOM relaunch: {d.detail}")

    def oom(self, now: float) -> None:
        """An OOM: back to the last checkpoint (the caller applies the relaunch plan)."""
        self.oom_failures += 1
        self.done, self.trained_s = self.ckpt
        self.last_ckpt_t = now

    # -- time

    def _training(self, now: float) -> npt.NDArray[np.bool_]:
        out: npt.NDArray[np.bool_] = (self.ready <= now) | (now < self.w_down)
        return out

    def running_workers(self, now: float) -> int:
        if self.plan is None:
            return 0
        return int(np.count_nonzero(self._training(now)))

    def _sizes(self, mask: npt.NDArray[np.bool_]) -> list[tuple[float, int]]:
        """(CPU size, count) of the training workers ``mask``: one size but during a replacement."""
        cpus = self.w_cpu[mask]
        if len(cpus) == 0:
            return []
        if (cpus == cpus[0]).all():
            return [(float(cpus[0]), len(cpus))]
        sizes, counts = np.unique(cpus, return_counts=True)
        return [(float(c), int(k)) for c, k in zip(sizes, counts, strict=True)]

    def _psi(self, mask: npt.NDArray[np.bool_]) -> float:
        """True throughput of the training workers ``mask`` on the serving PS."""
        ps = self.ps
        sizes = self._sizes(mask)
        n = sum(k for _, k in sizes)
        if n == 0 or ps is None:
            return 0.0
        return float(sum(k / n * float(throughput(self.truth, n, ps.count, c, ps.cpu)) for c, k in sizes))

    def step(self, now: float, dt: float) -> None:
        """Train from ``now`` for ``dt`` seconds (or until the job finishes)."""
        plan = self.plan
        if plan is None or self.over:
            return
        self._advance(now)
        self._tell_monitor(now)
        mask = self._training(now)
        # a worker that stopped lost what it had not reported (the monitor drops a dead node's samples)
        self.worker_interval[~mask] = 0.0
        self.worker_busy[~mask] = 0.0
        n = int(np.count_nonzero(mask))
        psi = self._psi(mask)
        if psi != self.last_psi:
            self.timeline.append((now - self.job.submitted_at, psi, plan_summary(plan)))
            self.last_psi = psi
        span = dt
        if psi > 0.0:
            left = self.job.samples_total - self.done
            if psi * dt >= left:
                span = left / psi
                self.finished_at = now + span
            self.done = min(float(self.job.samples_total), self.done + psi * span)
            self.trained_s += span
            self.worker_samples[mask] += psi * span / n
            self.worker_interval[mask] += psi * span / n
            self.worker_busy[mask] += span
            if now + span - self.last_ckpt_t >= self.cfg.checkpoint_s:
                self.ckpt = (self.done, self.trained_s)
                self.last_ckpt_t = now + span
        else:
            self.pause_total_s += span
        w_used, ps_used = self._cpu_used(mask, psi)
        used = sum(w_used[c] * k for c, k in self._sizes(mask)) + sum(ps_used)
        self.core_h_alloc += plan_resources(plan).cpu * span / 3600.0
        self.core_h_used += used * span / 3600.0

    def _cpu_used(self, mask: npt.NDArray[np.bool_], psi: float) -> tuple[dict[float, float], list[float]]:
        """(cores used by a training worker of each size, cores used by each serving PS) at throughput ``psi``."""
        ps = self.ps
        sizes = self._sizes(mask)
        n = sum(k for _, k in sizes)
        if ps is None:
            return {}, []
        ps_cores = cores_used(self.truth, 0.0, ps.count, ps.cpu, n, psi)[1]
        return {c: cores_used(self.truth, c, ps.count, ps.cpu, n, psi)[0] for c, _ in sizes}, ps_cores

    # -- what the monitor sees and publishes

    def _worker_phases(self, now: float) -> npt.NDArray[np.int64]:
        pending = (self.w_down <= now) & (now < self.w_down + self.cfg.pending_s)
        init = (self.w_down + self.cfg.pending_s <= now) & (now < self.ready)
        out: npt.NDArray[np.int64] = np.where(pending, _PENDING, np.where(init, _INIT, _TRAINING))
        return out

    def _ps_phase(self, now: float) -> int:
        ps = self.ps
        if ps is None:
            return _ABSENT
        return _PENDING if now < ps.up_at - self.cfg.init_s else _INIT if now < ps.up_at else _TRAINING

    def _event(self, node: str, role: Role, kind: str, now: float, reason: str = "") -> None:
        self.monitor.observe_node_event(NodeEvent(self.job.name, node, kind, now, reason=reason, role=role.value), now)

    def _moved(self, node: str, role: Role, before: int, after: int, now: float, reason: str = "") -> None:
        """Tell the monitor, as the executor's node events do, that ``node`` went from phase ``before`` to ``after``.

        A node back in an earlier phase was restarted in between (a new pod).
        """
        restarted = _ABSENT < after < before
        if before != _ABSENT and (after == _ABSENT or restarted):
            self._event(node, role, NodeEventKind.DIED, now, reason or "killed")
        if after == _ABSENT:
            return
        if before == _ABSENT or restarted:
            self._event(node, role, NodeEventKind.CREATED, now)
        if after >= _INIT and (before < _INIT or restarted):
            self._event(node, role, NodeEventKind.RUNNING, now)

    def _tell_monitor(self, now: float, reason: str = "") -> None:
        """The node events since the last call: pods created, running, died (the executor's view)."""
        phases = self._worker_phases(now)
        told, now_at = self._w_phase, phases
        if len(told) != len(now_at):
            n = max(len(told), len(now_at))
            told = np.pad(told, (0, n - len(told)), constant_values=_ABSENT)
            now_at = np.pad(now_at, (0, n - len(now_at)), constant_values=_ABSENT)
        for i in np.nonzero(told != now_at)[0]:
            self._moved(f"worker-{i}", Role.WORKER, int(told[i]), int(now_at[i]), now, reason)
        self._w_phase = phases
        ps_before, phase_before = self._ps_told
        phase = self._ps_phase(now)
        if self.ps is not ps_before:  # a new PS set (a first start, a migration's switch, an OOM relaunch)
            old = 0 if ps_before is None else ps_before.count
            new = 0 if self.ps is None else self.ps.count
            for j in range(max(old, new)):
                if j < old:
                    self._moved(f"ps-{j}", Role.PS, phase_before, _ABSENT, now, reason)
                if j < new:
                    self._moved(f"ps-{j}", Role.PS, _ABSENT, phase, now)
        elif phase != phase_before and self.ps is not None:
            for j in range(self.ps.count):
                self._moved(f"ps-{j}", Role.PS, phase_before, phase, now, reason)
        self._ps_told = (self.ps, phase)

    def stats(self, now: float) -> JobStatistics:
        """The monitor's statistics at ``now``, from what the nodes' agents report since the last call.

        The job's nodes report as agents do (:class:`AgentMetrics` over the
        steps since their last report, :class:`Heartbeat` while their trainer
        starts), the executor's node events say which run, and the shard
        service's counts come as a :class:`DatasetStatus`; the statistics are
        the monitor core's (:class:`MonitorCore`), as the brain service gets
        them.  Noise: one lognormal factor per report for the job's training
        speed (its workers share input pipeline and network), one per node
        for its CPU and memory readings.
        """
        self._advance(now)
        self._tell_monitor(now)
        plan, ps = self.plan, self.ps
        assert plan is not None and ps is not None
        cfg, t, job = self.cfg, self.truth, self.job
        mask = self._training(now)
        psi = self._psi(mask)
        w_used, ps_cores = self._cpu_used(mask, psi)

        def noisy(x: float) -> float:
            return x * float(self.rng.lognormal(0.0, cfg.noise)) if cfg.noise > 0 else x

        speed_noise = noisy(1.0)
        phases = self._worker_phases(now)
        m = job.batch_size
        for i in range(len(self.ready)):
            name = f"worker-{i}"
            cores = w_used[float(self.w_cpu[i])] if mask[i] else 0.0
            busy, done = float(self.worker_busy[i]), float(self.worker_interval[i])
            if mask[i] and busy > 0 and done > 0:
                steps = max(1, round(done / m))
                self.monitor.observe_metrics(AgentMetrics(
                    job=job.name, node=name, role=Role.WORKER.value, ts=now, local_step=0, iteration=0,
                    bpt_s=busy / steps / speed_noise, batch_size=m, samples_per_s=done / busy * speed_noise,
                    samples_total=int(self.worker_samples[i]),
                    cpu_percent=min(noisy(cores * 100.0), float(self.w_cpu[i]) * 100.0),
                    rss_bytes=int(noisy(t.worker_base_mb) * 2**20), last_action_seq=0, last_action_iteration=-1,
                    primary=i == 0, steps=steps), now)
            elif phases[i] >= _INIT:
                self.monitor.observe_heartbeat(Heartbeat(job.name, name, Role.WORKER.value, now, "sim", i == 0,
                                                         True), now)
        if self._ps_phase(now) >= _INIT:
            rss = ps_rss_mb(t, ps.count, self.trained_s)
            for j in range(ps.count):
                self.monitor.observe_metrics(AgentMetrics(
                    job=job.name, node=f"ps-{j}", role=Role.PS.value, ts=now, local_step=0, iteration=0,
                    bpt_s=0.0, batch_size=m, samples_per_s=0.0, samples_total=0,
                    cpu_percent=min(noisy(ps_cores[j] * 100.0), ps.cpu * 100.0),
                    rss_bytes=int(noisy(min(rss[j], ps.memory_mb)) * 2**20), last_action_seq=0,
                    last_action_iteration=-1, primary=False), now)
        shard = m * _SHARD
        total_shards = math.ceil(job.samples_total / shard)
        done_shards = int(self.done // shard)
        doing = min(plan.workers, total_shards - done_shards)
        self.monitor.observe_shards(DatasetStatus(
            job=job.name, dataset="sim", mode=DatasetMode.FINITE, epoch=0, epochs=1,
            todo=total_shards - done_shards - doing, doing=doing, done=done_shards, failed=0,
            records_total=job.samples_total, records_done=int(self.done), records_duplicated=0,
            finished=self.finished_at is not None, closed=True), now)
        st: JobStatistics = self.monitor.statistics(job.name, now)
        self.interval_t0 = now
        self.worker_interval[:] = 0.0
        self.worker_busy[:] = 0.0
        self.last_stats = st
        return st

    def result(self, scaler: str) -> JobRun:
        end = self.finished_at
        return JobRun(
            job=self.job.name, profile=self.truth.profile, scaler=scaler,
            jct_s=None if end is None else end - self.job.submitted_at,
            started_s=None if self.started_at is None else self.started_at - self.job.submitted_at,
            samples_total=self.job.samples_total, samples_done=int(self.done),
            timeline=list(self.timeline), cpu_core_hours_allocated=self.core_h_alloc,
            cpu_core_hours_used=self.core_h_used, scalings=self.scalings, oom_failures=self.oom_failures,
            pause_s=self.pause_total_s, rejected=self.rejected, final_plan=self.plan, failed=self.failed,
        )
