"""The pod-executor's pure decisions: exit classification, relaunch budget, OOM, scaling, worker resizing."""

from __future__ import annotations

import pytest
from pacer.contracts.executor import (
    ExecutorJobState,
    MigrationPhase,
    NodeIntent,
    NodePhase,
    PodPhase,
)
from pacer_services.pod_executor.core import (
    RETRYABLE,
    TERMINAL,
    TRANSITIONS,
    CreatePod,
    DeletePod,
    DeletePods,
    EnterPhase,
    ExecutorPolicy,
    ExitInfo,
    ExitOutcome,
    ExitReason,
    IllegalTransition,
    JobView,
    MigrationStep,
    MigrationView,
    Node,
    NodeSpec,
    NodeView,
    Plan,
    PsView,
    ReconcilePass,
    RequestCheckpoint,
    ResizeView,
    RestartNodes,
    RestoreShards,
    SaveRecord,
    SetIntent,
    SwitchCluster,
    WorkerPhase,
    answer_exit,
    can_move,
    classify,
    legacy_state,
    migration_start,
    migration_step,
    on_exit,
    plan_change,
    reconcile,
    reconcile_pass,
    relaunch_resized,
    resize_batch,
    resize_batch_size,
    resize_rounds,
    resize_targets,
    transition,
)

W0 = Node(NodeSpec("worker", 0, cpu=1.0, memory_mb=1024), state="running")


@pytest.mark.parametrize(
    ("info", "reason"),
    [
        (ExitInfo(0), ExitReason.COMPLETED),
        (ExitInfo(75), ExitReason.RESTART_REQUESTED),
        (ExitInfo(None, signal=9), ExitReason.KILLED),
        (ExitInfo(-9), ExitReason.KILLED),
        (ExitInfo(137), ExitReason.KILLED),
        (ExitInfo(137, k8s_reason="OOMKilled"), ExitReason.OOM),
        (ExitInfo(None, signal=9, oom=True), ExitReason.OOM),
        (ExitInfo(None, k8s_reason="Evicted"), ExitReason.EVICTED),
        (ExitInfo(1, network_error=True), ExitReason.NETWORK),
        (ExitInfo(2, network_error=True), ExitReason.CONFIG_ERROR),  # a usage error mentioning a connection
        (ExitInfo(2), ExitReason.CONFIG_ERROR),
        (ExitInfo(None, k8s_reason="ImagePullBackOff"), ExitReason.CONFIG_ERROR),
        (ExitInfo(1), ExitReason.USER_ERROR),
        (ExitInfo(77), ExitReason.REFUSED),
        (ExitInfo(77, network_error=True), ExitReason.REFUSED),  # a refused trainer's log names the connection
    ],
)
def test_exits_are_classified_as_antdt_v_d(info: ExitInfo, reason: ExitReason) -> None:
    assert classify(info) is reason


def test_user_and_config_errors_are_not_retried_and_fail_the_job() -> None:
    for info in (ExitInfo(1), ExitInfo(2)):
        d = on_exit(W0, info)
        assert not d.retryable and d.relaunch is None and d.fail_job
        assert "worker-0" in d.detail and "unretryable" in d.detail
    assert ExitReason.USER_ERROR not in RETRYABLE and ExitReason.CONFIG_ERROR not in RETRYABLE


def test_retryable_failures_relaunch_until_the_budget_is_spent() -> None:
    policy = ExecutorPolicy(relaunch_budget=2)
    node = W0
    for _ in range(2):
        d = on_exit(node, ExitInfo(None, signal=9), policy)
        assert d.retryable and d.relaunch == node.spec and not d.fail_job
        node = Node(d.relaunch, restarts=node.restarts + 1)
    d = on_exit(node, ExitInfo(None, signal=9), policy)
    assert d.fail_job and d.relaunch is None and "budget" in d.detail


def test_a_pod_refused_by_the_bus_is_relaunched_while_its_job_runs_and_not_once_it_ended() -> None:
    # The relaunch mints the new pod a fresh token (an expired one is the usual cause); it spends budget,
    # so credentials refused for another reason cannot relaunch a node for ever.
    running = answer_exit(W0, ExitInfo(77))
    assert running.outcome is ExitOutcome.RELAUNCH and running.relaunch == W0.spec and not running.requested
    assert running.reason == "refused"
    ended = answer_exit(W0, ExitInfo(77), active=False)
    assert ended.outcome is ExitOutcome.NOTHING
    spent = on_exit(Node(W0.spec, restarts=3), ExitInfo(77), ExecutorPolicy(relaunch_budget=3))
    assert spent.fail_job and "budget" in spent.detail


