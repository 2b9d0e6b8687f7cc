"""The runners of the autoscaling simulator: one job under a scaler, or jobs sharing a cluster.

The runner is the simulated cluster around the scalers: it asks a scaler for
plans on the monitor's schedule, checks them against the quota (a plan that
breaks it is rejected and counted), applies them to the simulated jobs
(:mod:`.jobsim`) and answers OOMs as the executor does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pacer_services.brain.core.cluster import Resources, plan_resources

from .jobsim import JobSim
from .scalers import make_scaler
from .truth import PROFILES, JobTruth, draw_truth, rngs
from .types import (
    AutoscaleError,
    ClusterJobView,
    ClusterRun,
    ClusterScaler,
    JobRun,
    Scaler,
    ScalerContext,
    SharedCluster,
    SimConfig,
    SimJob,
    UserPlan,
    plan_summary,
    sim_job,
)

__all__ = ["cluster_jobs", "run_cluster", "run_job"]


def run_job(
    truth: JobTruth | str,
    scaler: Scaler | str,
    *,
    seed: int = 0,
    samples_total: int | None = None,
    config: SimConfig | None = None,
    user_plan: UserPlan | None = None,
    params: Mapping[str, Any] | None = None,
    name: str = "job",
    draw: bool = True,
) -> JobRun:
    """Simulate one job under ``scaler`` from submission (t = 0) to its last sample.

    ``truth`` is a profile name of :data:`PROFILES` or explicit parameters;
    with ``draw`` the job's true parameters are drawn around it from the seed.
    ``scaler`` is a :class:`Scaler` or a name of :data:`SCALERS`.
    """
    cfg = config or SimConfig()
    if isinstance(truth, str):
        if truth not in PROFILES:
            raise AutoscaleError(f"unknown profile {truth!r}; known: {', '.join(sorted(PROFILES))}")
        prof = PROFILES[truth]
        nominal, total = prof.truth, samples_total or prof.samples_total
    else:
        nominal, total = truth, samples_total or 100_000_000
    truth_rng, noise_rng = rngs(seed, 0)
    true = draw_truth(nominal, truth_rng, cfg.sigma) if draw else nominal
    if isinstance(scaler, str):
        scaler = make_scaler(scaler, ScalerContext(true, total, cfg, user_plan or UserPlan(), params or {}))
    # A scaler that sets ``every_window`` sees every monitor window (and paces itself, as the brain
    # service does); the others are asked once per adjust interval, over the whole interval.
    decide_s = cfg.stats_interval_s if getattr(scaler, "every_window", False) else cfg.adjust_interval_s
    job = sim_job(name, true, total, cfg)
    sim = JobSim(job, true, cfg, noise_rng, window_s=decide_s)
    first = scaler.start(job, 0.0)
    if not sim.valid(first):
        raise AutoscaleError(f"scaler {scaler.name}: first plan {plan_summary(first)} breaks the quota "
                             f"({cfg.quota_cpu:g} CPU, pods <= {cfg.max_pod_cpu:g})")
    rec = sim.apply(first, 0.0)
    sim.started_at = 0.0
    if rec is not None:
        scaler.on_applied(job, 0.0, rec)
    now, dt = 0.0, cfg.tick_s
    next_decide = decide_s
    while not sim.over and now < cfg.max_time_s:
        sim.step(now, dt)
        now += dt
        if sim.over:
            break
        bad = sim.oom_node(now)
        if bad is not None and sim.plan is not None:
            node, role = bad
            sim.oom(now)
            relaunch = sim.relaunch_plan(node, now)  # the executor core's answer (on_exit)
            if relaunch is None:
                break  # the executor failed the job
            new = scaler.on_oom(job, now, node, role, relaunch)
            if new is None or not sim.valid(new):
                new = relaunch
            rec = sim.apply(new, now, restart=True)
            if rec is not None:
                scaler.on_applied(job, now, rec)
        if now + 1e-9 >= next_decide:
            next_decide += decide_s
            new = scaler.decide(job, now, sim.stats(now))
            if new is not None:
                if not sim.valid(new):
                    sim.rejected += 1
                else:
                    rec = sim.apply(new, now)
                    if rec is not None:
                        sim.scalings += 1
                        scaler.on_applied(job, now, rec)
    return sim.result(scaler.name)


def cluster_jobs(spec: SharedCluster, cfg: SimConfig, seed: int) -> list[tuple[SimJob, JobTruth]]:
    """The jobs of a cluster scenario: arrival times, profiles, sizes and true parameters, from the seed."""
    rng = np.random.default_rng([seed, 1_000_003])
    names = [n for n, _ in spec.mix]
    weights = np.array([w for _, w in spec.mix], dtype=np.float64)
    weights /= weights.sum()
    t = 0.0
    out: list[tuple[SimJob, JobTruth]] = []
    for i in range(spec.jobs):
        if i:
            t += float(rng.exponential(spec.arrival_mean_s))
        prof = PROFILES[names[int(rng.choice(len(names), p=weights))]]
        total = int(prof.samples_total * rng.uniform(spec.size_min, spec.size_max))
        truth = draw_truth(prof.truth, rngs(seed, i + 1)[0], cfg.sigma)
        out.append((sim_job(f"job-{i:03d}", truth, total, cfg, submitted_at=t), truth))
    return out


def run_cluster(spec: SharedCluster, scaler: ClusterScaler, seed: int = 0, config: SimConfig | None = None) -> ClusterRun:
    """Simulate the jobs of ``spec`` arriving over time and sharing one quota under ``scaler``.

    ``decide_all`` runs every adjust interval and whenever a job arrives or
    finishes; returned plans are applied in order, each only if the cluster
    total stays within the capacity (else it is rejected and counted).  An
    OOM is answered by the executor core's relaunch (:func:`~pacer_services.pod_executor.core.answer_exit`),
    even if the cluster is then over its memory capacity for a while.
    """
    cfg = config or SimConfig()
    cap = Resources(spec.cpu, spec.memory_mb)
    jobs = cluster_jobs(spec, cfg, seed)
    decide_s = cfg.stats_interval_s if getattr(scaler, "every_window", False) else cfg.adjust_interval_s
    sims = {j.name: JobSim(j, t, cfg, rngs(seed, i + 1)[1], window_s=decide_s) for i, (j, t) in enumerate(jobs)}
    order = [j.name for j, _ in jobs]
    rejected = 0
    now, dt = 0.0, cfg.tick_s
    next_decide = decide_s
    alloc_cpu_s = used_cpu_s = 0.0
    arrived: set[str] = set()

    def held() -> Resources:
        total = Resources()
        for s in sims.values():
            if s.plan is not None and not s.over:
                total = total + plan_resources(s.plan)
        return total

    def decide(now: float) -> None:
        nonlocal rejected
        views = [ClusterJobView(sims[n].job, sims[n].plan, sims[n].last_stats)
                 for n in order if n in arrived and not sims[n].over]
        plans = scaler.decide_all(now, views, cap - held())
        for name, plan in plans.items():
            s = sims.get(name)
            if s is None or name not in arrived or s.over:
                rejected += 1
                continue
            after = held() - plan_resources(s.plan) + plan_resources(plan)
            if not after.fits_in(cap) or not s.valid(plan):
                rejected += 1
                continue
            first = s.plan is None
            rec = s.apply(plan, now)
            if first:
                s.started_at = now
                s.interval_t0 = now
            elif rec is not None:
                s.scalings += 1
            if rec is not None:
                scaler.on_applied(s.job, now, rec)

    while now < cfg.max_time_s:
        changed = False
        for name in order:
            if name not in arrived and sims[name].job.submitted_at <= now:
                arrived.add(name)
                changed = True
        if now + 1e-9 >= next_decide:
            next_decide += decide_s
            for s in sims.values():
                if s.plan is not None and not s.over and now > s.interval_t0:
                    s.stats(now)
            changed = True
        if changed:
            decide(now)
        finished_now = False
        for s in sims.values():
            if s.plan is None or s.over:
                continue
            alloc_cpu_s += plan_resources(s.plan).cpu * dt
            before = s.core_h_used
            s.step(now, dt)
            used_cpu_s += (s.core_h_used - before) * 3600.0
            if s.over:
                finished_now = True
                continue
            bad = s.oom_node(now + dt)
            if bad is not None and s.plan is not None:
                s.oom(now + dt)
                relaunch = s.relaunch_plan(bad[0], now + dt)  # the executor core's answer (on_exit)
                if relaunch is None:
                    finished_now = True  # the executor failed the job: its resources are free
                    continue
                s.apply(relaunch, now + dt, restart=True)
        now += dt
        if finished_now:
            decide(now)
        if len(arrived) == len(order) and all(s.over for s in sims.values()):
            break
    runs = [sims[n].result(scaler.name) for n in order]
    jcts = [r.jct_s for r in runs if r.jct_s is not None]
    ends = [s.finished_at for s in sims.values() if s.finished_at is not None]
    makespan = max(ends) if ends else now
    return ClusterRun(
        scaler=scaler.name, jobs=runs, mean_jct_s=float(np.mean(jcts)) if jcts else None,
        makespan_s=makespan,
        cpu_allocated_util=alloc_cpu_s / (cap.cpu * makespan) if makespan > 0 else 0.0,
        cpu_used_util=used_cpu_s / (cap.cpu * makespan) if makespan > 0 else 0.0,
        rejected=rejected, unfinished=len(runs) - len(jcts),
    )
