"""Cluster-level weighted greedy selection of the jobs' plans (DLRover-RM §4.3, Eq. 8, 11-14).

Every job that needs (re)allocation brings its Pareto candidates
(:mod:`pacer_services.brain.core.pareto`), its current plan and throughput
(none for a job not yet started), and its remaining samples Phi_sp.  One
candidate is chosen per job so that the weighted benefit sum
``sum_j RE(A^j) * WG(A^j)`` (Eq. 12) is large while ``sum_j A^j <= S``
(Eq. 13), greedily:

1. score every (job, candidate) by ``RE * WG``;
2. walk the scores from the highest down; take a candidate if its job has
   no choice yet and the change from the job's current plan fits in what
   is left of S; a job that gets nothing keeps its current plan.

Definitions, as the paper writes them:

* ``A^j`` is the *additional* allocation (§4.2: "the additional allocated
  resources"): the candidate minus the current plan.  RC(A) (Eq. 7) is its
  cost; a candidate that costs no more than the current plan but is faster
  has RE = +inf and is taken first.  Candidates that would shrink a job
  and lose throughput are not scored (scaling in is the business of the
  other stages).
* ``TG(A) = Delta Psi - Overhead(A)`` (Eq. 8).  The paper states the
  overhead as time lost to scaling, estimated from history.  As a
  throughput: the job must still train Phi samples; at the new throughput
  Psi' that takes Phi/Psi' seconds plus the pause t_o, so its effective
  throughput is ``Phi / (t_o + Phi/Psi')`` and
  ``Overhead = Psi' - Phi / (t_o + Phi/Psi') = Psi'^2 t_o / (Phi + Psi' t_o)``.
  Candidates with TG <= 0 are dropped.
* ``RE(A) = TG(A) / RC(A)`` (Eq. 11).
* ``WG(A) = 1 / (Phi / Psi^A + eps)^rho`` (Eq. 14), rho = 2.5 as at
  AntGroup: the shorter the remaining time at the candidate's throughput,
  the higher the weight; rho -> 0 gives every job the weight 1.

S is what the jobs being planned may hold together: the free resources
plus what their current plans hold (the caller decides, e.g. a cluster's
capacity minus everything else).  Teams share S under quotas of their own:
``group_room`` gives, per group (a namespace), what its jobs may still add
together, and a candidate is taken only if it fits there too (Eq. 13 once
more per group: ``sum_{j in g} A^j <= room_g``).  The pause t_o comes from
:class:`OverheadModel`, the median of past pauses of the same kind (Eq. 8:
"estimated through statistical analysis ... of historical jobs").

Pure: no IO, no clock.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pacer.contracts.jobs import ResourcePlan

from .pareto import Candidate, Prices

__all__ = [
    "DEFAULT_EPSILON",
    "DEFAULT_RHO",
    "ClusterDecision",
    "JobChoice",
    "JobRequest",
    "OverheadModel",
    "Resources",
    "ScalingKind",
    "ScalingRecord",
    "Scored",
    "best_for_job",
    "effective_overhead",
    "plan_resources",
    "resource_cost",
    "score",
    "select",
    "weight",
]

DEFAULT_RHO = 2.5  # DLRover-RM §4.3: "we choose rho = 2.5"
DEFAULT_EPSILON = 1e-9  # Eq. 14's epsilon: only keeps the division defined


@dataclass(frozen=True, slots=True)
class Resources:
    """An amount of CPUs and memory (a plan's total, the cluster's S, an allocation A)."""

    cpu: float = 0.0
    memory_mb: float = 0.0

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.cpu + other.cpu, self.memory_mb + other.memory_mb)

    def __sub__(self, other: Resources) -> Resources:
        return Resources(self.cpu - other.cpu, self.memory_mb - other.memory_mb)

    def fits_in(self, capacity: Resources, tol: float = 1e-9) -> bool:
        return self.cpu <= capacity.cpu + tol and self.memory_mb <= capacity.memory_mb + tol


def plan_resources(plan: ResourcePlan | None) -> Resources:
    """The total CPUs and memory of a plan (nothing for no plan)."""
    if plan is None:
        return Resources()
    return Resources(
        cpu=plan.workers * plan.worker_cpu + plan.ps * plan.ps_cpu,
        memory_mb=float(plan.workers * plan.worker_memory_mb + plan.ps * plan.ps_memory_mb),
    )


def resource_cost(extra: Resources, prices: Prices) -> float:
    """RC(A) = sum a_r * Money(a_r) (DLRover-RM Eq. 7) of an additional allocation."""
    return extra.cpu * prices.cpu + extra.memory_mb / 1024.0 * prices.memory_gib


class ScalingKind(str, enum.Enum):
    """What a re-plan has to restart, which decides how long training pauses.

    ``none``: the plan does not change.  ``memory``: only memory grows, same
    counts and CPU (the executor raises the running pods' limits in place:
    no pause where the cluster can).  ``workers``: only workers are added,
    removed or resized; the PS keep the model.  ``ps``: the PS set changes,
    so the model is checkpointed and restored (DLRover-RM §5.2 migration).
    """

    NONE = "none"
    MEMORY = "memory"
    WORKERS = "workers"
    PS = "ps"

    @classmethod
    def between(cls, current: ResourcePlan | None, new: ResourcePlan) -> ScalingKind:
        if current is None:
            return cls.PS  # a first start brings up everything
        if ((current.ps, current.ps_cpu, current.workers, current.worker_cpu)
                == (new.ps, new.ps_cpu, new.workers, new.worker_cpu)
                and new.ps_memory_mb >= current.ps_memory_mb and new.worker_memory_mb >= current.worker_memory_mb
                and (new.ps_memory_mb, new.worker_memory_mb) != (current.ps_memory_mb, current.worker_memory_mb)):
            return cls.MEMORY
        if (current.ps, current.ps_cpu, current.ps_memory_mb) != (new.ps, new.ps_cpu, new.ps_memory_mb):
            return cls.PS
        if (current.workers, current.worker_cpu, current.worker_memory_mb) != (
            new.workers, new.worker_cpu, new.worker_memory_mb,
        ):
            return cls.WORKERS
        return cls.NONE


@dataclass(frozen=True, slots=True)
class ScalingRecord:
    """A past re-plan from the history: its kind and the training time it cost, seconds."""

    kind: ScalingKind
    pause_s: float


@dataclass(frozen=True, slots=True)
class OverheadModel:
    """Pause of a re-plan by kind (DLRover-RM Eq. 8's Overhead(A), as time).

    Medians of past pauses of the same kind (robust to the odd scaling that
    waited for a busy cluster); the defaults stand in until history exists.
    """

    worker_pause_s: float = 30.0
    ps_pause_s: float = 120.0
    # memory raised in place: nothing restarts (a cluster that cannot shows a pause in the history)
    memory_pause_s: float = 0.0

    @classmethod
    def from_history(
        cls, records: Iterable[ScalingRecord], default: OverheadModel | None = None
    ) -> OverheadModel:
        base = default or cls()
        by_kind: dict[ScalingKind, list[float]] = {ScalingKind.WORKERS: [], ScalingKind.PS: [],
                                                   ScalingKind.MEMORY: []}
        for r in records:
            if r.kind in by_kind and r.pause_s >= 0.0 and math.isfinite(r.pause_s):
                by_kind[r.kind].append(r.pause_s)
        w, p, m = by_kind[ScalingKind.WORKERS], by_kind[ScalingKind.PS], by_kind[ScalingKind.MEMORY]
        return cls(
            worker_pause_s=statistics.median(w) if w else base.worker_pause_s,
            ps_pause_s=statistics.median(p) if p else base.ps_pause_s,
            memory_pause_s=statistics.median(m) if m else base.memory_pause_s,
        )

    def pause_s(self, current: ResourcePlan | None, new: ResourcePlan) -> float:
        kind = ScalingKind.between(current, new)
        if kind is ScalingKind.NONE:
            return 0.0
        if kind is ScalingKind.MEMORY:
            return self.memory_pause_s
        return self.worker_pause_s if kind is ScalingKind.WORKERS else self.ps_pause_s


def effective_overhead(new_throughput: float, remaining_samples: float, pause_s: float) -> float:
    """Overhead(A) of DLRover-RM Eq. 8 as throughput: ``Psi'^2 t_o / (Phi + Psi' t_o)`` (module doc)."""
    if pause_s <= 0.0 or new_throughput <= 0.0:
        return 0.0
    if remaining_samples <= 0.0:
        return new_throughput  # nothing left to train: any pause is pure loss
    return new_throughput**2 * pause_s / (remaining_samples + new_throughput * pause_s)


def weight(remaining_samples: float, throughput: float, rho: float = DEFAULT_RHO,
           epsilon: float = DEFAULT_EPSILON) -> float:
    """WG(A) = 1 / (Phi_sp / Psi^A + eps)^rho (DLRover-RM Eq. 14)."""
    return float(1.0 / (remaining_samples / throughput + epsilon) ** rho)


@dataclass(frozen=True, slots=True)
class JobRequest:
    """One job to (re)allocate: its candidates, where it stands, and what is left to train."""

    job: str
    candidates: Sequence[Candidate]
    remaining_samples: float  # Phi_sp
    current: ResourcePlan | None = None  # None: not started yet
    current_throughput: float = 0.0  # measured Psi of ``current``


@dataclass(frozen=True, slots=True)
class Scored:
    """A candidate with the terms of DLRover-RM Eq. 8, 11, 14 and its greedy score RE * WG."""

    job: str
    candidate: Candidate
    extra: Resources  # A^j: candidate minus the current plan
    cost: float  # RC(A^j), Eq. 7
    gain: float  # TG(A^j), Eq. 8
    efficiency: float  # RE(A^j), Eq. 11 (+inf when RC <= 0 and TG > 0)
    weight: float  # WG(A^j), Eq. 14
    score: float  # RE * WG, the summand of Eq. 12


def score(
    request: JobRequest,
    candidate: Candidate,
    *,
    prices: Prices,
    overhead: OverheadModel,
    rho: float = DEFAULT_RHO,
    epsilon: float = DEFAULT_EPSILON,
) -> Scored | None:
    """Score one candidate of a job, or None when it gains nothing (TG <= 0)."""
    extra = plan_resources(candidate.plan) - plan_resources(request.current)
    pause = overhead.pause_s(request.current, candidate.plan)
    gain = (candidate.throughput - request.current_throughput) - effective_overhead(
        candidate.throughput, request.remaining_samples, pause
    )  # Eq. 8
    if gain <= 0.0:
        return None
    cost = resource_cost(extra, prices)  # Eq. 7
    efficiency = gain / cost if cost > 0.0 else math.inf  # Eq. 11
    wg = weight(request.remaining_samples, candidate.throughput, rho, epsilon)  # Eq. 14
    return Scored(
        job=request.job, candidate=candidate, extra=extra, cost=cost, gain=gain,
        efficiency=efficiency, weight=wg, score=efficiency * wg,
    )


@dataclass(frozen=True, slots=True)
class JobChoice:
    """What the selection gives a job: a new plan (``scored`` says why) or its current one."""

    job: str
    plan: ResourcePlan | None  # None: a new job that did not fit
    scored: Scored | None = None  # None: unchanged

    @property
    def changed(self) -> bool:
        return self.scored is not None


@dataclass(frozen=True, slots=True)
class ClusterDecision:
    """The outcome of one round: one choice per job, in request order, and what is left of S."""

    choices: list[JobChoice]
    left: Resources
    objective: float = 0.0  # sum of the chosen RE * WG (Eq. 12; inf if a free win was taken)
    considered: list[Scored] = field(default_factory=list)  # every scored candidate, best first


def select(
    requests: Sequence[JobRequest],
    total: Resources,
    *,
    prices: Prices | None = None,
    overhead: OverheadModel | None = None,
    rho: float = DEFAULT_RHO,
    epsilon: float = DEFAULT_EPSILON,
    group_of: Mapping[str, str] | None = None,
    group_room: Mapping[str, Resources] | None = None,
) -> ClusterDecision:
    """Weighted greedy selection (DLRover-RM Eq. 12-14) of one plan per job within ``total`` (Eq. 13).

    ``group_of`` maps a job to its group (namespace) and ``group_room`` a
    group to what its jobs may add together beyond their current plans
    (a team's quota less what the team holds; a group without an entry is
    bound by ``total`` only).  Raises ValueError if the jobs' current plans
    alone exceed ``total`` or if two requests name the same job.
    """
    prices = prices or Prices()
    overhead = overhead or OverheadModel()
    jobs = [r.job for r in requests]
    if len(set(jobs)) != len(jobs):
        raise ValueError(f"duplicate jobs in the requests: {jobs}")
    held = Resources()
    for r in requests:
        held = held + plan_resources(r.current)
    if not held.fits_in(total):
        raise ValueError(f"the current plans ({held}) already exceed the total resources ({total})")
    left = total - held

    scored: list[Scored] = []
    for r in requests:
        for c in r.candidates:
            s = score(r, c, prices=prices, overhead=overhead, rho=rho, epsilon=epsilon)
            if s is not None:
                scored.append(s)
    # Highest score first; ties go to the larger gain, then the cheaper, then request order
    # (sorted() is stable), so the outcome does not depend on hash order.
    scored.sort(key=lambda s: (-s.score, -s.gain, s.cost))

    group_of = group_of or {}
    room = dict(group_room or {})
    chosen: dict[str, Scored] = {}
    for s in scored:
        if s.job in chosen:
            continue
        after = left - s.extra
        if after.cpu < -1e-9 or after.memory_mb < -1e-9:  # Eq. 13: sum_j A^j <= S
            continue
        group = group_of.get(s.job)
        if group in room:  # and within the job's group: sum_{j in g} A^j <= room_g
            if not s.extra.fits_in(room[group]):
                continue
            room[group] = room[group] - s.extra
        chosen[s.job] = s
        left = after

    choices = [
        JobChoice(job=r.job, plan=chosen[r.job].candidate.plan, scored=chosen[r.job])
        if r.job in chosen
        else JobChoice(job=r.job, plan=r.current)
        for r in requests
    ]
    objective = sum(s.score for s in chosen.values())
    return ClusterDecision(choices=choices, left=left, objective=objective, considered=scored)


def best_for_job(
    request: JobRequest,
    quota: Resources,
    *,
    prices: Prices | None = None,
    overhead: OverheadModel | None = None,
) -> JobChoice:
    """The plan of one job alone within its own ``quota``: the candidate with the largest TG (Eq. 8).

    A job that shares nothing wants the shortest JCT, so the gain net of the
    pause it costs decides; on equal gains the cheaper plan (Eq. 7) wins.
    Eq. 11-14's efficiency and remaining-time weights decide *between* jobs
    (:func:`select`); within one job they would prefer a small free step to
    a large paid one.  Candidates that do not fit the quota, or gain
    nothing, are not taken: the job keeps its plan.
    """
    prices = prices or Prices()
    overhead = overhead or OverheadModel()
    best: Scored | None = None
    for c in request.candidates:
        if not plan_resources(c.plan).fits_in(quota):
            continue
        s = score(request, c, prices=prices, overhead=overhead)
        if s is not None and (best is None or (s.gain, -s.cost) > (best.gain, -best.cost)):
            best = s
    if best is None:
        return JobChoice(job=request.job, plan=request.current)
    return JobChoice(job=request.job, plan=best.candidate.plan, scored=best)
