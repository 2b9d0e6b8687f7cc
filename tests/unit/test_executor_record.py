"""The executor's record changes after an exit (core.record.apply_exit): pure, in one place."""

from __future__ import annotations

import pytest
from pacer.contracts.executor import (
    CommandKind,
    ExecutorCommand,
    ExecutorJob,
    ExecutorJobState,
    NodeIntent,
    NodePhase,
    NodeRecord,
)
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer_services.pod_executor.core import effects as fx
from pacer_services.pod_executor.core.exits import (
    EXIT_RESTART,
    SIGKILL,
    ExitInfo,
    ExitOutcome,
    answer_exit,
)
from pacer_services.pod_executor.core.node import IllegalTransition
from pacer_services.pod_executor.core.record import (
    apply_change,
    apply_exit,
    move,
    node_command,
    node_view,
    restart_node,
)

PLAN = ResourcePlan("j", 2, 1, 1.0, 1024, 1.0, 2048, PlanSource.DEFAULT)


def job(*nodes: NodeRecord) -> ExecutorJob:
    return ExecutorJob("j", ExecutorJobState.RUNNING, PLAN, cluster="", nodes=list(nodes))


def worker(index: int = 1, **kw: object) -> NodeRecord:
    return NodeRecord(f"worker-{index}", "worker", index, 1.0, 1024, **{"state": NodePhase.RUNNING, **kw})  # type: ignore[arg-type]


def test_a_crash_spends_the_budget_and_relaunches_with_the_died_event_of_the_pod_that_ended() -> None:
    n = worker(generation=2, restarts=1)
    ej = job(n)
    ans = answer_exit(node_view(n), ExitInfo(code=None, signal=SIGKILL))  # killed: retryable
    assert ans.outcome is ExitOutcome.RELAUNCH
    effects = apply_exit(ej, n, ans, pod="j-worker-1-g2", exit_code=None)
    died, create, save = effects
    assert isinstance(died, fx.PublishNodeEvent) and died.kind == "died" and died.relaunch
    assert (died.generation, died.restarts, died.exit_code, died.pod) == (2, 1, None, "j-worker-1-g2")  # the old pod
    assert create == fx.CreatePod("worker-1") and save == fx.SaveRecord()
    assert (n.generation, n.restarts, n.requested_restarts, n.state) == (3, 2, 0, NodePhase.PENDING)


def test_an_oom_relaunch_doubles_memory_and_keeps_it_as_the_floor() -> None:
    n = worker()
    ans = answer_exit(node_view(n), ExitInfo(code=137, oom=True))
    apply_exit(job(n), n, ans, exit_code=137)
    assert n.memory_mb == 2048 and n.oom_memory_mb == 2048 and n.generation == 1


def test_a_requested_restart_spends_no_budget_and_restores_a_chief_that_lost_its_ps() -> None:
    n = worker(resize_cpu=2.0, resize_memory_mb=4096)
    ans = answer_exit(node_view(n), ExitInfo(code=EXIT_RESTART))
    apply_exit(job(n), n, ans, exit_code=EXIT_RESTART)
    assert (n.restarts, n.requested_restarts) == (0, 1)
    assert (n.resize_cpu, n.resize_memory_mb) == (0.0, 0)  # a due replacement is taken by (or cleared for) the relaunch


def test_finished_is_terminal_and_carries_the_result_a_removed_node_stays_removed() -> None:
    n = worker(index=0)
    ans = answer_exit(node_view(n), ExitInfo(code=0))
    save, done = apply_exit(job(n), n, ans, pod="p", exit_code=0, result={"auc": 0.8})
    assert save == fx.SaveRecord() and isinstance(done, fx.PublishNodeEvent)
    assert done.kind == "finished" and dict(done.result) == {"auc": 0.8} and n.state is NodePhase.FINISHED
    with pytest.raises(IllegalTransition):
        move(n, NodePhase.PENDING)
    gone = worker(state=NodePhase.REMOVED, removed=True)
    apply_exit(job(gone), gone, answer_exit(node_view(gone), ExitInfo(code=0), removed=True))
    assert gone.state is NodePhase.REMOVED


