"""Autoscaling simulator: a PS job (or a cluster of them) under a resource scaler.

Why: DLRover-RM §6 compares its auto-scaling with ES and Optimus on the JCT
and on how fast a cold-started job reaches its best throughput (Fig. 7,
Fig. 10).  Pacer's brain must be judged the same way without a real
cluster, so this module simulates jobs whose *true* resource-performance
behaviour is hidden from the scalers, which only see noisy
:class:`~pacer.contracts.monitor.JobStatistics` as Pacer's monitor would
publish them, and whose plan changes cost what they cost in a real cluster
(pod pending, trainer initialisation, checkpoint restarts, OOM relaunches).

The hidden job model follows the structure of DLRover-RM Eq. 1-5
(:mod:`pacer_services.brain.core.fitting`) but not its form, so that a fitted
Eq. 1-6 model is an approximation, as in reality.  Asynchronous PS training,
per-worker batch ``m``, plan ``(w, p, C_w, C_p)``::

    T_grad = a_grad * m / E_w + b_grad                 worker compute
    T_sync = a_sync * model_mb * w / (p * bandwidth)   parameter pull/push, shared PS links
    T_ps   = s_hot * u * m / E_p                       the hot PS's service time of one batch
    Psi    = w * m / (T_grad + T_sync + T_ps + beta)   samples per second ...
    Psi   <= min_j E_p / (s_j * u)                     ... capped by every PS's capacity
    E_w    = min(C_w, par_w) - ovh_w,  E_p = min(C_p, par_p) - ovh_p

``E`` are the cores left for the real work: cores beyond ``par`` are wasted,
and every process spends ``ovh`` cores on its runtime (input pipeline, RPC
threads), so many tiny pods are no bargain either.

``form="off-model"`` departs from that structure where the brain's
calibrated model assumes it (:mod:`pacer_services.brain.core.calibration`),
to see how the brain fares on a job that does not behave as it believes:
parallelism saturates smoothly (``min`` becomes ``(C^-3 + par^-3)^(-1/3)``),
the sync cost grows as ``(w/p)^1.4`` (equal to the linear one at w/p = 4),
and the PS capacity is approached smoothly (a soft minimum,
``(Psi^-4 + cap^-4)^(-1/4)``).  The CPU readings stay what the work costs.
``u`` is the PS work per sample (update + embedding lookup, core-seconds),
split over the PS with a skew: ``ps-0`` (the hot PS) gets
``s_hot = min(1, skew / p)`` of it, the others share the rest equally
(DLRover 2023 §4.3's hot PS; Wide&Deep-like jobs have skew ~1.6).
Reported CPU use is the compute actually done: a worker uses
``a_grad * Psi / w`` cores, PS j ``s_j * u * Psi``, each capped at what it
may use.  Memory: a worker holds ``worker_base_mb``; PS j holds
``ps_base_mb + s_j * (model_mb + growth_mb_per_hour * hours trained)``
(embedding tables grow as new IDs arrive); a node over its plan's memory
is OOM-killed.

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

Pure: no IO, no clock; every random draw comes from numpy generators
seeded by the run's seed, so the same seed gives the same run.  The true
parameters of a job depend only on the seed (and the job's index in a
cluster), never on the scaler, so scalers are compared on the same jobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from pacer.contracts.jobs import (
    DataFormat,
    DatasetConfig,
    JobSpec,
    ModelConfig,
    ModelName,
    PlanSource,
    ResourceLimits,
    ResourcePlan,
)
from pacer.contracts.monitor import JobStatistics, NodeState, NodeStats, ShardSummary
from pacer.errors import ValidationError
from pacer_services.brain.core.cluster import Resources, ScalingKind, ScalingRecord, plan_resources

FloatArray = npt.NDArray[np.float64]
ArrayLike = float | FloatArray

__all__ = [
    "CLUSTER_SCALERS",
    "PROFILES",
    "SCALERS",
    "AutoscaleError",
    "ClusterJobView",
    "ClusterRun",
    "ClusterScaler",
    "ClusterSpec",
    "JobRun",
    "JobTruth",
    "Scaler",
    "ScalerContext",
    "SimConfig",
    "SimJob",
    "UserPlan",
    "cpu_used",
    "draw_truth",
    "make_scaler",
    "ps_rss_mb",
    "ps_shares",
    "run_cluster",
    "run_job",
    "throughput",
    "time_to_fraction_of",
]


class AutoscaleError(ValidationError):
    """A scaler's first plan is unusable, or a run cannot be set up (the message says why)."""

    code = "invalid"


