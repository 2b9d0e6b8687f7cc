"""What the executor runs for a job, folded from its events (services/brain/core/running.py)."""

from __future__ import annotations

from pacer.contracts.brain import NodeSize, RunningJob
from pacer.contracts.executor import ExecutorEvent, ExecutorEventKind
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer.contracts.nodes import NodeEvent
from pacer_services.brain.core.running import as_run, is_new, on_applied, on_node

PLAN = ResourcePlan("j", 2, 2, 1.0, 2048, 2.0, 4096, PlanSource.BRAIN)


def applied(plan: ResourcePlan, ts: float = 10.0) -> ExecutorEvent:
    return ExecutorEvent("j", ExecutorEventKind.APPLIED, ts, plan=plan, overhead_s=5.0)


def node(name: str, kind: str, cpu: float, memory_mb: int) -> NodeEvent:
    return NodeEvent("j", name, kind, 1.0, role=name.rsplit("-", 1)[0], cpu=cpu, memory_mb=memory_mb)


def test_the_applied_plan_is_the_plan_in_force_and_an_event_is_folded_once() -> None:
    rec = on_applied(None, applied(PLAN), seq=7)
    assert (rec.plan, rec.applied_at, rec.seq) == (PLAN, 10.0, 7)
    assert not is_new(rec, 7) and not is_new(rec, 3) and is_new(rec, 8) and is_new(None, 1)
    bigger = ResourcePlan("j", 4, 2, 1.0, 2048, 2.0, 4096, PlanSource.BRAIN)
    assert on_applied(rec, applied(bigger, 20.0), seq=9).plan == bigger


def test_a_relaunched_nodes_memory_is_the_plan_as_run() -> None:
    """After an OOM the executor relaunches ps-1 with twice the memory: the config DB learns the PS needed it."""
    rec = on_applied(None, applied(PLAN), seq=1)
    rec = on_node(rec, node("ps-1", "created", 2.0, 8192), seq=2)
    assert rec is not None and rec.nodes == [NodeSize("ps-1", "ps", 2.0, 8192)]
    ran = as_run(rec, PLAN)
    assert (ran.ps_memory_mb, ran.worker_memory_mb, ran.workers, ran.ps) == (8192, 2048, 2, 2)
    assert "as run" in ran.reason


def test_nodes_outside_the_plan_in_force_and_events_without_a_size_do_not_count() -> None:
    rec: RunningJob | None = on_applied(None, applied(PLAN), seq=1)
    rec = on_node(rec, node("worker-5", "created", 8.0, 65536), seq=2)  # scaled in since
    rec = on_node(rec, node("worker-0", "died", 9.0, 99999), seq=3)  # not a pod being made
    assert rec is not None and rec.seq == 3 and [n.node for n in rec.nodes] == ["worker-5"]
    assert as_run(rec, PLAN).worker_cpu == 1.0 and as_run(rec, PLAN).worker_memory_mb == 2048
    # a pod dying of a job the brain has no record of (it ended): nothing to write
    assert on_node(None, node("worker-0", "died", 1.0, 2048), seq=4) is None


def test_without_the_executors_events_the_jobs_own_plan_stands() -> None:
    assert as_run(None, PLAN) is PLAN
    assert as_run(RunningJob("j"), PLAN) is PLAN
