"""Job-level resource plan candidates on the Pareto front (DLRover-RM §4.2-4.3, NSGA-II).

DLRover-RM Eq. 9 asks for allocations that minimise the resource cost
RC (Eq. 7) and maximise the throughput gain TG (Eq. 8).  Within one job,
TG = Psi(A) - Psi(current) - Overhead(A): the current throughput is a
constant, so the front of (cost, predicted throughput) is the front of
(cost, Delta Psi).  The overhead needs the job's remaining samples and the
history of scaling times; it is subtracted by the cluster stage
(:mod:`pacer_services.brain.core.cluster`), which also always keeps
"no change" as an option, since a plan off this front can still win once
overheads count.

Decision variables, all integers so NSGA-II works on a lattice
(``pymoo`` integer sampling, SBX and polynomial mutation with rounding
repair): workers ``w``, PS ``p``, and the CPUs per worker and per PS as
multiples of ``cpu_step``.  Memory per node is not a variable of the
throughput model: workers get ``worker_memory_mb``; each PS gets
``max(ps_memory_mb, ps_base_mb + model_memory_mb / p)`` since the
parameters are split over the PS and each PS has its own runtime.  Constraints (NSGA-II's constraint domination): total CPUs and
total memory within the job's quota.

Cost (DLRover-RM Eq. 7): ``RC = sum a_r * Money(a_r)`` with a price per CPU
and per GiB of memory (:class:`Prices`).

Budget: population 40, 50 generations (2,000 evaluations, vectorised
through :meth:`Model.predict_many`): ~0.3 s on this machine class
(docs/design.md), the front of a 4-variable problem is stable well before.
Deterministic for a given ``seed`` (pymoo draws from its own
``numpy.random.default_rng(seed)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pymoo.algorithms.moo.nsga2 import NSGA2  # type: ignore[import-untyped]
from pymoo.core.problem import Problem  # type: ignore[import-untyped]
from pymoo.operators.crossover.sbx import SBX  # type: ignore[import-untyped]
from pymoo.operators.mutation.pm import PM  # type: ignore[import-untyped]
from pymoo.operators.repair.rounding import RoundingRepair  # type: ignore[import-untyped]
from pymoo.optimize import minimize  # type: ignore[import-untyped]

from .fitting import Model

__all__ = [
    "Candidate",
    "NoFeasiblePlan",
    "Prices",
    "SearchSpace",
    "dominates",
    "lattice_best",
    "non_dominated",
    "pareto_candidates",
    "plan_cost",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


class NoFeasiblePlan(ValueError):
    """Not even the smallest plan of the search space fits the quota."""


@dataclass(frozen=True, slots=True)
class Prices:
    """Money(a_r) of DLRover-RM Eq. 7: the price of one unit of each resource."""

    cpu: float = 1.0  # per CPU
    memory_gib: float = 0.25  # per GiB (1 CPU ~ 4 GiB, a common cloud ratio)


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Bounds of the plans of one job; ``max_cpu`` / ``max_memory_mb`` are its quota (None = none)."""

    batch_size: int  # m: samples per worker per iteration (DLRover-RM Eq. 1)
    max_workers: int
    max_ps: int
    max_worker_cpu: float
    max_ps_cpu: float
    worker_memory_mb: int
    ps_memory_mb: int  # at least this per PS
    model_memory_mb: int = 0  # parameters + embeddings, split over the PS
    ps_base_mb: int = 0  # what every PS holds besides its share of the model (its runtime)
    memory_skew: float = 1.0  # kappa_mem: the largest of p PS holds min(1, kappa_mem / p) of the model
    min_workers: int = 1
    min_ps: int = 1
    cpu_step: float = 0.5
    min_worker_cpu: float = 0.0  # below one cpu_step means one cpu_step
    min_ps_cpu: float = 0.0
    max_cpu: float | None = None
    max_memory_mb: int | None = None

    def __post_init__(self) -> None:
        if not (1 <= self.min_workers <= self.max_workers and 1 <= self.min_ps <= self.max_ps):
            raise ValueError(f"need 1 <= min <= max for workers and PS: {self}")
        if not (self.cpu_step > 0 and self.max_worker_cpu >= self.cpu_step and self.max_ps_cpu >= self.cpu_step):
            raise ValueError(f"need 0 < cpu_step <= max CPUs per node: {self}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1: {self}")
        if self.min_worker_cpu > self.max_worker_cpu or self.min_ps_cpu > self.max_ps_cpu:
            raise ValueError(f"need min <= max CPUs per node: {self}")

    @property
    def lower(self) -> tuple[int, int, int, int]:
        """The smallest plan on the lattice: (workers, PS, worker CPU steps, PS CPU steps)."""
        def steps(cpu: float) -> int:
            return max(1, math.ceil(cpu / self.cpu_step - 1e-9))
        return (self.min_workers, self.min_ps, steps(self.min_worker_cpu), steps(self.min_ps_cpu))

    def ps_memory(self, ps: npt.ArrayLike) -> IntArray:
        """Memory per PS for ``ps`` PS: its runtime plus the largest PS's share, at least ``ps_memory_mb``.

        One plan gives every PS the same memory, so each gets what the
        largest partition needs (``min(1, memory_skew / p)`` of the model).
        """
        p = np.asarray(ps, dtype=np.int64)
        share = np.ceil(self.model_memory_mb * np.minimum(1.0, max(1.0, self.memory_skew) / p) - 1e-9)
        return np.maximum(self.ps_memory_mb, self.ps_base_mb + share.astype(np.int64))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A plan on the front with its cost (Eq. 7) and predicted throughput (Eq. 1)."""

    plan: ResourcePlan
    cost: float
    throughput: float


def plan_cost(plan: ResourcePlan, prices: Prices) -> float:
    """RC(A) = sum a_r * Money(a_r) (DLRover-RM Eq. 7) of a whole plan."""
    cpu = plan.workers * plan.worker_cpu + plan.ps * plan.ps_cpu
    mem = plan.workers * plan.worker_memory_mb + plan.ps * plan.ps_memory_mb
    return cpu * prices.cpu + mem / 1024.0 * prices.memory_gib


def dominates(a: Candidate, b: Candidate) -> bool:
    """``a`` costs no more, yields no less, and is strictly better in one of the two."""
    return (a.cost <= b.cost and a.throughput >= b.throughput) and (
        a.cost < b.cost or a.throughput > b.throughput
    )


def non_dominated(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other candidate dominates, by cost then throughput, one per (cost, throughput)."""
    ordered = sorted(candidates, key=lambda c: (c.cost, -c.throughput))
    front: list[Candidate] = []
    best = -math.inf
    for c in ordered:  # sorted by cost: a candidate survives iff it beats every cheaper one
        if c.throughput > best:
            front.append(c)
            best = c.throughput
    return front