def test_kill_restart_is_not_a_failure_and_spends_no_budget() -> None:
    spent = Node(W0.spec, restarts=3)
    d = on_exit(spent, ExitInfo(75), ExecutorPolicy(relaunch_budget=3))
    assert d.relaunch == W0.spec and not d.fail_job


def test_oom_relaunches_with_double_memory_up_to_the_cap() -> None:
    d = on_exit(W0, ExitInfo(137, k8s_reason="OOMKilled"))
    assert d.relaunch is not None and d.relaunch.memory_mb == 2048 and d.relaunch.cpu == W0.spec.cpu
    capped = on_exit(W0, ExitInfo(None, oom=True), ExecutorPolicy(max_memory_mb=1500))
    assert capped.relaunch is not None and capped.relaunch.memory_mb == 1500
    at_cap = Node(NodeSpec("worker", 0, memory_mb=1500))
    d2 = on_exit(at_cap, ExitInfo(None, oom=True), ExecutorPolicy(max_memory_mb=1500))
    assert d2.fail_job and "cap" in d2.detail


def test_exits_we_caused_and_completions_are_not_relaunched() -> None:
    assert on_exit(W0, ExitInfo(None, signal=15, by_executor=True)).relaunch is None
    d = on_exit(W0, ExitInfo(0))
    assert d.relaunch is None and not d.fail_job


def test_reconcile_scales_up_into_free_slots_and_down_from_the_top() -> None:
    nodes = {
        "worker-0": W0,
        "worker-2": Node(NodeSpec("worker", 2), state="running"),
        "worker-3": Node(NodeSpec("worker", 3), state="exited"),
        "ps-0": Node(NodeSpec("ps", 0), state="running"),
    }
    up = reconcile(Plan(workers=4, ps=2, worker=NodeSpec("worker", 0, memory_mb=2048)), nodes)
    assert sorted((s.role, s.index) for s in up.start) == [("ps", 1), ("worker", 1), ("worker", 3)]
    assert all(s.memory_mb == 2048 for s in up.start if s.role == "worker") and up.stop == ()
    down = reconcile(Plan(workers=1, ps=1), nodes)
    assert down.start == () and down.stop == ("worker-2",)
    assert reconcile(Plan(workers=1, ps=1), {"worker-0": W0, "ps-0": nodes["ps-0"]}) == reconcile(
        Plan(workers=1, ps=1), {"ps-0": nodes["ps-0"], "worker-0": W0})


# ------------------------------------------------------------ rolling worker replacement

def worker(i: int, cpu: float = 1.0, memory_mb: int = 1024, state: str = "running", oom_memory_mb: int = 0) -> Node:
    return Node(NodeSpec("worker", i, cpu, memory_mb), state=state, oom_memory_mb=oom_memory_mb)


def test_a_plan_with_more_worker_memory_replaces_the_workers_of_another_size_only() -> None:
    nodes = [worker(0), worker(1), worker(2, memory_mb=2048), worker(3), worker(4, state="exited"),
             Node(NodeSpec("ps", 0, 1.0, 1024), state="running")]
    due = resize_targets(NodeSpec("worker", 0, 1.0, 2048), nodes)
    assert [(s.role, s.index, s.cpu, s.memory_mb) for s in due] == [
        ("worker", 0, 1.0, 2048), ("worker", 1, 1.0, 2048), ("worker", 3, 1.0, 2048)]
    # PS are never replaced here (a PS moves by a migration), even when its size differs too
    assert resize_targets(NodeSpec("worker", 0, 1.0, 1024), [Node(NodeSpec("ps", 0, 4.0, 8192))]) == ()


def test_nothing_to_replace_when_the_sizes_match() -> None:
    nodes = [worker(i) for i in range(4)]
    assert resize_targets(NodeSpec("worker", 0, 1.0, 1024), nodes) == ()
    assert resize_batch([ResizeView(i, WorkerPhase.RUNNING, queued=False) for i in range(4)]) == ()


def test_a_cpu_change_alone_replaces_every_worker_with_its_memory_unchanged() -> None:
    due = resize_targets(NodeSpec("worker", 0, 2.0, 1024), [worker(0), worker(1)])
    assert [(s.index, s.cpu, s.memory_mb) for s in due] == [(0, 2.0, 1024), (1, 2.0, 1024)]


