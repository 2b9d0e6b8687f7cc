"""Controller core: the policy request, the review of decisions (AntDT §V-E2 guards), the restart cool-down,
and the round (fallback, batch-size re-send, what was applied) that the service and the simulator share.

Every test injects ``now``; nothing reads a clock.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, StragglerKind
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest
from pacer_services.controller.core import ControllerConfig, ControllerCore, JobSetup, Round
from pacer_services.controller.policies import antdt_nd

JOB = "job1"
T0 = 10_000.0


def node(name: str, role: str = "worker", state: Liveness = Liveness.RUNNING, bpt: float = 1.0,
         kind: StragglerKind = StragglerKind.NONE) -> NodeStats:
    return NodeStats(
        node=name, role=role, bpt_short_s=bpt, bpt_long_s=bpt, speed_samples_per_s=0.0, samples_total=0,
        cpu_percent=100.0, rss_bytes=1, last_seen=1.0, state=state, pending_s=0.0, restarts=0,
        slowdown_short=bpt, slowdown_long=bpt, straggler=kind,
    )


def stats(busy: bool = False, extra: list[NodeStats] | None = None) -> JobStatistics:
    nodes = [node("ps-0", role="ps"), node("worker-0"), node("worker-1"), node("worker-2"),
             node("worker-3", state=Liveness.DEAD)] + (extra or [])
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


def core_of(setup: JobSetup = SETUP, cfg: ControllerConfig | None = None) -> ControllerCore:
    """A core with AntDT's guards; the never-worse guard only where a test asks for it (``GUARDED``): the
    shape tests' statistics (every BPT 1.0) would make it refuse every rebalance as noise-chasing."""
    return ControllerCore(JOB, setup, cfg or ControllerConfig(guard=False), policy="test")


GUARDED = ControllerConfig()


def review(core: ControllerCore, d: PolicyDecision, now: float = T0, busy: bool = False) -> Any:
    return core.review(core.request(stats(busy), now), d, now)


def execute(core: ControllerCore, *actions: PolicyAction, now: float = T0) -> None:
    """Record ``actions`` as carried out (a round whose plan is exactly them)."""
    req = core.request(stats(), now)
    rnd = Round(req, core.policy, tuple(actions), (), False, "", 0.0, False, True)
    core.applied(rnd, [""] * len(actions), now)


# ---------------------------------------------------------------- request


def test_request_carries_the_setup_of_the_live_workers_only() -> None:
    setup = JobSetup(global_batch=300, batch_sizes={"worker-0": 150, "worker-3": 50}, accumulations={"worker-0": 2},
                     device_groups={"worker-1": "v100", "worker-3": "p100"}, params={"lambda": 2.0})
    req = core_of(setup).request(stats(), T0)
    assert isinstance(req, PolicyRequest)
    assert req.batch_sizes == {"worker-0": 150, "worker-1": 100, "worker-2": 100}  # even split B/n for new ones
    assert req.accumulations == {"worker-0": 2, "worker-1": 1, "worker-2": 1}
    assert req.device_groups == {"worker-1": "v100"}
    assert req.params == {"lambda": 2.0} and req.restart_blocked == [] and req.mode == "bsp"


def test_request_of_another_job_is_an_error() -> None:
    with pytest.raises(ValueError):
        ControllerCore("other", SETUP).request(stats(), T0)


# ---------------------------------------------------------------- KILL_RESTART guards


def test_cooldown_blocks_a_second_restart_of_the_same_node_until_it_expires() -> None:
    core = core_of(cfg=ControllerConfig(cooldown_s=600, max_restarts_per_window=5))
    r = review(core, decision(restart("worker-1")))
    assert r.execute == [restart("worker-1")] and r.refused == []
    execute(core, r.execute[0])

    assert "worker-1" in core.request(stats(), T0 + 100).restart_blocked
    r = review(core, decision(restart("worker-1")), now=T0 + 100)
    assert r.execute == [] and "cool-down" in r.refused[0].reason
    # Another node is not in cool-down.
    assert review(core, decision(restart("worker-2")), now=T0 + 100).execute == [restart("worker-2")]

    later = T0 + 601
    assert core.request(stats(), later).restart_blocked == []
    assert review(core, decision(restart("worker-1")), now=later).execute == [restart("worker-1")]


