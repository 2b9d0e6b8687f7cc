"""Baseline scalers for the autoscaling simulator (:mod:`pacer_services.simulator.autoscale`).

Why: DLRover-RM §6 measures its auto-scaling against a hand-tuned static
plan, ES and Optimus (Fig. 7: 17.7 % / 28.5 % shorter JCT; Fig. 10: higher
throughput sooner).  These are our readings of those baselines, written from
the papers' descriptions:

* :class:`StaticScaler` - a fixed plan, never changed ("w/o DLRover", a
  user's manual configuration).  :class:`FirstComeStatic` - the same in a
  shared cluster: jobs are admitted in arrival order with the user plan while
  it fits what is free, and never rescaled.
* :class:`EsScaler` - ES, the Elastic Scheduler (DLRover-RM ref. [43], as
  §6 describes it: "adds or removes a fixed number of nodes each time ...
  only modulates workers"): start from a typical user plan, add a fixed
  number of workers per adjustment while the scaling efficiency of the last
  step, ``(dPsi/Psi) / (dw/w)``, stays above a threshold (0.3); when it falls
  below, take that step back and stop.
* :class:`OptimusScaler` - Optimus (EuroSys'18; DLRover-RM §7: "dynamically
  adds one worker or parameter server each time to maximize the cluster's
  performance without considering the transition time"): fit Optimus' speed
  model of asynchronous PS training,
  ``f(p, w) = w / (theta0 + theta1 w/p + theta2 w + theta3 p)``, by NNLS on
  the observed speeds, and add the one pod (worker or PS, of the existing
  size) with the larger predicted marginal gain per CPU while it is positive
  and fits the quota.  Pod sizes never change.
* :func:`oracle_plan` / :class:`OracleScaler` - the best *static* plan found
  by exhaustive search over (w, p, C_w, C_p) with the true noiseless model:
  the reference of ``jct_vs_oracle_pct``.  It is not the best *dynamic*
  policy (a scaler could in principle beat it, e.g. by growing PS memory
  late), but no static plan is faster.

A measurement-driven scaler must not judge a plan by an interval in which
the plan was still starting: ES and Optimus use the throughput of an
interval only if it began after the last change settled (the change's
``pause_s`` reported through ``on_applied``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics
from pacer_services.brain.core.cluster import Resources, ScalingRecord, plan_resources
from scipy.optimize import nnls  # type: ignore[import-untyped]

from ..truth import JobTruth, ps_rss_mb, throughput
from ..types import ClusterJobView, SimJob, UserPlan

__all__ = [
    "EsScaler",
    "FirstComeStatic",
    "OptimusScaler",
    "OracleScaler",
    "StaticScaler",
    "oracle_plan",
]


def _quota(job: SimJob) -> float:
    lim = job.spec.limits
    return math.inf if lim is None or lim.max_cpu is None else float(lim.max_cpu)


def _cpu(plan: ResourcePlan) -> float:
    return float(plan_resources(plan).cpu)


def _start_plan(job: SimJob, user: UserPlan, reason: str) -> ResourcePlan:
    """The user plan, with fewer workers if it does not fit the job's CPU quota."""
    plan = user.plan(job.name, reason)
    quota = _quota(job)
    if _cpu(plan) > quota:
        workers = max(1, int((quota - plan.ps * plan.ps_cpu) // plan.worker_cpu))
        plan = replace(plan, workers=workers, reason=f"{reason} (workers clamped to the quota)")
    return plan


@dataclass(slots=True)
class _Settle:
    """When the last change settled, so that an interval's throughput describes the current plan."""

    settled_at: float = math.inf

    def applied(self, now: float, record: ScalingRecord) -> None:
        self.settled_at = now + record.pause_s

    def clean(self, stats: JobStatistics) -> bool:
        return stats.ts - stats.window_short_s >= self.settled_at - 1e-6


class _Tracking:
    """What a measurement-driven baseline remembers: its current plan (the scaler interface does not
    pass it) and when the last change settled.  A proposal becomes the plan when ``on_applied`` says
    so; a rejected one is forgotten at the next decision."""

    def __init__(self) -> None:
        self.plans: dict[str, ResourcePlan] = {}
        self.proposed: dict[str, ResourcePlan] = {}
        self.settle: dict[str, _Settle] = {}

    def _begin(self, job: SimJob, plan: ResourcePlan) -> ResourcePlan:
        self.plans[job.name] = plan
        return plan

    def _propose(self, job: SimJob, plan: ResourcePlan) -> ResourcePlan:
        self.proposed[job.name] = plan
        return plan

    def _clean(self, job: SimJob, stats: JobStatistics) -> ResourcePlan | None:
        """The current plan if ``stats`` describe it settled (else None); drops a stale proposal."""
        self.proposed.pop(job.name, None)
        plan = self.plans.get(job.name)
        st = self.settle.get(job.name)
        if plan is None or st is None or not st.clean(stats):
            return None
        return plan

    def on_oom(self, job: SimJob, now: float, node: str, role: str, relaunch: ResourcePlan) -> ResourcePlan | None:
        """The executor's answer, made explicit so the plan stays known."""
        return self._propose(job, relaunch)

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None:
        if job.name in self.proposed:
            self.plans[job.name] = self.proposed.pop(job.name)
        self.settle.setdefault(job.name, _Settle()).applied(now, record)


# ------------------------------------------------------------------ static


class StaticScaler:
    """A fixed plan, never changed (``plan_fn(job)`` makes it)."""

    name = "static"

    def __init__(self, plan_fn: Callable[[SimJob], ResourcePlan], name: str = "static") -> None:
        self.plan_fn = plan_fn
        self.name = name

    def start(self, job: SimJob, now: float) -> ResourcePlan:
        return self.plan_fn(job)

    def decide(self, job: SimJob, now: float, stats: JobStatistics) -> ResourcePlan | None:
        return None

    def on_oom(self, job: SimJob, now: float, node: str, role: str, relaunch: ResourcePlan) -> ResourcePlan | None:
        return None

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None:
        return None


class FirstComeStatic:
    """Cluster baseline: admit pending jobs first come first served with the user plan; never rescale.

    A job that does not fit what is free waits, and so do all that came
    after it (no backfilling).
    """

    name = "first-come-static"

    def __init__(self, user_plan: UserPlan | None = None) -> None:
        self.user_plan = user_plan or UserPlan()

    def decide_all(self, now: float, jobs: Sequence[ClusterJobView], free: Resources) -> dict[str, ResourcePlan]:
        out: dict[str, ResourcePlan] = {}
        for view in sorted(jobs, key=lambda v: (v.job.submitted_at, v.job.name)):
            if view.plan is not None:
                continue
            plan = _start_plan(view.job, self.user_plan, "first-come static user plan")
            need = plan_resources(plan)
            if not need.fits_in(free):
                break
            out[view.job.name] = plan
            free = free - need
        return out

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None:
        return None


# ------------------------------------------------------------------ ES


@dataclass(slots=True)
class _EsState:
    prev: tuple[int, float] | None = None  # (workers, throughput) before the last step
    stopped: bool = False


class EsScaler(_Tracking):
    """ES (DLRover-RM §6 baseline): grow workers by a fixed step while the step pays off."""

    name = "es"

    def __init__(self, user_plan: UserPlan | None = None, *, step_workers: int = 4, threshold: float = 0.3) -> None:
        super().__init__()
        self.user_plan = user_plan or UserPlan()
        self.step_workers = step_workers
        self.threshold = threshold
        self.state: dict[str, _EsState] = {}
        self.efficiencies: list[float] = []  # every measured step, for reports and tests

    def _st(self, job: SimJob) -> _EsState:
        return self.state.setdefault(job.name, _EsState())

    def start(self, job: SimJob, now: float) -> ResourcePlan:
        return self._begin(job, _start_plan(job, self.user_plan, "es: user plan"))

    def decide(self, job: SimJob, now: float, stats: JobStatistics) -> ResourcePlan | None:
        st = self._st(job)
        plan = self._clean(job, stats)
        if st.stopped or plan is None:
            return None
        w, psi = plan.workers, stats.throughput_samples_per_s
        if st.prev is not None:
            w0, psi0 = st.prev
            eff = ((psi - psi0) / psi0) / ((w - w0) / w0) if psi0 > 0 and w != w0 else 0.0
            self.efficiencies.append(eff)
            if eff < self.threshold:
                st.stopped = True
                return self._propose(job, replace(plan, workers=w0, reason=f"es: efficiency {eff:.2f} < {self.threshold}, step back"))
        room = int((_quota(job) - _cpu(plan)) // plan.worker_cpu)
        add = min(self.step_workers, room)
        if add <= 0:
            st.stopped = True
            return None
        st.prev = (w, psi)
        return self._propose(job, replace(plan, workers=w + add, reason=f"es: +{add} workers"))


# ------------------------------------------------------------------ Optimus


@dataclass(slots=True)
class _OptimusState:
    samples: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (p, w) -> speeds


class OptimusScaler(_Tracking):
    """Optimus (EuroSys'18): one pod at a time by the marginal gain of a fitted speed model."""

    name = "optimus"

    def __init__(self, user_plan: UserPlan | None = None, *, min_gain: float = 0.0) -> None:
        super().__init__()
        self.user_plan = user_plan or UserPlan()
        self.min_gain = min_gain  # of the gain per CPU, as a fraction of the current speed per CPU
        self.state: dict[str, _OptimusState] = {}
        self.thetas: list[tuple[float, ...]] = []

    def _st(self, job: SimJob) -> _OptimusState:
        return self.state.setdefault(job.name, _OptimusState())

    def start(self, job: SimJob, now: float) -> ResourcePlan:
        return self._begin(job, _start_plan(job, self.user_plan, "optimus: user plan"))

    @staticmethod
    def fit(samples: dict[tuple[int, int], list[float]]) -> tuple[float, float, float, float]:
        """NNLS fit of ``w / f = theta0 + theta1 w/p + theta2 w + theta3 p`` on the mean speed of each (p, w).

        With a single PS count, ``w/p`` and ``w`` cannot be told apart; the
        contention is then put on the PS (theta2 = 0), so that a saturated
        PS shows up as a gain of one more PS.
        """
        keys = sorted(samples)
        p = np.array([k[0] for k in keys], dtype=np.float64)
        w = np.array([k[1] for k in keys], dtype=np.float64)
        f = np.array([float(np.mean(samples[k])) for k in keys])
        y = w / f
        cols = [np.ones_like(w), w / p, w, p]
        use = [0, 1, 3] if len(set(p.tolist())) == 1 else [0, 1, 2, 3]
        a = np.stack([cols[i] for i in use], axis=1)
        scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
        sol, _ = nnls(a / scale, y)
        theta = [0.0, 0.0, 0.0, 0.0]
        for i, v in zip(use, sol / scale, strict=True):
            theta[i] = float(v)
        return theta[0], theta[1], theta[2], theta[3]

    @staticmethod
    def speed(theta: tuple[float, float, float, float], p: int, w: int) -> float:
        d = theta[0] + theta[1] * w / p + theta[2] * w + theta[3] * p
        return w / d if d > 0 else math.inf

    def decide(self, job: SimJob, now: float, stats: JobStatistics) -> ResourcePlan | None:
        st = self._st(job)
        plan = self._clean(job, stats)
        if plan is None or stats.throughput_samples_per_s <= 0:
            return None
        st.samples.setdefault((plan.ps, plan.workers), []).append(stats.throughput_samples_per_s)
        room = _quota(job) - _cpu(plan)
        if len(st.samples) < 2:
            if plan.worker_cpu <= room:
                return self._propose(job, replace(plan, workers=plan.workers + 1, reason="optimus: +1 worker (sampling)"))
            return None
        theta = self.fit(st.samples)
        self.thetas.append(theta)
        base = self.speed(theta, plan.ps, plan.workers)
        floor = self.min_gain * stats.throughput_samples_per_s / _cpu(plan)
        options = [
            ((self.speed(theta, plan.ps, plan.workers + 1) - base) / plan.worker_cpu, "worker", plan.worker_cpu),
            ((self.speed(theta, plan.ps + 1, plan.workers) - base) / plan.ps_cpu, "ps", plan.ps_cpu),
        ]
        for gain, kind, cpu in sorted(options, reverse=True):
            if gain <= max(floor, 0.0) or not math.isfinite(gain):
                break
            if cpu <= room + 1e-9:
                if kind == "worker":
                    new = replace(plan, workers=plan.workers + 1, reason=f"optimus: +1 worker (gain {gain:.1f}/CPU)")
                else:
                    new = replace(plan, ps=plan.ps + 1, reason=f"optimus: +1 ps (gain {gain:.1f}/CPU)")
                return self._propose(job, new)
        return None


# ------------------------------------------------------------------ oracle


def oracle_plan(
    truth: JobTruth,
    quota: float,
    max_pod_cpu: float,
    *,
    samples_total: int | None = None,
    job: str = "job",
    memory_margin: float = 1.25,
) -> ResourcePlan:
    """The best static plan by exhaustive search over integer (w, p, C_w, C_p) with the true model.

    Highest true throughput with ``w C_w + p C_p <= quota`` and pods of at
    most ``max_pod_cpu``; among plans within 1e-9 of it, the fewest CPUs.
    Memory: the largest RSS each role reaches by the end of the run (from
    the true growth over ``samples_total`` samples, else over 24 h) times
    ``memory_margin``, so the oracle never OOMs.
    """
    q, cmax = math.floor(quota + 1e-9), math.floor(max_pod_cpu + 1e-9)
    if q < 2 or cmax < 1:
        raise ValueError(f"no plan fits a quota of {quota} CPU with pods <= {max_pod_cpu}")
    c = np.arange(1, cmax + 1, dtype=np.float64)
    cw, cp = np.meshgrid(c, c, indexing="ij")
    best: tuple[float, float, int, int, float, float] | None = None  # (psi, -cpu, w, p, C_w, C_p)
    for p in range(1, q):
        wmax = (q - p * cp) // cw  # per (C_w, C_p): most workers that fit
        if wmax.max() < 1:
            break
        ws = np.arange(1, int(wmax.max()) + 1, dtype=np.float64)
        W = ws[None, None, :]
        psi = np.asarray(throughput(truth, W, p, cw[:, :, None], cp[:, :, None]))
        cpu = W * cw[:, :, None] + p * cp[:, :, None]
        psi = np.where(W <= wmax[:, :, None], psi, -1.0)
        top = float(psi.max())
        if best is not None and top < best[0] * (1 - 1e-9):
            continue
        near = psi >= top * (1 - 1e-9)
        idx = np.unravel_index(int(np.argmin(np.where(near, cpu, np.inf))), psi.shape)
        cand = (top, -float(cpu[idx]), int(ws[idx[2]]), p, float(c[idx[0]]), float(c[idx[1]]))
        if best is None or cand[0] > best[0] * (1 + 1e-9) or (cand[0] >= best[0] * (1 - 1e-9) and cand[1] > best[1]):
            best = cand
    assert best is not None
    psi_best, _, w, p, c_w, c_p = best
    hours = 24.0 if samples_total is None else samples_total / psi_best / 3600.0 + 1.0
    ps_mem = max(ps_rss_mb(truth, p, hours * 3600.0)) * memory_margin
    return ResourcePlan(
        job=job, workers=w, ps=p, worker_cpu=c_w, ps_cpu=c_p,
        worker_memory_mb=_round_mb(truth.worker_base_mb * memory_margin), ps_memory_mb=_round_mb(ps_mem),
        source=PlanSource.BRAIN, reason=f"oracle: best static plan, {psi_best:.0f} samples/s",
    )


def _round_mb(mb: float) -> int:
    return int(math.ceil(mb / 256.0) * 256)


class OracleScaler(StaticScaler):
    """Runs :func:`oracle_plan` (with the job's true parameters) from the start; never changes it."""

    def __init__(self, truth: JobTruth, quota: float, max_pod_cpu: float, *, samples_total: int | None = None) -> None:
        self.truth, self.quota, self.max_pod_cpu, self.samples_total = truth, quota, max_pod_cpu, samples_total
        super().__init__(self._plan, name="oracle")

    def _plan(self, job: SimJob) -> ResourcePlan:
        return oracle_plan(self.truth, min(self.quota, _quota(job)), self.max_pod_cpu,
                           samples_total=self.samples_total or job.samples_total, job=job.name)