def test_a_worker_raised_after_an_oom_never_gets_less_memory_from_a_plan() -> None:
    raised = worker(1, memory_mb=4096, oom_memory_mb=4096)  # OOM at 2048: relaunched with x2
    nodes = [worker(0, memory_mb=2048), raised]
    assert resize_targets(NodeSpec("worker", 0, 1.0, 2048), nodes) == ()  # the same plan: it keeps 4096
    more_cpu = resize_targets(NodeSpec("worker", 0, 2.0, 3072), nodes)
    assert [(s.index, s.cpu, s.memory_mb) for s in more_cpu] == [(0, 2.0, 3072), (1, 2.0, 4096)]
    more_mem = resize_targets(NodeSpec("worker", 0, 1.0, 8192), nodes)
    assert [(s.index, s.memory_mb) for s in more_mem] == [(0, 8192), (1, 8192)]


@pytest.mark.parametrize(("workers", "fraction", "size"), [
    (1, 0.25, 1), (3, 0.25, 1), (4, 0.25, 1), (8, 0.25, 2), (10, 0.25, 2), (100, 0.25, 25),
    (4, 0.5, 2), (5, 1.0, 5), (3, 0.0, 1),
])
def test_a_batch_is_a_bounded_fraction_of_the_workers_and_at_least_one(workers: int, fraction: float,
                                                                       size: int) -> None:
    assert resize_batch_size(workers, ExecutorPolicy(resize_fraction=fraction)) == size


def test_batches_go_highest_slot_first_and_the_next_waits_until_the_replacements_run() -> None:
    def views(phase: dict[int, WorkerPhase], queued: set[int]) -> list[ResizeView]:
        return [ResizeView(i, phase.get(i, WorkerPhase.RUNNING), i in queued) for i in range(8)]

    assert resize_batch(views({}, set(range(8)))) == (7, 6)  # 8 workers x 0.25: two at a time, chief last
    left = set(range(6))
    for phase in (WorkerPhase.STOPPING, WorkerPhase.GONE, WorkerPhase.PENDING):  # the replacements start
        assert resize_batch(views({7: phase, 6: phase}, left)) == ()
    assert resize_batch(views({7: WorkerPhase.RUNNING}, left)) == (5, 4)  # both run again: the next batch
    assert resize_batch(views({}, {0})) == (0,)


def test_a_worker_down_for_another_reason_takes_the_room_and_a_pending_one_is_replaced_free() -> None:
    queued = {0, 1, 2}
    down = [ResizeView(0, WorkerPhase.RUNNING, True), ResizeView(1, WorkerPhase.RUNNING, True),
            ResizeView(2, WorkerPhase.RUNNING, True), ResizeView(3, WorkerPhase.GONE, False)]
    assert resize_batch(down) == ()  # 4 workers: one may be down, and worker-3 is (relaunching)
    pending = [ResizeView(i, WorkerPhase.PENDING if i == 2 else WorkerPhase.RUNNING, i in queued) for i in range(4)]
    assert resize_batch(pending) == (2,)  # it trains nothing yet: no running worker is taken with it


def test_a_rolling_replacement_keeps_the_job_training_and_ends_with_every_worker_resized() -> None:
    """Drive the pure decisions the way the executor does: replacements take one round to run again."""
    wanted = NodeSpec("worker", 0, 1.0, 4096)
    policy = ExecutorPolicy(resize_fraction=0.25)
    nodes = {i: worker(i) for i in range(10)}
    due = {s.index: s for s in resize_targets(wanted, nodes.values())}
    assert sorted(due) == list(range(10))
    phase = {i: WorkerPhase.RUNNING for i in nodes}
    order: list[tuple[int, ...]] = []
    for _ in range(20):
        for i, ph in phase.items():  # last round's replacements run now, with their new size
            if ph is WorkerPhase.STOPPING:
                nodes[i] = Node(relaunch_resized(nodes[i].spec, due.pop(i), oom=False), state="running")
                phase[i] = WorkerPhase.RUNNING
        batch = resize_batch([ResizeView(i, phase[i], i in due) for i in nodes], policy)
        if not batch:
            break
        order.append(batch)
        for i in batch:
            phase[i] = WorkerPhase.STOPPING
        assert sum(ph is not WorkerPhase.RUNNING for ph in phase.values()) <= resize_batch_size(10, policy)
    assert order == [(9, 8), (7, 6), (5, 4), (3, 2), (1, 0)]
    assert all(n.spec.memory_mb == 4096 and n.spec.cpu == 1.0 for n in nodes.values())
    assert resize_targets(wanted, nodes.values()) == ()


