"""What a job's own CPU and memory readings say about its resource-performance model.

DLRover-RM Eq. 2-3 are written in lambda_w and lambda_p, "the number of
parallel computing CPU cores" of a worker and of a PS (§4.1), not the CPUs
a pod is given: a TensorFlow process cannot use more cores than it has
threads with work, and part of what it uses goes to its own runtime (RPC,
input pipeline, logging).  Throughput alone cannot tell these apart from
the alphas until many configurations have been measured; the monitor's
per-node CPU readings can, from the first one.  This module reads them:

* **Worker cost and overhead.**  A worker that is not starved uses
  ``u_w = o_w + a * s_w`` cores at ``s_w`` samples/s: ``o_w`` for its runtime,
  ``a`` core-seconds per sample of real work.  ``a`` is DLRover-RM Eq. 2's
  alpha_grad (workload ``m`` over rate lambda_w is the compute time of one
  iteration, ``a m / lambda_w``).  Fitted by NNLS over the configurations
  (their per-worker speeds differ), with a weak prior row pulling ``o_w``
  towards ``prior_overhead`` so that one configuration still gives a value.
* **Worker parallelism.**  DLRover 2023 §4.2 gives a worker "w = ceil(w-hat)"
  CPUs: what it used when it had C_max.  We read that as the cores a worker
  can use in parallel, ``P_w``; a worker that used (nearly) all it had may
  be able to use more, so then ``P_w`` is at least twice that allocation
  (the sample stage's doubling rule), at most C_max.  Only configurations
  the PS did not pace bound it: where the throughput reached the PS capacity
  (below), the hottest PS set the step (:mod:`.fitting`: Psi = min(Eq. 1,
  capacity)) and a worker waited for it, so its mean use (DLRover-RM Eq.
  2's work ``a m`` over a step longer than Eq. 1-5's sum) is a floor of
  ``P_w``, not its value; where every configuration was paced, nothing
  showed that a worker cannot use the CPUs it had, so ``P_w`` is at least
  that allocation (a warm start whose plan is PS-bound would else rate
  every larger worker no faster).  A PS's usage is its
  load rather than its limit (below the capacity it serves what comes), so
  a PS is credited with ``usage / busy``.
  ``lambda_w(C) = min(C, P_w) - o_w`` (at least 5 % of ``min(C, P_w)``).
* **PS cost, overhead and skew.**  Together the PS use
  ``U = p o_p + b Psi``: ``b`` core-seconds per sample over all PS.  The
  hottest PS serves the share ``h = (u_hot - o_p) / (U - p o_p)`` of it;
  with the partitions of a skewed embedding over ``p`` PS that share
  behaves like ``h(p) = min(1, kappa / p)`` (DLRover 2023 §4.3's hot PS:
  one PS holding the hot embeddings), ``kappa >= 1`` measured as ``h p``.
  ``P_p`` and ``lambda_p`` as for workers, from the hottest PS.
* **Capacity.**  The hottest PS must serve ``h(p) b Psi`` cores, so
  ``Psi <= lambda_p / (h(p) b)``: the throughput a PS set can carry,
  whatever the workers do (used by :meth:`fitting.Model.predict`).
* **Memory skew.**  PS memory is split the same way: the hottest PS holds
  ``min(1, kappa_mem / p)`` of the model, ``kappa_mem`` from the PS RSS
  readings (memory of a bare TF process, ``process_base_mb``, aside).

Pure: no IO, no clock; numbers in, a frozen dataclass out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from scipy.optimize import nnls  # type: ignore[import-untyped]

__all__ = ["Calibration", "CalibrationConfig", "Observation", "calibrate", "skew"]


# A configuration whose throughput reached this share of the PS capacity ran at it: the hottest PS set
# the step (Psi = min(Eq. 1, capacity)), so its throughput says nothing of the iteration time.
AT_CAPACITY = 0.95


@dataclass(frozen=True, slots=True)
class Observation:
    """One configuration as measured: the plan's CPUs and the mean of its valid statistics windows."""

    workers: int
    ps: int
    worker_cpu: float  # allocated CPUs per worker
    ps_cpu: float  # allocated CPUs per PS
    throughput: float  # samples/s, all workers
    worker_used: float  # cores one worker used (mean over workers)
    ps_used: tuple[float, ...]  # cores each PS used, hottest first
    ps_rss_mb: tuple[float, ...] = ()  # each PS's RSS, largest first


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    """Priors and thresholds of :func:`calibrate`; the defaults are the documented ones."""

    prior_overhead: float = 0.5  # cores a process spends on its runtime, until measured otherwise
    prior_weight: float = 0.3  # weight of that prior against one relative residual of a measurement
    busy: float = 0.9  # a node using this share of its CPUs is starved: it may be able to use more
    min_spread: float = 0.15  # relative spread of speeds needed to separate overhead from cost
    cpu_step: float = 1.0
    c_max: float = 16.0  # C_max: the largest node
    process_base_mb: float = 600.0  # RSS of a bare TF process: not part of the model's memory