def test_at_most_max_restarts_per_window() -> None:
    core = core_of(cfg=ControllerConfig(cooldown_s=600, max_restarts_per_window=1))
    r = review(core, decision(restart("worker-1"), restart("ps-0")))
    assert r.execute == [restart("worker-1")]
    assert "at most 1" in r.refused[0].reason
    execute(core, r.execute[0])
    # The job's budget is spent: every node is blocked for the policy, and the review agrees.
    assert set(core.request(stats(), T0 + 10).restart_blocked) >= {"ps-0", "worker-0", "worker-2"}
    assert review(core, decision(restart("ps-0")), now=T0 + 10).execute == []


def test_busy_cluster_refuses_restarts() -> None:
    r = review(core_of(), decision(restart("worker-1")), busy=True)
    assert r.execute == [] and "busy" in r.refused[0].reason and not r.fallback
    permissive = core_of(cfg=ControllerConfig(refuse_restart_when_busy=False))
    assert review(permissive, decision(restart("worker-1")), busy=True).execute == [restart("worker-1")]


@pytest.mark.parametrize(("target", "why"), [("worker-3", "dead"), ("worker-77", "unknown")])
def test_restart_of_dead_or_unknown_nodes_is_refused(target: str, why: str) -> None:
    r = review(core_of(), decision(restart(target)))
    assert r.execute == [] and why in r.refused[0].reason


def test_applied_ignores_other_actions() -> None:
    core = core_of()
    execute(core, adjust({"worker-0": 100, "worker-1": 100, "worker-2": 100}))
    assert core.request(stats(), T0).restart_blocked == []


# ---------------------------------------------------------------- malformed decisions


def test_decision_for_another_job_falls_back() -> None:
    r = review(core_of(), decision(restart("worker-1"), job="other"))
    assert r.fallback and r.execute == [] and len(r.refused) == 1
    assert "malformed" in r.refused[0].reason and "other" in r.reason


def test_unknown_action_kind_falls_back_for_the_whole_decision() -> None:
    bogus = PolicyAction(kind="SPEED_UP", node="worker-1")  # type: ignore[arg-type]
    r = review(core_of(), decision(restart("worker-1"), bogus))
    assert r.fallback and r.execute == [] and len(r.refused) == 2
    assert all("SPEED_UP" in x.reason for x in r.refused)


def test_not_a_decision_falls_back() -> None:
    r = review(core_of(), {"job": JOB, "actions": []})  # type: ignore[arg-type]
    assert r.fallback and r.execute == [] and r.refused and r.refused[0].reason


def test_none_actions_are_dropped_silently() -> None:
    r = review(core_of(), decision(PolicyAction(kind=ActionKind.NONE)))
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
        (adjust({"worker-0": 300, "worker-1": -1, "worker-2": 1}), "not an integer >= 0"),
        (adjust(GOOD, {"worker-0": 2}), "sum of B_i * C_i 450 != global batch 300"),
        (adjust(GOOD, {"worker-0": 0}), "accumulation 0"),
        (adjust(GOOD, {"worker-3": 1}), "not live"),
        (PolicyAction(kind=ActionKind.ADJUST_BS, payload={"batch_sizes": [1, 2]}), "must be maps"),
    ],
)
def test_adjust_bs_is_refused_unless_it_names_the_live_workers_and_sums_to_B(action: PolicyAction, why: str) -> None:
    r = review(core_of(), decision(action))
    assert r.execute == [] and not r.fallback
    assert why in r.refused[0].reason