def test_a_relaunch_while_a_replacement_is_due_takes_the_new_size() -> None:
    old = NodeSpec("worker", 3, 1.0, 1024)
    target = NodeSpec("worker", 3, 2.0, 1536)
    assert relaunch_resized(old, target, oom=False) == NodeSpec("worker", 3, 2.0, 1536)
    doubled = on_exit(Node(old), ExitInfo(None, oom=True)).relaunch
    assert doubled is not None and doubled.memory_mb == 2048
    assert relaunch_resized(doubled, target, oom=True) == NodeSpec("worker", 3, 2.0, 2048)  # the larger one


# ------------------------------------------------------------ node lifecycle: one transition table

def test_terminal_states_have_no_outgoing_transitions_and_every_state_is_in_the_table() -> None:
    assert set(TRANSITIONS) == set(NodePhase)
    assert frozenset({NodePhase.FINISHED}) == TERMINAL
    for state in TERMINAL:
        assert TRANSITIONS[state] == {}
        for to in NodePhase:
            if to is not state:
                assert not can_move(state, to)
                with pytest.raises(IllegalTransition):
                    transition("worker-0", state, to)


def test_every_edge_says_why_and_illegal_moves_are_rejected_in_one_place() -> None:
    for frm, out in TRANSITIONS.items():
        for to, why in out.items():
            assert why.strip(), f"{frm.value} -> {to.value} has no comment"
    assert transition("worker-1", NodePhase.PENDING, NodePhase.RUNNING) is NodePhase.RUNNING
    assert transition("worker-1", NodePhase.RUNNING, NodePhase.RUNNING) is NodePhase.RUNNING  # a redo
    with pytest.raises(IllegalTransition, match="removed to running"):
        transition("worker-1", NodePhase.REMOVED, NodePhase.RUNNING)  # scale-up starts a fresh pod first
    with pytest.raises(IllegalTransition, match="intent"):
        transition("worker-1", NodePhase.RUNNING, NodePhase.STOPPING)  # a stop must say why
    assert transition("worker-1", NodePhase.RUNNING, NodePhase.STOPPING, NodeIntent.RESIZE) is NodePhase.STOPPING


def test_a_record_written_before_node_states_gets_its_state_from_the_loose_fields() -> None:
    assert legacy_state(finished=True, removed=True, intent=NodeIntent.NONE, running=True) is NodePhase.FINISHED
    assert legacy_state(finished=False, removed=True, intent=NodeIntent.NONE, running=True) is NodePhase.REMOVED
    assert legacy_state(finished=False, removed=False, intent=NodeIntent.RESIZE, running=True) is NodePhase.STOPPING
    assert legacy_state(finished=False, removed=False, intent=NodeIntent.NONE, running=False) is NodePhase.PENDING


# ------------------------------------------------------------ plan_change: one algorithm for executor and simulators

def job(workers: int, ps: int = 1, cpu: float = 1.0, memory_mb: int = 1024, **states: str) -> dict[str, Node]:
    nodes = {f"worker-{i}": worker(i, cpu, memory_mb, states.get(f"worker_{i}", "running")) for i in range(workers)}
    nodes.update({f"ps-{i}": Node(NodeSpec("ps", i, 1.0, 1024), state="running") for i in range(ps)})
    return nodes


def P(workers: int, ps: int = 1, cpu: float = 1.0, memory_mb: int = 1024, ps_cpu: float = 1.0,
      ps_memory_mb: int = 1024) -> Plan:
    return Plan(workers, ps, NodeSpec("worker", 0, cpu, memory_mb), NodeSpec("ps", 0, ps_cpu, ps_memory_mb))


def test_a_first_plan_starts_every_node_and_nothing_else() -> None:
    ch = plan_change(P(0, 0), P(3, 2, memory_mb=2048), {})
    assert sorted((s.role, s.index) for s in ch.start) == [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1),
                                                           ("worker", 2)]
    assert all(s.memory_mb == 2048 for s in ch.start if s.role == "worker")
    assert (ch.stop, ch.resize_batches, ch.migrate_ps) == ((), (), False)


