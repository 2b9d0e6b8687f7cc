"""Controller core: the policy request, the review of decisions (AntDT §V-E2 guards), the restart cool-down.

Every test injects ``now``; nothing reads a clock.
"""

from __future__ import annotations

from typing import Any

import pytest
from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import JobStatistics, NodeState, NodeStats, StragglerKind
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest
from pacer_services.controller.core import ControllerConfig, ControllerCore, JobSetup
from pacer_services.controller.policies import antdt_nd

JOB = "job1"
T0 = 10_000.0


def node(name: str, role: str = "worker", state: NodeState = NodeState.RUNNING, bpt: float = 1.0,
         kind: StragglerKind = StragglerKind.NONE) -> NodeStats:
    return NodeStats(
        node=name, role=role, bpt_short_s=bpt, bpt_long_s=bpt, speed_samples_per_s=0.0, samples_total=0,
        cpu_percent=100.0, rss_bytes=1, last_seen=1.0, state=state, pending_s=0.0, restarts=0,
        slowdown_short=bpt, slowdown_long=bpt, straggler=kind,
    )


def stats(busy: bool = False, extra: list[NodeStats] | None = None) -> JobStatistics:
    nodes = [node("ps-0", role="ps"), node("worker-0"), node("worker-1"), node("worker-2"),
             node("worker-3", state=NodeState.DEAD)] + (extra or [])
    return JobStatistics(job=JOB, ts=T0, window_short_s=300.0, window_long_s=600.0,
                         throughput_samples_per_s=0.0, nodes=nodes, cluster_busy=busy)


SETUP = JobSetup(global_batch=300, mode="bsp")


def decision(*actions: PolicyAction, job: str = JOB) -> PolicyDecision:
    return PolicyDecision(job=job, policy="test", actions=list(actions))


def restart(n: str) -> PolicyAction:
    return PolicyAction(kind=ActionKind.KILL_RESTART, node=n, reason="slow")


def adjust(sizes: dict[str, Any], accs: dict[str, Any] | None = None) -> PolicyAction:
    payload: dict[str, Any] = {"batch_sizes": sizes}
    if accs is not None:
        payload["accumulations"] = accs
    return PolicyAction(kind=ActionKind.ADJUST_BS, payload=payload)


def review(core: ControllerCore, d: PolicyDecision, now: float = T0, busy: bool = False,
           setup: JobSetup = SETUP) -> Any:
    return core.review(core.request(stats(busy), setup, now), d, now)


# ---------------------------------------------------------------- request


def test_request_carries_the_setup_of_the_live_workers_only() -> None:
    setup = JobSetup(global_batch=300, batch_sizes={"worker-0": 150, "worker-3": 50}, accumulations={"worker-0": 2},
                     device_groups={"worker-1": "v100", "worker-3": "p100"}, params={"lambda": 2.0})
    req = ControllerCore(JOB).request(stats(), setup, T0)
    assert isinstance(req, PolicyRequest)
    assert req.batch_sizes == {"worker-0": 150, "worker-1": 100, "worker-2": 100}  # even split B/n for new ones
    assert req.accumulations == {"worker-0": 2, "worker-1": 1, "worker-2": 1}
    assert req.device_groups == {"worker-1": "v100"}
    assert req.params == {"lambda": 2.0} and req.restart_blocked == [] and req.mode == "bsp"


def test_request_of_another_job_is_an_error() -> None:
    with pytest.raises(ValueError):
        ControllerCore("other").request(stats(), SETUP, T0)


# ---------------------------------------------------------------- KILL_RESTART guards


def test_cooldown_blocks_a_second_restart_of_the_same_node_until_it_expires() -> None:
    core = ControllerCore(JOB, ControllerConfig(cooldown_s=600, max_restarts_per_window=5))
    r = review(core, decision(restart("worker-1")))
    assert r.execute == [restart("worker-1")] and r.refused == []
    core.applied(r.execute[0], T0)

    assert "worker-1" in core.request(stats(), SETUP, T0 + 100).restart_blocked
    r = review(core, decision(restart("worker-1")), now=T0 + 100)
    assert r.execute == [] and "cool-down" in r.refused[0].reason
    # Another node is not in cool-down.
    assert review(core, decision(restart("worker-2")), now=T0 + 100).execute == [restart("worker-2")]

    later = T0 + 601
    assert core.request(stats(), SETUP, later).restart_blocked == []
    assert review(core, decision(restart("worker-1")), now=later).execute == [restart("worker-1")]


