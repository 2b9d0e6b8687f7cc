"""Dike placement of PS and workers onto machines (cost model Eq. 1-6)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from pacer.contracts.executor import MachineInfo
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer_services.brain.core.placement import (
    Machine,
    PlacementError,
    PlacementInfeasible,
    Task,
    TaskRole,
    after_placement,
    cost_of,
    machines_for,
    place,
    place_plan,
    tasks_from_plan,
)


def _ps(name: str, cpu: float, mem: float, traffic: float) -> Task:
    return Task(name, TaskRole.PS, cpu, mem, traffic)


def _workers(n: int, cpu: float, mem: float) -> list[Task]:
    return [Task(f"worker-{k}", TaskRole.WORKER, cpu, mem) for k in range(n)]


def _brute_force(tasks: list[Task], machines: list[Machine], cost_in: float, cost_out: float) -> float:
    """Min of Dike Eq. 1 over every assignment of every task, subject to Eq. 2 (capacity)."""
    best = math.inf
    for hosts in itertools.product(range(len(machines)), repeat=len(tasks)):
        used_cpu = [0.0] * len(machines)
        used_mem = [0.0] * len(machines)
        for t, i in zip(tasks, hosts, strict=True):
            used_cpu[i] += t.cpu
            used_mem[i] += t.memory_mb
        if any(used_cpu[i] > m.cpu + 1e-9 or used_mem[i] > m.memory_mb + 1e-9 for i, m in enumerate(machines)):
            continue
        assignment = {t.name: machines[i].name for t, i in zip(tasks, hosts, strict=True)}
        best = min(best, cost_of(assignment, tasks, cost_in, cost_out)[0])
    return best


def _check_capacity(assignment: dict[str, str], tasks: list[Task], machines: list[Machine]) -> None:
    assert set(assignment) == {t.name for t in tasks}
    for m in machines:
        on = [t for t in tasks if assignment[t.name] == m.name]
        assert sum(t.cpu for t in on) <= m.cpu + 1e-9
        assert sum(t.memory_mb for t in on) <= m.memory_mb + 1e-9


def test_everything_fits_on_one_machine_so_all_are_co_located() -> None:
    machines = [Machine("m0", 4, 8_000), Machine("big", 64, 256_000), Machine("m2", 4, 8_000)]
    tasks = [_ps("ps-0", 2, 4_000, 100.0), _ps("ps-1", 2, 4_000, 50.0), *_workers(6, 4, 8_000)]
    p = place(tasks, machines, cost_in=0.1, cost_out=1.0)
    assert set(p.assignment.values()) == {"big"}
    assert p.cross_traffic == 0.0
    assert p.cost == pytest.approx(6 * 150.0 * 0.1)  # every pair local: Mem_j * Cost_in (Eq. 1)
    assert p.exact


def test_a_capacity_split_is_the_cost_models_best() -> None:
    # Two 10-CPU machines: the PS (4 CPUs) and 5 workers (2 CPUs each) cannot share one.
    machines = [Machine("m0", 10, 64_000), Machine("m1", 10, 64_000)]
    tasks = [_ps("ps-0", 4, 1_000, 10.0), *_workers(5, 2, 1_000)]
    p = place(tasks, machines)
    _check_capacity(p.assignment, tasks, machines)
    ps_host = p.assignment["ps-0"]
    assert sum(1 for k in range(5) if p.assignment[f"worker-{k}"] == ps_host) == 3  # fill the PS's host
    assert p.cross_traffic == pytest.approx(2 * 10.0)
    assert p.cost == pytest.approx(_brute_force(tasks, machines, 0.0, 1.0))


@pytest.mark.parametrize("cost_in", [0.0, 0.3])
@pytest.mark.parametrize(
    "machines",
    [
        [Machine("a", 6, 16_000), Machine("b", 4, 8_000), Machine("c", 3, 16_000)],
        [Machine("a", 4, 8_000), Machine("b", 4, 8_000), Machine("c", 8, 4_000)],
    ],
)
def test_optimal_on_tiny_cases_by_brute_force(machines: list[Machine], cost_in: float) -> None:
    tasks = [_ps("ps-0", 2, 4_000, 30.0), _ps("ps-1", 1, 2_000, 10.0), _ps("ps-2", 1, 1_000, 5.0),
             *_workers(4, 1.5, 2_000)]
    p = place(tasks, machines, cost_in=cost_in, cost_out=1.0)
    _check_capacity(p.assignment, tasks, machines)
    assert p.exact
    got_cost, got_cross = cost_of(p.assignment, tasks, cost_in, 1.0)
    assert p.cost == pytest.approx(got_cost) and p.cross_traffic == pytest.approx(got_cross)
    assert p.cost == pytest.approx(_brute_force(tasks, machines, cost_in, 1.0))


def test_infeasible_plans_get_a_clear_error() -> None:
    machines = [Machine("m0", 4, 8_000), Machine("m1", 4, 8_000)]
    with pytest.raises(PlacementInfeasible, match="CPUs"):
        place([_ps("ps-0", 1, 100, 1.0), *_workers(4, 2, 100)], machines)
    with pytest.raises(PlacementInfeasible, match=r"ps-0.*no single machine"):
        place([_ps("ps-0", 6, 100, 1.0)], machines)
    # Enough in total (6 of 8 CPUs) but 3-CPU workers cannot share a 4-CPU machine.
    with pytest.raises(PlacementInfeasible, match="cannot be packed"):
        place(_workers(3, 2.5, 100), machines)
    with pytest.raises(PlacementError, match="identical"):
        place([Task("worker-0", TaskRole.WORKER, 1, 1), Task("worker-1", TaskRole.WORKER, 2, 1)], machines)


def test_tasks_from_plan_and_a_larger_case_stays_exact() -> None:
    plan = ResourcePlan(job="j", workers=12, ps=4, worker_cpu=2.0, worker_memory_mb=4096,
                        ps_cpu=4.0, ps_memory_mb=8192, source=PlanSource.BRAIN)
    tasks = tasks_from_plan(plan)
    assert [t.name for t in tasks][:5] == ["ps-0", "ps-1", "ps-2", "ps-3", "worker-0"]
    machines = [Machine(f"m{i}", 16, 64 * 1024) for i in range(8)]
    p = place(tasks, machines)
    _check_capacity(p.assignment, tasks, machines)
    assert p.exact and p.explored < 1_000  # symmetric empty machines are tried once
    # 56 CPUs over 16-CPU machines: the best keeps each PS with as many workers as fit.
    assert p.cross_traffic < 12 * 4 * 8192
    assert len(tasks_from_plan(plan, [1.0, 2.0, 3.0, 4.0])) == 16
    with pytest.raises(PlacementError):
        tasks_from_plan(plan, [1.0])


# -- a plan and the executor's machines in, the plan with its placement out -------------------------


def _plan(workers: int = 6, ps: int = 2, reason: str = "optimize") -> ResourcePlan:
    return ResourcePlan(job="j", workers=workers, ps=ps, worker_cpu=2.0, worker_memory_mb=4096,
                        ps_cpu=4.0, ps_memory_mb=8192, source=PlanSource.BRAIN, reason=reason)


def _info(name: str, free_cpu: float, free_mb: int, **held: tuple[float, int]) -> MachineInfo:
    return MachineInfo(name, 16.0, 65536, free_cpu, free_mb, {j: c for j, (c, _) in held.items()},
                       {j: m for j, (_, m) in held.items()})


def test_a_plan_is_placed_within_what_each_machine_can_give_the_job() -> None:
    # m1 looks nearly full, but 8 of its CPUs are this job's own pods, which the re-plan replaces;
    # another job's pods on m2 stay where they are.
    infos = [_info("m0", 6.0, 16384), _info("m1", 2.0, 4096, j=(8.0, 16384)),
             _info("m2", 4.0, 65536, other=(12.0, 1024))]
    bins = machines_for("j", infos)
    assert [(m.name, m.cpu, m.memory_mb) for m in bins] == [("m0", 6.0, 16384), ("m1", 10.0, 20480),
                                                            ("m2", 4.0, 65536)]
    plan = _plan()
    placed = place_plan(plan, bins)
    tasks = tasks_from_plan(plan)
    _check_capacity(placed.placement, tasks, bins)  # every node, each machine within what it can give
    # the resources are the plan's; only the placement and the reason are added
    assert (placed.workers, placed.ps, placed.worker_cpu, placed.ps_cpu) == (6, 2, 2.0, 4.0)
    assert placed.reason.startswith("optimize; placed on 3 of 3 machines (Dike")
    # the plan needs all 20 CPUs: without the job's own share of m1 (12 CPUs free in all) it does not fit
    assert place_plan(plan, machines_for("other-job", infos)).placement == {}
    # and the placement is Dike's least-cost one (Eq. 1), not merely a feasible one
    assert cost_of(placed.placement, tasks)[0] == pytest.approx(place(tasks, bins).cost)


def test_an_infeasible_placement_leaves_the_plan_unplaced_with_the_reason() -> None:
    bins = [Machine("m0", 3.0, 65536), Machine("m1", 3.0, 65536), Machine("m2", 3.0, 65536)]
    plan = replace(_plan(workers=2, ps=1), placement={"ps-0": "gone"})  # stale: never carried over
    out = place_plan(plan, bins)
    assert out.placement == {}
    assert out.reason.startswith("optimize; no placement: ") and "ps-0" in out.reason  # 4 CPUs fit nowhere
    assert (out.workers, out.ps, out.ps_cpu) == (2, 1, 4.0)  # the plan itself goes out as it was


def test_one_machine_or_none_means_no_placement() -> None:
    plan = replace(_plan(), placement={"ps-0": "m0"})
    for machines in ([], [Machine("only", 64.0, 1 << 20)]):
        out = place_plan(plan, machines)
        assert out.placement == {} and out.reason == "optimize"


def test_what_a_placement_takes_is_not_offered_to_the_next_job() -> None:
    infos = [_info("m0", 8.0, 32768), _info("m1", 1.0, 4096, j=(7.0, 20480))]
    placed = place_plan(_plan(workers=2, ps=1), machines_for("j", infos))  # 8 CPUs: 4 (PS) + 2 x 2
    after = {m.name: m for m in after_placement(infos, placed)}
    for m in infos:  # free + the job's share is conserved; the job now holds what its placement puts there
        on = [t for t in tasks_from_plan(placed) if placed.placement[t.name] == m.name]
        assert after[m.name].held_cpu["j"] == pytest.approx(sum(t.cpu for t in on))
        assert after[m.name].free_cpu + after[m.name].held_cpu["j"] == pytest.approx(m.free_cpu + m.held_cpu.get("j", 0.0))
    # another job now sees only what is left
    left = sum(b.cpu for b in machines_for("k", list(after.values())))
    assert left == pytest.approx(16.0 - 8.0)
    assert after_placement(infos, _plan()) == infos  # no placement: nothing taken
