"""Cluster simulator: determinism, analytic JCTs, straggler effects, KILL_RESTART, shard accounting, scenario errors.

Small clusters and short jobs; the policies here are test policies written
against the real contracts (the built-in ones live in the controller).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import StragglerKind
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest
from pacer_services.controller.core import ControllerConfig
from pacer_services.shard_service.core import ShardState
from pacer_services.simulator.autoscale.scenario import is_autoscale
from pacer_services.simulator.cli import main
from pacer_services.simulator.stragglers import (
    ScenarioError,
    Simulation,
    load,
    none_policy,
    parse,
    run,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sim"

# 4 workers x local batch 100 (B = 400), shards of 10 batches = 1,000 records,
# 200 shards: 500 BSP steps of 0.1 (compute) + 0.1 (PS) + 0.1 (comm) = 0.3 s.
BASE: dict[str, Any] = {
    "name": "unit",
    "seed": 1,
    "cluster": {"workers": 4, "ps": 2, "worker_speed": 1000, "ps_time_s": 0.1, "comm_s": 0.1,
                "pending_s": 5, "init_s": 10},
    "job": {"mode": "bsp", "global_batch": 400, "records": 200_000, "batches_per_shard": 10},
    "monitor": {"interval_s": 30, "window_short_s": 30, "window_long_s": 60},
}
IDEAL = 500 * 0.3
SLOW = {"node": "worker-1", "pattern": "persistent", "sleep_s": 2.5, "intensity": 0.8}  # +2 s per step


def scenario(**over: Any) -> Any:
    raw = json.loads(json.dumps(BASE))
    for key, val in over.items():
        if isinstance(val, dict) and isinstance(raw.get(key), dict):
            raw[key].update(val)
        else:
            raw[key] = val
    return parse(raw)


# The controller's round without its guards (no cool-down, no restart budget): a test policy's
# actions are carried out as it asks, through the same core as live.
UNGUARDED = ControllerConfig(cooldown_s=0.0, max_restarts_per_window=1_000_000, guard=False)


def restart_stragglers(req: PolicyRequest) -> PolicyDecision:
    """KILL_RESTART every node the monitor calls a persistent straggler (not in cool-down)."""
    acts = [
        PolicyAction(ActionKind.KILL_RESTART, node=n.node, reason="persistent")
        for n in req.stats.nodes
        if n.straggler is StragglerKind.PERSISTENT and n.node not in req.restart_blocked
    ]
    return PolicyDecision(job=req.job, policy="test-restart", actions=acts)


# ------------------------------------------------------------------ analytic baselines


@pytest.mark.parametrize("mode", ["bsp", "asp"])
def test_no_straggler_jct_matches_analytic(mode: str) -> None:
    res = run(scenario(job={"mode": mode}))
    assert res.jct_s == pytest.approx(IDEAL, rel=1e-6)
    assert res.ideal_jct_s == pytest.approx(IDEAL, rel=1e-6)
    # 200 shards, the last ones cut into pieces near the end (DatasetSpec.tail_split).
    assert res.shards_done == res.shards_total >= 200
    assert res.records_done == 200_000
    assert res.records_duplicated == res.restarts == 0


def test_analytic_jct_with_epochs_and_overheads() -> None:
    # 2 epochs, comm 0.3 s: 1,000 steps of 0.1 + 0.1 + 0.3.
    res = run(scenario(job={"epochs": 2}, cluster={"comm_s": 0.3}), ideal=False)
    assert res.jct_s == pytest.approx(1000 * 0.5, rel=1e-6)
    assert res.steps == 1000
    assert res.records_done == 400_000


# ------------------------------------------------------------------ determinism


def transient(seed: int) -> Any:
    pats = [{"node": f"worker-{i}", "pattern": "transient", "sleep_s": 1.0, "intensity": 1.0,
             "period_s": 20, "on_s": 10, "probability": 0.5} for i in range(4)]
    return scenario(seed=seed, stragglers=pats)


def test_same_seed_same_result() -> None:
    a, b = run(transient(5)).to_dict(), run(transient(5)).to_dict()
    assert a == b


def test_different_seeds_differ_with_transient_stragglers() -> None:
    jcts = {run(transient(s), ideal=False).jct_s for s in range(4)}
    assert len(jcts) > 1


def test_cli_prints_json_last_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({**BASE, "stragglers": [SLOW]}))  # JSON is YAML
    assert main([str(path), "--seed", "9"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert len(lines) > 1
    for key in ("method", "jct_s", "ideal_jct_s", "actions", "shards_done", "records_duplicated",
                "steps", "restarts", "seed", "scenario"):
        assert key in out
    assert out["seed"] == 9 and out["method"] == "none" and out["jct_s"] > out["ideal_jct_s"]


# ------------------------------------------------------------------ stragglers


def test_persistent_worker_straggler_hurts_bsp_more_than_asp() -> None:
    bsp = run(scenario(stragglers=[SLOW]))
    asp = run(scenario(job={"mode": "asp"}, stragglers=[SLOW]))
    # BSP: every step waits for worker-1 (2.3 s instead of 0.3 s).
    assert bsp.jct_s == pytest.approx(500 * 2.3, rel=1e-6)
    # ASP + DDS: the fast workers take more shards; the straggler only holds back its own.
    assert asp.jct_s < 2 * IDEAL
    assert asp.jct_s / asp.ideal_jct_s < bsp.jct_s / bsp.ideal_jct_s  # type: ignore[operator]
    assert asp.shards_done == asp.shards_total


def test_persistent_ps_straggler_slows_every_step() -> None:
    res = run(scenario(stragglers=[{"node": "ps-1", "pattern": "persistent", "sleep_s": 1.0, "intensity": 0.5}]))
    assert res.jct_s == pytest.approx(500 * 0.8, rel=1e-6)


def test_kill_restart_brings_jct_closer_to_ideal() -> None:
    sc = scenario(stragglers=[SLOW])
    none = run(sc, policy=none_policy, ideal=False)
    sim = Simulation(sc, restart_stragglers, "test-restart", UNGUARDED)
    res = sim.run()
    assert res.actions == {"KILL_RESTART": 1}
    assert res.restarts == 1
    assert IDEAL < res.jct_s < none.jct_s / 3
    # The killed worker's shard went back to TODO and was granted again: the
    # core counts the re-granted rest; the work since its last progress report is redone.
    ds = sim.shards.datasets["train"]
    regranted = [s for s in ds.shards.values() if s.grants > 1]
    assert len(regranted) == 1
    assert 0 < res.records_duplicated <= 1000
    assert res.records_duplicated == ds.records_duplicated
    assert 0 <= res.records_recomputed <= res.records_duplicated
    # The executor core counted it as a requested restart, not a failure.
    assert sim.nodes["worker-1"].requested_restarts == 1 and sim.nodes["worker-1"].restarts == 0


def test_restart_does_not_cure_a_straggler_that_follows_the_node() -> None:
    sc = scenario(stragglers=[{**SLOW, "follows_restart": True}])
    res = run(sc, policy=restart_stragglers, ideal=False, controller=UNGUARDED)
    cured = run(scenario(stragglers=[SLOW]), policy=restart_stragglers, ideal=False, controller=UNGUARDED)
    assert res.restarts >= 2
    assert res.jct_s > cured.jct_s


def test_ps_kill_restart_pauses_then_recovers() -> None:
    slow_ps = [{"node": "ps-0", "pattern": "persistent", "sleep_s": 2.0, "intensity": 1.0}]
    sc = scenario(cluster={"ps_migration": "restart"}, stragglers=slow_ps)
    none = run(sc, policy=none_policy)
    res = run(sc, policy=restart_stragglers, controller=UNGUARDED)
    assert res.actions == {"KILL_RESTART": 1}
    assert res.jct_s < none.jct_s / 2
    assert res.records_duplicated == 0  # a PS restart loses no data


def test_seamless_ps_migration_trades_slow_service_for_a_shorter_pause() -> None:
    """DLRover-RM §5.2: the replacement starts while the old PS serves; only init_s is a pause.

    That wins when the old PS is mildly slow (little is lost while it serves) and
    loses when it is very slow (stopping it at once costs less than its service).
    """
    def both(sleep_s: float) -> tuple[Any, Any]:
        slow_ps = [{"node": "ps-0", "pattern": "persistent", "sleep_s": sleep_s, "intensity": 1.0}]
        # a long queue (pending 30 s) and a quick PS start (10 s): restart pauses 40 s, seamless 10 s
        cluster = {"ps_migration": "", "ps_start_s": 10, "pending_s": 30}
        return tuple(run(scenario(cluster={**cluster, "ps_migration": mode}, stragglers=slow_ps),
                         policy=restart_stragglers, controller=UNGUARDED) for mode in ("restart", "seamless"))

    restart, seamless = both(0.2)  # a step of 0.5 s instead of 0.3
    assert seamless.restarts == restart.restarts == 1  # requests while the replacement starts change nothing
    assert seamless.jct_s < restart.jct_s
    assert seamless.records_duplicated == 0
    restart, seamless = both(9.7)  # 10 s instead of 0.3: 40 s of its service cost more than the pause
    assert restart.jct_s < seamless.jct_s


def test_backup_workers_drop_the_straggler_gradient_and_its_records_are_trained_again() -> None:
    res = run(scenario(job={"backup_workers": 1}, stragglers=[SLOW]))
    slow = run(scenario(stragglers=[SLOW]))
    assert res.jct_s < slow.jct_s / 2
    # The straggler's discarded gradients' records went back to the shard core and were trained again.
    assert res.records_reserved > 0 and res.records_dropped == 0
    assert res.records_done == 200_000


def test_adjust_bs_is_applied() -> None:
    def rebalance(req: PolicyRequest) -> PolicyDecision:
        sizes = {"worker-0": 160, "worker-1": 40, "worker-2": 100, "worker-3": 100}
        if req.batch_sizes == sizes:
            return PolicyDecision(job=req.job, policy="t", actions=[])
        return PolicyDecision(job=req.job, policy="t", actions=[
            PolicyAction(ActionKind.ADJUST_BS, payload={"batch_sizes": sizes})])

    # worker-1 computes at 1000 samples/s + 0.2 s: with B_1 = 40 its step matches worker-0's.
    slow = {"node": "worker-1", "pattern": "persistent", "sleep_s": 0.2, "intensity": 1.0}
    base = run(scenario(stragglers=[slow]), policy=none_policy, ideal=False)
    res = run(scenario(stragglers=[slow]), policy=rebalance, ideal=False, controller=UNGUARDED)
    assert res.actions == {"ADJUST_BS": 1}
    assert res.jct_s < base.jct_s


# ------------------------------------------------------------------ shard accounting


@pytest.mark.parametrize("mode", ["bsp", "asp"])
def test_every_shard_done_exactly_once(mode: str) -> None:
    sc = scenario(job={"mode": mode, "epochs": 2, "records": 123_457}, stragglers=[SLOW])
    sim = Simulation(sc, restart_stragglers, "test-restart", UNGUARDED)
    res = sim.run()
    ds = sim.shards.datasets["train"]
    assert all(s.state is ShardState.DONE for s in ds.shards.values())
    assert ds.done_count == len(ds.shards) == res.shards_done
    assert ds.records_done == 2 * 123_457 == res.records_done
    assert not ds.todo and not ds.doing and not ds.failed


# ------------------------------------------------------------------ scenario errors


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"cluster": {"wrkers": 3}}, "cluster.wrkers"),
        ({"cluster": {"workers": 0}}, "cluster.workers"),
        ({"cluster": {"worker_speed": "fast"}}, "cluster.worker_speed"),
        ({"job": {"mode": "ssp"}}, "job.mode"),
        ({"job": {"global_batch": 2}}, "job.global_batch"),
        ({"stragglers": [{"node": "worker-9"}]}, "stragglers[0].node"),
        ({"stragglers": [{"node": "worker-1", "intensity": 1.5}]}, "stragglers[0].intensity"),
        ({"stragglers": [{"node": "worker-1", "side": "ps"}]}, "stragglers[0].side"),
        ({"stragglers": [{"node": "ps-0", "pattern": "sometimes"}]}, "stragglers[0].pattern"),
        ({"stragglers": [{"node": "ps-0", "period_s": 10, "on_s": 20}]}, "stragglers[0].on_s"),
        ({"monitor": {"lambda": 0.5}}, "monitor.lambda"),
        ({"monitor": {"window_long_s": 10}}, "monitor.window_long_s"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_fields_are_named(over: dict[str, Any], field: str) -> None:
    with pytest.raises(ScenarioError) as e:
        scenario(**over)
    assert str(e.value).startswith(field + ":")


def test_missing_required_field_is_named() -> None:
    raw = json.loads(json.dumps(BASE))
    del raw["job"]["records"]
    with pytest.raises(ScenarioError, match=r"^job\.records: required"):
        parse(raw)


# ------------------------------------------------------------------ the shipped examples


# autoscale-*.yaml are the other kind of scenario (tests/unit/test_autoscale_sim.py parses them)
STRAGGLER_EXAMPLES = sorted(p for p in EXAMPLES.glob("*.yaml") if not is_autoscale(p))


def test_both_kinds_of_example_are_shipped() -> None:
    assert STRAGGLER_EXAMPLES and len(STRAGGLER_EXAMPLES) < len(list(EXAMPLES.glob("*.yaml")))


@pytest.mark.parametrize("path", STRAGGLER_EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path: Path) -> None:
    sc = load(path)
    assert sc.stragglers or sc.cluster.device_groups  # each example is about one or the other


@pytest.mark.parametrize("name", ["antdt-table3-worker", "antdt-table3-server", "transient-workers"])
def test_small_examples_run_without_policy(name: str) -> None:
    sc = load(EXAMPLES / f"{name}.yaml")
    res = run(replace(sc, method="none"))
    assert res.shards_done == res.shards_total
    assert res.jct_s > res.ideal_jct_s  # type: ignore[operator]


# ------------------------------------------------------------------ through the real controller and policies


def test_antdt_nd_through_the_controller() -> None:
    pytest.importorskip("pacer_services.controller.policies.registry")
    sc = scenario(stragglers=[SLOW], params={})
    none = run(sc, "none", ideal=False)
    nd = run(sc, "antdt-nd")
    assert nd.actions.get("KILL_RESTART", 0) >= 1
    assert nd.ideal_jct_s is not None and nd.ideal_jct_s < nd.jct_s < none.jct_s / 2
    assert nd.shards_done == nd.shards_total


def test_antdt_dd_beats_equal_batches_and_lb_bsp_on_heterogeneous_devices() -> None:
    """AntDT §VI-B: with a device memory cap, LB-BSP cannot give the fast devices more;
    AntDT-DD's batch + accumulation per group (Eq. 4) balances the step time."""
    sc = load(EXAMPLES / "heterogeneous-dd.yaml")
    jct = {m: run(sc, m, ideal=False).jct_s for m in ("none", "lb-bsp", "antdt-dd")}
    assert jct["antdt-dd"] < 0.8 * jct["none"]
    assert jct["antdt-dd"] < 0.8 * jct["lb-bsp"]
    assert jct["lb-bsp"] <= jct["none"]