def test_a_migrating_chief_hands_its_checkpoint_to_the_job() -> None:
    n = worker(index=0, intent=NodeIntent.MIGRATE, state=NodePhase.STOPPING)
    ej = job(n)
    ans = answer_exit(node_view(n), ExitInfo(code=EXIT_RESTART, by_executor=True), intent=NodeIntent.MIGRATE)
    assert ans.outcome is ExitOutcome.MIGRATING
    effects = apply_exit(ej, n, ans, exit_code=EXIT_RESTART, result={"checkpoint": "ck-7"})
    assert effects[0] == fx.SaveRecord() and isinstance(effects[1], fx.PublishNodeEvent) and effects[1].relaunch
    assert ej.checkpoint == "ck-7" and n.state is NodePhase.RELAUNCHING and n.generation == 0


def test_an_unretryable_exit_fails_the_job_after_saving() -> None:
    n = worker()
    ans = answer_exit(node_view(n), ExitInfo(code=1))  # a user error
    assert ans.outcome is ExitOutcome.FAIL_JOB
    died, save, fail = apply_exit(job(n), n, ans, exit_code=1)
    assert isinstance(died, fx.PublishNodeEvent) and not died.relaunch
    assert save == fx.SaveRecord() and isinstance(fail, fx.FailJob) and fail.reason == ans.detail


def test_restart_node_takes_a_due_size() -> None:
    n = worker(resize_cpu=2.0, resize_memory_mb=4096, state=NodePhase.RELAUNCHING)
    restart_node(n, restore=True)
    assert (n.cpu, n.memory_mb, n.generation, n.restore, n.state) == (2.0, 4096, 1, True, NodePhase.PENDING)


def test_a_plan_change_adds_scales_back_removes_and_queues_resizes() -> None:
    from pacer_services.pod_executor.core.model import NodeSpec
    from pacer_services.pod_executor.core.plan import PlanChange

    w0, w1, w2 = worker(0), worker(1), worker(2, state=NodePhase.REMOVED, removed=True, generation=3)
    ej = job(w0, w1, w2)
    new = ResourcePlan("j", 2, 1, 2.0, 4096, 1.0, 2048, PlanSource.BRAIN)
    change = PlanChange(start=(NodeSpec("worker", 2, 2.0, 4096), NodeSpec("ps", 0, 1.0, 2048)), stop=("worker-1",),
                        resize_batches=((0,),), migrate_ps=False, resize=(NodeSpec("worker", 0, 2.0, 4096),))
    effects = apply_change(ej, new, change, 50.0, "because")
    assert effects == (fx.SaveRecord(), fx.CreatePod("ps-0"), fx.CreatePod("worker-2"), fx.DeletePod("worker-1"))
    assert (ej.plan, ej.plan_at, ej.applied, ej.reason) == (new, 50.0, False, "because")
    assert (w2.state, w2.generation, w2.cpu, w2.memory_mb) == (NodePhase.PENDING, 4, 2.0, 4096)  # scaled back up
    assert w1.state is NodePhase.REMOVED and [n.node for n in ej.nodes][-1] == "ps-0"
    assert (w0.resize_cpu, w0.resize_memory_mb, w1.resize_memory_mb) == (2.0, 4096, 0)


@pytest.mark.parametrize(("kind", "live_pod"), [(CommandKind.RESTART, True), (CommandKind.RESTART, False),
                                                (CommandKind.MIGRATE, True), (CommandKind.STOP, True),
                                                (CommandKind.STOP, False)])
def test_a_node_command(kind: CommandKind, live_pod: bool) -> None:
    n = worker()
    ej = job(n)
    cmd = ExecutorCommand("j", "worker-1", kind, "test", cpu=2.0, memory_mb=3000, command_id="c1")
    effects = node_command(ej, n, cmd, live_pod=live_pod)
    assert ej.commands == ["c1"] and effects[0] == fx.SaveRecord()
    if kind is CommandKind.STOP:
        assert n.state is NodePhase.REMOVED and effects[1:] == ((fx.DeletePod("worker-1"),) if live_pod else ())
    elif live_pod:  # stopped to start again; its exit will be a requested restart
        assert n.state is NodePhase.STOPPING and n.intent is NodeIntent.RESTART
        assert effects[1:] == (fx.DeletePod("worker-1"),) and n.generation == 0
    else:  # nothing running: its next pod now
        assert (n.state, n.generation, n.requested_restarts) == (NodePhase.PENDING, 1, 1)
        assert effects[1:] == (fx.CreatePod("worker-1"),)
    assert (n.cpu, n.memory_mb) == ((2.0, 3000) if kind is CommandKind.MIGRATE else (1.0, 1024))
