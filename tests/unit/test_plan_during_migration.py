"""A plan that arrives while a PS migration is under way leaves the PS set to the migration.

Found in the brain's end-to-end test: the brain's OOM plan (2 PS) reached
the executor while its optimize plan's migration to 5 PS was starting the
new PS; the plan stopped ps-2..4, the migration then moved the workers
onto a cluster whose PS were gone, and the job stalled for good.
"""

from __future__ import annotations

from pacer_services.pod_executor.core import Node, NodeSpec, Plan, plan_change

W = NodeSpec("worker", 0, 1.0, 2048)
PS = NodeSpec("ps", 0, 1.0, 1200)


def _nodes(ps: int, workers: int) -> dict[str, Node]:
    out = {f"ps-{i}": Node(NodeSpec("ps", i, 1.0, 1200), state="running") for i in range(ps)}
    out |= {f"worker-{i}": Node(NodeSpec("worker", i, 1.0, 2048), state="running") for i in range(workers)}
    return out


def test_a_plan_during_a_migration_touches_no_ps() -> None:
    nodes = _nodes(ps=5, workers=2)  # ps-2..4: the migration's new PS, starting
    before = Plan(1, 2, W, PS)  # the cluster in force still has 2 PS
    after = Plan(1, 2, W, NodeSpec("ps", 0, 1.0, 2496))  # OOM prevention: more PS memory
    change = plan_change(before, after, nodes, migrating=True)
    assert not [n for n in change.stop if n.startswith("ps-")]
    assert not [s for s in change.start if s.role == "ps"]
    assert change.ps_deferred and not change.migrate_ps
    assert change.stop == ("worker-1",)  # workers still follow the plan


def test_without_a_migration_the_same_plan_stops_surplus_ps_slots() -> None:
    change = plan_change(Plan(1, 2, W, PS), Plan(1, 2, W, PS), _nodes(ps=3, workers=1))
    assert "ps-2" in change.stop
