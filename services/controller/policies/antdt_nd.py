"""AntDT-ND (AntDT §VI-A): straggler mitigation for a non-dedicated cluster.

Workers:

* a *persistent* straggler (slow over L_per) -> KILL_RESTART, but only when
  the cluster is not busy (a relaunch may wait dozens of minutes in the
  queue, §V-E2) and the node is not in its restart cool-down
  (``PolicyRequest.restart_blocked``);
* a *transient* straggler (T_i^trans >= lambda * T^trans) -> ADJUST_BS with
  the exact solution of AntDT Eq. 3 over v_i = B_i / T_i^trans.

Servers: a persistent PS straggler -> KILL_RESTART (the paper does not gate
it on the cluster; the controller's review still refuses restarts while the
cluster is busy).

ASP training: only KILL_RESTART (§VII-A3: "In ASP training, AntDT-ND only
takes the KILL_RESTART action"); dynamic sharding already moves work away
from slow workers.

"Slow" is the monitor's signal (``NodeStats.straggler`` and the slowdowns,
see ``services/monitor/core.py``): T_i over the *median* T of the node's live
same-role peers, not the mean over all nodes, for the reasons given there.
The policy's ``lambda`` (``params["lambda"]``, default the monitor's 1.5)
can only make it stricter.  Only RUNNING nodes take part.
"""

from __future__ import annotations

from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import NodeStats, StragglerKind
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest

from . import (
    PS_ROLE,
    batch_caps,
    current_assignment,
    live_servers,
    live_workers,
    param_float,
    worker_speeds,
)
from .batch import balance, makespan

NAME = "antdt-nd"

_NO_STRAGGLER = "no transient straggler"
_BALANCED = "batch sizes already balanced"
_NOTHING_TO_DO = (_NO_STRAGGLER, _BALANCED)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min"


def _persistent(n: NodeStats, lam: float) -> bool:
    # AntDT §VI-A step 4 / servers step 2: T_i^per >= lambda * T^per (the
    # monitor also requires evidence older than L_trans).
    return n.straggler is StragglerKind.PERSISTENT and n.slowdown_long >= lam


def adjust_batch(req: PolicyRequest, lam: float, expected: dict[str, float] | None = None) -> PolicyAction | str:
    """ADJUST_BS for the live workers by AntDT Eq. 3, or the reason why not.

    Taken when some live worker is slow over L_trans (AntDT §VI-A step 3), or
    when the current B_i leave the predicted step time (max_i B_i C_i / v_i)
    at least lambda times above the balanced one (a transient straggler
    that has recovered still holds a small batch).  ``expected`` overrides
    v_i for some workers (a worker being restarted is expected back at the
    median speed).
    """
    workers = live_workers(req.stats)
    if not workers:
        return "no live workers"
    speeds = worker_speeds(req, workers)
    if not speeds:
        return "no throughput data yet"
    speeds.update(expected or {})
    sizes, accs = current_assignment(req, workers)
    names = [w.node for w in workers]
    v = [speeds[n] for n in names]
    try:
        target = balance(req.global_batch, v, lo=req.min_batch, hi=batch_caps(req, names))
    except ValueError as e:
        return f"cannot rebalance: {e}"
    new = dict(zip(names, target, strict=True))
    ones = {n: 1 for n in names}
    if new == sizes and accs == ones:
        return _BALANCED
    # AntDT Eq. 2: predicted BPT under the current and the balanced assignment.
    now_ms = makespan([sizes[n] * accs[n] for n in names], v)
    best = makespan(target, v)
    slow = [w for w in workers if w.slowdown_short >= lam and w.node not in (expected or {})]
    if slow:
        worst = max(slow, key=lambda w: w.slowdown_short)
        why = (
            f"{len(slow)} transient straggler(s), worst {worst.node} BPT {worst.slowdown_short:.2f}x "
            f"its peers over L_trans ({_minutes(req.stats.window_short_s)})"
        )
    elif now_ms >= lam * best:
        why = f"batch sizes out of balance: predicted step {now_ms:.3g}s vs {best:.3g}s balanced"
    else:
        return _NO_STRAGGLER
    return PolicyAction(
        kind=ActionKind.ADJUST_BS,
        payload={"batch_sizes": new, "accumulations": ones},
        reason=f"{why}: B_i proportional to throughput (AntDT Eq. 3), predicted step {now_ms:.3g}s -> {best:.3g}s",
    )


def decide(req: PolicyRequest) -> PolicyDecision:
    stats = req.stats
    lam = param_float(req, "lambda", stats.slowness_ratio)
    blocked = set(req.restart_blocked)
    actions: list[PolicyAction] = []
    notes: list[str] = []
    window = _minutes(stats.window_long_s)

    restarting: set[str] = set()
    for n in live_servers(stats) + live_workers(stats):
        if not _persistent(n, lam):
            continue
        what = f"{n.node} BPT {n.slowdown_long:.2f}x its peers over L_per ({window}): persistent straggler"
        if n.node in blocked:
            notes.append(f"{what}, but in restart cool-down")
        elif n.role != PS_ROLE and stats.cluster_busy:
            # §VI-A step 4: restart a worker only "if ... the cluster is not busy".
            notes.append(f"{what}, but the cluster is busy")
        else:
            actions.append(PolicyAction(kind=ActionKind.KILL_RESTART, node=n.node, reason=what))
            restarting.add(n.node)

    if req.mode == "bsp":
        # A worker being restarted comes back at a typical speed: do not size its batch for its slowness.
        workers = live_workers(stats)
        speeds = worker_speeds(req, workers)
        others = sorted(v for name, v in speeds.items() if name not in restarting)
        expected: dict[str, float] = {}
        if others:
            expected = {w.node: others[len(others) // 2] for w in workers if w.node in restarting}
        adj = adjust_batch(req, lam, expected)
        if isinstance(adj, PolicyAction):
            actions.append(adj)
        elif adj not in _NOTHING_TO_DO:
            notes.append(adj)
    elif not actions:
        notes.append("ASP: AntDT-ND only takes KILL_RESTART (§VII-A3)")

    if not actions and not any("persistent" in x for x in notes):
        notes.insert(0, f"no straggler to act on at lambda {lam:g}")
    reason = "; ".join(notes) or f"{len(actions)} action(s)"
    return PolicyDecision(job=req.job, policy=NAME, actions=actions, reason=reason)


