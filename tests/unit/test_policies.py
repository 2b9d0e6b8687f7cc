"""Built-in straggler policies and their exact batch solvers (AntDT Eq. 3 and Eq. 4).

Pure: every test builds a PolicyRequest and asserts on the PolicyDecision.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, StragglerKind
from pacer.contracts.policy import PolicyDecision, PolicyRequest
from pacer.subjects import POLICY_BUILTINS
from pacer_services.controller.policies import antdt_dd, antdt_nd, baselines, registry
from pacer_services.controller.policies.batch import DeviceGroup, balance, balance_groups, makespan

JOB = "job1"
P, T = StragglerKind.PERSISTENT, StragglerKind.TRANSIENT


def node(
    name: str,
    bpt: float = 1.0,
    role: str = "worker",
    state: Liveness = Liveness.RUNNING,
    kind: StragglerKind = StragglerKind.NONE,
    slow: float | None = None,
    speed: float = 0.0,
) -> NodeStats:
    """A node whose slowdown (short and long) is ``slow`` (default: bpt over 1.0, the peers' BPT here)."""
    s = bpt if slow is None else slow
    return NodeStats(
        node=name, role=role, bpt_short_s=bpt, bpt_long_s=bpt, speed_samples_per_s=speed, samples_total=0,
        cpu_percent=100.0, rss_bytes=1, last_seen=1.0, state=state, pending_s=0.0, restarts=0,
        slowdown_short=s, slowdown_long=s, straggler=kind,
    )


def request(nodes: list[NodeStats], busy: bool = False, **kw: Any) -> PolicyRequest:
    stats = JobStatistics(job=JOB, ts=1000.0, window_short_s=300.0, window_long_s=600.0,
                          throughput_samples_per_s=0.0, nodes=nodes, cluster_busy=busy)
    base: dict[str, Any] = dict(job=JOB, stats=stats, mode="bsp", global_batch=400)
    base.update(kw)
    return PolicyRequest(**base)


def kinds(d: PolicyDecision) -> list[ActionKind]:
    return [a.kind for a in d.actions]


def only(d: PolicyDecision, kind: ActionKind) -> Any:
    found = [a for a in d.actions if a.kind is kind]
    assert len(found) == 1, d
    return found[0]


# ---------------------------------------------------------------- Eq. 3 solver


def brute_force(total: int, v: list[float], lo: list[int], hi: list[int]) -> float:
    """min over every integer assignment of max B_i / v_i, by exhaustive recursion (inf: infeasible)."""

    @functools.cache
    def best(i: int, rest: int) -> float:
        if i == len(v):
            return 0.0 if rest == 0 else math.inf
        return min((max(b / v[i], best(i + 1, rest - b)) for b in range(lo[i], min(hi[i], rest) + 1)), default=math.inf)

    return best(0, total)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 5),
    total=st.integers(0, 40),
)
def test_balance_is_exact_against_brute_force(data: st.DataObject, n: int, total: int) -> None:
    v = data.draw(st.lists(st.floats(0.05, 20.0, allow_nan=False), min_size=n, max_size=n))
    lo = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    hi = [a + data.draw(st.integers(0, 25)) for a in lo]
    expected = brute_force(total, v, lo, hi)
    if math.isinf(expected):
        with pytest.raises(ValueError):
            balance(total, v, lo=lo, hi=hi)
        return
    got = balance(total, v, lo=lo, hi=hi)
    assert sum(got) == total
    assert all(a <= b <= c for a, b, c in zip(lo, got, hi, strict=True))
    assert makespan(got, v) == pytest.approx(expected, rel=1e-12)


def test_balance_unbounded_is_proportional_to_speed() -> None:
    assert balance(400, [3.0, 1.0]) == [300, 100]
    assert balance(10, [1.0, 1.0, 1.0]) == [4, 3, 3]  # ties go to the lower index


@pytest.mark.parametrize(
    ("total", "v", "lo", "hi"),
    [(5, [1.0, 1.0, 1.0], 2, None), (10, [1.0, 1.0], 1, 4), (10, [1.0, 0.0], 1, None), (10, [], 1, None),
     (10, [1.0, math.inf], 1, None), (10, [1.0, 1.0], [1], None)],
)
def test_balance_infeasible_or_invalid_raises(total: int, v: list[float], lo: Any, hi: Any) -> None:
    with pytest.raises(ValueError):
        balance(total, v, lo=lo, hi=hi)


