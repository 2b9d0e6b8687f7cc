"""The baselines of AntDT §VII-A3, as policies: LB-BSP, Backup Workers, and NONE.

* ``lb-bsp``: load balancing only (LB-BSP [18]): the batch sizes follow the
  measured worker speeds, B_i proportional to v_i, through the same exact
  solver as AntDT-ND (AntDT Eq. 3).  No restarts.  Re-balances whenever the
  balanced assignment would shorten the predicted step by more than
  ``params["tolerance"]`` (default 5 %), so it follows slow and recovered
  workers alike and does not churn on noise.
* ``backup-workers``: replication (Sync-OPT [28]): each synchronous step
  drops the gradients of the ``b`` slowest workers (their samples go back
  to the shard service, so no data is lost).  ``b`` is the number of live
  workers slow over L_trans (slowdown >= lambda), capped by
  ``params["backup"]`` (default 1) and kept below the number of live workers.
* ``none``: never acts (plain BSP / ASP-DDS).

Backup Workers and LB-BSP are BSP techniques; in ASP they do nothing.
"""

from __future__ import annotations

from pacer.contracts.agent import ActionKind
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest

from . import batch_caps, current_assignment, live_workers, param_float, worker_speeds
from .batch import balance, makespan

LB_BSP = "lb-bsp"
BACKUP_WORKERS = "backup-workers"
NONE = "none"


def lb_bsp(req: PolicyRequest) -> PolicyDecision:
    def nothing(reason: str) -> PolicyDecision:
        return PolicyDecision(job=req.job, policy=LB_BSP, reason=reason)

    if req.mode != "bsp":
        return nothing("LB-BSP balances synchronous steps: nothing to do in ASP")
    workers = live_workers(req.stats)
    speeds = worker_speeds(req, workers)
    if not speeds:
        return nothing("no throughput data yet")
    names = [w.node for w in workers]
    v = [speeds[n] for n in names]
    try:
        target = balance(req.global_batch, v, lo=req.min_batch, hi=batch_caps(req, names))
    except ValueError as e:
        return nothing(f"cannot rebalance: {e}")
    sizes, accs = current_assignment(req, workers)
    now_s = makespan([sizes[n] * accs[n] for n in names], v)
    best = makespan(target, v)  # AntDT Eq. 2: predicted BPT
    if now_s <= best * (1 + param_float(req, "tolerance", 0.05)):
        return nothing(f"balanced: predicted step {now_s:.3g}s vs {best:.3g}s")
    action = PolicyAction(
        kind=ActionKind.ADJUST_BS,
        payload={"batch_sizes": dict(zip(names, target, strict=True)), "accumulations": {n: 1 for n in names}},
        reason=f"B_i proportional to measured speed (AntDT Eq. 3): predicted step {now_s:.3g}s -> {best:.3g}s",
    )
    return PolicyDecision(job=req.job, policy=LB_BSP, actions=[action], reason="load balancing")


def backup_workers(req: PolicyRequest) -> PolicyDecision:
    def nothing(reason: str) -> PolicyDecision:
        return PolicyDecision(job=req.job, policy=BACKUP_WORKERS, reason=reason)

    if req.mode != "bsp":
        return nothing("backup workers drop gradients of a synchronous step: nothing to do in ASP")
    workers = live_workers(req.stats)
    if len(workers) < 2:
        return nothing("fewer than two live workers: no backup possible")
    lam = param_float(req, "lambda", req.stats.slowness_ratio)
    cap = max(0, int(param_float(req, "backup", 1)))
    slow = sorted((w for w in workers if w.slowdown_short >= lam), key=lambda w: -w.slowdown_short)
    b = min(len(slow), cap, len(workers) - 1)
    if b == req.backup_workers:
        return nothing(f"keep {b} backup worker(s): {len(slow)} slow at lambda {lam:g} (cap {cap})")
    names = ", ".join(f"{w.node} {w.slowdown_short:.2f}x" for w in slow) or "none slow"
    action = PolicyAction(
        kind=ActionKind.BACKUP_WORKERS,
        payload={"backup": b},
        reason=f"drop the {b} slowest gradient(s) per step (Sync-OPT), was {req.backup_workers}: {names}",
    )
    return PolicyDecision(job=req.job, policy=BACKUP_WORKERS, actions=[action], reason="replication")


def none(req: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(job=req.job, policy=NONE, reason="policy none: no straggler mitigation")


