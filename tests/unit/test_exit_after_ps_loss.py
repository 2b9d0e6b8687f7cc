"""A worker that loses its PS because the PS died is relaunched without spending its budget.

Found by the chaos runs: every PS death makes every worker's TF session
fail (a NETWORK exit), and those exits counted against the workers' relaunch
budget exactly like their own failures, so one flaky PS (3 deaths) failed a
job of healthy workers.
"""

from __future__ import annotations

from pacer_services.pod_executor.core import (
    ExecutorPolicy,
    ExitInfo,
    ExitOutcome,
    ExitReason,
    Node,
    NodeSpec,
    on_exit,
)
from pacer_services.pod_executor.core.exits import answer_exit

POLICY = ExecutorPolicy(relaunch_budget=3)
LOST_PS = ExitInfo(1, network_error=True)
SPENT = Node(NodeSpec("worker", 1), restarts=3)


def test_a_spent_worker_that_lost_its_dead_ps_is_relaunched_for_free() -> None:
    d = on_exit(SPENT, LOST_PS, POLICY, ps_lost=True)
    assert d.reason is ExitReason.NETWORK and d.relaunch == SPENT.spec and not d.fail_job
    ans = answer_exit(SPENT, LOST_PS, policy=POLICY, ps_lost=True)
    assert ans.outcome is ExitOutcome.RELAUNCH and ans.requested  # requested: the executor counts no restart


def test_without_a_dead_ps_a_lost_connection_still_spends_the_budget() -> None:
    d = on_exit(SPENT, LOST_PS, POLICY)
    assert d.fail_job and "budget" in d.detail
    fresh = Node(NodeSpec("worker", 1))
    ans = answer_exit(fresh, LOST_PS, policy=POLICY)
    assert ans.outcome is ExitOutcome.RELAUNCH and not ans.requested


def test_a_dead_ps_excuses_only_lost_ps_exits_of_workers() -> None:
    own_failure = on_exit(SPENT, ExitInfo(None, signal=9), POLICY, ps_lost=True)  # killed: its own death
    assert own_failure.fail_job
    ps = Node(NodeSpec("ps", 0), restarts=3)
    assert on_exit(ps, LOST_PS, POLICY, ps_lost=True).fail_job  # a PS's own budget still holds
    chief_restore = answer_exit(Node(NodeSpec("worker", 0)), LOST_PS, policy=POLICY, ps_lost=True)
    assert chief_restore.restore and chief_restore.requested  # the chief restores and rewinds, for free