def test_balance_1000_workers_is_exact() -> None:
    """Scale run (timing belongs to bench/): the result satisfies the greedy-exchange optimality certificate."""
    rng = random.Random(7)
    v = [rng.uniform(0.1, 10.0) for _ in range(1000)]
    total, lo, hi = 256_000, 16, 1024
    got = balance(total, v, lo=lo, hi=hi)
    assert sum(got) == total and min(got) >= lo and max(got) <= hi
    # Exact iff no worker above its minimum holds a level above a level another worker could still take.
    taken = max(b / s for b, s in zip(got, v, strict=True) if b > lo)
    free = min((b + 1) / s for b, s in zip(got, v, strict=True) if b < hi)
    assert taken <= free * (1 + 1e-12)


# ---------------------------------------------------------------- Eq. 4 solver


def test_eq4_two_speeds_3_to_1_balances_with_accumulation_within_memory() -> None:
    groups = [DeviceGroup("v100", 2, 300.0, 1, 64), DeviceGroup("p100", 2, 100.0, 1, 64)]
    plan = balance_groups(512, groups)
    assert plan["v100"].batch <= 64 and plan["p100"].batch <= 64
    assert sum(g.devices * plan[g.name].samples for g in groups) == 512
    times = {g.name: plan[g.name].samples / g.speed for g in groups}
    assert times["v100"] == pytest.approx(times["p100"])  # 192/300 == 64/100
    assert (plan["v100"].batch, plan["v100"].accumulation) == (64, 3)
    assert (plan["p100"].batch, plan["p100"].accumulation) == (64, 1)


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(1, 60),
    spec=st.lists(st.tuples(st.integers(1, 3), st.floats(0.5, 4.0), st.integers(1, 3), st.integers(0, 6)),
                  min_size=1, max_size=3),
    c_max=st.integers(1, 3),
)
def test_eq4_is_exact_against_brute_force(total: int, spec: list[tuple[int, float, int, int]], c_max: int) -> None:
    groups = [DeviceGroup(f"g{i}", n, v, lo, lo + w) for i, (n, v, lo, w) in enumerate(spec)]
    options = [[(b, c) for b in range(g.min_batch, g.max_batch + 1) for c in range(1, c_max + 1)] for g in groups]
    best = math.inf
    for combo in itertools.product(*options):
        if sum(g.devices * b * c for g, (b, c) in zip(groups, combo, strict=True)) == total:
            best = min(best, max(b * c / g.speed for g, (b, c) in zip(groups, combo, strict=True)))
    if math.isinf(best):
        with pytest.raises(ValueError):
            balance_groups(total, groups, c_max=c_max)
        return
    plan = balance_groups(total, groups, c_max=c_max)
    assert sum(g.devices * plan[g.name].samples for g in groups) == total
    for g in groups:
        assert g.min_batch <= plan[g.name].batch <= g.max_batch and 1 <= plan[g.name].accumulation <= c_max
    assert max(plan[g.name].samples / g.speed for g in groups) == pytest.approx(best, rel=1e-12)


def test_eq4_infeasible_raises() -> None:
    with pytest.raises(ValueError):
        balance_groups(7, [DeviceGroup("a", 2, 1.0, 1, 64)])  # 2 devices x anything is even
    with pytest.raises(ValueError):
        balance_groups(1000, [DeviceGroup("a", 2, 1.0, 1, 64)], c_max=5)  # 2 x 64 x 5 < 1000


# ---------------------------------------------------------------- AntDT-ND


def workers(*extra: NodeStats, n: int = 4) -> list[NodeStats]:
    return [node(f"worker-{i}") for i in range(n)] + list(extra)


def test_nd_persistent_worker_is_restarted_when_the_cluster_is_idle() -> None:
    d = antdt_nd.decide(request(workers(node("worker-9", bpt=2.1, kind=P))))
    a = only(d, ActionKind.KILL_RESTART)
    assert a.node == "worker-9"
    assert "2.10x" in a.reason and "persistent" in a.reason and "10 min" in a.reason
    # Its slowness is about to be cured: no batch re-sizing for it.
    assert ActionKind.ADJUST_BS not in kinds(d)


def test_nd_busy_cluster_blocks_worker_restart_but_still_adjusts_batches() -> None:
    nodes = workers(node("worker-8", bpt=2.0, kind=T), node("worker-9", bpt=3.0, kind=P))
    d = antdt_nd.decide(request(nodes, busy=True))
    assert ActionKind.KILL_RESTART not in kinds(d)
    assert "busy" in d.reason
    sizes = only(d, ActionKind.ADJUST_BS).payload["batch_sizes"]
    assert sum(sizes.values()) == 400
    assert sizes["worker-9"] < sizes["worker-8"] < sizes["worker-0"]


