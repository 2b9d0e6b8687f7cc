"""One simulated job: its nodes, progress, checkpoints and costs, advanced tick by tick by the runners.

Runtime (DLRover-RM §6 setup): a 200-CPU quota per job, pods of at most 32
CPUs, a decision every 3 minutes, a new pod pending ~20 s and initialising
~100 s.  Time advances in fixed ticks.  Adding workers lets the running ones
go on training (the new ones join after ``pending_s + init_s``); removing
workers is immediate; any change of the PS (count, CPU, memory) or of the
worker pod size restarts the job from a checkpoint taken at that moment
(pause ``pending_s + init_s``, progress kept).  An OOM loses the progress
since the last periodic checkpoint and relaunches with double memory (as
:mod:`pacer_services.pod_executor.core` does, DLRover 2023 §4.2) unless the
scaler says otherwise.

Pure: no IO, no clock; measurement noise comes from the job's own seeded
generator.
"""

from __future__ import annotations

import math

import numpy as np
from pacer.contracts.jobs import ResourcePlan
from pacer.contracts.monitor import JobStatistics, NodeState, NodeStats, ShardSummary
from pacer_services.brain.core.cluster import ScalingKind, ScalingRecord, plan_resources

from .truth import JobTruth, cpu_used, ps_rss_mb, throughput
from .types import JobRun, SimConfig, SimJob, plan_summary

__all__ = ["JobSim"]

_SHARD = 100  # batches per shard, for the shard counts of the statistics


