"""The pod-executor's pure decisions: exit classification, relaunch budget, OOM, scaling."""

from __future__ import annotations

import pytest
from pacer_services.pod_executor.core import (
    RETRYABLE,
    ExecutorPolicy,
    ExitInfo,
    ExitReason,
    Node,
    NodeSpec,
    Plan,
    classify,
    on_exit,
    reconcile,
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
        (ExitInfo(2), ExitReason.CONFIG_ERROR),
        (ExitInfo(None, k8s_reason="ImagePullBackOff"), ExitReason.CONFIG_ERROR),
        (ExitInfo(1), ExitReason.USER_ERROR),
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