class _PlanProblem(Problem):  # type: ignore[misc]
    """x = (w, p, worker CPU steps, PS CPU steps); f = (cost, -throughput); g <= 0 = quota."""

    def __init__(self, model: Model, space: SearchSpace, prices: Prices) -> None:
        self.model = model
        self.space = space
        self.prices = prices
        n_constr = int(space.max_cpu is not None) + int(space.max_memory_mb is not None)
        super().__init__(
            n_var=4,
            n_obj=2,
            n_ieq_constr=n_constr,
            xl=np.array(space.lower),
            xu=np.array([
                space.max_workers,
                space.max_ps,
                int(space.max_worker_cpu / space.cpu_step + 1e-9),
                int(space.max_ps_cpu / space.cpu_step + 1e-9),
            ]),
            vtype=int,
        )

    def _evaluate(self, x: FloatArray, out: dict[str, object], *args: object, **kwargs: object) -> None:
        f, g = _objectives(np.rint(x).astype(np.int64), self.model, self.space, self.prices)
        out["F"] = f
        if g.shape[1]:
            out["G"] = g


def _objectives(
    x: IntArray, model: Model, space: SearchSpace, prices: Prices
) -> tuple[FloatArray, FloatArray]:
    w, p = x[:, 0], x[:, 1]
    cw, cp = x[:, 2] * space.cpu_step, x[:, 3] * space.cpu_step
    psi = model.predict_many(w, p, cw, cp, space.batch_size)
    cpu = w * cw + p * cp
    mem = w * space.worker_memory_mb + p * space.ps_memory(p)
    cost = cpu * prices.cpu + mem / 1024.0 * prices.memory_gib  # Eq. 7
    g: list[FloatArray] = []
    if space.max_cpu is not None:
        g.append(cpu - space.max_cpu)
    if space.max_memory_mb is not None:
        g.append((mem - space.max_memory_mb).astype(np.float64))
    return np.stack([cost, -psi], axis=1), np.stack(g, axis=1) if g else np.zeros((len(x), 0))