def test_adjust_bs_accepted_and_applied_to_the_setup() -> None:
    core = core_of()
    good = adjust({"worker-0": 100, "worker-1": 50, "worker-2": 50}, {"worker-0": 2})
    r = review(core, decision(good))
    assert r.execute == [good]
    assert core.setup == SETUP  # reviewed is not executed
    execute(core, good)
    assert core.setup == SETUP.apply(good)
    req = core.request(stats(), T0)
    assert req.batch_sizes == {"worker-0": 100, "worker-1": 50, "worker-2": 50}
    assert req.accumulations == {"worker-0": 2, "worker-1": 1, "worker-2": 1}


@pytest.mark.parametrize(("asked", "setup", "want"), [
    # a cap: what is over it goes to the others, in the proportions asked
    (GOOD, JobSetup(global_batch=300, max_batch=120), {"worker-0": 120, "worker-1": 120, "worker-2": 60}),
    # a device's own cap (a device group's), below the job's
    ({"worker-0": 100, "worker-1": 100, "worker-2": 100}, JobSetup(global_batch=300, caps={"worker-1": 60}),
     {"worker-0": 120, "worker-1": 60, "worker-2": 120}),
    # the floor: a worker cut to nothing keeps the floor, paid for by the others
    ({"worker-0": 300, "worker-1": 0, "worker-2": 0}, JobSetup(global_batch=300, min_batch=12),
     {"worker-0": 276, "worker-1": 12, "worker-2": 12}),
    # the global batch: a sum that misses it is split again as asked
    ({"worker-0": 150, "worker-1": 100, "worker-2": 51}, SETUP, {"worker-0": 150, "worker-1": 100, "worker-2": 50}),
])
def test_adjust_bs_is_clamped_to_the_limits_whichever_policy_asked(
        asked: dict[str, int], setup: JobSetup, want: dict[str, int]) -> None:
    core = core_of(setup)
    r = review(core, decision(adjust(asked)))
    assert not r.refused and len(r.execute) == 1
    got = r.execute[0].payload["batch_sizes"]
    assert got == want
    assert not setup.limits().violations(got, {})
    assert "clamped to the batch limits" in r.execute[0].reason and r.clamped
    rnd = core.round(core.request(stats(), T0), decision(adjust(asked)), T0)
    assert "clamped to the batch limits" in rnd.reason  # the decision event says so


def test_adjust_bs_that_no_clamp_brings_within_the_limits_is_refused() -> None:
    r = review(core_of(JobSetup(global_batch=300, max_batch=90)), decision(adjust(GOOD)))
    assert r.execute == [] and "caps sum to 270" in r.refused[0].reason
    r = review(core_of(JobSetup(global_batch=300, min_batch=120)), decision(adjust(GOOD)))
    assert r.execute == [] and "floor 120" in r.refused[0].reason


def test_adjust_bs_respects_max_batch_and_one_per_decision() -> None:
    setup = JobSetup(global_batch=300, max_batch=120)
    ok = adjust({"worker-0": 100, "worker-1": 100, "worker-2": 100})
    r = review(core_of(setup), decision(ok, ok))
    assert r.execute == [ok] and "only one" in r.refused[0].reason


@pytest.mark.parametrize(("b", "ok"), [(0, True), (2, True), (3, False), (-1, False), ("1", False), (True, False)])
def test_backup_workers_must_keep_one_live_gradient(b: Any, ok: bool) -> None:
    a = PolicyAction(kind=ActionKind.BACKUP_WORKERS, payload={"backup": b})
    r = review(core_of(cfg=ControllerConfig(guard=False)), decision(a))  # the shape only (the guard: below)
    assert (r.execute == [a]) is ok
    if not ok:
        assert "backup" in r.refused[0].reason


def test_backup_workers_refused_in_asp_and_applied_to_the_setup() -> None:
    a = PolicyAction(kind=ActionKind.BACKUP_WORKERS, payload={"backup": 1})
    r = review(core_of(JobSetup(global_batch=300, mode="asp")), decision(a))
    assert r.execute == [] and "BSP" in r.refused[0].reason
    assert SETUP.apply(a).backup_workers == 1
    core = core_of()
    execute(core, a)
    assert core.request(stats(), T0).backup_workers == 1


