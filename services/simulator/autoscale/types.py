"""What the autoscaling simulator's parts exchange: jobs as scalers see them, scaler protocols, results.

A scaler never sees a job's truth (:mod:`.truth`, the oracle aside): it gets a
:class:`SimJob` (spec, batch, dataset size, submission time) and the monitor's
:class:`~pacer.contracts.monitor.JobStatistics`, and answers with
:class:`~pacer.contracts.jobs.ResourcePlan` s.  Single-job scalers follow
:class:`Scaler`, cluster scalers (jobs sharing one quota) :class:`ClusterScaler`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from pacer.contracts.jobs import (
    DataFormat,
    DatasetConfig,
    JobSpec,
    ModelConfig,
    PlanSource,
    ResourceLimits,
    ResourcePlan,
)
from pacer.contracts.monitor import JobStatistics
from pacer.errors import ValidationError
from pacer_services.brain.core.cluster import Resources, ScalingRecord
from pacer_services.pod_executor.core import ExecutorPolicy

from .truth import JobTruth

__all__ = [
    "AutoscaleError",
    "ClusterJobView",
    "ClusterRun",
    "ClusterScaler",
    "JobRun",
    "Scaler",
    "ScalerContext",
    "SharedCluster",
    "SimConfig",
    "SimJob",
    "UserPlan",
    "plan_summary",
    "sim_job",
    "time_to_fraction_of",
]


class AutoscaleError(ValidationError):
    """A scaler's first plan is unusable, or a run cannot be set up (the message says why)."""

    code = "invalid"


@dataclass(frozen=True, slots=True)
class SimJob:
    """What a scaler may know of a job (NOT its true parameters)."""

    name: str
    spec: JobSpec
    batch_size: int  # m, samples per worker per iteration
    samples_total: int
    submitted_at: float


class Scaler(Protocol):
    """A single-job resource scaler (ES, Optimus, oracle, static, Pacer's brain).

    ``on_oom`` is told the plan the executor relaunches with after an OOM
    (``relaunch``, the executor core's answer); it may return another plan
    (a scaler that keeps track of its plan returns ``relaunch`` itself), or
    None to let the executor's answer stand.
    """

    name: str

    def start(self, job: SimJob, now: float) -> ResourcePlan: ...

    def decide(self, job: SimJob, now: float, stats: JobStatistics) -> ResourcePlan | None: ...

    def on_oom(self, job: SimJob, now: float, node: str, role: str, relaunch: ResourcePlan) -> ResourcePlan | None: ...

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None: ...


@dataclass(frozen=True, slots=True)
class ClusterJobView:
    """One job of a cluster as a cluster scaler sees it."""

    job: SimJob
    plan: ResourcePlan | None  # None: pending, not admitted yet
    stats: JobStatistics | None  # None until it has run an interval


class ClusterScaler(Protocol):
    """Plans every job of a cluster sharing one quota."""

    name: str

    def decide_all(self, now: float, jobs: Sequence[ClusterJobView], free: Resources) -> dict[str, ResourcePlan]: ...

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None: ...