# ------------------------------------------------------------------ the hidden truth


@dataclass(frozen=True, slots=True)
class JobTruth:
    """The true parameters of one job (hidden from every scaler but the oracle)."""

    profile: str
    model: ModelName
    batch_size: int  # m: samples per worker per iteration
    a_grad: float  # worker core-seconds per sample
    b_grad: float  # s per iteration, fixed worker overhead
    par_w: float  # cores a worker can really use
    u_ps: float  # PS core-seconds per sample (update + embedding lookup), over all PS
    skew: float  # >= 1: the hot PS gets min(1, skew / p) of the PS work
    par_p: float  # cores a PS can really use
    a_sync: float  # sync cost factor
    model_mb: float  # model (dense + embeddings) size, MiB
    bandwidth_mb_s: float  # per-PS network bandwidth, MiB/s
    beta: float  # s per iteration, fixed (framework, data input)
    ovh_w: float = 0.5  # cores a worker process spends besides gradients (TF runtime, input pipeline)
    ovh_p: float = 0.5  # cores a PS process spends besides serving (TF runtime, RPC threads)
    worker_base_mb: float = 2048.0  # worker RSS
    ps_base_mb: float = 600.0  # a bare TF PS process
    growth_mb_per_hour: float = 0.0  # embedding growth while training, over all PS
    form: str = "dlrover"  # "dlrover" | "off-model" (module docstring)


@dataclass(frozen=True, slots=True)
class Profile:
    """A job family: nominal true parameters and the default dataset size."""

    truth: JobTruth
    samples_total: int


# Nominal values: with a 200-CPU quota the best static plan trains the job in
# ~3 h (see the module tests); the best plan has several PS and workers of a
# particular size, neither "all workers" nor the user's default.
PROFILES: dict[str, Profile] = {
    # IO/embedding bound: PS-heavy with a hot PS, workers use ~4 cores.
    "wide_deep": Profile(
        truth=JobTruth(
            profile="wide_deep", model=ModelName.WIDE_DEEP, batch_size=512,
            a_grad=0.004, b_grad=0.05, par_w=4.0, u_ps=0.0012, skew=1.6, par_p=8.0,
            a_sync=0.01, model_mb=4000.0, bandwidth_mb_s=1000.0, beta=0.05,
            worker_base_mb=2048.0, ps_base_mb=600.0, growth_mb_per_hour=2000.0, ovh_w=1.0, ovh_p=0.5,
        ),
        samples_total=300_000_000,
    ),
    # Compute bound: heavy CIN layers, workers scale to ~16 cores, light PS.
    "xdeepfm": Profile(
        truth=JobTruth(
            profile="xdeepfm", model=ModelName.XDEEPFM, batch_size=1024,
            a_grad=0.02, b_grad=0.1, par_w=16.0, u_ps=0.0004, skew=1.05, par_p=8.0,
            a_sync=0.01, model_mb=1500.0, bandwidth_mb_s=1000.0, beta=0.05,
            worker_base_mb=4096.0, ps_base_mb=600.0, growth_mb_per_hour=500.0, ovh_w=1.0, ovh_p=0.5,
        ),
        samples_total=80_000_000,
    ),
}

_DRAWN = ("a_grad", "b_grad", "par_w", "u_ps", "par_p", "a_sync", "beta", "model_mb", "growth_mb_per_hour", "ovh_w", "ovh_p")


def draw_truth(nominal: JobTruth, rng: np.random.Generator, sigma: float = 0.2) -> JobTruth:
    """One job instance: each continuous parameter x lognormal(0, sigma) around the nominal value.

    The skew's excess over 1 is drawn the same way (a skew stays >= 1).
    """
    if sigma <= 0.0:
        return nominal
    f = rng.lognormal(0.0, sigma, size=len(_DRAWN) + 1)
    values: dict[str, Any] = {k: float(getattr(nominal, k) * f[i]) for i, k in enumerate(_DRAWN)}
    values["skew"] = 1.0 + (nominal.skew - 1.0) * float(f[-1])
    return replace(nominal, **values)


def ps_shares(skew: float, ps: int) -> list[float]:
    """Share of the PS work of each PS, ``ps-0`` (the hot one) first."""
    hot = min(1.0, skew / ps)
    if ps == 1:
        return [1.0]
    return [hot] + [(1.0 - hot) / (ps - 1)] * (ps - 1)