def test_nd_restart_blocked_node_is_not_restarted() -> None:
    d = antdt_nd.decide(request(workers(node("worker-9", bpt=2.1, kind=P)), restart_blocked=["worker-9"]))
    assert ActionKind.KILL_RESTART not in kinds(d)
    assert "cool-down" in d.reason


def test_nd_transient_straggler_gets_a_smaller_batch_summing_to_B() -> None:
    nodes = workers(node("worker-4", bpt=3.0, kind=T))
    d = antdt_nd.decide(request(nodes, global_batch=500))
    assert kinds(d) == [ActionKind.ADJUST_BS]
    a = d.actions[0]
    sizes = a.payload["batch_sizes"]
    assert set(sizes) == {f"worker-{i}" for i in range(5)}
    assert sum(sizes.values()) == 500
    # v = 100/1 x 4 and 100/3: B_i proportional to v_i.
    assert sizes["worker-4"] == 38 and all(sizes[f"worker-{i}"] in (115, 116) for i in range(4))
    assert set(a.payload["accumulations"].values()) == {1}
    assert "transient" in a.reason and "worker-4" in a.reason


def test_nd_server_persistent_straggler_is_restarted_even_when_busy() -> None:
    nodes = workers(node("ps-0", role="ps"), node("ps-1", role="ps", bpt=3.0, kind=P))
    d = antdt_nd.decide(request(nodes, busy=True))
    assert [(a.kind, a.node) for a in d.actions] == [(ActionKind.KILL_RESTART, "ps-1")]


def test_nd_asp_only_restarts() -> None:
    nodes = workers(node("worker-8", bpt=2.0, kind=T), node("worker-9", bpt=3.0, kind=P))
    d = antdt_nd.decide(request(nodes, mode="asp"))
    assert [(a.kind, a.node) for a in d.actions] == [(ActionKind.KILL_RESTART, "worker-9")]
    quiet = antdt_nd.decide(request(workers(node("worker-8", bpt=2.0, kind=T)), mode="asp"))
    assert quiet.actions == [] and "ASP" in quiet.reason


def test_nd_ignores_dead_and_pending_nodes() -> None:
    nodes = workers(
        node("worker-8", bpt=3.0, kind=P, state=Liveness.DEAD),
        node("worker-9", bpt=3.0, kind=T, state=Liveness.PENDING),
    )
    d = antdt_nd.decide(request(nodes))
    assert d.actions == []
    assert d.reason


def test_nd_lambda_param_can_make_it_stricter() -> None:
    nodes = workers(node("worker-4", bpt=1.6, kind=T))
    assert kinds(antdt_nd.decide(request(nodes))) == [ActionKind.ADJUST_BS]
    assert antdt_nd.decide(request(nodes, params={"lambda": 2.0})).actions == []


def test_nd_rebalances_after_a_transient_straggler_recovers() -> None:
    # worker-4 kept its small batch and now runs at full speed: everyone else is overloaded.
    nodes = [node(f"worker-{i}", bpt=2.0, slow=1.0) for i in range(4)] + [node("worker-4", bpt=0.1, slow=0.05)]
    sizes = {f"worker-{i}": 190 for i in range(4)} | {"worker-4": 40}
    d = antdt_nd.decide(request(nodes, global_batch=800, batch_sizes=sizes))
    new = only(d, ActionKind.ADJUST_BS).payload["batch_sizes"]
    assert new["worker-4"] > 40 and sum(new.values()) == 800


def test_nd_no_straggler_no_action_with_reason() -> None:
    d = antdt_nd.decide(request(workers(node("ps-0", role="ps"))))
    assert d.actions == [] and "no straggler" in d.reason and d.policy == "antdt-nd"


# ---------------------------------------------------------------- AntDT-DD


def dd_request(sizes: dict[str, int], accs: dict[str, int], v: dict[str, float]) -> PolicyRequest:
    nodes = [node(n, bpt=sizes[n] * accs[n] / v[n]) for n in sorted(v)]
    groups = {n: ("v100" if n.startswith("fast") else "p100") for n in v}
    return request(nodes, global_batch=512, batch_sizes=sizes, accumulations=accs, max_batch=64, device_groups=groups)