@pytest.mark.parametrize(("scale", "ok"), [(0.5, True), (2, True), (0, False), (float("nan"), False), (None, False)])
def test_adjust_lr_needs_a_positive_scale(scale: Any, ok: bool) -> None:
    a = PolicyAction(kind=ActionKind.ADJUST_LR, payload={"scale": scale})
    assert (review(core_of(), decision(a)).execute == [a]) is ok


# ---------------------------------------------------------------- policy and core agree


def test_antdt_nd_decisions_pass_review() -> None:
    core = core_of()
    s = stats(extra=[node("worker-4", bpt=3.0, kind=StragglerKind.PERSISTENT),
                     node("worker-5", bpt=2.0, kind=StragglerKind.TRANSIENT)])
    req = core.request(s, T0)
    d = antdt_nd.decide(req)
    r = core.review(req, d, T0)
    assert r.refused == [] and {a.kind for a in r.execute} == {ActionKind.KILL_RESTART, ActionKind.ADJUST_BS}
    rnd = core.round(req, d, T0)
    assert list(rnd.execute) == r.execute and not rnd.fallback
    core.applied(rnd, [""] * len(rnd.execute), T0)
    # Next round, worker-4 is in cool-down: AntDT-ND does not even propose it.
    req2 = core.request(s, T0 + 60)
    assert "worker-4" in req2.restart_blocked
    assert ActionKind.KILL_RESTART not in {a.kind for a in antdt_nd.decide(req2).actions}


# ---------------------------------------------------------------- the round (shared by the service and the simulator)


def all_running() -> JobStatistics:
    nodes = [node("ps-0", role="ps"), node("worker-0"), node("worker-1"), node("worker-2")]
    return JobStatistics(job=JOB, ts=T0, window_short_s=300.0, window_long_s=600.0,
                         throughput_samples_per_s=0.0, nodes=nodes)


def test_an_unusable_answer_falls_back_to_none_and_says_why() -> None:
    core = core_of()
    req = core.request(stats(), T0)
    rnd = core.round(req, "timeout: nobody answered", T0)
    assert rnd.fallback and rnd.execute == () and rnd.refused == ()
    assert rnd.reason == "policy test unusable, none used: timeout: nobody answered"
    out = core.applied(rnd, [], T0, round_ms=3.0)
    assert out.fallback and out.policy == "test" and out.executed == [] and out.round_ms == 3.0 and out.ts == T0
    # A malformed decision: every action refused, none executed.
    rnd = core.round(req, decision(restart("worker-1"), job="other"), T0)
    assert rnd.fallback and rnd.execute == () and [r.kind for r in rnd.refused] == ["KILL_RESTART"]
    assert "malformed" in rnd.reason


def test_round_carries_the_policy_reason_and_time_and_records_refusals() -> None:
    core = core_of(cfg=ControllerConfig(max_restarts_per_window=1))
    d = PolicyDecision(JOB, "test", [restart("worker-1"), restart("worker-2")], reason="two slow", decision_ms=1.5)
    rnd = core.round(core.request(stats(), T0), d, T0)
    assert rnd.execute == (restart("worker-1"),) and rnd.reason == "two slow" and rnd.decision_ms == 1.5
    assert [(r.kind, r.node) for r in rnd.refused] == [("KILL_RESTART", "worker-2")]
    out = core.applied(rnd, [""], T0)
    assert out.executed == [restart("worker-1")] and out.refused == list(rnd.refused) and not out.failed
    assert out.reason == "two slow" and out.decision_ms == 1.5


def test_a_failed_action_is_reported_and_not_recorded() -> None:
    core = core_of(cfg=ControllerConfig(max_restarts_per_window=5, guard=False))
    good = adjust({"worker-0": 100, "worker-1": 50, "worker-2": 150})
    rnd = core.round(core.request(stats(), T0), decision(restart("worker-1"), good), T0)
    out = core.applied(rnd, ["executor: timeout", "not applied: busy"], T0)
    assert out.executed == [] and [(f.kind, f.node, f.reason) for f in out.failed] == [
        ("KILL_RESTART", "worker-1", "executor: timeout"), ("ADJUST_BS", "", "not applied: busy")]
    assert core.setup == SETUP and core.request(stats(), T0 + 1).restart_blocked == []
    with pytest.raises(ValueError):
        core.applied(rnd, [""], T0)