class JobSim:
    """The state of one running job; advanced tick by tick by the runners."""

    def __init__(self, job: SimJob, truth: JobTruth, cfg: SimConfig, noise_rng: np.random.Generator) -> None:
        self.job, self.truth, self.cfg, self.rng = job, truth, cfg, noise_rng
        self.plan: ResourcePlan | None = None
        self.paused_until = 0.0
        self.ready = np.zeros(0)  # per worker: time it starts training
        self.worker_samples = np.zeros(0)  # per worker: samples since its (re)start
        self.worker_interval = np.zeros(0)  # per worker: samples since the last statistics
        self.done = 0.0
        self.trained_s = 0.0
        self.ckpt = (0.0, 0.0)  # (samples, trained_s) of the last checkpoint
        self.last_ckpt_t = 0.0
        self.finished_at: float | None = None
        self.started_at: float | None = None
        self.interval_t0 = 0.0
        self.interval_samples = 0.0
        self.timeline: list[tuple[float, float, str]] = []
        self.core_h_alloc = 0.0
        self.core_h_used = 0.0
        self.scalings = 0
        self.oom_failures = 0
        self.pause_total_s = 0.0
        self.rejected = 0
        self.restarts = 0
        self.last_psi = -1.0
        self.last_stats: JobStatistics | None = None

    # -- plans

    def valid(self, plan: ResourcePlan, quota_cpu: float | None = None) -> bool:
        c = self.cfg
        quota = c.quota_cpu if quota_cpu is None else quota_cpu
        res = plan_resources(plan)
        return (plan.workers >= 1 and plan.ps >= 1 and 0 < plan.worker_cpu <= c.max_pod_cpu
                and 0 < plan.ps_cpu <= c.max_pod_cpu and plan.worker_memory_mb > 0 and plan.ps_memory_mb > 0
                and res.cpu <= quota + 1e-9
                and (c.quota_memory_mb is None or res.memory_mb <= c.quota_memory_mb + 1e-9))

    def apply(self, plan: ResourcePlan, now: float, *, restart: bool = False) -> ScalingRecord | None:
        """Apply a plan; the record of what it cost (None when nothing changed)."""
        old = self.plan
        kind = ScalingKind.between(old, plan)
        if kind is ScalingKind.NONE and not restart:
            return None
        if old is not None and not restart and kind is ScalingKind.WORKERS and (
            (old.worker_cpu, old.worker_memory_mb) == (plan.worker_cpu, plan.worker_memory_mb)
        ):
            # only the worker count changes: the running workers keep training
            if plan.workers > old.workers:
                start = max(now, self.paused_until) + self.cfg.restart_s
                extra = plan.workers - old.workers
                self.ready = np.concatenate([self.ready, np.full(extra, start)])
                self.worker_samples = np.concatenate([self.worker_samples, np.zeros(extra)])
                self.worker_interval = np.concatenate([self.worker_interval, np.zeros(extra)])
                pause = start - now
            else:
                self.ready = self.ready[: plan.workers]
                self.worker_samples = self.worker_samples[: plan.workers]
                self.worker_interval = self.worker_interval[: plan.workers]
                pause = 0.0
        else:
            # a restart of the whole job from a checkpoint (taken now, unless an OOM lost it)
            if not restart and old is not None:
                self.ckpt = (self.done, self.trained_s)
                self.last_ckpt_t = now
            self.paused_until = now + self.cfg.restart_s
            self.ready = np.full(plan.workers, self.paused_until)
            self.worker_samples = np.zeros(plan.workers)
            self.worker_interval = np.zeros(plan.workers)
            pause = self.cfg.restart_s
            self.pause_total_s += pause
            if old is not None:
                self.restarts += 1
            if kind is ScalingKind.NONE:
                kind = ScalingKind.PS
        self.plan = plan
        return ScalingRecord(kind=kind, pause_s=pause)

    # -- time

    def running_workers(self, now: float) -> int:
        if self.plan is None or now < self.paused_until:
            return 0
        return int(np.count_nonzero(self.ready <= now))

    def oom_node(self, now: float) -> tuple[str, str] | None:
        """The first node over its memory limit, if any (only running processes can OOM)."""
        plan = self.plan
        if plan is None or now < self.paused_until:
            return None
        if self.truth.worker_base_mb > plan.worker_memory_mb and self.running_workers(now) > 0:
            return "worker-0", "worker"
        for j, rss in enumerate(ps_rss_mb(self.truth, plan.ps, self.trained_s)):
            if rss > plan.ps_memory_mb:
                return f"ps-{j}", "ps"
        return None

    def oom(self, now: float) -> None:
        """An OOM: back to the last checkpoint (the caller applies the relaunch plan)."""
        self.oom_failures += 1
        self.done, self.trained_s = self.ckpt
        self.last_ckpt_t = now

    def step(self, now: float, dt: float) -> None:
        """Train from ``now`` for ``dt`` seconds (or until the job finishes)."""
        plan = self.plan
        if plan is None or self.finished_at is not None:
            return
        n = self.running_workers(now)
        psi = float(throughput(self.truth, n, plan.ps, plan.worker_cpu, plan.ps_cpu)) if n else 0.0
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
            self.interval_samples += psi * span
            mask = self.ready <= now
            self.worker_samples[mask] += psi * span / n
            self.worker_interval[mask] += psi * span / n
            if now + span - self.last_ckpt_t >= self.cfg.checkpoint_s:
                self.ckpt = (self.done, self.trained_s)
                self.last_ckpt_t = now + span
        worker, ps = cpu_used(self.truth, plan, n, psi)
        self.core_h_alloc += plan_resources(plan).cpu * span / 3600.0
        self.core_h_used += (worker * n + sum(ps)) * span / 3600.0

    # -- what the monitor would publish

    def stats(self, now: float) -> JobStatistics:
        plan = self.plan
        assert plan is not None
        cfg, t, job = self.cfg, self.truth, self.job
        span = max(now - self.interval_t0, 1e-9)
        n = self.running_workers(now)
        psi = float(throughput(t, n, plan.ps, plan.worker_cpu, plan.ps_cpu)) if n else 0.0
        w_cores, ps_cores = cpu_used(t, plan, n, psi)

        def noisy(x: float) -> float:
            return x * float(self.rng.lognormal(0.0, cfg.noise)) if cfg.noise > 0 else x

        worker_speed = self.worker_interval / span
        nodes: list[NodeStats] = []
        pending = 0
        for i in range(plan.workers):
            ready = float(self.ready[i])
            is_pending = now < ready - cfg.init_s
            pending += is_pending
            speed = noisy(float(worker_speed[i]))
            bpt = job.batch_size / speed if speed > 0 else 0.0
            training = ready <= now and now >= self.paused_until
            nodes.append(NodeStats(
                node=f"worker-{i}", role="worker", bpt_short_s=bpt, bpt_long_s=bpt,
                speed_samples_per_s=speed, samples_total=int(self.worker_samples[i]),
                cpu_percent=min(noisy(w_cores * 100.0), plan.worker_cpu * 100.0) if training else 0.0,
                rss_bytes=int(noisy(t.worker_base_mb) * 2**20) if not is_pending else 0,
                last_seen=now if not is_pending else 0.0,
                state=NodeState.PENDING if is_pending else NodeState.RUNNING,
                pending_s=min(cfg.pending_s, max(0.0, now - (ready - cfg.restart_s))),
                restarts=self.restarts, slowdown_short=1.0, slowdown_long=1.0,
            ))
        ps_pending = now < self.paused_until - cfg.init_s
        rss = ps_rss_mb(t, plan.ps, self.trained_s)
        for j in range(plan.ps):
            pending += ps_pending
            nodes.append(NodeStats(
                node=f"ps-{j}", role="ps", bpt_short_s=0.0, bpt_long_s=0.0, speed_samples_per_s=0.0,
                samples_total=0, cpu_percent=min(noisy(ps_cores[j] * 100.0), plan.ps_cpu * 100.0),
                rss_bytes=0 if ps_pending else int(noisy(min(rss[j], plan.ps_memory_mb)) * 2**20),
                last_seen=0.0 if ps_pending else now,
                state=NodeState.PENDING if ps_pending else NodeState.RUNNING,
                pending_s=cfg.pending_s if self.restarts or ps_pending else 0.0,
                restarts=self.restarts, slowdown_short=1.0, slowdown_long=1.0,
            ))
        shard = job.batch_size * _SHARD
        total_shards = math.ceil(job.samples_total / shard)
        done_shards = int(self.done // shard)
        doing = min(plan.workers, total_shards - done_shards)
        st = JobStatistics(
            job=job.name, ts=now, window_short_s=span, window_long_s=2 * span,
            throughput_samples_per_s=noisy(self.interval_samples / span),
            nodes=sorted(nodes, key=lambda s: s.node), pending_nodes=int(pending),
            shards=ShardSummary(
                todo=total_shards - done_shards - doing, doing=doing, done=done_shards, failed=0,
                records_done=int(self.done), records_total=job.samples_total, datasets=1,
                finished=self.finished_at is not None, updated=now,
            ),
        )
        self.interval_t0 = now
        self.interval_samples = 0.0
        self.worker_interval = np.zeros(plan.workers)
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
            pause_s=self.pause_total_s, rejected=self.rejected, final_plan=self.plan,
        )