def test_dd_balances_a_3_to_1_cluster_once_within_memory() -> None:
    v = {"fast-0": 300.0, "fast-1": 300.0, "slow-0": 100.0, "slow-1": 100.0}
    start = dd_request(dict.fromkeys(v, 64), dict.fromkeys(v, 2), v)
    d = antdt_dd.decide(start)
    a = only(d, ActionKind.ADJUST_BS)
    sizes, accs = a.payload["batch_sizes"], a.payload["accumulations"]
    assert max(sizes.values()) <= 64
    assert sum(sizes[n] * accs[n] for n in v) == 512
    times = {sizes[n] * accs[n] / v[n] for n in v}
    assert max(times) == pytest.approx(min(times))  # balanced per-iteration time
    assert accs["fast-0"] == 3 and accs["slow-0"] == 1
    assert "Eq. 4" in a.reason
    # Applied: same devices, same speeds -> nothing more to do.
    again = antdt_dd.decide(dd_request(sizes, accs, v))
    assert again.actions == [] and "already balanced" in again.reason


def test_dd_does_nothing_in_asp() -> None:
    v = {"fast-0": 300.0, "slow-0": 100.0}
    req = dd_request(dict.fromkeys(v, 64), dict.fromkeys(v, 2), v)
    d = antdt_dd.decide(PolicyRequest(**{**{f: getattr(req, f) for f in req.__dataclass_fields__}, "mode": "asp"}))
    assert d.actions == []


# ---------------------------------------------------------------- baselines


def test_lb_bsp_rebalances_by_speed_and_never_restarts() -> None:
    nodes = workers(node("worker-9", bpt=4.0, kind=P), n=3)
    d = baselines.lb_bsp(request(nodes))
    assert kinds(d) == [ActionKind.ADJUST_BS]
    sizes = d.actions[0].payload["batch_sizes"]
    # v = 100, 100, 100, 25: the optimum step is 1.24 s (124/100 or 31/25, both optimal).
    assert sum(sizes.values()) == 400 and sizes["worker-9"] in (30, 31)
    assert max(sizes[f"worker-{i}"] / 100 for i in range(3)) <= 1.24 and sizes["worker-9"] / 25 <= 1.24
    assert d.policy == "lb-bsp"


def test_lb_bsp_quiet_when_balanced_or_asp() -> None:
    assert baselines.lb_bsp(request(workers())).actions == []
    assert baselines.lb_bsp(request(workers(node("worker-9", bpt=4.0, kind=T)), mode="asp")).actions == []


def test_backup_workers_counts_slow_workers_up_to_the_cap() -> None:
    nodes = workers(node("worker-8", bpt=2.0, kind=T), node("worker-9", bpt=3.0, kind=P))
    a = only(baselines.backup_workers(request(nodes)), ActionKind.BACKUP_WORKERS)
    assert a.payload == {"backup": 1} and "worker-9" in a.reason
    a = only(baselines.backup_workers(request(nodes, params={"backup": 5})), ActionKind.BACKUP_WORKERS)
    assert a.payload == {"backup": 2}
    assert baselines.backup_workers(request(nodes, backup_workers=1)).actions == []  # already so
    # Stragglers gone: back to aggregating every gradient.
    a = only(baselines.backup_workers(request(workers(), backup_workers=1)), ActionKind.BACKUP_WORKERS)
    assert a.payload == {"backup": 0}


def test_backup_workers_keeps_one_gradient_and_skips_asp() -> None:
    nodes = [node("worker-0", bpt=3.0, kind=P), node("worker-1", bpt=3.0, kind=P)]
    a = only(baselines.backup_workers(request(nodes, params={"backup": 9})), ActionKind.BACKUP_WORKERS)
    assert a.payload == {"backup": 1}
    assert baselines.backup_workers(request(nodes, mode="asp")).actions == []


def test_none_never_acts() -> None:
    d = baselines.none(request(workers(node("worker-9", bpt=5.0, kind=P))))
    assert d.actions == [] and d.reason and d.policy == "none"


def test_registry_covers_the_builtins_which_read_no_clock() -> None:
    assert set(registry.BUILTINS) == set(POLICY_BUILTINS)
    req = request(workers(node("worker-9", bpt=2.5, kind=P)))
    for name, decide in registry.BUILTINS.items():
        d = decide(req)
        # decision_ms is the serving shell's measurement (pacer.policy.serve_policies), not the policy's.
        assert d.policy == name and d.job == JOB and d.decision_ms == 0
    assert registry.get("my-policy") is None