def test_device_groups_must_cover_the_workers() -> None:
    raw = {"name": "x", "cluster": {"workers": 4, "worker_speed": 100.0,
                                    "device_groups": [{"name": "a", "count": 3, "speed": 100.0}]},
           "job": {"global_batch": 64, "records": 1000}}
    with pytest.raises(ScenarioError, match=r"cluster\.device_groups"):
        parse(raw)
    raw["cluster"]["device_groups"] = [{"name": "a", "count": 4, "speed": 100.0, "memory": 1}]
    with pytest.raises(ScenarioError, match=r"device_groups\[0\]\.memory"):
        parse(raw)


# ------------------------------------------------------------------ shared with the live system


def test_stragglers_are_the_trainers_patterns_seeded_by_the_run() -> None:
    from pacer.trainer.straggler import PatternKind, StragglerSpec

    pats = [{"node": "worker-1", "pattern": "transient", "sleep_s": 1.0, "intensity": 0.5, "period_s": 20,
             "on_s": 10, "probability": 0.5, "start_s": 5},
            {"node": "worker-1", "pattern": "persistent", "sleep_s": 1.0, "intensity": 1.0, "start_s": 50}]
    sc = replace(scenario(stragglers=pats), seed=7)
    sim = Simulation(sc, none_policy, "none")
    spec = StragglerSpec(kind=PatternKind.TRANSIENT, sleep_s=1.0, intensity=0.5, period_s=20, on_s=10,
                         probability=0.5, seed=7, start_s=5)
    first, second = (p.pattern for p in sim.wpat[1])
    assert first == spec.on("worker-1")  # what a real worker-1 with this spec would sleep
    assert second.node == "worker-1#1" and second.spec.kind is PatternKind.PERSISTENT
    for t in (0.0, 5.0, 14.9, 15.0, 25.0, 60.0, 333.0):
        sim.t, sim.next_change = t, -1.0
        sim._refresh_delays()
        assert sim.wd[1] == first.delay_at(t) + second.delay_at(t)
        assert sim.next_change == min(first.next_change(t), second.next_change(t))