def test_scaling_workers_starts_the_lowest_free_slots_and_stops_the_highest() -> None:
    up = plan_change(P(2), P(4), job(2))
    assert [(s.role, s.index) for s in up.start] == [("worker", 2), ("worker", 3)]
    assert (up.stop, up.resize_batches, up.migrate_ps) == ((), (), False)
    down = plan_change(P(4), P(2), job(4))
    assert down.start == () and down.stop == ("worker-2", "worker-3") and down.resize_batches == ()
    # a finished worker keeps its slot: not started again, not stopped
    done = plan_change(P(2), P(1), job(2, worker_1="finished"))
    assert done.start == () and done.stop == ()
    # a removed one is started again when a plan scales back up
    back = plan_change(P(1), P(2), {**job(1), "worker-1": worker(1, state="removed")})
    assert [s.index for s in back.start] == [1]


def test_new_worker_size_is_a_rolling_replacement_chief_last() -> None:
    ch = plan_change(P(8), P(8, cpu=2.0, memory_mb=2048), job(8))
    assert ch.resize_batches == ((7, 6), (5, 4), (3, 2), (1, 0)) and not ch.migrate_ps
    assert ch.start == () and ch.stop == () and ch.grow == ()
    assert [(s.cpu, s.memory_mb) for s in ch.resize] == [(2.0, 2048)] * 8
    # less memory cannot be given in place: a replacement too
    less = plan_change(P(8, memory_mb=2048), P(8), job(8, memory_mb=2048))
    assert less.resize_batches == ((7, 6), (5, 4), (3, 2), (1, 0)) and less.grow == ()
    # without in-place growth (a cluster that cannot), more memory is a replacement as well
    off = plan_change(P(8), P(8, memory_mb=2048), job(8), ExecutorPolicy(memory_in_place=False))
    assert off.resize_batches == ((7, 6), (5, 4), (3, 2), (1, 0)) and off.grow == ()
    # scaled down and resized: only the workers that stay are replaced, in batches of the new count
    down = plan_change(P(8), P(4, cpu=2.0), job(8))
    assert down.stop == ("worker-4", "worker-5", "worker-6", "worker-7")
    assert down.resize_batches == ((3,), (2,), (1,), (0,))
    # scaled up and resized: the new workers start with the new size, the old ones are replaced
    up = plan_change(P(2), P(4, cpu=2.0), job(2))
    assert [(s.index, s.cpu) for s in up.start] == [(2, 2.0), (3, 2.0)] and up.resize_batches == ((1,), (0,))


def test_a_ps_change_is_a_migration_that_carries_the_worker_resize() -> None:
    more_ps = plan_change(P(4), P(4, ps=2), job(4))
    assert more_ps.migrate_ps and more_ps.start == () and more_ps.stop == () and more_ps.resize_batches == ()
    bigger = plan_change(P(4), P(4, ps_cpu=2.0, memory_mb=2048), job(4))
    assert bigger.migrate_ps and bigger.resize_batches == ()  # every worker restarts once, with its new size
    assert [s.memory_mb for s in bigger.resize] == [2048] * 4 and bigger.grow == ()
    waits = plan_change(P(4), P(4, ps=3), job(4), migrating=True)
    assert not waits.migrate_ps and waits.ps_deferred
    assert not plan_change(P(4), P(4), job(4)).migrate_ps


def test_more_memory_alone_grows_the_running_nodes_in_place() -> None:
    # the PS: no migration, every live PS grows; the workers: no replacement
    ch = plan_change(P(4, ps=2), P(4, ps=2, ps_memory_mb=4096, memory_mb=2048), job(4, ps=2))
    assert not ch.migrate_ps and ch.resize_batches == () and ch.resize == () and not ch.ps_deferred
    assert sorted((s.role, s.index, s.cpu, s.memory_mb) for s in ch.grow) == [
        ("ps", 0, 1.0, 4096), ("ps", 1, 1.0, 4096),
        *(("worker", i, 1.0, 2048) for i in range(4))]
    # new workers of the same plan start with the new size; only the running ones grow
    up = plan_change(P(2), P(3, memory_mb=2048), job(2))
    assert [(s.index, s.memory_mb) for s in up.start] == [(2, 2048)]
    assert sorted(s.index for s in up.grow if s.role == "worker") == [0, 1]
    # a PS the executor already gave more (an OOM relaunch) does not shrink nor grow
    big = {**job(2, ps=2), "ps-1": Node(NodeSpec("ps", 1, 1.0, 8192), state="running")}
    some = plan_change(P(2, ps=2), P(2, ps=2, ps_memory_mb=4096), big)
    assert [(s.role, s.index) for s in some.grow] == [("ps", 0)] and not some.migrate_ps
    # more PS memory and another PS count: a migration, nothing grows in place
    moved = plan_change(P(2), P(2, ps=2, ps_memory_mb=4096), job(2))
    assert moved.migrate_ps and moved.grow == ()
    # during a migration the new PS start with the old size: the growth waits for it
    waits = plan_change(P(2), P(2, ps_memory_mb=4096), job(2), migrating=True)
    assert waits.ps_deferred and not waits.migrate_ps and all(s.role == "worker" for s in waits.grow)
    # policy off: the PS migrate as before
    off = plan_change(P(2), P(2, ps_memory_mb=4096), job(2), ExecutorPolicy(memory_in_place=False))
    assert off.migrate_ps and off.grow == ()


