"""Exact batch-size solvers: AntDT's ADJUST_BS problem (Eq. 2/3) and AntDT-DD's Eq. 4.

:func:`balance` solves the min-max of AntDT Eq. 2 (Eq. 3 with the latent
variable z)::

    minimize   max_i B_i / v_i
    subject to sum_i B_i = B,   lo_i <= B_i <= hi_i,   B_i integer

:func:`balance_groups` solves AntDT-DD's Eq. 4 over k device groups (group g
holds n_g devices of speed v_g; all devices of a group share B_g and C_g)::

    minimize   max_g C_g * B_g / v_g
    subject to sum_g n_g * C_g * B_g = B
               Bmin_g <= B_g <= Bmax_g      (Bmax_g: the device's memory limit)
               Cmin   <= C_g <= Cmax        (gradient accumulation steps)

Both are pure functions of their arguments.  Infeasible problems raise
``ValueError`` naming the violated bound.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

Bound = int | Sequence[int] | None


def _bounds(bound: Bound, n: int, default: float, name: str) -> list[float]:
    if bound is None:
        return [default] * n
    if isinstance(bound, int):
        return [float(bound)] * n
    if len(bound) != n:
        raise ValueError(f"{name}: {len(bound)} bounds for {n} workers")
    return [float(b) for b in bound]


def _water_level(total: int, speeds: Sequence[float], lo: Sequence[float], hi: Sequence[float],
                 offsets: Sequence[float]) -> float:
    """The continuous optimum of Eq. 3: the z where sum_i clamp((z - d_i) * v_i, lo_i, hi_i) = total.

    g(z) = sum_i clamp((z - d_i) v_i, lo_i, hi_i) is piecewise linear and
    non-decreasing, with a kink at d_i + lo_i / v_i (worker i starts to fill,
    slope +v_i) and at d_i + hi_i / v_i (it is full, slope -v_i).  One sweep
    over the sorted kinks finds the segment where g crosses ``total``.
    """
    events: list[tuple[float, float]] = []
    for v, a, b, d in zip(speeds, lo, hi, offsets, strict=True):
        events.append((d + a / v, v))
        if math.isfinite(b):
            events.append((d + b / v, -v))
    events.sort()
    level, slope, z = float(sum(lo)), 0.0, 0.0
    for at, dv in events:
        nxt = level + slope * (at - z)
        if nxt >= total:
            return z + (total - level) / slope if slope > 0 else z
        level, z = nxt, at
        slope += dv
    return z + (total - level) / slope if slope > 0 else z


def balance(total: int, speeds: Sequence[float], lo: Bound = 1, hi: Bound = None,
            offsets: Sequence[float] | None = None) -> list[int]:
    """Integer batch sizes B_i that minimise max_i B_i / v_i with sum B_i = ``total`` (AntDT Eq. 3).

    ``lo`` / ``hi``: the minimum / maximum batch size, one for all workers or
    one per worker (``hi=None``: unbounded).  Returns B_i in the order of
    ``speeds``.  Raises ``ValueError`` if a speed is not positive and finite
    or if no assignment satisfies the bounds (total < sum lo_i or > sum hi_i).

    ``offsets``: a fixed time d_i >= 0 per step of worker i on top of its
    compute (an additive straggler delay, AntDT §VII-A4's injected sleep);
    the objective is then max_i (d_i + B_i / v_i).  The method below holds
    unchanged: worker i's k-th sample costs the level d_i + k / v_i, still
    increasing in k.  ``None``: all zero (the proportional model of Eq. 3).

    Method (exact):

    1. Worker i's k-th sample costs the *level* k / v_i; its first lo_i levels
       are forced.  An assignment's objective is the highest level it takes,
       and taking level k of worker i means taking all its lower levels too.
       So any feasible assignment takes R = total - sum lo_i unforced levels,
       and its maximum is at least the R-th smallest unforced level (and at
       least max_i lo_i / v_i).  Taking exactly the R smallest unforced levels
       is feasible, because each worker's levels increase with k: the smallest
       R form a prefix of every worker's level sequence.  Hence greedy
       "give the next unit to the worker with the smallest (B_i + 1) / v_i"
       is optimal for this min-max objective with unit increments.
    2. Running that greedy from B_i = lo_i would take R heap steps (R can be
       the whole global batch).  Instead start from the continuous optimum z
       (:func:`_water_level`, Eq. 3 relaxed): B_i = clamp(floor(z v_i), lo_i, hi_i)
       takes exactly the unforced levels <= z, i.e. the first part of the
       greedy's own order, and leaves fewer than n units, which the heap
       distributes.

    Complexity O(n log n) (sorting the kinks plus at most n heap steps):
    ~2-5 ms at 1,000 workers in CPython.  Ties (equal levels) go to the lower
    index, so the result is deterministic.
    """
    n = len(speeds)
    if n == 0:
        raise ValueError("no workers to assign a batch to")
    v = [float(s) for s in speeds]
    if not all(math.isfinite(s) and s > 0 for s in v):
        raise ValueError("every speed must be positive and finite")
    low = _bounds(lo, n, 0.0, "lo")
    high = _bounds(hi, n, math.inf, "hi")
    if any(a < 0 or a > b for a, b in zip(low, high, strict=True)):
        raise ValueError("need 0 <= lo_i <= hi_i for every worker")
    if total < sum(low):
        raise ValueError(f"global batch {total} < sum of the minimum batch sizes {int(sum(low))}")
    if total > sum(high):
        raise ValueError(f"global batch {total} > sum of the maximum batch sizes {int(sum(high))}")
    d = [0.0] * n if offsets is None else [float(x) for x in offsets]
    if len(d) != n or not all(math.isfinite(x) and x >= 0 for x in d):
        raise ValueError("offsets: one finite value >= 0 per worker")

    z = _water_level(total, v, low, high, d)
    sizes = [int(min(max(math.floor((z - o) * s), a), b)) for s, a, b, o in zip(v, low, high, d, strict=True)]
    # Rounding of z can overshoot by a unit here and there: hand back the
    # highest levels first (the reverse of the greedy), which keeps the
    # "prefix of the greedy order" property.
    over = sum(sizes) - total
    if over > 0:
        back = [(-(d[i] + sizes[i] / v[i]), i) for i in range(n) if sizes[i] > low[i]]
        heapq.heapify(back)
        while over > 0:
            _, i = heapq.heappop(back)
            sizes[i] -= 1
            over -= 1
            if sizes[i] > low[i]:
                heapq.heappush(back, (-(d[i] + sizes[i] / v[i]), i))
    heap = [(d[i] + (sizes[i] + 1) / v[i], i) for i in range(n) if sizes[i] < high[i]]
    heapq.heapify(heap)
    for _ in range(total - sum(sizes)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        if sizes[i] < high[i]:
            heapq.heappush(heap, (d[i] + (sizes[i] + 1) / v[i], i))
    return sizes


def makespan(sizes: Sequence[int], speeds: Sequence[float], offsets: Sequence[float] | None = None) -> float:
    """max_i (d_i +) B_i / v_i: the predicted batch processing time of a synchronous step (AntDT Eq. 2)."""
    d = offsets if offsets is not None else [0.0] * len(sizes)
    return max(o + b / s for b, s, o in zip(sizes, speeds, d, strict=True))


@dataclass(frozen=True, slots=True)
class DeviceGroup:
    """One series of devices of AntDT-DD (Eq. 4): n_g devices of per-device speed v_g."""

    name: str
    devices: int  # n_g
    speed: float  # v_g, samples/s of one device
    min_batch: int  # B^min_g: the saturation point (below it a batch costs the same)
    max_batch: int  # B^max_g: the memory limit (95 % of device memory)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """Eq. 4's answer for one group: every device of it trains ``accumulation`` micro-batches of ``batch``."""

    batch: int  # B_g
    accumulation: int  # C_g

    @property
    def samples(self) -> int:
        return self.batch * self.accumulation


def balance_groups(
    total: int, groups: Sequence[DeviceGroup], c_min: int = 1, c_max: int = 5
) -> dict[str, GroupPlan]:
    """Exact solution of AntDT-DD's Eq. 4: per group, B_g and C_g with sum_g n_g C_g B_g = ``total``.

    Method (exact, for the few device series that a cluster has):

    * Only the product S_g = C_g * B_g (samples per device per step) enters
      the objective and the sum, so group g can take any S in
      A_g = {c * b : Cmin <= c <= Cmax, Bmin_g <= b <= Bmax_g}.
    * The optimal z = max_g S_g / v_g is one of the candidates s / v_g
      (s in A_g).  For a threshold z, group g may take any S in A_g with
      S <= z v_g, and z is feasible iff some choice gives sum n_g S_g = total
      exactly: a subset-sum over k groups, checked with a bitset (a Python
      int whose bit t says "t samples are reachable").  Feasibility is
      monotone in z, so a binary search over the sorted candidates finds the
      smallest feasible z, i.e. the optimum of Eq. 4 (latent variable z as in
      Eq. 3).
    * From the bitsets of the optimal z the choice is rebuilt group by group,
      taking the largest reachable S_g first; each S_g is then split as the
      fewest accumulation steps C_g (largest B_g within memory): with the
      linear time model of Eq. 4 this costs the same time, and AntDT-DD's
      point is that every device runs near its full batch (§VI-B, Fig. 9).

    Cost: O(log |A| * sum_g |A_g| * total / 64) word operations, with
    |A_g| <= (Cmax - Cmin + 1) * (Bmax_g - Bmin_g + 1); tens of ms for
    total ~ 64k and a few groups.  AntDT-DD decides once per job.  Raises
    ``ValueError`` when no (B_g, C_g) meets the bounds and the sum exactly.
    """
    if not groups:
        raise ValueError("no device groups")
    if not 1 <= c_min <= c_max:
        raise ValueError("need 1 <= c_min <= c_max")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError("device group names must be unique")
    for g in groups:
        if g.devices <= 0 or not (math.isfinite(g.speed) and g.speed > 0):
            raise ValueError(f"group {g.name}: needs devices > 0 and a positive speed")
        if not 1 <= g.min_batch <= g.max_batch:
            raise ValueError(f"group {g.name}: need 1 <= min_batch <= max_batch")

    # A_g, sorted, restricted to what fits in the global batch at all.
    choices: list[list[int]] = []
    for g in groups:
        cap = total // g.devices
        products = {c * b for c in range(c_min, c_max + 1) for b in range(g.min_batch, min(g.max_batch, cap // c) + 1)}
        if not products:
            raise ValueError(f"group {g.name}: even {c_min} x {g.min_batch} per device exceeds the global batch {total}")
        choices.append(sorted(products))

    mask = (1 << (total + 1)) - 1

    def reach(z: float) -> list[int] | None:
        """Bitsets of the sums reachable by the first g groups under makespan z (None: infeasible)."""
        sets = [1]
        for g, opts in zip(groups, choices, strict=True):
            limit = z * g.speed * (1 + 1e-12)  # a candidate must admit itself despite rounding
            prev, acc = sets[-1], 0
            for s in opts:
                if s > limit:
                    break
                acc |= prev << (g.devices * s)
            acc &= mask
            if not acc:
                return None
            sets.append(acc)
        return sets if (sets[-1] >> total) & 1 else None

    candidates = sorted({s / g.speed for g, opts in zip(groups, choices, strict=True) for s in opts})
    lo, hi = 0, len(candidates) - 1
    if reach(candidates[hi]) is None:
        raise ValueError(f"no per-group batch and accumulation sums to the global batch {total} within the bounds")
    while lo < hi:
        mid = (lo + hi) // 2
        if reach(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    z = candidates[lo]
    sets = reach(z)
    assert sets is not None

    plan: dict[str, GroupPlan] = {}
    remaining = total
    for idx in range(len(groups) - 1, -1, -1):
        g, below = groups[idx], sets[idx]
        limit = z * g.speed * (1 + 1e-12)
        for s in reversed(choices[idx]):
            rest = remaining - g.devices * s
            if s <= limit and rest >= 0 and (below >> rest) & 1:
                break
        else:  # pragma: no cover - the bitsets say a choice exists
            raise AssertionError("Eq. 4 reconstruction failed")
        c = next(c for c in range(c_min, c_max + 1) if s % c == 0 and g.min_batch <= s // c <= g.max_batch)
        plan[g.name] = GroupPlan(batch=s // c, accumulation=c)
        remaining = rest
    return {name: plan[name] for name in names}