def throughput(t: JobTruth, workers: ArrayLike, ps: ArrayLike, worker_cpu: ArrayLike, ps_cpu: ArrayLike) -> ArrayLike:
    """True job throughput Psi (samples/s) of ``workers`` running workers; broadcasts over numpy arrays."""
    w = np.asarray(workers, dtype=np.float64)
    p = np.asarray(ps, dtype=np.float64)
    off = t.form == "off-model"
    ew = _effective(np.asarray(worker_cpu, dtype=np.float64), t.par_w, t.ovh_w, smooth=off)
    ep = _effective(np.asarray(ps_cpu, dtype=np.float64), t.par_p, t.ovh_p, smooth=off)
    m = float(t.batch_size)
    hot = np.minimum(1.0, t.skew / p)
    t_grad = t.a_grad * m / ew + t.b_grad
    ratio = w / p
    t_sync = t.a_sync * t.model_mb / t.bandwidth_mb_s * (ratio**1.4 * 4.0**-0.4 if off else ratio)
    t_ps = hot * t.u_ps * m / ep
    psi = w * m / (t_grad + t_sync + t_ps + t.beta)
    cap = ep / (hot * t.u_ps)
    with np.errstate(divide="ignore"):
        capped = (psi**-4.0 + cap**-4.0) ** -0.25 if off else np.minimum(psi, cap)
    out = np.where(w > 0, capped, 0.0)
    return float(out) if out.ndim == 0 else out


def _effective(cpu: FloatArray, par: float, ovh: float, *, smooth: bool = False) -> FloatArray:
    """Cores left for the real work: min(C, par) minus the process overhead (at least 5 % of C)."""
    usable = (cpu**-3.0 + par**-3.0) ** (-1.0 / 3.0) if smooth else np.minimum(cpu, par)
    out: FloatArray = np.maximum(usable - ovh, 0.05 * usable)
    return out


def cpu_used(t: JobTruth, plan: ResourcePlan, running_workers: int, psi: float) -> tuple[float, list[float]]:
    """(cores used by one running worker, cores used by each PS) at throughput ``psi``."""
    if running_workers <= 0 or psi <= 0.0:
        return 0.0, [0.0] * plan.ps
    worker = min(plan.worker_cpu, t.par_w, t.ovh_w + t.a_grad * psi / running_workers)
    cap = min(plan.ps_cpu, t.par_p)
    return worker, [min(cap, t.ovh_p + s * t.u_ps * psi) for s in ps_shares(t.skew, plan.ps)]


def ps_rss_mb(t: JobTruth, ps: int, trained_s: float) -> list[float]:
    """Resident memory of each PS after ``trained_s`` seconds of training (embeddings grow)."""
    held = t.model_mb + t.growth_mb_per_hour * trained_s / 3600.0
    return [t.ps_base_mb + s * held for s in ps_shares(t.skew, ps)]


# ------------------------------------------------------------------ what scalers see


@dataclass(frozen=True, slots=True)
class SimJob:
    """What a scaler may know of a job (NOT its true parameters)."""

    name: str
    spec: JobSpec
    batch_size: int  # m, samples per worker per iteration
    samples_total: int
    submitted_at: float


class Scaler(Protocol):
    """A single-job resource scaler (ES, Optimus, oracle, static, Pacer's brain)."""

    name: str

    def start(self, job: SimJob, now: float) -> ResourcePlan: ...

    def decide(self, job: SimJob, now: float, stats: JobStatistics) -> ResourcePlan | None: ...

    def on_oom(self, job: SimJob, now: float, node: str, role: str, plan: ResourcePlan) -> ResourcePlan | None: ...

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

    @property
    def restart_s(self) -> float:
        return self.pending_s + self.init_s


@dataclass(frozen=True, slots=True)
class ScalerContext:
    """What a scaler factory of :data:`SCALERS` gets: ``factory(ctx) -> Scaler``.

    ``truth`` is for the oracle only; a fair scaler must not read it.
    """

    truth: JobTruth
    samples_total: int
    config: SimConfig
    user_plan: UserPlan = field(default_factory=UserPlan)
    params: Mapping[str, Any] = field(default_factory=dict)


def _static(ctx: ScalerContext) -> Scaler:
    from .baselines import StaticScaler

    up = ctx.user_plan
    return StaticScaler(lambda job: up.plan(job.name, "static user plan"))


def _es(ctx: ScalerContext) -> Scaler:
    from .baselines import EsScaler

    return EsScaler(ctx.user_plan, step_workers=int(ctx.params.get("step_workers", 4)),
                    threshold=float(ctx.params.get("threshold", 0.3)))