@dataclass(frozen=True, slots=True)
class UserPlan:
    """A typical hand-written plan (DLRover-RM §6: users over- or under-provision)."""

    workers: int = 4
    worker_cpu: float = 8.0
    worker_memory_mb: int = 16 * 1024
    ps: int = 2
    ps_cpu: float = 8.0
    ps_memory_mb: int = 16 * 1024

    def plan(self, job: str, reason: str = "user plan") -> ResourcePlan:
        return ResourcePlan(
            job=job, workers=self.workers, ps=self.ps, worker_cpu=self.worker_cpu,
            worker_memory_mb=self.worker_memory_mb, ps_cpu=self.ps_cpu, ps_memory_mb=self.ps_memory_mb,
            source=PlanSource.USER, reason=reason,
        )


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Runtime of the simulation (DLRover-RM §6 defaults)."""

    quota_cpu: float = 200.0  # per job: limits.max_cpu
    quota_memory_mb: float | None = None  # per job: limits.max_memory_mb (None: unbounded)
    max_pod_cpu: float = 32.0
    adjust_interval_s: float = 180.0
    stats_interval_s: float = 60.0  # the monitor's window, for scalers that read every one (``every_window``)
    pending_s: float = 20.0
    init_s: float = 100.0
    checkpoint_s: float = 600.0
    tick_s: float = 10.0
    noise: float = 0.05  # sigma of the multiplicative lognormal measurement noise
    sigma: float = 0.2  # spread of a job's true parameters around its profile
    max_time_s: float = 7 * 86400.0  # give up (unfinished) after this long
    # the executor's limits (OOM memory factor and cap, relaunch budget, rolling replacement's share): the live defaults
    executor: ExecutorPolicy = field(default_factory=ExecutorPolicy)

    @property
    def restart_s(self) -> float:
        return self.pending_s + self.init_s


@dataclass(frozen=True, slots=True)
class ScalerContext:
    """What a scaler factory of the registry gets: ``factory(ctx) -> Scaler``.

    ``truth`` is for the oracle only; a fair scaler must not read it.
    """

    truth: JobTruth
    samples_total: int
    config: SimConfig
    user_plan: UserPlan = field(default_factory=UserPlan)
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SharedCluster:
    """A shared cluster and its job arrivals (a Poisson process, seeded)."""

    cpu: float = 2000.0
    memory_mb: float = 8 * 1024 * 1024
    jobs: int = 50
    arrival_mean_s: float = 600.0
    mix: tuple[tuple[str, float], ...] = (("wide_deep", 0.5), ("xdeepfm", 0.5))
    size_min: float = 0.1  # a job's samples = the profile's samples x U(size_min, size_max)
    size_max: float = 0.5


@dataclass(frozen=True, slots=True)
class JobRun:
    """What happened to one job."""

    job: str
    profile: str
    scaler: str
    jct_s: float | None  # submission to the last sample; None: not finished within max_time_s
    started_s: float | None  # submission to the first plan
    samples_total: int
    samples_done: int
    timeline: list[tuple[float, float, str]]  # (t from submission, true throughput, plan), at each change
    cpu_core_hours_allocated: float
    cpu_core_hours_used: float
    scalings: int  # plan changes applied (not counting the first plan and OOM relaunches)
    oom_failures: int
    pause_s: float  # time the whole job stood still for restarts (first start included)
    rejected: int  # plans refused (over quota, pod too big, empty)
    final_plan: ResourcePlan | None
    failed: str = ""  # why the executor failed the job (an OOM past its memory cap or relaunch budget)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "job", "profile", "scaler", "jct_s", "started_s", "samples_total", "samples_done",
            "cpu_core_hours_allocated", "cpu_core_hours_used", "scalings", "oom_failures", "pause_s", "rejected",
            "failed",
        )}
        d["cpu_utilisation"] = (self.cpu_core_hours_used / self.cpu_core_hours_allocated
                                if self.cpu_core_hours_allocated else 0.0)
        d["final_plan"] = None if self.final_plan is None else {
            k: v for k, v in asdict(self.final_plan).items() if k not in ("source", "reason", "job")
        }
        d["timeline"] = [[round(t, 1), round(psi, 1), s] for t, psi, s in self.timeline]
        return d


@dataclass(frozen=True, slots=True)
class ClusterRun:
    """What happened to a cluster of jobs."""

    scaler: str
    jobs: list[JobRun]
    mean_jct_s: float | None
    makespan_s: float
    cpu_allocated_util: float  # mean allocated CPU / capacity over the makespan
    cpu_used_util: float  # mean used CPU / capacity over the makespan
    rejected: int  # plans returned that would exceed the quota (or a job's limits)
    unfinished: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "scaler": self.scaler, "mean_jct_s": self.mean_jct_s, "makespan_s": self.makespan_s,
            "cpu_allocated_util": self.cpu_allocated_util, "cpu_used_util": self.cpu_used_util,
            "rejected": self.rejected, "unfinished": self.unfinished,
            "jobs": {r.job: {"profile": r.profile, "jct_s": r.jct_s, "started_s": r.started_s,
                             "scalings": r.scalings, "oom_failures": r.oom_failures} for r in self.jobs},
        }


def sim_job(name: str, truth: JobTruth, samples_total: int, config: SimConfig, submitted_at: float = 0.0) -> SimJob:
    """The scaler's view of a job: its spec (model kind, batch, limits), never the truth."""
    spec = JobSpec(
        name=name,
        model=ModelConfig(name=truth.model),
        dataset=DatasetConfig(path=f"sim://{name}", format=DataFormat.RECORD, records=samples_total),
        batch_size=truth.batch_size,
        limits=ResourceLimits(max_cpu=config.quota_cpu,
                              max_memory_mb=None if config.quota_memory_mb is None else int(config.quota_memory_mb)),
    )
    return SimJob(name=name, spec=spec, batch_size=truth.batch_size, samples_total=samples_total,
                  submitted_at=submitted_at)


def plan_summary(plan: ResourcePlan | None) -> str:
    if plan is None:
        return "-"
    return (f"{plan.workers}w x {plan.worker_cpu:g}c/{plan.worker_memory_mb}M + "
            f"{plan.ps}ps x {plan.ps_cpu:g}c/{plan.ps_memory_mb}M")


def time_to_fraction_of(
    timeline: Sequence[tuple[float, float, str]], target: float, fraction: float = 0.95
) -> float | None:
    """First time (from submission) the true throughput reaches ``fraction`` of ``target`` (None: never)."""
    for t, psi, _ in timeline:
        if psi >= fraction * target:
            return t
    return None
