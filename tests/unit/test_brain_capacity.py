"""The capacity the brain's autoscaled jobs share (DLRover-RM Eq. 13's S), its checks, and how a round stays in it."""

from __future__ import annotations

import math

import pytest
from pacer.contracts.executor import ClusterStatus, MachineInfo
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer_services.brain.app import BrainConfig
from pacer_services.brain.core.autoscaler import Decision, Proposal, Rule, Stage
from pacer_services.brain.core.capacity import cluster_capacity, status_problem
from pacer_services.brain.core.cluster import JobChoice, JobRequest, Resources
from pacer_services.brain.core.pareto import Candidate
from pacer_services.brain.core.round import ReadyJob, cluster_round, round_total


def status(free_cpu: float = 10.0, *, reserves: bool = True, total_cpu: float = 32.0, total_mb: int = 65536,
           free_mb: int = 20000, machines: list[MachineInfo] | None = None) -> ClusterStatus:
    return ClusterStatus(0.0, "kubernetes", 0, 3, total_cpu, free_cpu, total_mb, free_mb,
                         reserves_capacity=reserves, machines=machines or [])


def plan(job: str, workers: int, worker_cpu: float = 1.0) -> ResourcePlan:
    return ResourcePlan(job, workers, 1, worker_cpu, 1024, 2.0, 2048, PlanSource.BRAIN)


class Job:
    """What cluster_round asks of a JobAutoscaler, with fixed candidates: a stand-in for a pure core's test."""

    def __init__(self, now: ResourcePlan, throughput: float, candidates: list[Candidate], declines: bool = False):
        self.plan, self.throughput, self.candidates, self.declines = now, throughput, candidates, declines
        self.namespace = "default"
        self.pauses: list[object] = []
        self.withdrawn: list[Decision] = []

    def propose(self, now: float, stats: object) -> Proposal:
        return Proposal(request=JobRequest(self.plan.job, self.candidates, 1e9, self.plan, self.throughput))

    def accept(self, choice: JobChoice, now: float) -> Decision | None:
        if self.declines or choice.plan is None or choice.scored is None:
            return None
        return Decision(choice.plan, Stage.ADJUST, Rule.MODEL, choice.scored.candidate.throughput)

    def withdraw(self, d: Decision) -> None:
        self.withdrawn.append(d)


def test_a_round_stays_within_its_total_when_a_job_declines_the_share_that_made_room() -> None:
    """Two jobs of 6 CPUs in a 12-CPU total: the selection shrinks "fast" to 4 CPUs (cheaper and faster)
    and grows "slow" to 8 with the room.  If "fast" declines, "slow"'s growth no longer fits: withdrawn."""
    fast_to = plan("fast", 2)  # 2 x 1 + 2 = 4 CPUs
    slow_to = plan("slow", 6)  # 6 x 1 + 2 = 8 CPUs
    total = Resources(12.0, math.inf)

    def jobs(declines: bool) -> tuple[Job, Job]:
        return (Job(plan("fast", 4), 100.0, [Candidate(fast_to, 4.0, 110.0)], declines=declines),
                Job(plan("slow", 4), 100.0, [Candidate(slow_to, 8.0, 150.0)]))

    def run(fast: Job, slow: Job) -> dict[str, Decision]:
        free = total - Resources(12.0, 0.0)  # the two jobs hold the 12 CPUs
        ready: list[ReadyJob] = [ReadyJob(fast, None), ReadyJob(slow, None)]  # type: ignore[arg-type]
        decided: dict[str, Decision] = cluster_round(ready, free, 0.0).decisions
        return decided

    fast, slow = jobs(declines=False)
    out = run(fast, slow)
    assert {j: d.plan for j, d in out.items()} == {"fast": fast_to, "slow": slow_to}
    fast, slow = jobs(declines=True)
    out = run(fast, slow)
    assert out == {} and [d.plan for d in slow.withdrawn] == [slow_to]


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
    # S = (24, 1e4); the round's jobs hold (8, 100), the others (10, 200): free is (6, 9700)
    assert round_total(Resources(8.0, 100.0), Resources(6.0, 9700.0)) == Resources(14.0, 9800.0)
    # S shrank to 12 CPUs under the jobs (free -6): they may trade and shrink, not grow
    assert round_total(Resources(8.0, 100.0), Resources(-6.0, 9700.0)) == Resources(8.0, 9800.0)


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


def test_config_reads_the_teams_quotas_and_names_a_bad_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    from pacer.errors import ValidationError
    from pacer_services.brain.app import namespace_quotas

    monkeypatch.delenv("PACER_BRAIN_NAMESPACE_CPU", raising=False)
    assert BrainConfig.from_env().namespace_cpu == {}
    monkeypatch.setenv("PACER_BRAIN_NAMESPACE_CPU", " team-a=32, team-b=16.5 ,")
    assert BrainConfig.from_env().namespace_cpu == {"team-a": 32.0, "team-b": 16.5}
    for bad in ("team-a", "team-a=lots", "Team_A=4", "team-a=-1", "team-a=inf"):
        with pytest.raises(ValidationError, match="PACER_BRAIN_NAMESPACE_CPU") as err:
            namespace_quotas(f"ok=1,{bad}")
        assert repr(bad) in err.value.message