def test_an_oom_raised_worker_keeps_its_memory_in_a_plan_change() -> None:
    nodes = {**job(2, memory_mb=2048), "worker-1": worker(1, memory_mb=4096, oom_memory_mb=4096)}
    ch = plan_change(P(2, memory_mb=2048), P(2, memory_mb=2048, cpu=2.0), nodes)
    assert [(s.index, s.cpu, s.memory_mb) for s in ch.resize] == [(0, 2.0, 2048), (1, 2.0, 4096)]


def test_resize_rounds_are_what_resize_batch_picks_round_after_round() -> None:
    assert resize_rounds(range(10), 10) == ((9, 8), (7, 6), (5, 4), (3, 2), (1, 0))
    assert resize_rounds([0, 3], 4) == ((3,), (0,))
    assert resize_rounds([], 4) == ()
    assert resize_rounds(range(4), 4, ExecutorPolicy(resize_fraction=1.0)) == ((3, 2, 1, 0),)


# ------------------------------------------------------------ PS migration: one pure step function

WORKERS = ("worker-0", "worker-1", "worker-2")


def mig(phase: MigrationPhase, ps_running: bool = True, workers: tuple[str, ...] = WORKERS,
        draining: tuple[str, ...] = (), checkpoint: str = "", stop_first: bool = False,
        retiring: tuple[str, ...] = ("j-ps-0-g0",)) -> MigrationView:
    return MigrationView(phase, ps_running, workers, draining, checkpoint, retiring=retiring, stop_first=stop_first)


def test_no_migration_is_no_step() -> None:
    assert migration_step(mig(MigrationPhase.NONE)) == MigrationStep(MigrationPhase.NONE, ())


def test_the_old_cluster_trains_until_every_new_ps_runs_then_the_chief_checkpoints_first() -> None:
    assert migration_step(mig(MigrationPhase.STARTING_PS, ps_running=False)) == MigrationStep(
        MigrationPhase.STARTING_PS, ())
    step = migration_step(mig(MigrationPhase.STARTING_PS))
    assert step.phase is MigrationPhase.DRAINING and not step.stuck
    # the checkpoint request comes first: refused, nothing after it is applied and the next pass asks again
    assert step.effects[0] == RequestCheckpoint("worker-0")
    assert step.effects[1:4] == (SetIntent(WORKERS, NodeIntent.MIGRATE), EnterPhase(MigrationPhase.DRAINING),
                                 SaveRecord())
    # the others are stopped after the intent is saved; the chief stops by itself once checkpointed
    assert step.effects[4:] == (DeletePod("worker-1"), DeletePod("worker-2"))


def test_without_a_chief_the_workers_are_drained_without_a_checkpoint_request() -> None:
    step = migration_step(mig(MigrationPhase.STARTING_PS, workers=("worker-1",)))
    assert not any(isinstance(e, RequestCheckpoint) for e in step.effects)
    assert DeletePod("worker-1") in step.effects


def test_draining_waits_for_every_worker_then_restores_and_restarts_them_on_the_new_cluster() -> None:
    waiting = migration_step(mig(MigrationPhase.DRAINING, draining=("worker-2",), checkpoint="ck-7"))
    assert waiting == MigrationStep(MigrationPhase.DRAINING, ())
    stuck = migration_step(mig(MigrationPhase.DRAINING))
    assert stuck.effects == () and "checkpoint" in stuck.stuck
    done = migration_step(mig(MigrationPhase.DRAINING, checkpoint="ck-7"))
    assert done.phase is MigrationPhase.NONE
    assert done.effects == (
        RestoreShards("ck-7"), SwitchCluster(), RestartNodes(WORKERS, ("worker-0",)), SaveRecord(),
        CreatePod("worker-0"), CreatePod("worker-1"), CreatePod("worker-2"), DeletePods(("j-ps-0-g0",)),
        SaveRecord())