def test_batch_sizes_are_sent_again_to_a_worker_relaunched_since_adjust_bs_bsp() -> None:
    core = core_of(cfg=ControllerConfig(cooldown_s=60, max_restarts_per_window=5, guard=False))
    sizes = {"worker-0": 150, "worker-1": 50, "worker-2": 100}
    rnd = core.round(core.request(all_running(), T0), decision(adjust(sizes)), T0)
    core.applied(rnd, [""], T0)
    assert not core.resync
    rnd = core.round(core.request(all_running(), T0 + 10), decision(restart("worker-1")), T0 + 10)
    assert not rnd.resync and rnd.execute == (restart("worker-1"),)
    core.applied(rnd, [""], T0 + 10)
    assert core.resync  # worker-1 comes back with B / n
    # While worker-1 is not running, nothing is re-sent (it would not reach it).
    down = stats()  # worker-3 is dead
    rnd = core.round(core.request(down, T0 + 20), decision(), T0 + 20)
    assert rnd.execute == () and not rnd.resync
    core.applied(rnd, [], T0 + 20)
    # Every worker runs: the current sizes go first, whatever the policy says; a failure keeps the flag.
    lr = PolicyAction(ActionKind.ADJUST_LR, payload={"scale": 0.5})
    rnd = core.round(core.request(all_running(), T0 + 30), decision(lr), T0 + 30)
    assert rnd.resync and rnd.execute[0].kind is ActionKind.ADJUST_BS and rnd.execute[1] == lr
    assert rnd.execute[0].payload == {"batch_sizes": sizes, "accumulations": dict.fromkeys(sizes, 1)}
    core.applied(rnd, ["not applied: timeout", ""], T0 + 30)
    assert core.resync
    # Also on a fallback round; once executed, no more re-sends.
    rnd = core.round(core.request(all_running(), T0 + 40), "no reply", T0 + 40)
    assert rnd.fallback and rnd.resync and len(rnd.execute) == 1
    core.applied(rnd, [""], T0 + 40)
    assert not core.resync
    assert core.round(core.request(all_running(), T0 + 50), decision(), T0 + 50).execute == ()


def test_the_policy_adjust_bs_replaces_the_resend_and_asp_never_resends() -> None:
    core = core_of(cfg=ControllerConfig(max_restarts_per_window=5, guard=False))
    core.setup = SETUP.apply(adjust({"worker-0": 150, "worker-1": 50, "worker-2": 100}))
    core.resync = True
    new = adjust({"worker-0": 100, "worker-1": 100, "worker-2": 100})
    rnd = core.round(core.request(all_running(), T0), decision(new), T0)
    assert rnd.execute == (new,) and not rnd.resync
    core.applied(rnd, [""], T0)
    assert not core.resync and core.setup.batch_sizes == new.payload["batch_sizes"]
    asp = core_of(JobSetup(global_batch=300, mode="asp", batch_sizes={"worker-0": 100}))
    rnd = asp.round(asp.request(all_running(), T0), decision(restart("worker-1")), T0)
    asp.applied(rnd, [""], T0)
    assert not asp.resync


def test_setup_of_a_job_record_splits_the_spec_batch_over_the_plan() -> None:
    from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
    from pacer.jobs.spec import parse_job_spec

    spec = parse_job_spec("name: j\nmodel: wide_deep\ndataset:\n  path: /d.rec\nbatch_size: 512\nmode: bsp\n"
                          "backup_workers: 1\n")
    rec = JobRecord("j", spec, JobState.RUNNING, 0.0, plan=ResourcePlan("j", 3, 1, 1.0, 2048, 1.0, 2048,
                                                                           PlanSource.DEFAULT))
    setup = JobSetup.of_record(rec)
    assert (setup.global_batch, setup.mode, setup.backup_workers, setup.min_batch) == (510, "bsp", 1, 21)