@dataclass(frozen=True, slots=True)
class Calibration:
    """The job's parameters as its CPU and memory readings show them (module docstring)."""

    worker_overhead: float  # o_w, cores
    worker_cost: float  # a, worker core-seconds per sample (DLRover-RM Eq. 2's alpha_grad)
    worker_parallel: float  # P_w, cores a worker can use
    ps_overhead: float  # o_p, cores
    ps_cost: float  # b, PS core-seconds per sample, all PS together
    ps_skew: float  # kappa >= 1: the hottest of p PS serves min(1, kappa / p)
    ps_parallel: float  # P_p, cores a PS can use
    memory_skew: float  # kappa_mem >= 1: the largest of p PS holds min(1, kappa_mem / p) of the model

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value >= 0.0 and math.isfinite(value)):
                raise ValueError(f"{f.name} must be finite and >= 0, got {value}")

    def to_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        """From :meth:`to_dict`'s form; ``KeyError`` or ``ValueError`` on a bad record."""
        return cls(**{f.name: float(d[f.name]) for f in fields(cls)})

    def hot_share(self, ps: float | np.ndarray) -> np.ndarray:
        """h(p) = min(1, kappa / p): the hottest PS's share of the PS work."""
        return np.minimum(1.0, self.ps_skew / np.asarray(ps, dtype=np.float64))

    def lambda_w(self, cpu: float | np.ndarray) -> np.ndarray:
        """Parallel cores of a worker with ``cpu`` CPUs (DLRover-RM Eq. 2's lambda_w)."""
        return _parallel(np.asarray(cpu, dtype=np.float64), self.worker_parallel, self.worker_overhead)

    def lambda_p(self, cpu: float | np.ndarray) -> np.ndarray:
        """Parallel cores of a PS with ``cpu`` CPUs (DLRover-RM Eq. 3's lambda_p)."""
        return _parallel(np.asarray(cpu, dtype=np.float64), self.ps_parallel, self.ps_overhead)

    def ps_capacity(self, ps: float | np.ndarray, ps_cpu: float | np.ndarray) -> np.ndarray:
        """The most samples/s ``ps`` PS of ``ps_cpu`` CPUs can serve: lambda_p / (h(p) b); inf if unmeasured."""
        if self.ps_cost <= 0.0:
            return np.full(np.broadcast(np.asarray(ps), np.asarray(ps_cpu)).shape, math.inf)
        return self.lambda_p(ps_cpu) / (self.hot_share(ps) * self.ps_cost)

    def paced(self, ps: float, ps_cpu: float, throughput: float) -> bool:
        """The hottest PS set the step: ``throughput`` reached ``AT_CAPACITY`` of what the PS can serve."""
        return throughput >= AT_CAPACITY * float(self.ps_capacity(ps, ps_cpu))


def skew(shares: Sequence[float]) -> float | None:
    """kappa of ``p`` PS's loads (CPU or memory, each net of its runtime): max share x p, >= 1.

    With the hottest of ``p`` PS carrying ``min(1, kappa / p)`` of the whole,
    this is the kappa one reading shows.  None when it shows nothing (fewer
    than two PS, or nothing carried).
    """
    total = sum(max(0.0, x) for x in shares)
    if len(shares) < 2 or total <= 0.0:
        return None
    return max(1.0, max(shares) / total * len(shares))


def _parallel(cpu: np.ndarray, parallel: float, overhead: float) -> np.ndarray:
    usable = np.minimum(cpu, parallel)
    out: np.ndarray = np.maximum(usable - overhead, 0.05 * usable)
    return out


def _cost_and_overhead(used: np.ndarray, rate: np.ndarray, count: np.ndarray,
                       cfg: CalibrationConfig, prior_overhead: float | None = None) -> tuple[float, float]:
    """(overhead per process, cost per sample) from ``used = count * o + cost * rate``.

    Relative residuals (each configuration weighs the same whatever its
    size), NNLS (both non-negative), plus the prior row
    ``prior_weight * (o - prior_overhead)``.  When the rates do not spread
    enough to separate the two, the prior alone sets ``o`` (never more than
    half of what the least busy process used) and the cost follows.
    """
    prior = cfg.prior_overhead if prior_overhead is None else prior_overhead
    per = rate / count
    if len(used) >= 2 and per.max() > (1.0 + cfg.min_spread) * per.min():
        a = np.vstack([np.stack([count, rate], axis=1) / used[:, None], [[cfg.prior_weight, 0.0]]])
        y = np.concatenate([np.ones_like(used), [cfg.prior_weight * prior]])
        sol, _ = nnls(a, y)
        o, cost = float(sol[0]), float(sol[1])
        if cost > 0.0:
            return o, cost
    o = min(prior, 0.5 * float(np.min(used / count)))
    cost = float(np.mean((used - count * o) / rate))
    return o, max(cost, 0.0)


