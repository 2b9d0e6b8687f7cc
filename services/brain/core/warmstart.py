"""DLRover-RM Alg. 1: a start-up plan for a new job from the most similar finished jobs.

1. Take the top-k jobs of the config DB most similar to the new job by
   metadata (:func:`pacer_services.brain.core.history.top_k_similar`).
2. Rank them by similarity, *ascending*: A^0 is the least similar of the k
   and A^{k-1} the most similar ("A^{k-1} is the job configuration with
   highest similarity", DLRover-RM §4.3).
3. Smooth (DLRover-RM Eq. 10, Alg. 1 lines 3-7)::

       A-bar^0 = A^0
       A-bar^i = mu * A^i + (1 - mu) * A-bar^{i-1},   i = 1 .. k-1

   and start the job with A-bar^{k-1}.  Unrolled, A^i weighs
   mu * (1 - mu)^(k-1-i) (A^0: (1 - mu)^(k-1)), so the most similar job
   weighs most when mu > 1/2.

A configuration is the vector (workers, PS, worker CPU, worker memory, PS
CPU, PS memory) of a job's final plan, smoothed component by component, then
rounded: counts to the nearest whole number (at least 1), CPU to 0.1 core,
memory up to a whole MiB.  The user's ``resources`` and the job's ``limits``
apply as to any brain plan (:func:`pacer_services.brain.core.stages.fit_to_spec`).

The predicted throughput of the plan smooths each similar job's throughput
per worker the same way and multiplies by the plan's workers (DLRover 2023
Eq. 1: the job's throughput is the sum of its workers').

The coefficients the similar jobs' models ended with are smoothed the same
way, coefficient by coefficient over the jobs that have them, into the
prior of the new job's fit (:func:`.fitting.fit`): on its first
configuration alone the fit cannot tell the sync term from beta, and the
similar jobs can (DLRover-RM §3: the warm-start plan comes with
"similarity information").  Measured on the autoscaling simulator's
warm-started jobs: JCT over the oracle's +2.5 % with this prior, +3.3 %
without.

Their calibrations (:mod:`.calibration`, what their CPU readings said) are
smoothed the same way, field by field, into the prior of the new job's
calibration: from its one warm configuration the job cannot tell a worker's
runtime overhead from its cost per sample, nor how many cores a worker that
filled its CPUs could use; the similar jobs' sample stages measured several
configurations and can.  Measured (issue 15, simulator, 20 warm jobs per
profile, seeds 200-219): Wide&Deep +6.40 -> +5.45 % over the oracle,
xDeepFM +3.01 -> +2.88 %.

Cold start: when no finished job is similar enough (or the DB is empty) the
plan is :func:`pacer.jobs.spec.default_plan`, the documented defaults, marked
``cold``; the service may then profile the job with the sample stage
(:func:`pacer_services.brain.core.stages.sample_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from pacer.contracts.jobs import JobSpec, PlanSource, ResourcePlan
from pacer.jobs.spec import default_plan

from .calibration import Calibration
from .fitting import Coefficients
from .history import JobFeatures, JobHistory, Similar, top_k_similar
from .stages import fit_to_spec

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WarmStartConfig:
    """Knobs of Alg. 1; the defaults are the documented ones."""

    k: int = 5  # top-k similar jobs
    mu: float = 0.6  # smoothing factor, 0 < mu < 1: the weight of the more similar job at each step
    min_similarity: float = 0.5  # jobs less similar than this are not used at all


DEFAULT_WARMSTART = WarmStartConfig()


@dataclass(frozen=True, slots=True)
class WarmStart:
    """A warm-start plan and where it came from."""

    plan: ResourcePlan
    sources: tuple[Similar, ...]  # A^0 .. A^{k-1}: least similar first, most similar last
    weights: tuple[float, ...]  # the weight of each source in the plan (they sum to 1)
    mu: float
    predicted_throughput: float  # samples/s; 0 when unknown (cold start)
    cold: bool
    coefficients: Coefficients | None = None  # the similar jobs' fitted models, smoothed (None: none had one)
    calibration: Calibration | None = None  # the similar jobs' calibrations, smoothed (None: none had one)


def exponential_smoothing(values: Sequence[float], mu: float) -> float:
    """A-bar^{k-1} of DLRover-RM Eq. 10 over ``values`` = A^0 .. A^{k-1}."""
    if not values:
        raise ValueError("exponential smoothing needs at least one value")
    if not 0.0 < mu < 1.0:
        raise ValueError(f"mu must be in (0, 1), got {mu}")
    smoothed = values[0]  # Alg. 1 line 3: A-bar^0 = A^0
    for v in values[1:]:
        smoothed = mu * v + (1.0 - mu) * smoothed  # DLRover-RM Eq. 10
    return smoothed


def smoothing_weights(k: int, mu: float) -> tuple[float, ...]:
    """The weight of A^0 .. A^{k-1} in A-bar^{k-1} (Eq. 10 unrolled)."""
    if k <= 0:
        return ()
    return tuple(((1.0 - mu) ** (k - 1)) if i == 0 else mu * (1.0 - mu) ** (k - 1 - i) for i in range(k))


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def warm_start(spec: JobSpec, histories: Iterable[JobHistory], config: WarmStartConfig = DEFAULT_WARMSTART,
               *, records: int | None = None) -> WarmStart:
    """The start-up plan of ``spec`` from the config DB (DLRover-RM Alg. 1).

    ``records`` is the dataset's record count when the service knows it
    better than the spec (0 = unknown).  Pure and deterministic.
    """
    features = JobFeatures.from_spec(spec, records)
    top = top_k_similar(features, histories, config.k, min_similarity=config.min_similarity)
    if not top:
        base = default_plan(spec)
        plan = replace(base, source=PlanSource.BRAIN,
                       reason=f"cold start: no similar finished job; {base.reason}")
        return WarmStart(plan=plan, sources=(), weights=(), mu=config.mu, predicted_throughput=0.0, cold=True)
    ordered = tuple(reversed(top))  # Alg. 1 line 2: A^{k-1} is the most similar
    plans = [s.history.final_plan for s in ordered]
    finals = [p for p in plans if p is not None]  # top_k_similar only returns jobs with a plan

    def smooth(values: Sequence[float]) -> float:
        return exponential_smoothing(values, config.mu)

    plan = ResourcePlan(
        job=spec.name,
        workers=max(1, _round_half_up(smooth([p.workers for p in finals]))),
        ps=max(1, _round_half_up(smooth([p.ps for p in finals]))),
        worker_cpu=max(0.1, round(smooth([p.worker_cpu for p in finals]), 1)),
        worker_memory_mb=math.ceil(smooth([p.worker_memory_mb for p in finals]) - 1e-9),
        ps_cpu=max(0.1, round(smooth([p.ps_cpu for p in finals]), 1)),
        ps_memory_mb=math.ceil(smooth([p.ps_memory_mb for p in finals]) - 1e-9),
        source=PlanSource.BRAIN,
        reason=(f"warm start (DLRover-RM Alg. 1, mu={config.mu:g}) from "
                + ", ".join(f"{s.history.job} ({s.similarity:.2f})" for s in top)),
    )
    plan = fit_to_spec(plan, spec)
    per_worker = [s.history.throughput / max(1, p.workers) for s, p in zip(ordered, finals, strict=True)]
    predicted = smooth(per_worker) * plan.workers
    return WarmStart(plan=plan, sources=ordered, weights=smoothing_weights(len(ordered), config.mu),
                     mu=config.mu, predicted_throughput=predicted, cold=False,
                     coefficients=_smoothed([s.history.coefficients for s in ordered], smooth,
                                            Coefficients.from_dict),
                     calibration=_smoothed([s.history.calibration for s in ordered], smooth, Calibration.from_dict))


def _smoothed(records: Sequence[Coefficients | Calibration | None], smooth: Callable[[Sequence[float]], float],
              build: Callable[[dict[str, float]], T]) -> T | None:
    """The similar jobs' records (coefficients, calibrations) smoothed field by field (Eq. 10), over the
    jobs that have one."""
    known = [r.to_dict() for r in records if r is not None]
    if not known:
        return None
    return build({name: smooth([r[name] for r in known]) for name in known[0]})


def warm_start_error_pct(predicted: float | WarmStart, optimum: float) -> float:
    """Relative error, in percent, of a warm start's predicted throughput against the true optimum.

    ``|predicted - optimum| / optimum * 100``; DLRover-RM §6 reports the
    accuracy of warm-start configurations as 100 minus such an error.
    """
    if optimum <= 0:
        raise ValueError(f"the optimum throughput must be > 0, got {optimum}")
    value = predicted.predicted_throughput if isinstance(predicted, WarmStart) else predicted
    return abs(value - optimum) / optimum * 100.0