def test_a_stop_and_restart_drains_at_once_stops_the_old_ps_then_waits_for_the_new() -> None:
    """AntDT §V-E2's stop-and-restart of a PS: no training on the slow PS while its replacement starts."""
    seamless = migration_step(mig(MigrationPhase.STARTING_PS, ps_running=False))
    assert seamless == MigrationStep(MigrationPhase.STARTING_PS, ())
    now = migration_step(mig(MigrationPhase.STARTING_PS, ps_running=False, stop_first=True))
    assert now == migration_step(mig(MigrationPhase.STARTING_PS))  # the drain a seamless move makes later
    # drained, the new PS not yet running: the old PS serve nobody and stop now, once
    drained = migration_step(mig(MigrationPhase.DRAINING, ps_running=False, checkpoint="ck-1", stop_first=True))
    assert drained == MigrationStep(MigrationPhase.DRAINING, (DeletePods(("j-ps-0-g0",)), SaveRecord()))
    waiting = migration_step(mig(MigrationPhase.DRAINING, ps_running=False, checkpoint="ck-1", stop_first=True,
                                 retiring=()))
    assert waiting == MigrationStep(MigrationPhase.DRAINING, ())
    # the new PS run: restore and restart the workers as a seamless move does
    done = migration_step(mig(MigrationPhase.DRAINING, checkpoint="ck-1", stop_first=True, retiring=()))
    assert done.phase is MigrationPhase.NONE and done.effects[:3] == (
        RestoreShards("ck-1"), SwitchCluster(), RestartNodes(WORKERS, ("worker-0",)))
    # still draining: nothing stops before every worker has
    assert migration_step(mig(MigrationPhase.DRAINING, ps_running=False, draining=("worker-1",),
                              checkpoint="ck-1", stop_first=True)).effects == ()


# ------------------------------------------------------------ answer_exit: what follows an exit in the executor

def test_an_exit_we_caused_for_a_restart_or_resize_relaunches_without_spending_budget() -> None:
    stopped = ExitInfo(None, signal=15, by_executor=True)
    restart = answer_exit(W0, stopped, intent=NodeIntent.RESTART)
    assert restart.outcome is ExitOutcome.RELAUNCH and restart.requested and restart.reason == "restart_requested"
    resized = answer_exit(W0, stopped, intent=NodeIntent.RESIZE, resize_to=NodeSpec("worker", 0, 2.0, 4096))
    assert resized.reason == "resized" and resized.relaunch == NodeSpec("worker", 0, 2.0, 4096)
    gone = answer_exit(W0, stopped, removed=True)  # scaled away: nothing follows
    assert gone.outcome is ExitOutcome.NOTHING and gone.relaunch is None


def test_a_failure_relaunches_or_fails_the_job_and_a_migration_stop_waits() -> None:
    oom = answer_exit(W0, ExitInfo(137, k8s_reason="OOMKilled"))
    assert oom.outcome is ExitOutcome.RELAUNCH and oom.oom and not oom.requested
    assert oom.relaunch is not None and oom.relaunch.memory_mb == 2048
    # a replacement due takes the larger of the doubled memory and the plan's
    due = answer_exit(W0, ExitInfo(137, k8s_reason="OOMKilled"), resize_to=NodeSpec("worker", 0, 1.0, 1536))
    assert due.relaunch == NodeSpec("worker", 0, 1.0, 2048) and due.reason == "oom"
    assert answer_exit(W0, ExitInfo(1)).outcome is ExitOutcome.FAIL_JOB
    assert answer_exit(W0, ExitInfo(1), active=False).outcome is ExitOutcome.NOTHING  # the job is over anyway
    assert answer_exit(W0, ExitInfo(0)).outcome is ExitOutcome.FINISHED
    moving = answer_exit(W0, ExitInfo(75), intent=NodeIntent.MIGRATE)
    assert moving.outcome is ExitOutcome.MIGRATING and moving.relaunch is None
    lost = answer_exit(W0, ExitInfo(1, network_error=True))
    assert lost.outcome is ExitOutcome.RELAUNCH and lost.restore  # the chief restores the newest checkpoint


# ------------------------------------------------------------ one reconcile pass: observe, then decide

def nv(node: str, state: NodePhase = NodePhase.RUNNING, pod: PodPhase | None = PodPhase.RUNNING, *,
       intent: NodeIntent = NodeIntent.NONE, handled: bool = False, resize_due: bool = False,
       running_at: float = 5.0, stop_sent: bool = False, stopping: bool = False) -> NodeView:
    return NodeView(node, node.rsplit("-", 1)[0], state, intent, pod, handled, resize_due, running_at, stop_sent,
                    stopping)