def test_at_most_max_restarts_per_window() -> None:
    core = ControllerCore(JOB, ControllerConfig(cooldown_s=600, max_restarts_per_window=1))
    r = review(core, decision(restart("worker-1"), restart("ps-0")))
    assert r.execute == [restart("worker-1")]
    assert "at most 1" in r.refused[0].reason
    core.applied(r.execute[0], T0)
    # The job's budget is spent: every node is blocked for the policy, and the review agrees.
    assert set(core.request(stats(), SETUP, T0 + 10).restart_blocked) >= {"ps-0", "worker-0", "worker-2"}
    assert review(core, decision(restart("ps-0")), now=T0 + 10).execute == []


def test_busy_cluster_refuses_restarts() -> None:
    r = review(ControllerCore(JOB), decision(restart("worker-1")), busy=True)
    assert r.execute == [] and "busy" in r.refused[0].reason and not r.fallback
    permissive = ControllerCore(JOB, ControllerConfig(refuse_restart_when_busy=False))
    assert review(permissive, decision(restart("worker-1")), busy=True).execute == [restart("worker-1")]


@pytest.mark.parametrize(("target", "why"), [("worker-3", "dead"), ("worker-77", "unknown")])
def test_restart_of_dead_or_unknown_nodes_is_refused(target: str, why: str) -> None:
    r = review(ControllerCore(JOB), decision(restart(target)))
    assert r.execute == [] and why in r.refused[0].reason


def test_applied_ignores_other_actions() -> None:
    core = ControllerCore(JOB)
    core.applied(adjust({"worker-0": 300}), T0)
    assert core.request(stats(), SETUP, T0).restart_blocked == []


# ---------------------------------------------------------------- malformed decisions


def test_decision_for_another_job_falls_back() -> None:
    r = review(ControllerCore(JOB), decision(restart("worker-1"), job="other"))
    assert r.fallback and r.execute == [] and len(r.refused) == 1
    assert "malformed" in r.refused[0].reason and "other" in r.reason


def test_unknown_action_kind_falls_back_for_the_whole_decision() -> None:
    bogus = PolicyAction(kind="SPEED_UP", node="worker-1")  # type: ignore[arg-type]
    r = review(ControllerCore(JOB), decision(restart("worker-1"), bogus))
    assert r.fallback and r.execute == [] and len(r.refused) == 2
    assert all("SPEED_UP" in x.reason for x in r.refused)


def test_not_a_decision_falls_back() -> None:
    r = review(ControllerCore(JOB), {"job": JOB, "actions": []})  # type: ignore[arg-type]
    assert r.fallback and r.execute == [] and r.refused and r.refused[0].reason


def test_none_actions_are_dropped_silently() -> None:
    r = review(ControllerCore(JOB), decision(PolicyAction(kind=ActionKind.NONE)))
    assert r.execute == [] and r.refused == [] and not r.fallback


# ---------------------------------------------------------------- ADJUST_BS / BACKUP_WORKERS / ADJUST_LR


GOOD = {"worker-0": 150, "worker-1": 100, "worker-2": 50}


@pytest.mark.parametrize(
    ("action", "why"),
    [
        (adjust({"worker-0": 200, "worker-1": 100}), "missing ['worker-2']"),
        (adjust(GOOD | {"worker-3": 0}), "not live ['worker-3']"),
        (adjust(GOOD | {"ps-0": 0}), "not live ['ps-0']"),
        (adjust({"worker-0": 150.0, "worker-1": 100, "worker-2": 50}), "not an integer"),
        (adjust({"worker-0": True, "worker-1": 199, "worker-2": 100}), "not an integer"),
        (adjust({"worker-0": 300, "worker-1": 0, "worker-2": 0}), "not an integer >= 1"),
        (adjust({"worker-0": 150, "worker-1": 100, "worker-2": 51}), "sum of B_i * C_i is 301"),
        (adjust(GOOD, {"worker-0": 2}), "sum of B_i * C_i is 450"),
        (adjust(GOOD, {"worker-0": 0}), "accumulation 0"),
        (adjust(GOOD, {"worker-3": 1}), "not live"),
        (PolicyAction(kind=ActionKind.ADJUST_BS, payload={"batch_sizes": [1, 2]}), "must be maps"),
    ],
)
def test_adjust_bs_is_refused_unless_it_names_the_live_workers_and_sums_to_B(action: PolicyAction, why: str) -> None:
    r = review(ControllerCore(JOB), decision(action))
    assert r.execute == [] and not r.fallback
    assert why in r.refused[0].reason


