"""NSGA-II plan candidates on the (cost, throughput) Pareto front (DLRover-RM §4.2-4.3, Eq. 7, 9)."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np
import pytest
from pacer.contracts.jobs import PlanSource
from pacer_services.brain.core.fitting import (
    PAPER_COEFFICIENTS,
    Coefficients,
    Config,
    JobConstants,
    Model,
)
from pacer_services.brain.core.pareto import (
    Candidate,
    NoFeasiblePlan,
    Prices,
    SearchSpace,
    dominates,
    pareto_candidates,
    plan_cost,
)

MODEL = Model(
    Coefficients(alpha_grad=1.2, alpha_upd=30.0, alpha_sync=6.0, alpha_emb=4.0, beta=9.0),
    JobConstants(model_size=4.0, bandwidth=10.0, embedding_dim=0.05),
)
SPACE = SearchSpace(
    batch_size=256, max_workers=32, max_ps=8, max_worker_cpu=8.0, max_ps_cpu=8.0,
    worker_memory_mb=2048, ps_memory_mb=1024, model_memory_mb=8192, cpu_step=0.5,
    max_cpu=64.0, max_memory_mb=96 * 1024,
)


def _brute_force_best(space: SearchSpace, model: Model) -> float:
    """The highest throughput of any plan within the quota, by enumerating the lattice."""
    best = 0.0
    steps_w = range(1, int(space.max_worker_cpu / space.cpu_step) + 1)
    steps_p = range(1, int(space.max_ps_cpu / space.cpu_step) + 1)
    for w, p in itertools.product(range(space.min_workers, space.max_workers + 1), range(space.min_ps, space.max_ps + 1)):
        mem = w * space.worker_memory_mb + p * int(space.ps_memory(p))
        if space.max_memory_mb is not None and mem > space.max_memory_mb:
            continue
        for sw, sp in itertools.product(steps_w, steps_p):
            cpu = w * sw * space.cpu_step + p * sp * space.cpu_step
            if space.max_cpu is not None and cpu > space.max_cpu:
                continue
            best = max(best, model.predict(Config(w, p, sw * space.cpu_step, sp * space.cpu_step, space.batch_size)))
    return best


@pytest.fixture(scope="module")
def front() -> list[Candidate]:
    found: list[Candidate] = pareto_candidates("job-a", MODEL, SPACE, seed=7)
    return found


def test_every_candidate_is_non_dominated(front: list[Candidate]) -> None:
    assert len(front) >= 5
    for a, b in itertools.permutations(front, 2):
        assert not dominates(a, b), (a, b)
    costs = [c.cost for c in front]
    assert costs == sorted(costs)


def test_candidates_respect_bounds_and_quota(front: list[Candidate]) -> None:
    for c in front:
        p = c.plan
        assert (p.job, p.source) == ("job-a", PlanSource.BRAIN)
        assert 1 <= p.workers <= SPACE.max_workers and 1 <= p.ps <= SPACE.max_ps
        assert 0 < p.worker_cpu <= SPACE.max_worker_cpu and 0 < p.ps_cpu <= SPACE.max_ps_cpu
        assert (p.worker_cpu / SPACE.cpu_step).is_integer() and (p.ps_cpu / SPACE.cpu_step).is_integer()
        assert p.workers * p.worker_cpu + p.ps * p.ps_cpu <= SPACE.max_cpu  # type: ignore[operator]
        assert p.workers * p.worker_memory_mb + p.ps * p.ps_memory_mb <= SPACE.max_memory_mb  # type: ignore[operator]
        assert p.ps_memory_mb == max(SPACE.ps_memory_mb, -(-SPACE.model_memory_mb // p.ps))
        # The reported numbers are the model's and Eq. 7's, not NSGA-II's internals.
        assert c.cost == pytest.approx(plan_cost(p, Prices()))
        assert c.throughput == pytest.approx(
            MODEL.predict(Config(p.workers, p.ps, p.worker_cpu, p.ps_cpu, SPACE.batch_size))
        )


def test_the_front_reaches_near_the_true_best_and_the_cheapest_plan(front: list[Candidate]) -> None:
    assert max(c.throughput for c in front) >= 0.98 * _brute_force_best(SPACE, MODEL)
    assert front[0].plan.workers == 1 and front[0].plan.ps == 1
    assert front[0].plan.worker_cpu == SPACE.cpu_step


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_more_budget_is_not_worse(seed: int) -> None:
    bests = []
    for quota in (16.0, 32.0, 64.0, 128.0):
        space = replace(SPACE, max_cpu=quota, max_memory_mb=None)
        bests.append(max(c.throughput for c in pareto_candidates("j", MODEL, space, seed=seed)))
    assert all(b >= a for a, b in itertools.pairwise(bests)), bests
    assert bests[-1] > 1.5 * bests[0]


def test_seeded_runs_are_deterministic() -> None:
    a = pareto_candidates("j", MODEL, SPACE, seed=3)
    b = pareto_candidates("j", MODEL, SPACE, seed=3)
    assert a == b
    c = pareto_candidates("j", MODEL, SPACE, seed=4)
    assert [x.plan for x in c] != [x.plan for x in a]


def test_paper_coefficients_give_a_front_too() -> None:
    front = pareto_candidates("j", Model(PAPER_COEFFICIENTS), replace(SPACE, max_cpu=32.0), seed=0)
    assert len(front) >= 3
    assert all(c.plan.workers * c.plan.worker_cpu + c.plan.ps * c.plan.ps_cpu <= 32.0 for c in front)


def test_a_quota_below_the_smallest_plan_is_refused() -> None:
    with pytest.raises(NoFeasiblePlan, match="quota"):
        pareto_candidates("j", MODEL, replace(SPACE, max_memory_mb=1000), seed=0)


def test_fast_enough() -> None:
    start = time.perf_counter()
    pareto_candidates("j", MODEL, SPACE, seed=11)
    assert time.perf_counter() - start < 3.0  # ~0.3 s here; generous for a loaded CI box
    assert np.isfinite(MODEL.predict(Config(1, 1, 0.5, 0.5, 256)))
