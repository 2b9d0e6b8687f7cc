"""AntDT-DD (AntDT §VI-B): batch size and gradient accumulation per device group, for a dedicated cluster.

Stragglers in a dedicated cluster are deterministic (hardware heterogeneity),
so the policy solves AntDT Eq. 4 once and returns one ADJUST_BS with
``{"batch_sizes": {node: B_g}, "accumulations": {node: C_g}}``: a slow device
keeps its full (memory-bound) batch and the fast ones accumulate more
micro-batches, so every group's step time C_g B_g / v_g is balanced.

Inputs: ``PolicyRequest.device_groups`` (worker -> group; a worker without
one is in group ``"default"``), the per-device speed v_g = mean over the
group's live workers of B_i C_i / T_i^trans, and the bounds:

* ``min_batch`` / ``max_batch`` of the request (B^min, B^max; ``max_batch``
  0 means no memory bound), overridden per group by
  ``params["min_batch_per_group"]`` / ``params["max_batch_per_group"]``;
* ``params["c_min"]`` / ``params["c_max"]`` (C^min, C^max; default 1 and 5,
  the paper's example).

"Decides once": when the current assignment's predicted step time is
within ``params["tolerance"]`` (default 5 %) of Eq. 4's optimum, there is
nothing to do, so after the one adjustment the policy stays quiet as long
as the devices keep their speeds.  BSP only (ASP has no synchronous step to
balance).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pacer.contracts.agent import ActionKind
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest

from . import current_assignment, live_workers, param_float, worker_speeds
from .batch import DeviceGroup, balance_groups

NAME = "antdt-dd"
DEFAULT_GROUP = "default"


def _per_group(req: PolicyRequest, key: str, group: str, default: int) -> int:
    table: Any = req.params.get(key, {})
    value = table.get(group, default) if isinstance(table, dict) else default
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def decide(req: PolicyRequest) -> PolicyDecision:
    def nothing(reason: str) -> PolicyDecision:
        return PolicyDecision(job=req.job, policy=NAME, reason=reason)

    if req.mode != "bsp":
        return nothing("AntDT-DD balances synchronous steps: nothing to do in ASP")
    workers = live_workers(req.stats)
    speeds = worker_speeds(req, workers)
    if not speeds:
        return nothing("no throughput data yet")
    members: dict[str, list[str]] = defaultdict(list)
    for w in workers:
        members[req.device_groups.get(w.node, DEFAULT_GROUP)].append(w.node)

    c_min = int(param_float(req, "c_min", 1))
    c_max = int(param_float(req, "c_max", 5))
    groups = []
    for name in sorted(members):
        nodes = members[name]
        b_max = req.max_batch or req.global_batch
        groups.append(
            DeviceGroup(
                name=name,
                devices=len(nodes),
                speed=sum(speeds[n] for n in nodes) / len(nodes),
                min_batch=_per_group(req, "min_batch_per_group", name, req.min_batch),
                max_batch=_per_group(req, "max_batch_per_group", name, b_max),
            )
        )
    try:
        plan = balance_groups(req.global_batch, groups, c_min=c_min, c_max=c_max)
    except ValueError as e:
        return nothing(f"AntDT Eq. 4 has no solution: {e}")

    by_name = {g.name: g for g in groups}
    best = max(p.samples / by_name[g].speed for g, p in plan.items())
    sizes, accs = current_assignment(req, workers)
    group_of = {n: g for g, nodes in members.items() for n in nodes}
    current = max(sizes[n] * accs[n] / by_name[group_of[n]].speed for n in group_of)
    if current <= best * (1 + param_float(req, "tolerance", 0.05)):
        return nothing(f"already balanced: predicted step {current:.3g}s vs {best:.3g}s at the optimum of AntDT Eq. 4")
    batch_sizes = {n: plan[group_of[n]].batch for n in sorted(group_of)}
    accumulations = {n: plan[group_of[n]].accumulation for n in sorted(group_of)}
    summary = ", ".join(
        f"{g} ({by_name[g].devices} x {by_name[g].speed:.3g}/s): B={p.batch} C={p.accumulation}" for g, p in plan.items()
    )
    action = PolicyAction(
        kind=ActionKind.ADJUST_BS,
        payload={"batch_sizes": batch_sizes, "accumulations": accumulations},
        reason=f"deterministic stragglers: AntDT Eq. 4 per device group, {summary}; predicted step {current:.3g}s -> {best:.3g}s",
    )
    return PolicyDecision(job=req.job, policy=NAME, actions=[action], reason="balance device groups once (AntDT-DD)")


