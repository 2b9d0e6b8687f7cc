"""The physical bound of a straggler scenario: what a per-step oracle could reach in the simulator's step model.

The simulator's step (AntDT Eq. 1, see :mod:`.engine`): worker i takes
``C_i B_i / v_i + d_i(t)`` to compute, plus ``T_s(t) = ps_time_s + max_j
d_j(t)`` at the PS and ``T_m = comm_s``; a straggler's delay d(t) is a fixed
time per step while its pattern is on.  The oracle knows every d(t) at every
step, at no cost:

* **BSP**: each step it picks the batch sizes that minimise the step
  (continuous B_i >= 0, sum B_i = B): the water level t with
  ``sum_i v_i max(0, t - d_i) = B``.  A worker with d_i >= t gets nothing,
  which is also the best any number of backup workers could do (a dropped
  gradient's samples are trained again later: the same as B_i = 0), so this
  bounds ADJUST_BS, BACKUP_WORKERS and their combination.  Step = t + T_s + T_m.
* **ASP**: every worker runs its own steps at the job's B / n (ASP batches
  are not resized; dynamic sharding hands out work with no tail), so the
  job's rate is ``sum_i (B / n) / (B / (n v_i) + d_i + T_s + T_m)``.
* **Relaunches**: a straggler whose slowness does not follow a relaunch
  (``follows_restart: false``) may be relaunched at t = 0, costing what the
  simulator charges: a worker is gone ``pending_s + init_s`` (the others go
  on), a PS pauses the job ``pending_s + init_s`` (stop-and-restart) or
  serves slowly ``pending_s + ps_start_s`` and then pauses ``init_s``
  (seamless); the oracle takes the cheaper, and relaunches only if that beats
  keeping the straggler.  Transient patterns follow a relaunch: nothing to
  gain.

The work is ``records x epochs`` samples, integrated between the pattern
changes (the delays are piecewise constant), so the oracle has no shard
granularity, no decision latency and no measurement windows.  Results are
reported as the gap ``bound_jct / free_jct - 1`` against the same integral
without stragglers (``free_jct``), which is how far above the straggler-free
JCT no policy in this model can go below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pacer.contracts.common import Role
from pacer.trainer.straggler import Pattern

from .scenario import Scenario


@dataclass(frozen=True, slots=True)
class Bound:
    """The oracle's JCT and the straggler-free JCT of the same integral, seconds."""

    jct_s: float
    free_jct_s: float
    relaunched: tuple[str, ...]  # stragglers the oracle relaunches at t = 0 (and how, for a PS)

    @property
    def gap_pct(self) -> float:
        return (self.jct_s / self.free_jct_s - 1) * 100


def _water_level(total: float, speeds: list[float], delays: list[float]) -> float:
    """The t with sum_i v_i max(0, t - d_i) = total (continuous ADJUST_BS of one step)."""
    order = sorted(range(len(speeds)), key=lambda i: delays[i])
    rate, acc = 0.0, 0.0  # sum of v over the workers in, sum of v d over them
    for k, i in enumerate(order):
        rate += speeds[i]
        acc += speeds[i] * delays[i]
        t = (total + acc) / rate
        nxt = delays[order[k + 1]] if k + 1 < len(order) else math.inf
        if t <= nxt:
            return t
    return math.inf  # pragma: no cover - the last segment always holds


