"""Cluster-level weighted greedy selection (DLRover-RM Eq. 8, 11-14)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer_services.brain.core.cluster import (
    DEFAULT_RHO,
    JobRequest,
    OverheadModel,
    Resources,
    ScalingKind,
    ScalingRecord,
    effective_overhead,
    plan_resources,
    select,
    weight,
)
from pacer_services.brain.core.pareto import Candidate, Prices

CPU_ONLY = Prices(cpu=1.0, memory_gib=0.0)
NO_PAUSE = OverheadModel(worker_pause_s=0.0, ps_pause_s=0.0)
BIG_MEM = 1e12


def _plan(job: str, workers: int, cpu: float = 1.0, ps: int = 1, ps_cpu: float = 0.0) -> ResourcePlan:
    return ResourcePlan(job=job, workers=workers, ps=ps, worker_cpu=cpu, worker_memory_mb=0,
                        ps_cpu=ps_cpu, ps_memory_mb=0, source=PlanSource.BRAIN)


def _cand(job: str, workers: int, throughput: float, cpu: float = 1.0) -> Candidate:
    plan = _plan(job, workers, cpu)
    return Candidate(plan=plan, cost=workers * cpu, throughput=throughput)


def _three_jobs() -> list[JobRequest]:
    return [
        JobRequest("a", [_cand("a", 2, 10.0)], remaining_samples=1_000),
        JobRequest("b", [_cand("b", 2, 20.0)], remaining_samples=100_000),
        JobRequest("c", [_cand("c", 1, 5.0)], remaining_samples=5_000),
    ]


def test_hand_checked_three_jobs() -> None:
    # By hand (new jobs, no pause, 1 per CPU): RE = TG / RC (Eq. 11), WG = (Phi/Psi)^-2.5 (Eq. 14)
    #   a: RE = 10/2 = 5,  WG = 100^-2.5    = 1e-5     -> 5e-5
    #   b: RE = 20/2 = 10, WG = 5000^-2.5   ~ 5.66e-10 -> 5.66e-9
    #   c: RE = 5/1 = 5,   WG = 1000^-2.5   ~ 3.16e-8  -> 1.58e-7
    # Greedy within 3 CPUs: a (2 CPUs), then c (1 CPU); b no longer fits.
    d = select(_three_jobs(), Resources(cpu=3.0, memory_mb=BIG_MEM), prices=CPU_ONLY, overhead=NO_PAUSE)
    by_job = {c.job: c for c in d.choices}
    assert by_job["a"].plan is not None and by_job["a"].plan.workers == 2
    assert by_job["c"].plan is not None and by_job["c"].plan.workers == 1
    assert by_job["b"].plan is None and not by_job["b"].changed
    assert [s.job for s in d.considered] == ["a", "c", "b"]
    scores = {s.job: s.score for s in d.considered}
    assert scores["a"] == pytest.approx(5 * 100**-2.5)
    assert scores["b"] == pytest.approx(10 * 5000**-2.5)
    assert scores["c"] == pytest.approx(5 * 1000**-2.5)
    assert d.left.cpu == pytest.approx(0.0)
    assert d.objective == pytest.approx(5 * 100**-2.5 + 5 * 1000**-2.5)


def test_rho_zero_weighs_all_jobs_equally() -> None:
    assert weight(1e9, 1.0, rho=0.0) == 1.0 and weight(1.0, 1e9, rho=0.0) == 1.0
    assert weight(1_000, 10.0, rho=1e-9) == pytest.approx(1.0)
    # Without weights only RE counts: b (RE 10) beats a (RE 5) for the 2 CPUs.
    d = select(_three_jobs()[:2], Resources(cpu=2.0, memory_mb=BIG_MEM), prices=CPU_ONLY,
               overhead=NO_PAUSE, rho=0.0)
    assert [c.job for c in d.choices if c.changed] == ["b"]
    assert all(s.weight == 1.0 for s in d.considered)


def test_fewer_remaining_samples_wins_at_the_default_rho() -> None:
    assert DEFAULT_RHO == 2.5
    for first_long in (True, False):
        jobs = [
            JobRequest("long", [_cand("long", 2, 10.0)], remaining_samples=50_000),
            JobRequest("short", [_cand("short", 2, 10.0)], remaining_samples=5_000),
        ]
        if not first_long:
            jobs.reverse()
        d = select(jobs, Resources(cpu=2.0, memory_mb=BIG_MEM), prices=CPU_ONLY, overhead=NO_PAUSE)
        assert [c.job for c in d.choices if c.changed] == ["short"]


def test_the_quota_is_never_exceeded() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        requests = []
        for j in range(int(rng.integers(1, 6))):
            name = f"j{j}"
            current = _plan(name, int(rng.integers(1, 4)), cpu=1.0) if rng.random() < 0.5 else None
            cands = [
                Candidate(plan=(p := ResourcePlan(
                    job=name, workers=int(rng.integers(1, 9)), ps=int(rng.integers(1, 3)),
                    worker_cpu=float(rng.integers(1, 5)), worker_memory_mb=int(rng.integers(1, 5)) * 1024,
                    ps_cpu=1.0, ps_memory_mb=1024, source=PlanSource.BRAIN)),
                    cost=0.0, throughput=float(rng.uniform(1, 100)) * p.workers)
                for _ in range(int(rng.integers(1, 6)))
            ]
            requests.append(JobRequest(name, cands, remaining_samples=float(rng.uniform(1e3, 1e6)),
                                       current=current, current_throughput=float(rng.uniform(0, 50)) if current else 0.0))
        held = sum((plan_resources(r.current) for r in requests), Resources())
        total = held + Resources(cpu=float(rng.uniform(0, 40)), memory_mb=float(rng.uniform(0, 40_000)))
        d = select(requests, total)
        used = sum((plan_resources(c.plan) for c in d.choices), Resources())
        assert used.fits_in(total), (used, total)
        assert d.left.cpu >= -1e-9 and d.left.memory_mb >= -1e-9
        assert (used + d.left).cpu == pytest.approx(total.cpu)
        for r, c in zip(requests, d.choices, strict=True):  # a job not chosen keeps its plan
            assert c.changed or c.plan == r.current


def test_overhead_of_eq_8_can_make_keeping_the_plan_better() -> None:
    # Effective throughput over the rest of the job: Phi / (t_o + Phi / Psi').
    assert effective_overhead(10.0, 1_000, 100.0) == pytest.approx(10.0 - 1_000 / (100.0 + 100.0))
    current = _plan("a", 2, cpu=1.0)
    faster = Candidate(plan=_plan("a", 3, cpu=1.0), cost=3.0, throughput=12.0)
    overhead = OverheadModel(worker_pause_s=600.0, ps_pause_s=600.0)
    total = Resources(cpu=10.0, memory_mb=BIG_MEM)
    # 2 more samples/s for the 1,000 samples left is not worth a 10-minute pause...
    short = JobRequest("a", [faster], remaining_samples=1_000, current=current, current_throughput=10.0)
    d = select([short], total, prices=CPU_ONLY, overhead=overhead)
    assert not d.choices[0].changed and d.choices[0].plan == current and d.considered == []
    # ...but it is for 10 million, and without any pause it always is.
    long = JobRequest("a", [faster], remaining_samples=10_000_000, current=current, current_throughput=10.0)
    assert select([long], total, prices=CPU_ONLY, overhead=overhead).choices[0].changed
    assert select([short], total, prices=CPU_ONLY, overhead=NO_PAUSE).choices[0].changed
    gain = select([long], total, prices=CPU_ONLY, overhead=overhead).considered[0].gain
    assert gain == pytest.approx(2.0 - effective_overhead(12.0, 10_000_000, 600.0))


def test_overhead_model_takes_medians_from_history() -> None:
    model = OverheadModel.from_history([
        ScalingRecord(ScalingKind.WORKERS, 10.0), ScalingRecord(ScalingKind.WORKERS, 40.0),
        ScalingRecord(ScalingKind.WORKERS, 1000.0), ScalingRecord(ScalingKind.PS, 90.0),
    ])
    assert model.worker_pause_s == 40.0 and model.ps_pause_s == 90.0
    base = _plan("a", 2)
    assert model.pause_s(base, base) == 0.0
    assert model.pause_s(base, _plan("a", 4)) == 40.0
    assert model.pause_s(base, _plan("a", 2, ps=2)) == 90.0
    assert model.pause_s(None, base) == 90.0
    assert OverheadModel.from_history([]).ps_pause_s == OverheadModel().ps_pause_s


def test_more_memory_alone_is_its_own_kind_and_costs_what_its_history_says() -> None:
    base = replace(_plan("a", 2, ps=2), ps_cpu=2.0, ps_memory_mb=2048, worker_memory_mb=1024)
    grown = replace(base, ps_memory_mb=base.ps_memory_mb * 2, worker_memory_mb=base.worker_memory_mb + 512)
    assert ScalingKind.between(base, grown) is ScalingKind.MEMORY
    # less memory, or more memory with anything else, is not an in-place growth
    assert ScalingKind.between(grown, base) is ScalingKind.PS
    assert ScalingKind.between(base, replace(grown, ps=3)) is ScalingKind.PS
    assert ScalingKind.between(base, replace(base, worker_memory_mb=base.worker_memory_mb * 2, workers=3)) \
        is ScalingKind.WORKERS
    assert OverheadModel().pause_s(base, grown) == 0.0  # in place: nothing restarts
    # a cluster that cannot grow pods in place shows it in the executor's pauses, and the model learns it
    learnt = OverheadModel.from_history([ScalingRecord(ScalingKind.MEMORY, 115.0),
                                         ScalingRecord(ScalingKind.MEMORY, 125.0)])
    assert learnt.pause_s(base, grown) == 120.0 and learnt.ps_pause_s == OverheadModel().ps_pause_s


def test_a_cheaper_and_faster_candidate_is_taken_first() -> None:
    current = _plan("a", 4, cpu=2.0)  # 8 CPUs
    better = Candidate(plan=_plan("a", 6, cpu=1.0), cost=6.0, throughput=30.0)  # 6 CPUs
    other = JobRequest("b", [_cand("b", 4, 1000.0)], remaining_samples=10.0)  # needs 4 of the 2 free
    d = select([JobRequest("a", [better], 1e6, current, 20.0), other],
               Resources(cpu=10.0, memory_mb=BIG_MEM), prices=CPU_ONLY, overhead=NO_PAUSE)
    assert d.considered[0].job == "a" and d.considered[0].efficiency == float("inf")
    assert all(c.changed for c in d.choices)  # a frees 2 CPUs, so b fits
    assert d.left.cpu == pytest.approx(0.0)


def test_current_plans_beyond_the_total_are_refused() -> None:
    with pytest.raises(ValueError, match="exceed"):
        select([JobRequest("a", [], 1.0, _plan("a", 4))], Resources(cpu=2.0, memory_mb=BIG_MEM))
    with pytest.raises(ValueError, match="duplicate"):
        select([JobRequest("a", [], 1.0), JobRequest("a", [], 1.0)], Resources())


def test_a_groups_room_bounds_its_jobs_together_and_no_one_else() -> None:
    """Team x (jobs a and c) may add 2 CPUs: a (2 CPUs, scored first) takes them, so c (1 CPU) no longer
    fits; b, of a team without a quota, is bound by the total only."""
    reqs = _three_jobs()
    d = select(reqs, Resources(cpu=10.0, memory_mb=BIG_MEM), prices=CPU_ONLY, overhead=NO_PAUSE,
               group_of={"a": "x", "c": "x", "b": "y"}, group_room={"x": Resources(2.0, BIG_MEM)})
    chosen = {c.job for c in d.choices if c.changed}
    assert chosen == {"a", "b"}
    assert d.left.cpu == pytest.approx(6.0)
    assert {c.job for c in select(reqs, Resources(cpu=10.0, memory_mb=BIG_MEM), prices=CPU_ONLY,
                                  overhead=NO_PAUSE).choices if c.changed} == {"a", "b", "c"}