def test_a_round_is_due_once_per_fresh_short_window_and_at_least_every_interval() -> None:
    from pacer.contracts.monitor import JobStatistics
    from pacer_services.controller.core import round_due

    def stats(short: float) -> JobStatistics:
        return JobStatistics(job="j", ts=0.0, window_short_s=short, window_long_s=600.0,
                             throughput_samples_per_s=0.0, nodes=[], cluster_busy=False)

    # AntDT's fixed windows: the 300 s cadence.
    assert not round_due(0.0, 299.0, 300.0, stats(300.0)) and round_due(0.0, 300.0, 300.0, stats(300.0))
    # An adapted 40 s window: a round per window, not before.
    assert not round_due(100.0, 139.0, 300.0, stats(40.0)) and round_due(100.0, 140.0, 300.0, stats(40.0))
    # A window longer than the interval never delays a round past the interval; no window: the interval.
    assert round_due(0.0, 60.0, 60.0, stats(300.0)) and round_due(0.0, 60.0, 60.0, stats(0.0))
    assert not round_due(0.0, 59.0, 60.0, stats(0.0))


# ---------------------------------------------------------------- never worse than doing nothing


def workers_at(*bpts: float, throughput: float = 0.0, left: int = 0) -> JobStatistics:
    from pacer.contracts.monitor import ShardSummary

    nodes = [node("ps-0", role="ps", bpt=0.1)] + [node(f"worker-{i}", bpt=b) for i, b in enumerate(bpts)]
    shards = ShardSummary(todo=1, doing=1, done=0, failed=0, records_done=0, records_total=left) if left else None
    return JobStatistics(job=JOB, ts=T0, window_short_s=300.0, window_long_s=600.0,
                         throughput_samples_per_s=throughput, nodes=nodes, shards=shards)


@pytest.mark.parametrize(("bpts", "ok"), [
    ((1.0, 1.0, 1.0, 3.0), True),   # one worker 3x slower: leaving it behind trains 3/4 in a third of the time
    ((1.0, 1.0, 2.9, 3.0), False),  # two slow ones: the step still waits for the other, and a quarter is discarded
    ((1.0, 1.0, 1.0, 1.2), False),  # a mild one: 20 % shorter steps do not pay for a quarter discarded
])
def test_backup_workers_are_refused_when_the_measured_bpts_say_they_cost_more(
        bpts: tuple[float, ...], ok: bool) -> None:
    core = core_of(cfg=GUARDED)
    a = PolicyAction(kind=ActionKind.BACKUP_WORKERS, payload={"backup": 1})
    r = core.review(core.request(workers_at(*bpts), T0), decision(a), T0)
    assert (r.execute == [a]) is ok, r.refused
    if not ok:
        assert "slower" in r.refused[0].reason


def test_a_restart_that_costs_more_than_it_can_gain_is_refused() -> None:
    """A PS a third slower, a relaunch of (default) 60 s pending + 120 s start-up: worth it with hours left,
    not with two minutes."""
    core = core_of(cfg=ControllerConfig(max_restarts_per_window=5))  # the guard on
    ps_slow = [node("ps-0", role="ps", bpt=0.4), node("ps-1", role="ps", bpt=0.1)]

    def st(left_s: float) -> JobStatistics:
        base = workers_at(1.0, 1.0, throughput=100.0, left=int(left_s * 100))
        return JobStatistics(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                                "nodes": ps_slow + base.nodes[1:]})

    long = core.review(core.request(st(36_000), T0), decision(restart("ps-0")), T0)
    assert [a.node for a in long.execute] == ["ps-0"], long.refused
    short = core.review(core.request(st(120), T0), decision(restart("ps-0")), T0)
    assert short.execute == [] and "would cost" in short.refused[0].reason