def test_adjust_bs_accepted_and_applied_to_the_setup() -> None:
    core = ControllerCore(JOB)
    good = adjust({"worker-0": 100, "worker-1": 50, "worker-2": 50}, {"worker-0": 2})
    r = review(core, decision(good))
    assert r.execute == [good]
    setup = SETUP.apply(good)
    req = core.request(stats(), setup, T0)
    assert req.batch_sizes == {"worker-0": 100, "worker-1": 50, "worker-2": 50}
    assert req.accumulations == {"worker-0": 2, "worker-1": 1, "worker-2": 1}


def test_adjust_bs_respects_max_batch_and_one_per_decision() -> None:
    setup = JobSetup(global_batch=300, max_batch=120)
    r = review(ControllerCore(JOB), decision(adjust(GOOD)), setup=setup)
    assert "max batch 120" in r.refused[0].reason
    ok = adjust({"worker-0": 100, "worker-1": 100, "worker-2": 100})
    r = review(ControllerCore(JOB), decision(ok, ok), setup=setup)
    assert r.execute == [ok] and "only one" in r.refused[0].reason


@pytest.mark.parametrize(("b", "ok"), [(0, True), (2, True), (3, False), (-1, False), ("1", False), (True, False)])
def test_backup_workers_must_keep_one_live_gradient(b: Any, ok: bool) -> None:
    a = PolicyAction(kind=ActionKind.BACKUP_WORKERS, payload={"backup": b})
    r = review(ControllerCore(JOB), decision(a))
    assert (r.execute == [a]) is ok
    if not ok:
        assert "backup" in r.refused[0].reason


def test_backup_workers_refused_in_asp_and_applied_to_the_setup() -> None:
    a = PolicyAction(kind=ActionKind.BACKUP_WORKERS, payload={"backup": 1})
    r = review(ControllerCore(JOB), decision(a), setup=JobSetup(global_batch=300, mode="asp"))
    assert r.execute == [] and "BSP" in r.refused[0].reason
    assert SETUP.apply(a).backup_workers == 1
    assert ControllerCore(JOB).request(stats(), SETUP.apply(a), T0).backup_workers == 1


@pytest.mark.parametrize(("scale", "ok"), [(0.5, True), (2, True), (0, False), (float("nan"), False), (None, False)])
def test_adjust_lr_needs_a_positive_scale(scale: Any, ok: bool) -> None:
    a = PolicyAction(kind=ActionKind.ADJUST_LR, payload={"scale": scale})
    assert (review(ControllerCore(JOB), decision(a)).execute == [a]) is ok


# ---------------------------------------------------------------- policy and core agree


def test_antdt_nd_decisions_pass_review() -> None:
    core = ControllerCore(JOB)
    s = stats(extra=[node("worker-4", bpt=3.0, kind=StragglerKind.PERSISTENT),
                     node("worker-5", bpt=2.0, kind=StragglerKind.TRANSIENT)])
    req = core.request(s, SETUP, T0)
    d = antdt_nd.decide(req)
    r = core.review(req, d, T0)
    assert r.refused == [] and {a.kind for a in r.execute} == {ActionKind.KILL_RESTART, ActionKind.ADJUST_BS}
    for a in r.execute:
        core.applied(a, T0)
    # Next round, worker-4 is in cool-down: AntDT-ND does not even propose it.
    req2 = core.request(s, SETUP, T0 + 60)
    assert "worker-4" in req2.restart_blocked
    assert ActionKind.KILL_RESTART not in {a.kind for a in antdt_nd.decide(req2).actions}