def _integrate(sc: Scenario, worker_out: dict[int, float], pause: tuple[float, float],
               slow_ps_until: float, cured: set[str]) -> float:
    """JCT of the oracle: ``worker_out`` {worker: back at}, ``pause`` (from, to) with no training,
    PS stragglers not in ``cured`` slow until ``slow_ps_until`` for the cured ones."""
    c, j = sc.cluster, sc.job
    n = c.workers
    speeds = c.speeds()
    work = float(j.records * j.epochs)
    wpat: list[list[Pattern]] = [[] for _ in range(n)]
    ppat: list[tuple[str, Pattern]] = []
    on: dict[str, int] = {}
    for k, s in enumerate(sc.stragglers):
        # Named as the engine names them, so the seeded draws are the same.
        seen = on.get(s.node, 0)
        on[s.node] = seen + 1
        pat = s.spec(sc.seed).on(s.node if not seen else f"{s.node}#{seen}")
        key = f"{s.node}#{k}"
        if s.side is Role.WORKER:
            if key not in cured:
                wpat[int(s.node.rsplit("-", 1)[1])].append(pat)
        else:
            ppat.append((key, pat))
    t, done = 0.0, 0.0
    while done < work:
        if pause[0] <= t < pause[1]:
            t = pause[1]
            continue
        nxt = math.inf
        d = []
        alive = []
        for i in range(n):
            if t < worker_out.get(i, 0.0):
                nxt = min(nxt, worker_out[i])
                continue
            di = 0.0
            for p in wpat[i]:
                v, ch = p.at(t)
                di += v
                nxt = min(nxt, ch)
            d.append(di)
            alive.append(speeds[i])
        ps = 0.0
        for key, p in ppat:
            if key in cured and t >= slow_ps_until:
                continue
            v, ch = p.at(t)
            ps = max(ps, v)
            nxt = min(nxt, ch)
        if t < slow_ps_until:
            nxt = min(nxt, slow_ps_until)
        if t < pause[0]:
            nxt = min(nxt, pause[0])
        shared = c.ps_time_s + ps + c.comm_s
        if j.mode == "bsp":
            # With a worker out, the live ones train either the whole B (an ADJUST_BS naming them) or their
            # own shares (the simulator's default while a worker is away): the oracle takes the faster.
            rate = max(total / (_water_level(total, alive, d) + shared)
                       for total in (float(j.global_batch), j.global_batch * sum(alive) / sum(speeds)))
        else:
            b = j.global_batch / n
            rate = sum(b / (b / v + di + shared) for v, di in zip(alive, d, strict=True))
        span = nxt - t
        if done + rate * span >= work:
            return t + (work - done) / rate
        done += rate * span
        t = nxt
    return t


def bound(sc: Scenario) -> Bound:
    """The oracle's JCT for ``sc`` (module docstring): the best of relaunching each curable straggler or not."""
    c = sc.cluster
    free = _integrate(replace(sc, stragglers=()), {}, (0.0, 0.0), 0.0, set())
    relaunch = c.pending_s + c.init_s
    curable = [(k, s) for k, s in enumerate(sc.stragglers) if not s.follows_restart and s.intensity * s.sleep_s > 0]
    best = _integrate(sc, {}, (0.0, 0.0), 0.0, set())
    how: tuple[str, ...] = ()
    # The oracle tries: relaunch every curable worker straggler at t = 0; and for the PS, stop-and-restart
    # or seamless (both on top of the worker choice).  Few stragglers are curable in practice: 2^k is fine.
    workers = [(k, s) for k, s in curable if s.side is Role.WORKER]
    servers = [(k, s) for k, s in curable if s.side is Role.PS]
    for wmask in range(1 << len(workers)):
        chosen_w = [workers[i] for i in range(len(workers)) if wmask >> i & 1]
        out = {int(s.node.rsplit("-", 1)[1]): relaunch for _, s in chosen_w}
        cured_w = {f"{s.node}#{k}" for k, s in chosen_w}
        for ps_how in ("keep", "restart", "seamless") if servers else ("keep",):
            cured = set(cured_w)
            pause, slow_until = (0.0, 0.0), 0.0
            if ps_how != "keep":
                cured |= {f"{s.node}#{k}" for k, s in servers}
                if ps_how == "restart":
                    pause = (0.0, relaunch)
                else:
                    slow_until = c.pending_s + c.ps_start_s
                    pause = (slow_until, slow_until + c.init_s)
            jct = _integrate(sc, out, pause, slow_until, cured)
            if jct < best - 1e-9:
                best = jct
                how = tuple(f"{s.node}" for _, s in chosen_w) + (
                    tuple(f"{s.node} ({ps_how})" for _, s in servers) if ps_how != "keep" else ())
    return Bound(jct_s=best, free_jct_s=free, relaunched=how)
