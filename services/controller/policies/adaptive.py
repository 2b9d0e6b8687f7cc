"""Pacer-adaptive: AntDT-ND's actions, chosen by their time cost and gain, with thresholds from the measured noise.

AntDT-ND (:mod:`.antdt_nd`) stays the paper's reference; this policy keeps its
actions (AntDT Table II) and changes when and how they are taken:

1. **lambda from the noise.**  The healthy nodes' BPT spread sets the
   slowness ratio instead of a fixed 1.5: with sigma = 1.4826 x the median
   absolute deviation of the faster half of the live workers'
   ``slowdown_short`` (stragglers only add time, so the spread of the faster
   half is the noise even when a wave slows up to half of them; a worker's
   BPT is first moved to the median batch along the fitted line of 2., so
   the unequal batches of an earlier ADJUST_BS do not read as noise),
   ``lambda = 1 + max(lambda_floor - 1, k x sigma)``
   (``params.lambda_floor``, default 1.05; ``params.noise_k``, default 4),
   never above ``params.lambda`` / the monitor's lambda.  Quiet clusters get
   a tight lambda (a 1.25x worker at intensity 0.1 is acted on), noisy ones a
   loose one (no churn on noise).  The PS use the same rule over the PS.
2. **Additive straggler model for ADJUST_BS.**  AntDT Eq. 1 splits a step
   into T_w + T_s + T_m; a straggler's delay (resource contention, the
   injected sleep of §VII-A4) is a time per step, not a slower sample rate.
   Per worker, d_i = BPT_i - (T_s + p x B_i C_i) with the per-sample time p
   and the shared T_s taken from the healthy workers and the PS; the batch
   sizes then minimise max_i (d_i + p B_i) (AntDT Eq. 3 with an offset per
   worker, :func:`.batch.balance` with ``offsets``).  The proportional model
   of Eq. 3 gives a slow worker too much work when its delay is fixed and
   needs several rounds to converge; this one lands in one.
3. **Backup workers while transient stragglers last** (BSP).  Decisions come
   every few minutes; a worker that turns slow in between holds up every
   step until the next round.  With b = 1 backup worker (Sync-OPT) each step
   drops the slowest gradient at once, so one fresh straggler costs one
   worker's share instead of the whole step.  b is set to
   ``params.backup`` (default 1; only while the short window, and so the
   time between rounds, is at least ``params.backup_window_s``, default
   120 s) while any worker is slow over L_trans or
   a relaunched worker has not reported yet (it may bring its slowness
   back, at B / n), and back to 0 when no worker is slow, and in the end
   game (the dropped samples are trained again later: the shard service
   re-queues them, so dropping costs throughput, never data; but with no
   shard left to hand out a dropped gradient only delays the last shards).
   ADJUST_BS is re-sent only when the predicted step (of the workers that
   train, without those beyond balancing) gains more than the noise,
   max(2 %, 2 sigma): hysteresis, so short windows do not make the batches
   flap (each ADJUST_BS is a synchronised action).
   End game (BSP, no shard left to hand out): workers without data (no
   report in the short window, or no samples) train nothing, so their B_i
   goes to the workers that still hold shards, each up to
   ``params.endgame_batch_factor`` (default 2) x B / n and ``max_batch``:
   the last shards end in fewer steps.
4. **KILL_RESTART by time cost vs gain** (AntDT §V-E2: a relaunch costs the
   pending time plus rebuilding the world, the gain is the straggler's
   share of the remaining time).  With R = the remaining records over the
   current throughput (the time left if nothing is done):

   * a PS slow over the short window (both windows >= lambda; no need to
     wait for L_per's confirmation when the ratio is clear) slows every step
     by its extra T_s (Eq. 1, T_s = max_j T_ij^s), a fraction
     f = (T_s,slow - T_s,healthy) / BPT of the time.  Left alone the job
     takes R; a stop-and-restart pauses training p + init and then runs
     fast: ``p + init + R (1 - f)``; a seamless migration (DLRover-RM §5.2)
     keeps the slow PS serving while the replacement starts (p + s), then
     pauses init: ``p + s + init + (R - p - s)(1 - f)``.  The cheapest of the
     three is taken, and the choice goes to the executor in the action's
     payload ``{"migration": "restart" | "seamless"}``.  Seamless wins
     exactly when f < p / (p + s): a mildly slow PS.
   * a worker slow over L_per (its long-window delay at today's batch at
     least half of its short-window one: slow for most of L_per, not a
     burst that a short window shows in full) that was never relaunched
     (a node still slow after a relaunch carries its slowness with it) loses
     the fraction x = min(1, d_i / t) of its share under balanced batches
     (t: the balanced step's compute time).  A relaunch takes the worker out
     for p + init, costing that share for that long: restart when
     ``x x H > p + init`` with the gain horizon H = max(L_per,
     ``params.restart_horizon_s``, default 600 s): a straggler slow over the
     whole long window is expected to stay slow at least that long again;
     H is capped by the time left R.  The slowest goes first (the
     controller allows one restart per cool-down window).

   * end game (BSP, no shard left to hand out): a worker whose delay alone
     exceeds the balanced step is relaunched whatever its history; it holds
     a shard that only it would finish (a dropped gradient does not advance
     it), and the relaunch gives the shard back to the fast workers.

   p, init and s: ``params.pending_s`` (default: the longest pending time
   the monitor saw on this job's nodes, else 20 s), ``params.init_s``
   (default: the longest start-up the monitor measured on this job's
   workers, pod running to first step, ``NodeStats.init_s``; else 100 s) and
   ``params.ps_start_s`` (default 30 s).
   Measured, not assumed: a 45-s job whose workers start in 5 s is not
   priced like a large model that takes minutes to build.

ASP: KILL_RESTART only (as AntDT-ND; dynamic sharding already moves work
away from slow workers), with the same cost/gain rule; the gain of a worker
relaunch in ASP is its lost rate x = d_i / BPT_i.

Pure: no IO, no clock; every number comes from the request.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import Liveness, NodeStats
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest

from . import batch_caps, current_assignment, is_worker, live_servers, live_workers, param_float
from .batch import balance, makespan

NAME = "pacer-adaptive"

DEFAULT_PENDING_S = 20.0
DEFAULT_INIT_S = 100.0
DEFAULT_PS_START_S = 30.0
IDLE_OFFSET_S = 1e6  # a worker without data, for the solver: it gets only what the training workers cannot take


@dataclass(frozen=True, slots=True)
class Noise:
    """The slowness ratio this round uses, and the spread it came from."""

    lam: float
    sigma: float
    samples: int


def noise_lambda(req: PolicyRequest, nodes: list[NodeStats], slowdowns: list[float] | None = None) -> Noise:
    """lambda from the robust spread of ``nodes``' short-window slowdowns (see the module docstring, 1.);
    ``slowdowns``: use these instead (the workers' at one batch size, :func:`batch_neutral_slowdowns`)."""
    cap = param_float(req, "lambda", req.stats.slowness_ratio)
    floor = min(cap, max(1.0, param_float(req, "lambda_floor", 1.05)))
    raw = slowdowns if slowdowns is not None else [n.slowdown_short for n in nodes]
    vals = sorted(v for v in raw if v > 0)
    if len(vals) < 3:
        return Noise(cap, 0.0, len(vals))
    # Stragglers only add time: the spread is read off the faster half alone, so a wave that slows
    # up to half of the nodes does not pass for noise.
    fast = vals[: (len(vals) + 1) // 2]
    med = statistics.median(fast)
    sigma = 1.4826 * statistics.median(abs(v - med) for v in fast)
    lam = 1.0 + max(floor - 1.0, param_float(req, "noise_k", 4.0) * sigma)
    return Noise(min(cap, lam), sigma, len(vals))


@dataclass(frozen=True, slots=True)
class Costs:
    """Time costs of a relaunch (AntDT §V-E2), seconds."""

    pending_s: float
    init_s: float
    ps_start_s: float


def costs(req: PolicyRequest) -> Costs:
    """p, init and s (module docstring, 4.): the job's params, else what the monitor measured, else defaults."""
    nodes = req.stats.nodes
    seen = max((n.pending_s for n in nodes), default=0.0)
    init = max((n.init_s for n in nodes if is_worker(n)), default=0.0)
    return Costs(
        pending_s=param_float(req, "pending_s", seen if seen > 0 else DEFAULT_PENDING_S),
        init_s=param_float(req, "init_s", init if init > 0 else DEFAULT_INIT_S),
        ps_start_s=param_float(req, "ps_start_s", DEFAULT_PS_START_S),
    )


def remaining_s(req: PolicyRequest) -> float:
    """R: the time left if nothing changes (records left / current throughput); inf when unknown.

    The monitor's throughput is the sum of the workers' own speeds.  In BSP a
    step is as slow as its slowest worker whose gradient is not dropped, so
    the job's pace is at most the global batch per that worker's step: a
    sum of speeds would take a job held up by one straggler for nearly done
    (a 45 s job of two workers, one 20x slow, read as 4 s left, and no
    relaunch ever paid off).
    """
    sh = req.stats.shards
    rate = req.stats.throughput_samples_per_s
    if req.mode == "bsp":
        bpts = sorted((w.bpt_short_s for w in live_workers(req.stats) if w.bpt_short_s > 0), reverse=True)
        if bpts:
            pace = req.global_batch / bpts[min(max(0, req.backup_workers), len(bpts) - 1)]
            rate = min(rate, pace) if rate > 0 else pace
    if sh is None or sh.records_total <= 0 or rate <= 0:
        return float("inf")
    return max(0.0, sh.records_total - sh.records_done) / rate


def ps_choice(f: float, r: float, c: Costs) -> tuple[str, dict[str, float]]:
    """The cheapest of leaving a slow PS, a stop-and-restart and a seamless migration (module docstring, 4.)."""
    keep = r
    restart = c.pending_s + c.init_s + r * (1 - f)
    start = c.pending_s + c.ps_start_s
    seamless = start + c.init_s + max(0.0, r - start) * (1 - f) if r > start else r + c.init_s
    totals = {"none": keep, "restart": restart, "seamless": seamless}
    best = min(totals, key=lambda k: (totals[k], k != "none"))
    return best, totals


@dataclass(frozen=True, slots=True)
class WorkerModel:
    """The additive model of the live workers' step (module docstring, 2.)."""

    names: list[str]
    per_sample: float  # p, seconds per sample of a healthy worker
    shared_s: float  # T_s + T_m estimate, seconds per step
    delays: dict[str, float]  # d_i
    noise_s: float  # delays up to this are noise


@dataclass(frozen=True, slots=True)
class LineFit:
    """The healthy workers' line BPT = shared + p x samples, and the assignment it was read at."""

    sizes: dict[str, int]
    accs: dict[str, int]
    have: list[NodeStats]  # the workers with a BPT and a batch
    per_sample: float
    shared_s: float


def fit_line(req: PolicyRequest, workers: list[NodeStats]) -> LineFit | None:
    """p and T_s + T_m of the additive model (see :func:`worker_model`); None without data."""
    sizes, accs = current_assignment(req, workers)
    have = [w for w in workers if w.bpt_short_s > 0 and sizes[w.node] > 0]
    if not have:
        return None
    ps = [n.bpt_short_s for n in live_servers(req.stats) if n.bpt_short_s > 0]
    floor = statistics.median(ps) if ps else 0.0  # T_s: the shared part is at least the PS time
    shared = floor
    rates = sorted((w.bpt_short_s - shared) / (sizes[w.node] * accs[w.node]) for w in have)
    if rates[0] <= 0:
        shared = 0.0
        rates = sorted(w.bpt_short_s / (sizes[w.node] * accs[w.node]) for w in have)
    p = rates[(len(rates) - 1) // 4]
    fit = _lower_line(have, sizes, accs, floor)
    # The envelope refines p (it sees the communication time the PS do not report) but may not overturn
    # it: a nearly flat envelope means the small batches are still slow, not that compute is free.
    if fit is not None and 0.5 * p <= fit[0] <= 1.5 * p:
        p, shared = fit
    return LineFit(sizes, accs, have, p, shared)


def batch_neutral_slowdowns(line: LineFit) -> list[float]:
    """Each worker's BPT as if it ran the median batch, over the median of those.

    After an ADJUST_BS the workers run different batches, so their BPTs differ by p x (S_i - S_j) with
    nobody slow: read as noise, that spread would blind lambda to the very stragglers the batches were
    cut for (a wave of recovered workers on small batches once read as sigma 0.17).  With equal batches
    these are the monitor's ``slowdown_short``."""
    samples = {w.node: line.sizes[w.node] * line.accs[w.node] for w in line.have}
    mid = statistics.median(samples.values())
    adj = [w.bpt_short_s - line.per_sample * (samples[w.node] - mid) for w in line.have]
    med = statistics.median(adj)
    return [a / med for a in adj] if med > 0 else []


def worker_model(req: PolicyRequest, workers: list[NodeStats], lam: float,
                 line: LineFit | None = None) -> WorkerModel | None:
    """Fit the additive step model to the short window: p, T_s + T_m and each worker's extra delay d_i.

    The per-sample time p is the lower quartile of (BPT_i - T_s) / (B_i C_i)
    over the workers: stragglers only add time, so the fastest quarter are
    healthy even when a wave slows many workers at once.  d_i is what is
    left of BPT_i after the model's compute and T_s; it is kept whether or
    not the worker *looks* slow (a straggler whose batch was already cut
    runs as fast as its peers, but its delay is still there), and taken as 0
    below the noise: (lambda - 1) x the typical BPT.
    """
    line = line or fit_line(req, workers)
    if line is None:
        return None
    sizes, accs, have, p, shared = line.sizes, line.accs, line.have, line.per_sample, line.shared_s
    typical = statistics.median(w.bpt_short_s for w in have)
    noise = (lam - 1.0) * typical
    delays: dict[str, float] = {}
    for w in workers:
        d = w.bpt_short_s - shared - p * sizes[w.node] * accs[w.node] if w.bpt_short_s > 0 else 0.0
        delays[w.node] = d if d > noise else 0.0
    return WorkerModel([w.node for w in workers], p, shared, delays, noise)


def _lower_line(have: list[NodeStats], sizes: dict[str, int], accs: dict[str, int],
                floor: float) -> tuple[float, float] | None:
    """(p, T_s + T_m) from the lower envelope of BPT over the batch, when the workers run different batches.

    Stragglers only add time, so healthy workers lie on the lowest line
    BPT = shared + p x samples.  The largest batch goes to healthy workers
    (that is what a balanced assignment does), so the envelope's last edge
    runs from the largest batch to the point j that maximises the slope
    (T_big - T_j) / (S_big - S_j): every other point lies above it.  Kept only
    if physical (p > 0, shared >= the PS time); None otherwise, e.g. when the
    smaller batches are still slow and the envelope is flat.
    """
    low: dict[int, float] = {}
    for w in have:
        samples = sizes[w.node] * accs[w.node]
        low[samples] = min(low.get(samples, w.bpt_short_s), w.bpt_short_s)
    if len(low) < 2:
        return None
    big = max(low)
    slope = max((low[big] - t) / (big - b) for b, t in low.items() if b != big)
    shared = low[big] - slope * big
    if slope <= 0 or shared < floor:
        return None
    return slope, shared


def _working_step(sizes: list[int], speeds: list[float], delays: list[float], lo: int) -> float:
    """The balanced step's compute time t of the workers that get more than the minimum batch
    (a worker whose delay alone exceeds t is left at the minimum: "hopeless", it waits for nobody)."""
    times = [d + b / v for b, v, d in zip(sizes, speeds, delays, strict=True) if b > lo or d == 0]
    return max(times) if times else makespan(sizes, speeds, delays)


def decide(req: PolicyRequest) -> PolicyDecision:
    stats = req.stats
    workers = live_workers(stats)
    servers = live_servers(stats)
    line = fit_line(req, workers) if workers else None
    wn = noise_lambda(req, workers, batch_neutral_slowdowns(line) if line is not None else None)
    sn = noise_lambda(req, servers)
    c = costs(req)
    r = remaining_s(req)
    blocked = set(req.restart_blocked)
    actions: list[PolicyAction] = []
    notes: list[str] = [f"lambda {wn.lam:.3g} (workers, sigma {wn.sigma:.2g}), {sn.lam:.3g} (PS)"]

    # ---- servers: act on a clear short-window signal, restart vs seamless by cost.
    median_bpt = statistics.median([w.bpt_short_s for w in workers if w.bpt_short_s > 0] or [0.0])
    ps_bpts = sorted(n.bpt_short_s for n in servers if n.bpt_short_s > 0)
    ps_typical = ps_bpts[(len(ps_bpts) - 1) // 2] if ps_bpts else 0.0  # the lower median: with 2 PS, the healthy one
    for n in sorted(servers, key=lambda s: -s.slowdown_short):
        if not (n.slowdown_short >= sn.lam and n.slowdown_long >= sn.lam):
            continue
        what = f"{n.node} BPT {n.slowdown_short:.2f}x its peers over L_trans"
        if n.node in blocked or stats.cluster_busy:
            notes.append(f"{what}, but {'in cool-down' if n.node in blocked else 'the cluster is busy'}")
            continue
        f = min(1.0, max(0.0, (n.bpt_short_s - ps_typical) / median_bpt)) if median_bpt > 0 else 0.0
        how, totals = ps_choice(f, r, c)
        est = ", ".join(f"{k} {v:.0f}s" for k, v in totals.items())
        if how == "none":
            notes.append(f"{what}: a relaunch costs more than it gains ({est})")
            continue
        actions.append(PolicyAction(
            kind=ActionKind.KILL_RESTART, node=n.node, payload={"migration": how},
            reason=f"{what}: {how} (AntDT §V-E2 time cost vs gain, slow fraction {f:.2f}; {est})"))
        break  # one PS per round: the controller allows one relaunch per window anyway

    # ---- workers
    model = worker_model(req, workers, wn.lam, line) if workers else None
    restarting: set[str] = set()
    outlier = param_float(req, "restart_outlier", 2.0)
    if model is not None and not actions:
        sizes, accs = current_assignment(req, workers)
        speeds = [1.0 / model.per_sample] * len(model.names)
        caps = batch_caps(req, model.names)
        d = [model.delays[x] for x in model.names]
        try:
            target = balance(req.global_batch, speeds, lo=req.min_batch, hi=caps, offsets=d)
            t_bal = _working_step(target, speeds, d, req.min_batch)
        except ValueError:
            target, t_bal = [], 0.0
        slow_d = sorted(v for v in model.delays.values() if v > 0)
        # End game: no shard left to hand out.  A worker whose delay exceeds the balanced step holds a
        # shard that only it can finish (its dropped gradients do not advance it), and the whole job will
        # wait for it: a relaunch gives the shard back to the fast workers at once (the shard service
        # re-queues it), whatever the worker's history.
        sh = stats.shards
        endgame = sh is not None and sh.todo == 0 and sh.doing > 0 and not sh.finished and req.mode == "bsp"
        for w in sorted(workers, key=lambda x: -model.delays[x.node]):
            di = model.delays[w.node]
            if endgame and t_bal > 0 and di >= t_bal and w.node not in blocked and not stats.cluster_busy:
                actions.append(PolicyAction(
                    kind=ActionKind.KILL_RESTART, node=w.node,
                    reason=(f"{w.node} {di:.2f}s extra per step, beyond any batch, with no shard left to hand "
                            "out: relaunch so its shard goes to the fast workers")))
                restarting.add(w.node)
                break
            # Slow over L_per too: the long window's BPT, at today's batch, still leaves a delay (a batch cut
            # within the window only makes the old samples look slower, never hides a delay), and at least
            # half of today's: slow for most of L_per, not a burst that a short window already shows in full.
            d_long = w.bpt_long_s - model.shared_s - model.per_sample * sizes[w.node] * accs[w.node]
            if di <= 0 or d_long <= max(model.noise_s, 0.5 * di) or w.restarts > 0:
                continue
            others = list(slow_d)
            others.remove(di)
            if others and di < outlier * statistics.median(others):
                continue  # one of a wave of equally slow workers: transient contention, a relaunch would not cure it
            if w.node in blocked or stats.cluster_busy:
                continue
            if req.mode == "bsp":
                x = min(1.0, di / t_bal) if t_bal > 0 else 1.0
            else:
                x = min(1.0, di / w.bpt_short_s) if w.bpt_short_s > 0 else 0.0
            horizon = min(r, max(stats.window_long_s, param_float(req, "restart_horizon_s", 600.0)))
            gain, cost = x * horizon, c.pending_s + c.init_s
            if gain > cost:
                actions.append(PolicyAction(
                    kind=ActionKind.KILL_RESTART, node=w.node,
                    reason=(f"{w.node} {di:.2f}s extra per step over L_per ({w.slowdown_long:.2f}x): loses {x:.0%} "
                            f"of its share, gain {gain:.0f}s > relaunch {cost:.0f}s (AntDT §V-E2)")))
                restarting.add(w.node)
                break
        if req.mode == "bsp":
            if restarting:  # sized as a healthy worker: it comes back fresh
                d = [0.0 if x in restarting else model.delays[x] for x in model.names]
                try:
                    target = balance(req.global_batch, speeds, lo=req.min_batch, hi=caps, offsets=d)
                    t_bal = _working_step(target, speeds, d, req.min_batch)
                except ValueError:
                    target = []
            # End game: a worker with no data left trains nothing (no report, or only empty steps), so its
            # B_i is lost to the step; the workers that still hold shards take the global batch (each at most
            # endgame_batch_factor x B / n, and max_batch), and finish their shards in fewer steps.
            idle = {w.node for w in workers if w.bpt_short_s <= 0 or w.speed_samples_per_s <= 0} if endgame else set()
            busy = [x not in idle for x in model.names]
            if target and idle and any(busy):
                cap = int(param_float(req, "endgame_batch_factor", 2.0) * req.global_batch / len(model.names))
                cap = max(req.min_batch, min(cap, req.max_batch) if req.max_batch else cap)
                try:
                    target = balance(req.global_batch, speeds, lo=req.min_batch,
                                     hi=[min(cap, c) if b else c for b, c in
                                         zip(busy, caps or [req.global_batch] * len(busy), strict=True)],
                                     offsets=[v if b else IDLE_OFFSET_S for v, b in zip(d, busy, strict=True)])
                except ValueError:
                    pass  # the bounds do not fit: keep the balanced target
            if target:
                # The step that batches can shorten: of the workers that train, without those whose delay alone
                # exceeds the balanced step (they get the minimum batch and are dropped as backup workers; their
                # time would hide every other change).
                held = [i for i, b in enumerate(busy) if b and not (t_bal > 0 and d[i] >= t_bal)] \
                    or list(range(len(busy)))

                def step(bs: list[int]) -> float:  # the compute of a step of the workers that train
                    return makespan([bs[i] for i in held], [speeds[i] for i in held], [d[i] for i in held])

                now_t = step([sizes[x] * accs[x] for x in model.names])
                tol = max(0.02, 2 * wn.sigma)
                best_t = step(target)
                changed = any(sizes[x] != b or accs[x] != 1 for x, b in zip(model.names, target, strict=True))
                # Hysteresis: re-balance only for a predicted gain above the noise (tol), so a short window's
                # noise does not make the batches flap (each ADJUST_BS is a synchronised action).  In the end
                # game the gain is fewer steps, not a shorter one: any change that moves batch to them counts.
                if changed and (now_t > best_t * (1 + tol) or (idle and any(busy))):
                    actions.append(PolicyAction(
                        kind=ActionKind.ADJUST_BS,
                        payload={"batch_sizes": dict(zip(model.names, target, strict=True)),
                                 "accumulations": {x: 1 for x in model.names}},
                        reason=(f"additive model (Eq. 1): {sum(1 for v in d if v > 0)} worker(s) with extra delay, "
                                f"predicted compute {now_t:.3g}s -> {best_t:.3g}s per step (Eq. 3 with offsets)"
                                + (f"; end game: {len(idle)} worker(s) without data give their batch to the "
                                   f"{sum(busy)} that train" if idle and any(busy) else ""))))
            # Backup workers (Sync-OPT): a spare while transient stragglers last (a new one between two rounds
            # is then dropped at once instead of holding up every step), plus one per "hopeless" worker whose
            # delay alone exceeds the balanced step (Eq. 3 gives it the minimum batch, so dropping it costs
            # nothing); none once no worker is slow.
            # A worker being relaunched counts as it is now: if its slowness follows it (transient contention
            # on its host), it comes back slow, with the spec's B / n, and is dropped instead of holding the step.
            slow_now = [w for w in workers if model.delays[w.node] > 0]
            hopeless = [x for x in model.names if t_bal > 0 and model.delays[x] >= t_bal]
            # A relaunched worker that has not reported yet may bring its slowness back (contention on its
            # host follows it), at the spec's B / n: the spare stays until it has shown its speed.
            returning = [n.node for n in stats.nodes if is_worker(n) and n.restarts > 0 and (
                n.state is Liveness.PENDING or (n.state is Liveness.RUNNING and n.bpt_short_s <= 0))]
            spare = max(0, int(param_float(req, "backup", 1)))
            if stats.window_short_s < param_float(req, "backup_window_s", 120.0):
                # Rounds come every short window: a fresh straggler is balanced out within one, and a spare
                # would drop one worker's share of every step meanwhile (measured: worker side, BSP, SI 0.8,
                # 10 seeds, 30-60 s windows: +16.0 % with the spare, +13.5 % without).
                spare = 0
            if (not (slow_now or returning) or len(slow_now) - len(hopeless) > len(workers) * param_float(req, "wave_fraction", 0.25)
                    or endgame):
                # None left, or they come in waves (above a quarter of the workers): one dropped gradient
                # cannot hold such a step and would only waste a worker's share (balancing does the work).
                # End game: a dropped gradient does not advance its shard, and the job waits for every shard.
                spare = 0
            # Never drop more than that fraction of the gradients of the workers that stay (a small job
            # cannot afford a dropped gradient per step; the core also keeps b below the live workers).
            most = int((len(workers) - len(restarting)) * param_float(req, "wave_fraction", 0.25))
            b = min(len(hopeless) + spare, most, len(workers) - 1) if slow_now or returning else 0
            if b != req.backup_workers:
                actions.append(PolicyAction(
                    kind=ActionKind.BACKUP_WORKERS, payload={"backup": b},
                    reason=(f"{len(slow_now)} transient straggler(s) ({len(hopeless)} beyond balancing, "
                            f"{len(returning)} relaunched not yet reporting): drop the "
                            f"slowest {b} gradient(s) per step while they last" if b
                            else "no transient straggler left: no backup workers")))
    elif model is None and workers:
        notes.append("no worker throughput data yet")

    reason = "; ".join([*notes, f"{len(actions)} action(s)"])
    return PolicyDecision(job=req.job, policy=NAME, actions=actions, reason=reason)