def _optimus(ctx: ScalerContext) -> Scaler:
    from .baselines import OptimusScaler

    return OptimusScaler(ctx.user_plan)


def _oracle(ctx: ScalerContext) -> Scaler:
    from .baselines import OracleScaler

    return OracleScaler(ctx.truth, ctx.config.quota_cpu, ctx.config.max_pod_cpu, samples_total=ctx.samples_total)


def _pacer(ctx: ScalerContext) -> Scaler:
    from .pacer_scaler import pacer

    return pacer(ctx)


# name -> factory(ctx: ScalerContext) -> Scaler.
SCALERS: dict[str, Callable[..., Scaler]] = {
    "pacer": _pacer,
    "oracle": _oracle,
    "es": _es,
    "optimus": _optimus,
    "static": _static,
}


def make_scaler(name: str, ctx: ScalerContext) -> Scaler:
    """The registered scaler ``name`` for one job (:class:`AutoscaleError` listing the known names)."""
    factory = SCALERS.get(name)
    if factory is None:
        raise AutoscaleError(f"unknown scaler {name!r}; known: {', '.join(sorted(SCALERS))}")
    return factory(ctx)


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


# ------------------------------------------------------------------ one simulated job

_SHARD = 100  # batches per shard, for the shard counts of the statistics


class _JobSim:
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

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "job", "profile", "scaler", "jct_s", "started_s", "samples_total", "samples_done",
            "cpu_core_hours_allocated", "cpu_core_hours_used", "scalings", "oom_failures", "pause_s", "rejected",
        )}
        d["cpu_utilisation"] = (self.cpu_core_hours_used / self.cpu_core_hours_allocated
                                if self.cpu_core_hours_allocated else 0.0)
        d["final_plan"] = None if self.final_plan is None else {
            k: v for k, v in asdict(self.final_plan).items() if k not in ("source", "reason", "job")
        }
        d["timeline"] = [[round(t, 1), round(psi, 1), s] for t, psi, s in self.timeline]
        return d


def time_to_fraction_of(
    timeline: Sequence[tuple[float, float, str]], target: float, fraction: float = 0.95
) -> float | None:
    """First time (from submission) the true throughput reaches ``fraction`` of ``target`` (None: never)."""
    for t, psi, _ in timeline:
        if psi >= fraction * target:
            return t
    return None


def _relaunch_plan(plan: ResourcePlan, role: str) -> ResourcePlan:
    """The executor's default answer to an OOM: the same plan with that role's memory doubled."""
    if role == "ps":
        return replace(plan, ps_memory_mb=plan.ps_memory_mb * 2, reason="OOM relaunch: ps memory x2")
    return replace(plan, worker_memory_mb=plan.worker_memory_mb * 2, reason="OOM relaunch: worker memory x2")


def _rngs(seed: int, index: int) -> tuple[np.random.Generator, np.random.Generator]:
    """(truth rng, noise rng) of job ``index``: the truth never depends on the scaler."""
    return np.random.default_rng([seed, index, 0]), np.random.default_rng([seed, index, 1])


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
    truth_rng, noise_rng = _rngs(seed, 0)
    true = draw_truth(nominal, truth_rng, cfg.sigma) if draw else nominal
    if isinstance(scaler, str):
        scaler = make_scaler(scaler, ScalerContext(true, total, cfg, user_plan or UserPlan(), params or {}))
    job = sim_job(name, true, total, cfg)
    sim = _JobSim(job, true, cfg, noise_rng)
    first = scaler.start(job, 0.0)
    if not sim.valid(first):
        raise AutoscaleError(f"scaler {scaler.name}: first plan {plan_summary(first)} breaks the quota "
                             f"({cfg.quota_cpu:g} CPU, pods <= {cfg.max_pod_cpu:g})")
    rec = sim.apply(first, 0.0)
    sim.started_at = 0.0
    if rec is not None:
        scaler.on_applied(job, 0.0, rec)
    now, dt = 0.0, cfg.tick_s
    # A scaler that sets ``every_window`` sees every monitor window (and paces itself, as the brain
    # service does); the others are asked once per adjust interval, over the whole interval.
    decide_s = cfg.stats_interval_s if getattr(scaler, "every_window", False) else cfg.adjust_interval_s
    next_decide = decide_s
    while sim.finished_at is None and now < cfg.max_time_s:
        sim.step(now, dt)
        now += dt
        if sim.finished_at is not None:
            break
        bad = sim.oom_node(now)
        if bad is not None and sim.plan is not None:
            node, role = bad
            sim.oom(now)
            new = scaler.on_oom(job, now, node, role, sim.plan)
            if new is None or not sim.valid(new):
                new = _relaunch_plan(sim.plan, role)
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