def test_a_restart_is_priced_on_the_other_pods_start_up_not_the_slow_nodes_own() -> None:
    """ps-1 was throttled from its start: its own start-up took 900 s on the sick machine, and the workers'
    (to their first step, which waits for every PS) 130 s.  The relaunch goes elsewhere; the other PS
    started in 20 s, and that is what it costs: with 400 s left it pays (it would not at 190 s)."""
    core = core_of(cfg=ControllerConfig(max_restarts_per_window=5))
    base = workers_at(1.0, 1.0, throughput=100.0, left=100 * 400)
    ps = [replace(node("ps-0", role="ps", bpt=0.1), init_s=20.0),
          replace(node("ps-1", role="ps", bpt=0.4), init_s=900.0)]
    st = replace(base, nodes=ps + [replace(n, init_s=130.0) for n in base.nodes[1:]])
    rnd = core.review(core.request(st, T0), decision(restart("ps-1")), T0)
    assert [a.node for a in rnd.execute] == ["ps-1"], rnd.refused


def test_a_bsp_worker_20x_slower_is_worth_a_restart_even_with_a_short_job_left() -> None:
    """39 s left, a relaunch of 20 s: the others step without the straggler while it is away, so killing it
    saves most of the 39 s at once (the real-TF end-to-end job of test_stragglers_e2e, as it was priced)."""
    core = core_of(cfg=ControllerConfig(max_restarts_per_window=5))
    base = workers_at(1.0, 20.0, throughput=100.0, left=3900)
    st = replace(base, nodes=[replace(n, pending_s=2.0, init_s=18.0) for n in base.nodes])
    rnd = core.review(core.request(st, T0), decision(restart("worker-1")), T0)
    assert [a.node for a in rnd.execute] == ["worker-1"], rnd.refused
    # ... and not with 5 s left: the relaunch outlasts the job.
    late = replace(st, shards=replace(st.shards, records_total=500))
    assert core_of(cfg=ControllerConfig(max_restarts_per_window=5)).review(
        core.request(late, T0), decision(restart("worker-1")), T0).execute == []


def test_an_action_after_which_the_job_ran_slower_is_undone_and_held_back() -> None:
    """BSP: the job's rate is the global batch over the slowest worker's BPT (300 / 3.0 = 100 samples/s)."""
    core = core_of(cfg=GUARDED)
    for i in range(4):  # quiet rounds: the rate's noise is about 1 %
        core.request(workers_at(1.0, 1.0, 3.0 + 0.03 * (i % 2)), T0 + i * 300)
    t = T0 + 1200
    req = core.request(workers_at(1.0, 1.0, 3.0), t)
    bs = adjust({"worker-0": 130, "worker-1": 130, "worker-2": 40})
    rnd = core.round(req, decision(bs), t)
    core.applied(rnd, [""] * len(rnd.execute), t)
    assert core.trial is not None and core.trial.before == pytest.approx(100.0)
    # Too early (not a whole short window after it): nothing judged.
    core.request(workers_at(1.0, 1.0, 6.0), t + 100)
    assert core.trial is not None and not core.pending_undo
    # A window later, 20 % slower (its step 3.75 s): undone (the setup before it, sent again) and held back one
    # long window.
    req2 = core.request(workers_at(1.0, 1.0, 3.75), t + 300)
    assert req2.held == {"ADJUST_BS": 600.0}
    again = adjust({"worker-0": 140, "worker-1": 140, "worker-2": 20})
    rnd2 = core.round(req2, decision(again), t + 300)
    assert rnd2.undo == 1 and rnd2.execute[0].payload["batch_sizes"] == {"worker-0": 100, "worker-1": 100,
                                                                          "worker-2": 100}
    assert [a for a in rnd2.execute if a.payload.get("batch_sizes") == again.payload["batch_sizes"]] == []
    assert any("held back" in r.reason for r in rnd2.refused) and "undo ADJUST_BS" in rnd2.reason
    out = core.applied(rnd2, [""] * len(rnd2.execute), t + 300)
    assert out.executed[0].kind is ActionKind.ADJUST_BS and core.trial is None  # an undo is not on trial
    # A second undo of the kind in a row is held back twice as long.
    later = t + 1000
    rnd3 = core.round(core.request(workers_at(1.0, 1.0, 3.0), later), decision(bs), later)
    core.applied(rnd3, [""] * len(rnd3.execute), later)
    assert core.request(workers_at(1.0, 1.0, 4.3), later + 300).held == {"ADJUST_BS": 1200.0}