def test_a_relaunched_worker_restarts_at_b_over_n_until_the_controller_resends() -> None:
    sizes = {"worker-0": 130, "worker-1": 70, "worker-2": 100, "worker-3": 100}
    asked: list[PolicyRequest] = []

    def adjust_then_restart(req: PolicyRequest) -> PolicyDecision:
        asked.append(req)
        acts = {1: [PolicyAction(ActionKind.ADJUST_BS, payload={"batch_sizes": sizes})],
                2: [PolicyAction(ActionKind.KILL_RESTART, node="worker-1")]}.get(len(asked), [])
        return PolicyDecision(job=req.job, policy="t", actions=acts)

    sim = Simulation(scenario(), adjust_then_restart, "t", UNGUARDED)
    res = sim.run()
    assert res.actions == {"ADJUST_BS": 2, "KILL_RESTART": 1}  # the second ADJUST_BS is the core's re-send
    resend = [e for e in res.timeline if e["actions"] == ["ADJUST_BS"]][-1]
    restart = next(e for e in res.timeline if e["actions"] == ["KILL_RESTART worker-1"])
    # worker-1 is back after pending + init (15 s) and reports; the next round re-sends.
    assert restart["t"] + 15 < resend["t"]
    assert dict(zip(sim.wnames, sim.B.tolist(), strict=True)) == sizes
    assert not sim.controller.resync


def test_tail_pieces_shorten_the_wait_for_the_slow_workers_last_shard() -> None:
    """ASP with dynamic sharding and a worker 7x slow: with whole shards the job waits at the end for the
    slow worker's last shard; with the tail cut into pieces by rate (DatasetSpec.tail_split) it does not.
    Both train every record exactly once."""
    runs = {split: run(scenario(job={"mode": "asp", "tail_split": split}, stragglers=[SLOW]), ideal=False)
            for split in (False, True)}
    for r in runs.values():
        assert r.records_done == 200_000 and r.records_duplicated == 0 and r.shards_done == r.shards_total
    assert runs[False].shards_total == 200 < runs[True].shards_total
    assert runs[True].jct_s < runs[False].jct_s
