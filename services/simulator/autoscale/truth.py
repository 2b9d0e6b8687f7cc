"""The hidden truth of a simulated PS job: what its plan really yields, uses and holds.

Why: DLRover-RM §6 compares auto-scaling policies on jobs whose behaviour the
scalers do not know.  This module is that behaviour; only the oracle scaler
reads it, every other scaler sees the monitor's statistics
(:mod:`.jobsim`).

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

Pure: every random draw comes from numpy generators seeded by the run's seed
(:func:`rngs`), so the true parameters of a job depend only on the seed (and
the job's index in a cluster), never on the scaler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
from pacer.contracts.jobs import ModelName, ResourcePlan

FloatArray = npt.NDArray[np.float64]
ArrayLike = float | FloatArray

__all__ = [
    "PROFILES",
    "JobTruth",
    "Profile",
    "cores_used",
    "cpu_used",
    "draw_truth",
    "ps_rss_mb",
    "ps_shares",
    "rngs",
    "throughput",
]


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
    return cores_used(t, plan.worker_cpu, plan.ps, plan.ps_cpu, running_workers, psi)


def cores_used(t: JobTruth, worker_cpu: float, ps: int, ps_cpu: float, running_workers: int,
               psi: float) -> tuple[float, list[float]]:
    """:func:`cpu_used` of a plan given by its worker size and PS."""
    if running_workers <= 0 or psi <= 0.0:
        return 0.0, [0.0] * ps
    worker = min(worker_cpu, t.par_w, t.ovh_w + t.a_grad * psi / running_workers)
    cap = min(ps_cpu, t.par_p)
    return worker, [min(cap, t.ovh_p + s * t.u_ps * psi) for s in ps_shares(t.skew, ps)]


def ps_rss_mb(t: JobTruth, ps: int, trained_s: float) -> list[float]:
    """Resident memory of each PS after ``trained_s`` seconds of training (embeddings grow)."""
    held = t.model_mb + t.growth_mb_per_hour * trained_s / 3600.0
    return [t.ps_base_mb + s * held for s in ps_shares(t.skew, ps)]



def rngs(seed: int, index: int) -> tuple[np.random.Generator, np.random.Generator]:
    """(truth rng, noise rng) of job ``index``: the truth never depends on the scaler."""
    return np.random.default_rng([seed, index, 0]), np.random.default_rng([seed, index, 1])