def test_the_rate_of_a_bsp_job_is_its_slowest_step_and_its_kept_share() -> None:
    """The monitor's throughput sums each worker's own B_i / BPT_i and misses the barrier wait."""
    core = core_of(cfg=GUARDED)
    st = workers_at(1.0, 1.0, 3.0, throughput=999.0)
    assert core.rate(st) == pytest.approx(300 / 3.0)
    assert core.rate(st, backup=1) == pytest.approx(300 * (2 / 3) / 1.0)  # the slowest left behind
    asp = core_of(JobSetup(global_batch=300, mode="asp"), cfg=GUARDED)
    assert asp.rate(st) == 999.0


def test_within_the_noise_or_across_a_changed_scene_nothing_is_undone() -> None:
    core = core_of(cfg=GUARDED)
    req = core.request(workers_at(1.0, 1.0, 3.0), T0)
    rnd = core.round(req, decision(adjust({"worker-0": 130, "worker-1": 130, "worker-2": 40})), T0)
    core.applied(rnd, [""] * len(rnd.execute), T0)
    core.request(workers_at(1.0, 1.0, 3.06), T0 + 300)  # 2 %: within the 3 % tolerance
    assert not core.pending_undo and not core.held
    rnd = core.round(core.request(workers_at(1.0, 1.0, 3.0), T0 + 600),
                     decision(adjust({"worker-0": 120, "worker-1": 120, "worker-2": 60})), T0 + 600)
    core.applied(rnd, [""] * len(rnd.execute), T0 + 600)
    # A worker left meanwhile: whatever the rate did, the action is not what changed it.
    core.request(workers_at(1.0, 6.0), T0 + 900)
    assert not core.pending_undo and not core.held


def test_an_adjust_bs_that_only_chases_the_noise_is_refused() -> None:
    """Equal BPTs: no split shortens the step (the plainest model); a worker 3x slower: cutting it does."""
    core = core_of(cfg=GUARDED)
    bs = adjust({"worker-0": 130, "worker-1": 130, "worker-2": 40})
    flat = core.review(core.request(workers_at(1.0, 1.02, 0.98), T0), decision(bs), T0)
    assert flat.execute == [] and "no nearer the even split" in flat.refused[0].reason
    tiny = adjust({"worker-0": 101, "worker-1": 100, "worker-2": 99})
    noise = core.review(core.request(workers_at(1.0, 1.0, 1.01), T0), decision(tiny), T0)
    assert noise.execute == [] and "within the noise" in noise.refused[0].reason
    slow = core.review(core.request(workers_at(1.0, 1.0, 3.0), T0), decision(bs), T0)
    assert len(slow.execute) == 1, slow.refused


def test_a_return_to_the_even_split_is_not_refused_on_stale_bpts() -> None:
    """worker-2 was cut to 40 while slow and is back to speed, but the window still holds its slow steps:
    restoring its batch looks slower on those BPTs.  It is the undo guard's to judge, not a refusal."""
    core = core_of(replace(SETUP, batch_sizes={"worker-0": 130, "worker-1": 130, "worker-2": 40}), cfg=GUARDED)
    even = adjust({"worker-0": 100, "worker-1": 100, "worker-2": 100})
    back = core.review(core.request(workers_at(1.3, 1.3, 1.2), T0), decision(even), T0)
    assert len(back.execute) == 1, back.refused
    further = adjust({"worker-0": 140, "worker-1": 140, "worker-2": 20})
    away = core.review(core.request(workers_at(1.3, 1.3, 1.2), T0), decision(further), T0)
    assert away.execute == [] and "no nearer the even split" in away.refused[0].reason
