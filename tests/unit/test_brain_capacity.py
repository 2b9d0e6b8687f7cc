"""The capacity the brain's autoscaled jobs share (DLRover-RM Eq. 13's S), its checks and guard."""

from __future__ import annotations

import math

import pytest
from pacer.contracts.executor import ClusterStatus, MachineInfo
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer_services.brain.app import BrainConfig
from pacer_services.brain.core.capacity import (
    cluster_capacity,
    round_total,
    status_problem,
    within_total,
)
from pacer_services.brain.core.cluster import Resources


def status(free_cpu: float = 10.0, *, reserves: bool = True, total_cpu: float = 32.0, total_mb: int = 65536,
           free_mb: int = 20000, machines: list[MachineInfo] | None = None) -> ClusterStatus:
    return ClusterStatus(0.0, "kubernetes", 0, 3, total_cpu, free_cpu, total_mb, free_mb,
                         reserves_capacity=reserves, machines=machines or [])


def plan(job: str, workers: int, worker_cpu: float = 1.0) -> ResourcePlan:
    return ResourcePlan(job, workers, 1, worker_cpu, 1024, 2.0, 2048, PlanSource.BRAIN)


def test_capacity_is_free_plus_what_the_jobs_hold_and_the_operator_wins() -> None:
    held = Resources(14.0, 8000.0)
    assert cluster_capacity(status(), held) == Resources(24.0, 28000.0)
    assert cluster_capacity(status(), held, cpu=16.0) == Resources(16.0, 28000.0)
    assert cluster_capacity(status(), held, memory_mb=1e5) == Resources(24.0, 1e5)
    # memory unknown to the backend: unbounded (each job's quota still bounds it)
    assert cluster_capacity(status(total_mb=0), held) == Resources(24.0, math.inf)


def test_capacity_is_unknown_where_nothing_is_reserved_or_reported() -> None:
    held = Resources(4.0, 0.0)
    assert cluster_capacity(None, held) is None
    assert cluster_capacity(status(reserves=False), held) is None  # local: free is the whole machine
    assert cluster_capacity(status(total_cpu=0.0), held) is None  # Kubernetes without node RBAC
    assert cluster_capacity(None, held, cpu=12.0) == Resources(12.0, math.inf)
    assert cluster_capacity(None, held, memory_mb=4096.0) is None  # memory alone plans nothing


def test_a_round_gets_what_the_others_leave_but_never_less_than_it_holds() -> None:
    assert round_total(Resources(24.0, 1e4), Resources(8.0, 100.0), Resources(10.0, 200.0)) == Resources(14.0, 9800.0)
    # S shrank under the jobs: they may trade and shrink, not grow
    assert round_total(Resources(12.0, 1e4), Resources(8.0, 100.0), Resources(10.0, 200.0)) == Resources(8.0, 9800.0)


def test_the_guard_keeps_plans_within_the_total_shrinking_ones_first() -> None:
    current = {"a": plan("a", 4), "b": plan("b", 4), "c": plan("c", 4)}  # 6 CPUs each: 18
    decided = {"a": plan("a", 2), "b": plan("b", 7), "c": plan("c", 6)}  # -2, +3, +2
    kept, dropped = within_total(decided, current, Resources(21.0, math.inf))
    # a frees 2 (16), c's +2 fits (18), b's +3 makes 21: just fits
    assert set(kept) == {"a", "b", "c"} and dropped == []
    kept, dropped = within_total(decided, current, Resources(20.0, math.inf))
    assert set(kept) == {"a", "c"} and dropped == ["b"]  # the least extra first: c, then b no longer fits
    kept, dropped = within_total({"a": plan("a", 8)}, current, Resources(18.0, math.inf))
    assert kept == {} and dropped == ["a"]


@pytest.mark.parametrize("bad", [
    status(free_cpu=float("nan")),
    status(free_cpu=-1.0),
    status(machines=[MachineInfo("m", 4.0, 1024, float("inf"), 10)]),
    status(machines=[MachineInfo("m", 4.0, 1024, 1.0, 10, held_cpu={"j": -0.5})]),
    status(machines=[MachineInfo("m", 4.0, 1024, 1.0, 10), MachineInfo("m", 4.0, 1024, 1.0, 10)]),
    status(machines=[MachineInfo("", 4.0, 1024, 1.0, 10)]),
])
def test_unusable_cluster_statuses_are_named(bad: ClusterStatus) -> None:
    assert status_problem(bad)
    assert status_problem(status(machines=[MachineInfo("m", 4.0, 1024, 1.0, 10, {"j": 2.0}, {"j": 512})])) == ""


def test_config_reads_the_cluster_capacity_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACER_BRAIN_CLUSTER_CPU", raising=False)
    monkeypatch.delenv("PACER_BRAIN_CLUSTER_MEMORY_MB", raising=False)
    assert (BrainConfig.from_env().cluster_cpu, BrainConfig.from_env().cluster_memory_mb) == (None, None)
    monkeypatch.setenv("PACER_BRAIN_CLUSTER_CPU", "96")
    monkeypatch.setenv("PACER_BRAIN_CLUSTER_MEMORY_MB", "")
    cfg = BrainConfig.from_env()
    assert (cfg.cluster_cpu, cfg.cluster_memory_mb) == (96.0, None)