def jv(*nodes: NodeView, state: ExecutorJobState = ExecutorJobState.STARTING, applied: bool = False,
       migration: MigrationPhase = MigrationPhase.NONE, completing_since: float = 0.0,
       pods_left: bool = True) -> JobView:
    return JobView(state, migration, applied, 1.0, completing_since, nodes, pods_left)


def test_a_plan_is_applied_once_every_live_node_runs() -> None:
    p = reconcile_pass(jv(nv("ps-0", running_at=3.0), nv("worker-0", running_at=7.5)), 10.0, 300.0)
    assert p.applied_overhead == 6.5 and p.resize and not p.migrate and not p.teardown
    waiting = jv(nv("ps-0"), nv("worker-0", NodePhase.PENDING, PodPhase.PENDING, running_at=0.0))
    assert reconcile_pass(waiting, 10.0, 300.0).applied_overhead is None
    resizing = jv(nv("ps-0"), nv("worker-0", resize_due=True))  # applied only once the replacement ran
    assert reconcile_pass(resizing, 10.0, 300.0).applied_overhead is None
    migrating = jv(nv("ps-0"), nv("worker-0"), migration=MigrationPhase.STARTING_PS)
    p2 = reconcile_pass(migrating, 10.0, 300.0)
    assert p2.applied_overhead is None and p2.migrate and not p2.resize


def test_what_a_crash_left_undone_is_done_again() -> None:
    job = jv(nv("ps-0"), nv("worker-0", NodePhase.PENDING, None, running_at=0.0),  # saved, never created
             nv("worker-1", NodePhase.RELAUNCHING, None, handled=True),  # its exit was handled: not recreated
             nv("worker-2", NodePhase.STOPPING, intent=NodeIntent.RESIZE),  # a stop that a crash swallowed
             nv("worker-3", NodePhase.STOPPING, intent=NodeIntent.RESIZE, stop_sent=True),
             state=ExecutorJobState.RUNNING)
    p = reconcile_pass(job, 10.0, 300.0)
    assert p.recreate == ("worker-0",) and p.restop == ("worker-2",) and p.applied_overhead is None


def test_a_job_is_torn_down_when_its_workers_finished_or_the_grace_ran_out_then_reported_gone() -> None:
    done = jv(nv("ps-0"), nv("worker-0", NodePhase.FINISHED, PodPhase.EXITED), state=ExecutorJobState.RUNNING,
              applied=True)
    assert reconcile_pass(done, 10.0, 300.0).teardown == "every worker finished"
    late = jv(nv("ps-0"), nv("worker-1"), state=ExecutorJobState.COMPLETING, completing_since=1.0)
    assert reconcile_pass(late, 100.0, 300.0).teardown == ""
    assert "after completion" in reconcile_pass(late, 400.0, 300.0).teardown
    tearing = jv(nv("ps-0", NodePhase.REMOVED, stopping=True), nv("worker-0", NodePhase.REMOVED),
                 state=ExecutorJobState.TEARING_DOWN)
    p = reconcile_pass(tearing, 10.0, 300.0)
    assert p.redelete == ("worker-0",) and not p.torn_down and not p.recreate  # ps-0's stop is under way
    gone = jv(nv("ps-0", NodePhase.REMOVED, PodPhase.EXITED), state=ExecutorJobState.FAILED, pods_left=False)
    assert reconcile_pass(gone, 10.0, 300.0).torn_down
    assert reconcile_pass(jv(state=ExecutorJobState.TORN_DOWN, pods_left=False), 10.0, 300.0) == ReconcilePass()


def test_a_migration_starts_every_ps_of_the_next_cluster_beside_the_old_ones() -> None:
    ps = [PsView(0, False, "j-ps-0-g0"), PsView(1, False, "j-ps-1-g0"), PsView(2, True)]
    more = migration_start(ps, {0: (1.0, 2048), 1: (1.0, 2048), 2: (1.0, 2048)})
    assert [(s.index, s.memory_mb) for s in more.start] == [(0, 2048), (1, 2048), (2, 2048)]
    assert more.retire == ("j-ps-0-g0", "j-ps-1-g0") and more.remove == ()  # a removed slot comes back
    fewer = migration_start(ps, {0: (2.0, 1024)})
    assert [s.index for s in fewer.start] == [0] and fewer.remove == ("ps-1",)
    assert fewer.retire == ("j-ps-0-g0", "j-ps-1-g0")  # both serve until the workers moved
