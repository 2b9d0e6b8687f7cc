"""The built-in straggler policies (AntDT §VI, §VII-A3), as pure ``decide(PolicyRequest) -> PolicyDecision``.

The same functions answer ``pacer.policy.<name>.decide`` in the live system
and drive the cluster simulator (:mod:`.registry` maps names to them).  This
module holds what they share: which nodes take part, how fast each worker
is, which numeric parameters are sane.  Nothing here does IO or reads a
clock: ``decision_ms`` is measured by whoever calls a policy (the policy
service, :func:`pacer.policy.serve_policies`; the benchmarks), never by the
policy itself.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats
from pacer.contracts.policy import MAX_NODES, PolicyDecision, PolicyRequest
from pacer.errors import ValidationError

PS_ROLE = "ps"

Decide = Callable[[PolicyRequest], PolicyDecision]


def is_worker(n: NodeStats) -> bool:
    """Trainers that take a batch (workers and the chief); the same split as the monitor's throughput."""
    return n.role != PS_ROLE


def live_workers(stats: JobStatistics) -> list[NodeStats]:
    """Running non-PS nodes, in node order: the only ones that take part in a batch assignment."""
    return [n for n in stats.nodes if n.state is Liveness.RUNNING and is_worker(n)]


def live_servers(stats: JobStatistics) -> list[NodeStats]:
    return [n for n in stats.nodes if n.state is Liveness.RUNNING and n.role == PS_ROLE]


def even_split(global_batch: int, workers: int, min_batch: int = 1) -> int:
    """B / n: the batch of a worker that has not been assigned one (AntDT-ND step 1, "Initialization")."""
    return max(min_batch, global_batch // max(1, workers))


def batch_caps(req: PolicyRequest, names: list[str]) -> list[int] | None:
    """Per worker of ``names``, the largest B_i it may get: its device's cap (``req.batch_caps``, a device
    group's memory), else ``max_batch``, else the global batch; None when no worker has a cap.  The
    controller clamps any ADJUST_BS to these anyway (:mod:`.limits`); planning within them keeps the
    policy's own intent (a clamp spreads the excess in the policy's proportions, not by speed)."""
    if not req.batch_caps and not req.max_batch:
        return None
    default = req.max_batch or req.global_batch
    return [min(default, req.batch_caps.get(n, 0) or default) for n in names]


def current_assignment(req: PolicyRequest, workers: list[NodeStats]) -> tuple[dict[str, int], dict[str, int]]:
    """(B_i, C_i) of every live worker; a worker without a B_i gets the even split."""
    even = even_split(req.global_batch, len(workers), req.min_batch)
    sizes = {w.node: int(req.batch_sizes.get(w.node, even)) for w in workers}
    accs = {w.node: max(1, int(req.accumulations.get(w.node, 1))) for w in workers}
    return sizes, accs


def worker_speeds(req: PolicyRequest, workers: list[NodeStats]) -> dict[str, float]:
    """v_i in samples/s per live worker (AntDT §VI-A step 3: v_i = B_i / T_i^trans).

    One step of worker i trains B_i * C_i samples (C_i micro-batches of
    gradient accumulation), so v_i = B_i * C_i / T_i^trans.  Without a BPT the
    monitor's measured speed is used; a worker with neither (just started or
    restarted) is assumed to run at the median speed of the others.  Empty
    when no worker has any data.
    """
    sizes, accs = current_assignment(req, workers)
    known: dict[str, float] = {}
    for w in workers:
        if w.bpt_short_s > 0 and sizes[w.node] > 0:
            known[w.node] = sizes[w.node] * accs[w.node] / w.bpt_short_s
        elif w.speed_samples_per_s > 0:
            known[w.node] = w.speed_samples_per_s
    if not known:
        return {}
    typical = statistics.median(known.values())
    return {w.node: known.get(w.node, typical) for w in workers}


#: The sane range of every numeric parameter the built-in policies read: a number outside it is refused
#: (``invalid``) before the policy works with it, e.g. ``c_max: 1e9`` would make AntDT-DD's solver
#: enumerate a billion accumulation steps.
PARAM_RANGES: dict[str, tuple[float, float]] = {
    "lambda": (0.0, 1000.0),
    "lambda_floor": (0.0, 1000.0),
    "noise_k": (0.0, 1000.0),
    "tolerance": (0.0, 100.0),
    "c_min": (1.0, 64.0),
    "c_max": (1.0, 64.0),
    "backup": (0.0, float(MAX_NODES)),
    "backup_window_s": (0.0, 1e9),
    "wave_fraction": (0.0, 1.0),
    "pending_s": (0.0, 1e7),
    "init_s": (0.0, 1e7),
    "ps_start_s": (0.0, 1e7),
    "restart_outlier": (0.0, 1e6),
    "restart_horizon_s": (0.0, 1e9),
    "endgame_batch_factor": (0.0, 1e4),
}


def param_float(req: PolicyRequest, key: str, default: float) -> float:
    """A numeric policy parameter from the job spec; a missing or non-numeric value means the default,
    a number outside :data:`PARAM_RANGES` (or not finite) is refused with :class:`ValidationError`."""
    if key not in req.params:
        return default
    value = req.params[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return default
    lo, hi = PARAM_RANGES.get(key, (-math.inf, math.inf))
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValidationError(f"params.{key}: must be a finite number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)
