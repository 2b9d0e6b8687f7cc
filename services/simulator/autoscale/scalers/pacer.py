"""Pacer's brain in the autoscaling simulator: the service's :class:`JobAutoscaler`, unchanged.

:class:`PacerScaler` (one job, scaler name ``pacer``) and :class:`PacerCluster`
(jobs sharing a quota, cluster scaler ``pacer``) hand the simulated
monitor's statistics to the same pure core the brain service runs
(:mod:`pacer_services.brain.core.autoscaler`): the sample plan
(DLRover 2023 §4.2), optimize (Eq. 10-11), the adjust stage with the online
NNLS fit of DLRover-RM Eq. 1-6, NSGA-II candidates and the Eq. 8-14 choice,
and OOM prediction (§5.3).  Like the service they read every monitor
window (``every_window``) and the core paces itself to the adjust
interval.  The stages' C_total is the job's CPU quota and C_max the largest
pod (the simulator's ``quota_cpu`` and ``max_pod_cpu``).

An OOM the core does not answer (after the sample stage) is relaunched as
the executor core says (:func:`pacer_services.pod_executor.core.answer_exit`:
the failed role's memory times the policy's factor, capped); the adapter
returns that plan itself so that the core knows the plan in force.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pacer.contracts.jobs import ResourcePlan
from pacer.contracts.monitor import JobStatistics
from pacer_services.brain.core.autoscaler import AutoscaleConfig, JobAutoscaler, same_resources
from pacer_services.brain.core.calibration import Calibration
from pacer_services.brain.core.cluster import Resources, ScalingRecord
from pacer_services.brain.core.fitting import Coefficients
from pacer_services.brain.core.oom import DEFAULT_OOM
from pacer_services.brain.core.round import ReadyJob, cluster_round
from pacer_services.brain.core.stages import StageConfig

from ..types import ClusterJobView, ScalerContext, SimConfig, SimJob

__all__ = ["PacerCluster", "PacerScaler", "autoscale_config"]


def autoscale_config(cfg: SimConfig, *, oom_prediction: bool = True, seed: int = 0,
                     params: dict[str, Any] | None = None) -> AutoscaleConfig:
    """The brain's configuration for the simulator's quota and pod size; ``params`` override knobs."""
    stages = StageConfig(c_total=cfg.quota_cpu, c_max=cfg.max_pod_cpu, ps_cpu_target=min(16.0, cfg.max_pod_cpu))
    out = AutoscaleConfig(stages=stages, adjust_interval_s=cfg.adjust_interval_s,
                          max_memory_mb=None if cfg.quota_memory_mb is None else int(cfg.quota_memory_mb),
                          seed=seed, oom=DEFAULT_OOM if oom_prediction else None)
    known = {k: v for k, v in (params or {}).items() if k in AutoscaleConfig.__dataclass_fields__}
    return replace(out, **known) if known else out


@dataclass(slots=True)
class _Job:
    auto: JobAutoscaler
    proposed: ResourcePlan | None = None  # what we asked for last: in force once on_applied says so
    fed_at: float = -1.0  # ts of the last statistics fed (the cluster runner may hand the same twice)


class PacerScaler:
    """One job under Pacer's brain (simulator scaler ``pacer``)."""

    name = "pacer"
    every_window = True

    def __init__(self, config: AutoscaleConfig, *, warm: ResourcePlan | None = None,
                 prior: Coefficients | None = None, prior_calibration: Calibration | None = None) -> None:
        self.config = config
        self.warm = warm
        self.prior = prior
        self.prior_calibration = prior_calibration
        self.job: _Job | None = None

    def start(self, job: SimJob, now: float) -> ResourcePlan:
        warm = None if self.warm is None else replace(self.warm, job=job.name)
        auto = JobAutoscaler(job.spec, job.batch_size, self.config, first=warm, warm=warm is not None,
                             prior=self.prior, prior_calibration=self.prior_calibration)
        first: ResourcePlan = auto.first_plan()
        self.job = _Job(auto, first)
        return first

    def decide(self, job: SimJob, now: float, stats: JobStatistics) -> ResourcePlan | None:
        assert self.job is not None
        d = self.job.auto.step(now, stats)
        if d is None:
            return None
        plan: ResourcePlan = d.plan
        self.job.proposed = plan
        return plan

    def on_oom(self, job: SimJob, now: float, node: str, role: str, relaunch: ResourcePlan) -> ResourcePlan | None:
        assert self.job is not None
        current = self.job.auto.plan
        out: ResourcePlan | None = self.job.auto.on_oom(role)
        if out is None or current is None or same_resources(out, current):
            out = relaunch
        self.job.proposed = out
        return out

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None:
        assert self.job is not None
        if self.job.auto.plan is not None:
            self.job.auto.paused(record)  # DLRover-RM Eq. 8: the overhead from history
        if self.job.proposed is not None:
            self.job.auto.applied(self.job.proposed, now)

    @property
    def autoscaler(self) -> JobAutoscaler:
        assert self.job is not None
        return self.job.auto


@dataclass(slots=True)
class PacerCluster:
    """Jobs sharing one quota under Pacer's brain (cluster scaler ``pacer``): DLRover-RM §4.3.

    Each call is one round of the live brain's
    (:func:`pacer_services.brain.core.round.cluster_round`): rule decisions
    of the jobs with a new window, then first-come-first-served admission of
    pending jobs with their sample plan, then the weighted greedy selection
    of Eq. 11-14 over what is free plus what the stepped jobs hold.
    """

    config: AutoscaleConfig
    name: str = "pacer"
    every_window: bool = True
    jobs: dict[str, _Job] = field(default_factory=dict)

    def decide_all(self, now: float, jobs: Sequence[ClusterJobView], free: Resources) -> dict[str, ResourcePlan]:
        ready: list[ReadyJob] = []
        for v in jobs:
            j = self.jobs.get(v.job.name)
            if v.plan is not None and j is not None and v.stats is not None and v.stats.ts > j.fed_at:
                j.fed_at = v.stats.ts  # the runner may hand the same window twice: feed it once
                ready.append(ReadyJob(j.auto, v.stats))
        waiting: list[JobAutoscaler] = []
        for v in sorted(jobs, key=lambda v: (v.job.submitted_at, v.job.name)):
            if v.plan is None:
                j = self.jobs.get(v.job.name)
                if j is None:
                    j = self.jobs[v.job.name] = _Job(JobAutoscaler(v.job.spec, v.job.batch_size, self.config))
                waiting.append(j.auto)
        out = cluster_round(ready, free, now, waiting=waiting, prices=self.config.prices, rho=self.config.rho)
        plans: dict[str, ResourcePlan] = out.plans()
        for name, plan in plans.items():
            self.jobs[name].proposed = plan
        return plans

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None:
        j = self.jobs.get(job.name)
        if j is None:
            return
        if j.auto.plan is not None:
            j.auto.paused(record)
        if j.proposed is not None:
            j.auto.applied(j.proposed, now)


def pacer(ctx: ScalerContext) -> PacerScaler:
    """``SCALERS["pacer"]``: params ``oom_prediction`` (default true) and any AutoscaleConfig knob."""
    params = dict(ctx.params)
    oom = bool(params.pop("oom_prediction", True))
    return PacerScaler(autoscale_config(ctx.config, oom_prediction=oom, params=params))


def pacer_cluster(ctx: ScalerContext) -> PacerCluster:
    """``CLUSTER_SCALERS["pacer"]``."""
    params = dict(ctx.params)
    oom = bool(params.pop("oom_prediction", True))
    return PacerCluster(autoscale_config(ctx.config, oom_prediction=oom, params=params))