def pareto_candidates(
    job: str,
    model: Model,
    space: SearchSpace,
    *,
    seed: int,
    prices: Prices | None = None,
    pop_size: int = 40,
    generations: int = 50,
) -> list[Candidate]:
    """Non-dominated plans of (cost, predicted throughput) by NSGA-II (DLRover-RM §4.3), cheapest first.

    Every candidate lies within ``space`` and its quota.  Raises
    :class:`NoFeasiblePlan` if the smallest plan already breaks the quota.
    The initial population holds the smallest plan (the cheap end of the
    front, which random sampling may miss) and random lattice points.
    """
    prices = prices or Prices()
    problem = _PlanProblem(model, space, prices)
    smallest = np.array([space.lower], dtype=np.int64)
    _, g_min = _objectives(smallest, model, space, prices)
    if g_min.size and float(g_min.max()) > 0.0:
        raise NoFeasiblePlan(
            f"job {job}: the smallest plan ({space.min_workers} workers, {space.min_ps} PS, "
            f"{space.cpu_step} CPU each) exceeds the quota (max_cpu={space.max_cpu}, "
            f"max_memory_mb={space.max_memory_mb})"
        )
    rng = np.random.default_rng(seed)
    xl, xu = problem.xl.astype(np.int64), problem.xu.astype(np.int64)
    initial = np.vstack([smallest, rng.integers(xl, xu + 1, size=(pop_size - 1, 4))])
    algorithm = NSGA2(
        pop_size=pop_size,
        sampling=initial,
        crossover=SBX(prob=0.9, eta=15, vtype=float, repair=RoundingRepair()),
        mutation=PM(eta=20, vtype=float, repair=RoundingRepair()),
        eliminate_duplicates=True,
    )
    res = minimize(problem, algorithm, ("n_gen", generations), seed=seed, verbose=False)
    if res.X is None:  # no feasible point found (cannot happen: the smallest plan is feasible)
        raise NoFeasiblePlan(f"job {job}: NSGA-II found no plan within the quota")
    xs = np.atleast_2d(np.rint(res.X).astype(np.int64))
    f, _ = _objectives(xs, model, space, prices)
    mem_ps = space.ps_memory(xs[:, 1])
    found = [
        Candidate(
            plan=ResourcePlan(
                job=job,
                workers=int(x[0]),
                ps=int(x[1]),
                worker_cpu=float(x[2] * space.cpu_step),
                worker_memory_mb=space.worker_memory_mb,
                ps_cpu=float(x[3] * space.cpu_step),
                ps_memory_mb=int(mem_ps[i]),
                source=PlanSource.BRAIN,
                reason=f"DLRover-RM Pareto candidate: predicted {-fi[1]:.1f} samples/s at cost {fi[0]:.2f}",
            ),
            cost=float(fi[0]),
            throughput=float(-fi[1]),
        )
        for i, (x, fi) in enumerate(zip(xs, f, strict=True))
    ]
    return non_dominated(found)


def lattice_best(
    job: str,
    model: Model,
    space: SearchSpace,
    *,
    prices: Prices | None = None,
    count: int = 8,
) -> list[Candidate]:
    """The ``count`` plans of highest predicted throughput in ``space``, by exhaustive search.

    NSGA-II spreads its population along the whole front, so its fastest
    plan can fall a few percent short of the fastest there is, and that top
    end is where a job alone in its quota wants to be.  The throughput of
    DLRover-RM Eq. 1 grows with the worker count for a fixed (p, C_w, C_p)
    (``w m / (c + d w)`` is increasing), so only the most workers that fit
    each (p, C_w, C_p) need evaluating: a few hundred thousand points in one
    vectorised call.  Ties go to the cheaper plan.
    """
    prices = prices or Prices()
    step = space.cpu_step
    lo_w, lo_p, lo_cw, lo_cp = space.lower
    hi_cw = int(space.max_worker_cpu / step + 1e-9)
    hi_cp = int(space.max_ps_cpu / step + 1e-9)
    cw = np.arange(lo_cw, hi_cw + 1, dtype=np.float64) * step
    cp = np.arange(lo_cp, hi_cp + 1, dtype=np.float64) * step
    p = np.arange(lo_p, space.max_ps + 1, dtype=np.float64)
    P, CW, CP = (a.ravel() for a in np.meshgrid(p, cw, cp, indexing="ij"))
    mem_ps = space.ps_memory(P.astype(np.int64)).astype(np.float64)
    w = np.full(P.shape, float(space.max_workers))
    if space.max_cpu is not None:
        w = np.minimum(w, np.floor((space.max_cpu - P * CP) / CW + 1e-9))
    if space.max_memory_mb is not None:
        w = np.minimum(w, np.floor((space.max_memory_mb - P * mem_ps) / space.worker_memory_mb + 1e-9))
    ok = w >= lo_w
    if not ok.any():
        return []
    P, CW, CP, W, mem_ps = P[ok], CW[ok], CP[ok], w[ok], mem_ps[ok]
    psi = model.predict_many(W, P, CW, CP, space.batch_size)
    cost = (W * CW + P * CP) * prices.cpu + (W * space.worker_memory_mb + P * mem_ps) / 1024.0 * prices.memory_gib
    order = np.lexsort((cost, -psi))[:count]
    return [
        Candidate(
            plan=ResourcePlan(
                job=job, workers=int(W[i]), ps=int(P[i]), worker_cpu=float(CW[i]),
                worker_memory_mb=space.worker_memory_mb, ps_cpu=float(CP[i]), ps_memory_mb=int(mem_ps[i]),
                source=PlanSource.BRAIN,
                reason=f"DLRover-RM model, fastest plans: predicted {psi[i]:.1f} samples/s at cost {cost[i]:.2f}",
            ),
            cost=float(cost[i]),
            throughput=float(psi[i]),
        )
        for i in order
    ]
