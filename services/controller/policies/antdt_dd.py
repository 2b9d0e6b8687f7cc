"""AntDT-DD (AntDT §VI-B): batch size and gradient accumulation per device group, for a dedicated cluster.

Stragglers in a dedicated cluster are deterministic (hardware heterogeneity),
so the policy solves AntDT Eq. 4 once and returns one ADJUST_BS with
``{"batch_sizes": {node: B_g}, "accumulations": {node: C_g}}``: a slow device
keeps its full (memory-bound) batch and the fast ones accumulate more
micro-batches, so every group's step time C_g B_g / v_g is balanced.

Inputs: ``PolicyRequest.device_groups`` (worker -> group; a worker without
one is in group ``"default"``), the per-device speed v_g = the slowest of
the group's live workers' B_i C_i / T_i^trans (the group's step waits for
it; for identical devices, the paper's v_g), and the bounds:

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

Bounded: a request whose bounds would make the exact solver's candidate
sets too large (:data:`MAX_SOLVER_WORDS`), or whose parameters are out of
their ranges, is refused with :class:`~pacer.errors.ValidationError` before
the solver runs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pacer.contracts.agent import ActionKind
from pacer.contracts.policy import MAX_GLOBAL_BATCH, PolicyAction, PolicyDecision, PolicyRequest
from pacer.errors import ValidationError

from . import current_assignment, live_workers, param_float, worker_speeds
from .batch import DeviceGroup, balance_groups

NAME = "antdt-dd"
DEFAULT_GROUP = "default"
MAX_GROUPS = 64  # device series; a cluster has a few


#: Most word operations (64-bit) that one decision's exact solver of AntDT Eq. 4 may need, estimated as
#: sum_g |A_g| x B / 64 (see :func:`.batch.balance_groups`): 1-3 s on the 2-core development machine
#: (measured: 4e7 words 0.4 s, 1.2e8 0.8 s, 3.4e8 5.7 s), below the policy service's 4-s decision limit.
#: Beyond it the request is refused, naming the bounds that make the candidate sets large.
MAX_SOLVER_WORDS = 200_000_000


def _per_group(req: PolicyRequest, key: str, group: str, default: int) -> int:
    table: Any = req.params.get(key, {})
    value = table.get(group, default) if isinstance(table, dict) else default
    if not isinstance(value, int) or isinstance(value, bool):
        return default
    if not 1 <= value <= MAX_GLOBAL_BATCH:
        raise ValidationError(f"params.{key}.{group}: must be in [1, {MAX_GLOBAL_BATCH}], got {value}")
    return value


def solver_words(total: int, groups: list[DeviceGroup], c_min: int, c_max: int) -> int:
    """The estimated cost of :func:`.batch.balance_groups` for these inputs, in 64-bit word operations."""
    choices = 0
    for g in groups:
        cap = total // max(1, g.devices)
        choices += sum(max(0, min(g.max_batch, cap // c) - g.min_batch + 1) for c in range(c_min, c_max + 1))
    return choices * (total // 64 + 1)


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
    if len(members) > MAX_GROUPS:
        raise ValidationError(f"device_groups: {len(members)} groups, more than the {MAX_GROUPS} AntDT-DD solves")
    groups = []
    for name in sorted(members):
        nodes = members[name]
        b_max = req.max_batch or req.global_batch
        groups.append(
            DeviceGroup(
                name=name,
                devices=len(nodes),
                # Every device of a group gets the same B_g and C_g, and a synchronous step waits for the
                # slowest of them: the group's step time is C_g B_g / (its slowest device's speed).  The mean
                # speed (the paper's v_g for identical devices) under-sizes nothing only when no device of the
                # group straggles; one that does would set every step while the plan ignored it.
                speed=min(speeds[n] for n in nodes),
                min_batch=_per_group(req, "min_batch_per_group", name, req.min_batch),
                max_batch=_per_group(req, "max_batch_per_group", name, b_max),
            )
        )
    words = solver_words(req.global_batch, groups, c_min, max(c_min, c_max))
    if words > MAX_SOLVER_WORDS:
        raise ValidationError(
            f"max_batch: AntDT Eq. 4 for a global batch of {req.global_batch} with these per-group batch bounds "
            f"would take ~{words:.3g} word operations (at most {MAX_SOLVER_WORDS:.3g}); bound the per-device batch "
            "(max_batch or params.max_batch_per_group) or the accumulation steps (params.c_max)")
    try:
        plan = balance_groups(req.global_batch, groups, c_min=c_min, c_max=c_max)
    except ValueError as e:
        return nothing(f"AntDT Eq. 4 has no solution: {e}")

    by_name = {g.name: g for g in groups}
    best = max(p.samples / by_name[g].speed for g, p in plan.items())
    sizes, accs = current_assignment(req, workers)
    group_of = {n: g for g, nodes in members.items() for n in nodes}
    current = max(sizes[n] * accs[n] / speeds[n] for n in group_of)
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