def _parallelism(allocated: Sequence[float], used: Sequence[float], cfg: CalibrationConfig,
                 *, slack: float = 1.0, filled: bool = True, prior: float | None = None) -> float:
    """P: the most a process used without being starved (times ``slack``), rounded up to CPU steps;
    at least twice an allocation it filled (it may be able to use more), at most C_max.  With
    ``filled`` False every reading is taken as not starved (``used`` is then a floor of P).

    ``prior`` (similar jobs' P, a warm start) replaces the doubling where every reading was starved
    and none says how much more the process could use: then P is the prior, at least the largest
    allocation filled."""
    unstarved = [u for c, u in zip(allocated, used, strict=True) if not filled or u < cfg.busy * c]
    starved = [c for c, u in zip(allocated, used, strict=True) if filled and u >= cfg.busy * c]
    p = 0.0
    if unstarved:
        p = max(cfg.cpu_step, math.ceil(max(unstarved) * slack / cfg.cpu_step - 1e-9) * cfg.cpu_step)
    if starved:
        bound = 2.0 * max(starved) if prior is None or unstarved else max(max(starved), prior)
        p = max(p, min(cfg.c_max, bound))
    return min(p, cfg.c_max) if p > 0 else cfg.c_max


def calibrate(observations: Sequence[Observation], config: CalibrationConfig | None = None,
              prior: Calibration | None = None) -> Calibration:
    """The job's :class:`Calibration` from its measured configurations (at least one with throughput).

    ``prior`` is the similar finished jobs' calibration (a warm start, :mod:`.warmstart`): their
    sample stages measured several configurations, a warm job starts with one.  It stands in only
    for what that one cannot tell: the runtime overheads (the prior row of the cost fit) and the
    parallelism of a process that filled every allocation it had.  Every value the readings do
    measure (costs, skews, an unstarved process's parallelism) is the job's own.
    """
    cfg = config or CalibrationConfig()
    obs = [o for o in observations if o.throughput > 0.0 and o.workers > 0 and o.ps > 0]
    if not obs:
        raise ValueError("calibrate needs at least one configuration with throughput")
    psi = np.array([o.throughput for o in obs])
    # Workers: only configurations where they were not starved say what a sample costs.
    fed = [o for o in obs if o.worker_used < cfg.busy * o.worker_cpu] or obs
    w_used = np.array([max(o.worker_used, 1e-6) for o in fed])
    w_rate = np.array([o.throughput / o.workers for o in fed])
    o_w, a = _cost_and_overhead(w_used, w_rate, np.ones_like(w_used), cfg,
                                prior.worker_overhead if prior is not None else None)
    # PS: all of them together; the hottest for the skew and the parallelism.
    u_total = np.array([max(sum(o.ps_used), 1e-6) for o in obs])
    count = np.array([float(o.ps) for o in obs])
    o_p, b = _cost_and_overhead(u_total, psi, count, cfg, prior.ps_overhead if prior is not None else None)
    cpu_skews = [k for o in obs if len(o.ps_used) == o.ps
                 and (k := skew([u - o_p for u in o.ps_used])) is not None]
    kappa = statistics.median(cpu_skews) if cpu_skews else 1.0
    # A PS's usage is its load, not its limit: at the load it carried it was not at its limit unless
    # starved, so it is credited with at least usage / busy (else every configuration would look
    # like it ran at the PS capacity, which is then estimated from the very same reading).
    p_p = _parallelism([o.ps_cpu for o in obs if o.ps_used], [o.ps_used[0] for o in obs if o.ps_used], cfg,
                       slack=1.0 / cfg.busy, prior=prior.ps_parallel if prior is not None else None)
    # Workers: DLRover 2023's ceil(w-hat), where the PS paced every configuration at least the
    # CPUs a worker had (module docstring).
    ps_side = Calibration(worker_overhead=o_w, worker_cost=a, worker_parallel=cfg.c_max, ps_overhead=o_p,
                          ps_cost=b, ps_skew=kappa, ps_parallel=p_p, memory_skew=1.0)
    p_w = _parallelism([o.worker_cpu for o in obs], [o.worker_used for o in obs], cfg,
                       prior=prior.worker_parallel if prior is not None else None)
    if all(ps_side.paced(o.ps, o.ps_cpu, o.throughput) for o in obs):  # each reading a floor: nothing showed that a worker cannot use the CPUs it had
        p_w = max(p_w, _parallelism([o.worker_cpu for o in obs], [o.worker_cpu for o in obs], cfg, filled=False))
    mem_skews = [k for o in obs if len(o.ps_rss_mb) == o.ps
                 and (k := skew([max(0.0, r - cfg.process_base_mb) for r in o.ps_rss_mb])) is not None]
    kappa_mem = statistics.median(mem_skews) if mem_skews else kappa
    return Calibration(worker_overhead=o_w, worker_cost=a, worker_parallel=p_w, ps_overhead=o_p, ps_cost=b,
                       ps_skew=kappa, ps_parallel=p_p, memory_skew=kappa_mem)