# ------------------------------------------------------------------ a cluster of jobs


def _first_come(ctx: ScalerContext) -> ClusterScaler:
    from .baselines import FirstComeStatic

    return FirstComeStatic(ctx.user_plan)


# name -> factory(ctx: ScalerContext) -> ClusterScaler (ctx.truth is the scenario's nominal truth).
def _pacer_cluster(ctx: ScalerContext) -> ClusterScaler:
    from .pacer_scaler import pacer_cluster

    return pacer_cluster(ctx)


CLUSTER_SCALERS: dict[str, Callable[..., ClusterScaler]] = {
    "pacer": _pacer_cluster,
    "first-come-static": _first_come,
}


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A shared cluster and its job arrivals (a Poisson process, seeded)."""

    cpu: float = 2000.0
    memory_mb: float = 8 * 1024 * 1024
    jobs: int = 50
    arrival_mean_s: float = 600.0
    mix: tuple[tuple[str, float], ...] = (("wide_deep", 0.5), ("xdeepfm", 0.5))
    size_min: float = 0.1  # a job's samples = the profile's samples x U(size_min, size_max)
    size_max: float = 0.5


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


def cluster_jobs(spec: ClusterSpec, cfg: SimConfig, seed: int) -> list[tuple[SimJob, JobTruth]]:
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
        truth = draw_truth(prof.truth, _rngs(seed, i + 1)[0], cfg.sigma)
        out.append((sim_job(f"job-{i:03d}", truth, total, cfg, submitted_at=t), truth))
    return out


def run_cluster(spec: ClusterSpec, scaler: ClusterScaler, seed: int = 0, config: SimConfig | None = None) -> ClusterRun:
    """Simulate the jobs of ``spec`` arriving over time and sharing one quota under ``scaler``.

    ``decide_all`` runs every adjust interval and whenever a job arrives or
    finishes; returned plans are applied in order, each only if the cluster
    total stays within the capacity (else it is rejected and counted).  An
    OOM is answered by the executor's default (double memory), even if the
    cluster is then over its memory capacity for a while.
    """
    cfg = config or SimConfig()
    cap = Resources(spec.cpu, spec.memory_mb)
    jobs = cluster_jobs(spec, cfg, seed)
    sims = {j.name: _JobSim(j, t, cfg, _rngs(seed, i + 1)[1]) for i, (j, t) in enumerate(jobs)}
    order = [j.name for j, _ in jobs]
    rejected = 0
    now, dt = 0.0, cfg.tick_s
    decide_s = cfg.stats_interval_s if getattr(scaler, "every_window", False) else cfg.adjust_interval_s
    next_decide = decide_s
    alloc_cpu_s = used_cpu_s = 0.0
    arrived: set[str] = set()

    def held() -> Resources:
        total = Resources()
        for s in sims.values():
            if s.plan is not None and s.finished_at is None:
                total = total + plan_resources(s.plan)
        return total

    def decide(now: float) -> None:
        nonlocal rejected
        views = [ClusterJobView(sims[n].job, sims[n].plan, sims[n].last_stats)
                 for n in order if n in arrived and sims[n].finished_at is None]
        plans = scaler.decide_all(now, views, cap - held())
        for name, plan in plans.items():
            s = sims.get(name)
            if s is None or name not in arrived or s.finished_at is not None:
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
                if s.plan is not None and s.finished_at is None and now > s.interval_t0:
                    s.stats(now)
            changed = True
        if changed:
            decide(now)
        finished_now = False
        for s in sims.values():
            if s.plan is None or s.finished_at is not None:
                continue
            alloc_cpu_s += plan_resources(s.plan).cpu * dt
            before = s.core_h_used
            s.step(now, dt)
            used_cpu_s += (s.core_h_used - before) * 3600.0
            if s.finished_at is not None:
                finished_now = True
                continue
            bad = s.oom_node(now + dt)
            if bad is not None and s.plan is not None:
                s.oom(now + dt)
                s.apply(_relaunch_plan(s.plan, bad[1]), now + dt, restart=True)
        now += dt
        if finished_now:
            decide(now)
        if len(arrived) == len(order) and all(s.finished_at is not None for s in sims.values()):
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
