"""Pure core of the controller: what a policy is asked, and which of its actions are carried out.

AntDT §V-E2 ("Time-cost and Gains of Actions"): KILL_RESTART is the one
heavyweight action.  A relaunch costs scheduling (pending time, dozens of
minutes when the cluster is busy) plus rebuilding the job's world, so the
controller guards it whatever the policy says:

* never while the cluster is busy (the monitor's ``cluster_busy``);
* never the same node twice within ``cooldown_s`` (a node that is still
  slow right after its restart is not helped by a second one);
* at most ``max_restarts_per_window`` restarts of the job within any
  ``cooldown_s`` window (and so per round);
* never when it costs more than it can gain (:func:`restart_price`): the
  time the relaunch takes away (a PS: the whole job pauses; a worker: its
  share) against what the node's slowness costs over the time the job has
  left.  A mildly slow PS of a job with minutes left is not worth a
  twenty-minute restart, whatever the policy says.

Lightweight global actions are checked for consistency instead: ADJUST_BS
must name exactly the live workers with integer batch sizes and accumulation
steps, and is then *clamped* to the job's batch limits whichever policy
asked (:class:`.policies.limits.BatchLimits`: every B_i within [floor, its
device's cap], the sum of B_i * C_i the global batch; a clamp is said in the
decision's reason, and an action no clamp can bring within them is refused);
BACKUP_WORKERS must keep
at least one gradient per step (a policy may change it at any round, e.g.
raise it while transient stragglers last and drop it after); a KILL_RESTART's
optional ``migration`` (how a PS is moved: ``restart`` | ``seamless``) must be
one of the two.  A decision that is not a decision for this
job (wrong job, unknown action kinds, wrong types) is refused as a whole
with ``fallback=True``: the service then runs ``none`` and emits an event.

A round, the same for the live service and the cluster simulator::

    req = core.request(stats, now)            # what the policy is asked
    rnd = core.round(req, decision_or_error, now)   # what to carry out, in order
    ...                                       # the caller executes rnd.execute (NATS / simulation)
    out = core.applied(rnd, errors, now)      # cool-downs, setup, re-send flag; the ControllerDecision

Never worse than doing nothing (:class:`Trial`).  After an ADJUST_BS or a
BACKUP_WORKERS is carried out, the core compares the job's measured
throughput over the first whole short window after it with the throughput
before it (the same evidence the brain's plans are judged by: what was
measured, not what was predicted).  Slower beyond the noise (the spread of
the throughput over the rounds before, at least ``guard_tolerance``): the
core undoes the action in its next round (the setup before it, sent again)
and holds that kind of action back for ``guard_hold_s``, which the policy
is told in ``PolicyRequest.held`` and the review enforces, so it cannot
repeat it at once.  A comparison across a change the action did not make
(a straggler came or went, a worker joined or left) proves nothing and is
dropped.  KILL_RESTART cannot be undone: its guards are the cool-downs.

The core owns the job's setup as the controller knows it (:class:`JobSetup`:
batch sizes, accumulations, backup workers) and follows it from executed
actions only.  A worker relaunched by KILL_RESTART (or every worker, after a
PS migration) starts from the job spec's B / n, not from the B_i an
ADJUST_BS gave it: in BSP the core then plans a re-send of the current batch
sizes once every worker runs again, and keeps planning it until one is
executed.

One :class:`ControllerCore` per job.  No IO, no clock: ``now`` comes in as an
argument (controller time, seconds).  Not thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pacer.contracts.agent import ActionKind
from pacer.contracts.common import Role
from pacer.contracts.jobs import JobRecord
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats
from pacer.contracts.policy import (
    ControllerDecision,
    PolicyAction,
    PolicyDecision,
    PolicyRequest,
    RefusedAction,
)

from .policies import even_split, live_workers
from .policies.limits import BatchLimits, LimitError, batch_floor, memory_cap


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Guards of the controller (AntDT §V-E2), and the never-worse guard of batch and backup actions."""

    cooldown_s: float = 600.0  # no second KILL_RESTART of a node within this (one L_per)
    max_restarts_per_window: int = 1  # KILL_RESTARTs of one job within any cooldown_s window
    refuse_restart_when_busy: bool = True  # the pending time of a relaunch is unbounded when busy
    # Never worse than doing nothing (module docstring): undo an ADJUST_BS / BACKUP_WORKERS that made the job
    # slower, refuse more backup workers that the measured BPTs say cost more than they save, and price every
    # KILL_RESTART (restart_price).  Off: the policy's actions as AntDT §V-E2's guards alone let them through.
    guard: bool = True
    guard_tolerance: float = 0.03  # slower by less than this (relative) is never undone: measurement noise
    guard_hold_s: float = 0.0  # an undone kind is held back this long, doubled per undo in a row (0: one L_per)
    guard_noise_rounds: int = 8  # the noise is the spread of the throughput over this many quiet rounds
    restart_pending_s: float = 60.0  # a relaunch's pending time until the monitor has measured a pod's
    restart_init_s: float = 120.0  # ... and its start-up (pod running to first step)
    restart_margin: float = 2.0  # a KILL_RESTART must gain this many times its cost (both are estimates)
    adjust_min_gain: float = 0.03  # an ADJUST_BS predicted to move the step by less than this is noise-chasing

    def __post_init__(self) -> None:
        if self.cooldown_s < 0 or self.max_restarts_per_window < 0:
            raise ValueError("cooldown_s and max_restarts_per_window must be >= 0")
        if not 0 <= self.guard_tolerance < 1 or self.guard_hold_s < 0 or self.guard_noise_rounds < 2:
            raise ValueError("guard_tolerance in [0, 1), guard_hold_s >= 0, guard_noise_rounds >= 2")


GUARDED = (ActionKind.ADJUST_BS, ActionKind.BACKUP_WORKERS)  # the actions the never-worse guard can undo
# How a PS is relaunched when the policy does not say (payload "migration"): priced here as the
# controller carries it out (app: MIGRATE for "seamless", RESTART for "restart").
DEFAULT_MIGRATION = "seamless"


@dataclass(frozen=True, slots=True)
class Trial:
    """Guarded actions carried out and not judged yet: what undoes them and what they are compared with.

    ``before`` is the throughput measured before the first of them (a second
    guarded action while one is on trial keeps it: the comparison is always
    with the job as it ran before the policy touched it), ``at`` when the
    newest was carried out (the judgement waits for a whole short window
    after it), ``undo`` the actions that restore the setup before the first.
    ``scene`` is what the action cannot change (live workers, stragglers): a
    different scene at judgement time makes the comparison void.
    """

    kinds: tuple[str, ...]
    undo: tuple[PolicyAction, ...]
    before: float
    at: float
    scene: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"kinds": list(self.kinds), "undo": [[a.kind.value, a.payload] for a in self.undo],
                "before": self.before, "at": self.at, "scene": list(self.scene)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Trial:
        return cls(tuple(raw["kinds"]), tuple(PolicyAction(ActionKind(k), payload=dict(p)) for k, p in raw["undo"]),
                   float(raw["before"]), float(raw["at"]), tuple(raw["scene"]))


@dataclass(frozen=True, slots=True)
class RestartPrice:
    """What a KILL_RESTART of one node would gain and cost, in seconds of the job's time."""

    gain_s: float  # the node's slowness over the time left once it is back, if the relaunch cured it
    cost_s: float  # the time the relaunch takes away (pending + start-up; a PS: the whole job's)
    left_s: float  # the job's time left at its current pace (0: unknown)
    margin: float = 2.0

    @property
    def pays(self) -> bool:
        return self.left_s <= 0 or self.gain_s > self.margin * self.cost_s

    def why(self, node: str) -> str:
        return (f"KILL_RESTART of {node} would cost ~{self.cost_s:.0f}s for a gain of ~{self.gain_s:.0f}s "
                f"over the ~{self.left_s:.0f}s the job has left")


def _bpt(n: NodeStats) -> float:
    return n.bpt_long_s if n.bpt_long_s > 0 else n.bpt_short_s


def restart_price(stats: JobStatistics, node: str, mode: str, cfg: ControllerConfig,
                  migration: str = DEFAULT_MIGRATION) -> RestartPrice:
    """Gain and cost of relaunching ``node`` onto a healthy machine (AntDT §V-E2's time-cost of actions).

    Time left: the records left over the job's throughput (0, unknown, without
    shard counts).  The relaunched node is back after its pending time and
    start-up, as the monitor measured them on the job's other pods (a PS: the
    other PS, as a worker's start-up waits for the slow PS; the largest;
    ``restart_pending_s`` / ``restart_init_s`` before any).  The gain is what
    the node's slowness costs the job over the time left: all of it for a
    worker (the others step without it meanwhile), after it is back for a PS
    (the job waits for it).  A PS
    (and a BSP worker) sets the pace of every step: the part of a step its
    extra time takes, ``(bpt - the next slowest of its role) / bpt`` (a
    worker's step is its BPT; a PS's BPT is a probe, its part of a step taken
    as PS-bound).  An ASP worker slows only its own share, ``1/n`` of it.  Cost: a PS
    stops the whole job for its start-up, and for its pending time too unless
    the move is seamless (the old PS serves meanwhile); a worker costs, for
    both, what it trains now (its share of the throughput).  It pays when the
    gain is ``restart_margin`` times the cost.
    """
    nodes = {n.node: n for n in stats.nodes if n.state is Liveness.RUNNING}
    me = nodes.get(node)
    workers = [n for n in nodes.values() if n.role != Role.PS]
    sh = stats.shards
    rate = stats.throughput_samples_per_s
    left = (sh.records_total - sh.records_done) / rate if sh is not None and sh.records_total and rate > 0 else 0.0
    if me is None or not workers or left <= 0:
        return RestartPrice(0.0, 0.0, 0.0, cfg.restart_margin)
    # Not the node's own: its start-up ran where it is slow (a throttled PS imports TensorFlow at its pace).
    # For a PS, not the workers' either: a worker's start-up runs to its first step, which waits for every
    # PS, the slow one too (measured: 130 s for workers beside a throttled PS, under load).
    others = [n for n in stats.nodes if n.node != node and (me is None or me.role != Role.PS or n.role == Role.PS)]
    pending = max((n.pending_s for n in others), default=0.0) or cfg.restart_pending_s
    init = max((n.init_s for n in others), default=0.0) or cfg.restart_init_s
    cost = pending + init
    after = max(0.0, left - cost)  # the time left once the node is back
    peers = sorted(_bpt(n) for n in nodes.values() if n.role == me.role and n.node != node and _bpt(n) > 0)
    mine, next_slowest = _bpt(me), (peers[-1] if peers else 0.0)
    steps = sorted(_bpt(w) for w in workers if _bpt(w) > 0)
    step = steps[len(steps) // 2] if steps else 0.0
    n = len(workers)
    if mine <= 0 or step <= 0:
        return RestartPrice(0.0, cost, left, cfg.restart_margin)
    if me.role == Role.PS:
        # A PS's BPT is its agent's probe of one RPC, not its share of a step: a PS throttled to 5 % of a
        # core answered a probe in 46 ms while it made every worker's step take seconds.  Every step pulls
        # from and pushes to every PS, so its part of a step is taken as PS-bound: the slow PS makes it
        # mine / next_slowest times as long (an upper bound on the gain, as the BSP worker's).
        frac = 1.0 - next_slowest / mine if next_slowest > 0 else 0.0
        pause = init if migration == "seamless" else cost
        return RestartPrice(after * min(1.0, frac), pause, left, cfg.restart_margin)
    if mode == "bsp":
        frac = max(0.0, mine - next_slowest) / mine
    else:
        frac = max(0.0, 1.0 - step / mine) / n
    # A worker's slowness leaves with it: while it is away the others step without it (its shard is served
    # to them), so the gain runs over the whole time left, and the job loses only what the node trains now,
    # its share of the throughput (a straggler's is small; 1/n when the monitor has no speed for it).
    share = me.speed_samples_per_s / rate if me.speed_samples_per_s > 0 else 1.0 / n
    return RestartPrice(left * frac, cost * min(1.0, share), left, cfg.restart_margin)


def adjust_gain(req: PolicyRequest, sizes: dict[str, int], accs: dict[str, int]) -> float | None:
    """The step an ADJUST_BS is predicted to save, relative (None: a live worker has no BPT yet).

    The plainest model, the policy's own aside: a worker's BPT scales with the
    samples of its step (AntDT Eq. 1's compute, linear in B_i; Fig. 8), so
    the step after is max_i BPT_i * (B_i' C_i') / (B_i C_i).  It overstates
    what cutting a worker with a fixed delay saves, so it never blocks a
    real rebalance; it shows one that only chases the noise of the BPTs.
    """
    before, after = 0.0, 0.0
    for w in live_workers(req.stats):
        bpt = _bpt(w)
        old = req.batch_sizes.get(w.node, 0) * req.accumulations.get(w.node, 1)
        if bpt <= 0 or old <= 0:
            return None
        before = max(before, bpt)
        after = max(after, bpt * sizes.get(w.node, 0) * accs.get(w.node, 1) / old)
    return 1.0 - after / before if before > 0 else None


def uneven(sizes: Mapping[str, int], accs: Mapping[str, int], global_batch: int) -> float:
    """How far a split is from the even one, sum_i |B_i C_i - B / n| (0: the split the job was submitted with)."""
    if not sizes:
        return 0.0
    even = global_batch / len(sizes)
    return sum(abs(b * accs.get(n, 1) - even) for n, b in sizes.items())


def backup_rate(bpts: Sequence[float], backup: int) -> float:
    """Relative useful samples per second of a BSP step with ``backup`` backup workers (AntDT Table II).

    Each step waits for the ``n - b`` fastest of the workers' BPTs and keeps
    their ``n - b`` gradients; the ``b`` discarded ones are trained again
    later (so they are work, not progress).  Rate = (n - b) / n / the
    (n - b)-th shortest BPT, in units of samples per step.
    """
    times = sorted(t for t in bpts if t > 0)
    n = len(times)
    if n == 0 or not 0 <= backup < n:
        return 0.0
    return (n - backup) / n / times[n - backup - 1]


def scene(stats: JobStatistics) -> tuple[str, ...]:
    """What a batch or backup action does not change: the live nodes and their incarnations (a relaunched
    node runs elsewhere).  Not the straggler flags: a batch action changes them (that is what it is for)."""
    return tuple(sorted(f"{n.node}#{n.restarts}" for n in stats.nodes if n.state is Liveness.RUNNING))


@dataclass(frozen=True, slots=True)
class JobSetup:
    """What the controller knows of a job's training setup; :meth:`apply` follows executed actions."""

    global_batch: int  # B
    mode: str = "bsp"  # asp | bsp
    batch_sizes: dict[str, int] = field(default_factory=dict)  # B_i (absent: B / n)
    accumulations: dict[str, int] = field(default_factory=dict)  # C_i (absent: 1)
    backup_workers: int = 0  # b
    min_batch: int = 1  # the batch floor (policies.limits.batch_floor)
    max_batch: int = 0  # every worker's cap (0: unbounded)
    device_groups: dict[str, str] = field(default_factory=dict)  # worker -> device group (AntDT-DD)
    params: dict[str, Any] = field(default_factory=dict)  # the policy's parameters from the job spec
    caps: dict[str, int] = field(default_factory=dict)  # worker -> its device's cap (0 or absent: max_batch)

    @classmethod
    def of_record(cls, rec: JobRecord) -> JobSetup:
        """The setup a job starts with: the spec's B split evenly over the plan's workers (as launched),
        the batch floor, and the cap the workers' memory limit holds for the job's model."""
        workers = rec.plan.workers if rec.plan else 1
        per = max(1, rec.spec.batch_size // workers)
        cap = memory_cap(rec.plan.worker_memory_mb, rec.spec.model, rec.spec.dataset.schema) if rec.plan else 0
        return cls(global_batch=per * workers, mode=rec.spec.mode.value,
                   backup_workers=rec.spec.backup_workers, min_batch=batch_floor(per * workers, workers),
                   max_batch=max(cap, per) if cap else 0, params=dict(rec.spec.policies.params))

    def limits(self) -> BatchLimits:
        """The batch limits every ADJUST_BS is clamped to (whichever policy asked)."""
        return BatchLimits(self.global_batch, max(1, self.min_batch), self.max_batch, dict(self.caps))

    def apply(self, action: PolicyAction) -> JobSetup:
        """The setup after ``action`` was executed (ADJUST_BS, BACKUP_WORKERS; others change nothing here)."""
        if action.kind is ActionKind.ADJUST_BS:
            sizes = {str(k): int(v) for k, v in action.payload.get("batch_sizes", {}).items()}
            accs = {str(k): int(v) for k, v in action.payload.get("accumulations", {}).items()}
            return replace(self, batch_sizes=sizes, accumulations={n: accs.get(n, 1) for n in sizes})
        if action.kind is ActionKind.BACKUP_WORKERS:
            return replace(self, backup_workers=int(action.payload["backup"]))
        return self


@dataclass(frozen=True, slots=True)
class Refusal:
    """An action the controller will not execute, and why."""

    action: Any  # a PolicyAction, or whatever a malformed decision carried
    reason: str


@dataclass(frozen=True, slots=True)
class Review:
    """The controller's verdict on a decision: what to execute, what not, and whether to fall back to ``none``."""

    execute: list[PolicyAction] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    fallback: bool = False  # the decision was unusable as a whole
    reason: str = ""
    clamped: tuple[str, ...] = ()  # one note per ADJUST_BS clamped to the batch limits


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _malformed(req: PolicyRequest, decision: object) -> str:
    """Why ``decision`` is not a decision for ``req`` at all ("" if it is one)."""
    if not isinstance(decision, PolicyDecision):
        return f"not a PolicyDecision: {type(decision).__name__}"
    if decision.job != req.job:
        return f"decision for job {decision.job!r}, asked about {req.job!r}"
    if not isinstance(decision.actions, list):
        return "actions is not a list"
    for a in decision.actions:
        if not isinstance(a, PolicyAction):
            return f"action is not a PolicyAction: {type(a).__name__}"
        if not isinstance(a.kind, ActionKind):
            return f"unknown action kind {a.kind!r}"
        if not isinstance(a.node, str) or not isinstance(a.payload, dict):
            return f"{a.kind.value}: node must be a string and payload a map"
    return ""


def check_adjust_bs(req: PolicyRequest, payload: dict[str, Any]) -> str:
    """Why an ADJUST_BS payload is unusable for ``req`` ("" if it is fine).

    The shape only: the live workers, integer B_i >= 1 and C_i >= 1.  The
    limits (floor, caps, global batch) are the clamp's (:meth:`BatchLimits.clamp`).
    """
    sizes, accs = payload.get("batch_sizes"), payload.get("accumulations", {})
    if not isinstance(sizes, dict) or not isinstance(accs, dict):
        return "batch_sizes and accumulations must be maps"
    live = {w.node for w in live_workers(req.stats)}
    if set(sizes) != live:
        missing, extra = sorted(live - set(sizes)), sorted(set(sizes) - live)
        return f"must name exactly the live workers (missing {missing}, not live {extra})"
    if not set(accs) <= live:
        return f"accumulations name workers that are not live: {sorted(set(accs) - live)}"
    for node, b in sizes.items():
        if not _is_int(b) or b < 0:
            return f"{node}: batch size {b!r} is not an integer >= 0"
    for node, c in accs.items():
        if not _is_int(c) or c < 1:
            return f"{node}: accumulation {c!r} is not an integer >= 1"
    return ""


def _clamp_note(review: Review) -> str:
    """What the decision's reason says of a clamp ("" when nothing was clamped)."""
    return f"; ADJUST_BS clamped to the batch limits: {'; '.join(review.clamped)}" if review.clamped else ""


def round_due(last: float, now: float, every_s: float, stats: JobStatistics) -> bool:
    """A decision round is due once per fresh short window, and at least every ``every_s``.

    With the monitor's fixed windows (``window_short_s`` >= ``every_s``: AntDT's
    5 min) this is the fixed cadence; with the noise-adapted short window
    (``PACER_MONITOR_WINDOW_SHORT_MIN_S``) a quiet job is decided as often as
    its window is renewed.
    """
    window = stats.window_short_s if stats.window_short_s > 0 else every_s
    return now - last >= min(every_s, window) - 1e-6


def all_workers_running(stats: JobStatistics) -> bool:
    """Every worker runs and has reported a step: an ADJUST_BS now reaches each of them."""
    workers = [n for n in stats.nodes if n.role != Role.PS]
    return bool(workers) and all(n.state is Liveness.RUNNING and n.bpt_short_s > 0 for n in workers)


def _refused(r: Refusal) -> RefusedAction:
    kind = getattr(r.action, "kind", None)
    node = getattr(r.action, "node", "")
    return RefusedAction(kind.value if isinstance(kind, ActionKind) else str(r.action),
                         node if isinstance(node, str) else str(node), r.reason)


@dataclass(frozen=True, slots=True)
class Round:
    """One round as the core planned it: the actions to carry out, in this order, and why.

    ``execute`` holds the reviewed actions of the policy (none on a fallback),
    preceded by the re-send of the batch sizes when one is due (``resync``).
    """

    request: PolicyRequest
    policy: str
    execute: tuple[PolicyAction, ...]
    refused: tuple[RefusedAction, ...]
    fallback: bool  # the policy's answer was unusable: ``none`` was used
    reason: str  # the decision event's reason
    decision_ms: float  # the policy's own decision time
    resync: bool  # execute[0] re-sends the batch sizes to a relaunched worker
    all_running: bool  # every worker ran when the round was planned
    undo: int = 0  # the first ``undo`` actions of execute undo guarded actions that made the job slower


class ControllerCore:
    """The controller's rules for one job: the policy request, the review, the job's setup and cool-downs."""

    def __init__(self, job: str, setup: JobSetup, cfg: ControllerConfig | None = None, *,
                 policy: str = "none") -> None:
        self.job = job
        self.setup = setup
        self.cfg = cfg or ControllerConfig()
        self.policy = policy  # the job's straggler policy (its name, for the decision event)
        self.restarts: list[tuple[str, float]] = []  # (node, when) of executed KILL_RESTARTs, oldest first
        # A relaunched worker runs with the spec's B / n until the batch sizes are sent again (BSP).
        self.resync = False
        # The never-worse guard: guarded actions on trial, kinds held back (kind -> until), and the throughput
        # of the rounds without a trial (its spread is the noise a slowdown must exceed).
        self.trial: Trial | None = None
        self.held: dict[str, float] = {}
        self.strikes: dict[str, int] = {}  # kind -> undos of it in a row
        self.quiet: list[float] = []
        self.pending_undo: tuple[PolicyAction, ...] = ()  # planned by request(), carried out by the next round

    def _recent(self, now: float) -> list[tuple[str, float]]:
        horizon = now - self.cfg.cooldown_s
        self.restarts = [(n, t) for n, t in self.restarts if t > horizon]
        return self.restarts

    def restart_blocked(self, stats: JobStatistics, now: float) -> list[str]:
        """Nodes a KILL_RESTART would be refused for now: in cool-down, or all of them once the job's budget is spent."""
        recent = self._recent(now)
        if len(recent) >= self.cfg.max_restarts_per_window:
            return sorted({n.node for n in stats.nodes} | {n for n, _ in recent})
        return sorted({n for n, _ in recent})

    # ------------------------------------------------------------ the never-worse guard
    def rate(self, stats: JobStatistics, backup: int | None = None) -> float:
        """The job's useful samples per second over the short window (what the guard compares).

        BSP: every step waits for the slowest kept worker and trains the global
        batch, less the backup workers' discarded share: ``B * backup_rate``
        over the workers' short-window BPTs.  The monitor's throughput, a sum
        of each worker's own B_i / BPT_i, counts a fast worker's wait at the
        barrier as training and misses what a batch action does to the step.
        ASP: the monitor's throughput (each worker trains on its own).
        ``backup``: the backup workers the window ran with (default: the setup's).
        """
        if self.setup.mode != "bsp":
            return stats.throughput_samples_per_s
        bpts = [w.bpt_short_s for w in live_workers(stats)]
        if not bpts or min(bpts) <= 0:
            return 0.0
        b = self.setup.backup_workers if backup is None else backup
        return self.setup.global_batch * backup_rate(bpts, min(b, len(bpts) - 1))

    def noise(self) -> float:
        """The relative spread (stdev / mean) of the throughput over the last quiet rounds (0: too few)."""
        q = self.quiet
        if len(q) < 3:
            return 0.0
        mean = sum(q) / len(q)
        if mean <= 0:
            return 0.0
        return math.sqrt(sum((x - mean) ** 2 for x in q) / (len(q) - 1)) / mean

    def _judge(self, stats: JobStatistics, now: float) -> None:
        """Judge the trial once a whole short window ran after its newest action (module docstring)."""
        t = self.trial
        if t is None:
            if (r := self.rate(stats)) > 0:
                self.quiet = [*self.quiet, r][-self.cfg.guard_noise_rounds:]
            return
        window = stats.window_short_s if stats.window_short_s > 0 else 0.0
        if now - t.at < window - 1e-6:
            return
        self.trial = None
        after = self.rate(stats)
        if scene(stats) != t.scene or t.before <= 0 or after <= 0:
            return  # something the action did not do changed too: the comparison proves nothing
        threshold = max(self.cfg.guard_tolerance, 2.0 * self.noise())
        if after >= t.before * (1.0 - threshold):
            for kind in t.kinds:
                self.strikes.pop(kind, None)  # kept: the next undo of the kind starts from one hold again
            return
        # Held back one long window (the monitor's L_per) or guard_hold_s, doubled for every undo of the
        # kind in a row: a policy that keeps asking for what keeps hurting is asked less and less often.
        hold = 0.0
        for kind in t.kinds:
            self.strikes[kind] = self.strikes.get(kind, 0) + 1
            hold = max(hold, (self.cfg.guard_hold_s or stats.window_long_s) * 2 ** (self.strikes[kind] - 1))
        for kind in t.kinds:
            self.held[kind] = now + hold
        why = (f"undo {'+'.join(t.kinds)}: the job ran {t.before:.4g} -> {after:.4g} samples/s, "
               f"{(1 - after / t.before) * 100:.1f} % slower (beyond the noise, {threshold * 100:.1f} %); held back "
               f"{hold:.0f}s")
        self.pending_undo = tuple(replace(a, reason=why) for a in t.undo)

    def _open_trial(self, req: PolicyRequest, executed: Sequence[PolicyAction], now: float) -> None:
        """Guarded actions were carried out: start (or extend) their trial."""
        kinds = tuple(dict.fromkeys(a.kind.value for a in executed if a.kind in GUARDED))
        if not kinds or not self.cfg.guard:
            return
        if self.trial is not None:
            self.trial = replace(self.trial, kinds=tuple(dict.fromkeys((*self.trial.kinds, *kinds))), at=now)
            have = {a.kind for a in self.trial.undo}
        else:
            # Measured before the actions (this round's request), with the backup workers it ran with.
            self.trial = Trial(kinds, (), self.rate(req.stats, req.backup_workers), now, scene(req.stats))
            have = set()
        undo = list(self.trial.undo)
        if ActionKind.ADJUST_BS.value in kinds and ActionKind.ADJUST_BS not in have:
            undo.append(PolicyAction(ActionKind.ADJUST_BS, payload={
                "batch_sizes": dict(req.batch_sizes), "accumulations": dict(req.accumulations)}))
        if ActionKind.BACKUP_WORKERS.value in kinds and ActionKind.BACKUP_WORKERS not in have:
            undo.append(PolicyAction(ActionKind.BACKUP_WORKERS, payload={"backup": req.backup_workers}))
        self.trial = replace(self.trial, undo=tuple(undo))

    def request(self, stats: JobStatistics, now: float) -> PolicyRequest:
        """The :class:`PolicyRequest` for this round: statistics, the setup of the live workers, the cool-down,
        what the never-worse guard holds back (it judges the last round's actions first)."""
        if stats.job != self.job:
            raise ValueError(f"statistics of job {stats.job!r} given to the controller of {self.job!r}")
        if self.cfg.guard:
            self._judge(stats, now)
        setup = self.setup
        workers = [w.node for w in live_workers(stats)]
        even = even_split(setup.global_batch, len(workers), setup.min_batch)
        return PolicyRequest(
            job=self.job,
            stats=stats,
            mode=setup.mode,
            global_batch=setup.global_batch,
            batch_sizes={w: setup.batch_sizes.get(w, even) for w in workers},
            accumulations={w: setup.accumulations.get(w, 1) for w in workers},
            backup_workers=setup.backup_workers,
            min_batch=setup.min_batch,
            max_batch=setup.max_batch,
            batch_caps={w: setup.caps[w] for w in workers if setup.caps.get(w, 0) > 0},
            device_groups={w: g for w, g in setup.device_groups.items() if w in workers},
            params=dict(setup.params),
            restart_blocked=self.restart_blocked(stats, now),
            held={k: round(t - now, 3) for k, t in sorted(self.held.items()) if t > now},
        )
    def review(self, req: PolicyRequest, decision: object, now: float) -> Review:
        """Split ``decision`` into actions to execute and refused ones, each refusal with its reason."""
        why = _malformed(req, decision)
        if why:
            actions = getattr(decision, "actions", None)
            items = list(actions) if isinstance(actions, list) else [decision]
            bad = [Refusal(a, f"malformed decision: {why}") for a in items]
            return Review(refused=bad, fallback=True, reason=f"malformed decision ({why}): falling back to none")
        assert isinstance(decision, PolicyDecision)  # _malformed checked it

        stats = req.stats
        nodes = {n.node: n for n in stats.nodes}
        live = live_workers(stats)
        recent = self._recent(now)
        in_cooldown = {n: t for n, t in recent}
        budget = self.cfg.max_restarts_per_window - len(recent)
        execute: list[PolicyAction] = []
        refused: list[Refusal] = []
        clamped: list[str] = []
        seen_global: set[ActionKind] = set()
        restarting: set[str] = set()

        def refuse(a: PolicyAction, reason: str) -> None:
            refused.append(Refusal(a, reason))

        for a in decision.actions:
            if a.kind is ActionKind.NONE:
                continue
            if a.kind is ActionKind.KILL_RESTART:
                node = nodes.get(a.node)
                if node is None:
                    refuse(a, f"KILL_RESTART of unknown node {a.node!r}")
                elif node.state is not Liveness.RUNNING:
                    refuse(a, f"KILL_RESTART of {a.node}: node is {node.state.value}, not running")
                elif a.node in restarting:
                    refuse(a, f"KILL_RESTART of {a.node}: already restarting in this round")
                elif a.payload.get("migration", DEFAULT_MIGRATION) not in ("restart", "seamless"):
                    refuse(a, f"KILL_RESTART of {a.node}: migration {a.payload.get('migration')!r} is not restart or seamless")
                elif self.cfg.refuse_restart_when_busy and stats.cluster_busy:
                    refuse(a, f"KILL_RESTART of {a.node}: the cluster is busy, a relaunch could pend for long (AntDT §V-E2)")
                elif a.node in in_cooldown:
                    left = in_cooldown[a.node] + self.cfg.cooldown_s - now
                    refuse(a, f"KILL_RESTART of {a.node}: restarted {now - in_cooldown[a.node]:.0f}s ago, cool-down for {left:.0f}s more")
                elif budget <= 0:
                    refuse(a, f"KILL_RESTART of {a.node}: at most {self.cfg.max_restarts_per_window} restart(s) per {self.cfg.cooldown_s:g}s")
                elif self.cfg.guard and not (price := restart_price(stats, a.node, req.mode, self.cfg,
                                                 str(a.payload.get("migration", DEFAULT_MIGRATION)))).pays:
                    refuse(a, price.why(a.node))
                else:
                    execute.append(a)
                    restarting.add(a.node)
                    budget -= 1
                continue
            # Global actions: one of each kind per round (the agents apply them at one iteration).
            if self.held.get(a.kind.value, -math.inf) > now:
                refuse(a, f"{a.kind.value}: held back {self.held[a.kind.value] - now:.0f}s more: the last one made "
                          "the job slower and was undone")
                continue
            if a.kind in seen_global:
                refuse(a, f"{a.kind.value}: only one per decision")
                continue
            seen_global.add(a.kind)
            if a.kind is ActionKind.ADJUST_BS:
                problem = check_adjust_bs(req, a.payload)
                if not problem:
                    try:
                        c = self.setup.limits().clamp(a.payload["batch_sizes"], a.payload.get("accumulations", {}))
                    except LimitError as exc:
                        problem = f"outside the batch limits: {exc}"
                    else:
                        if c.notes:
                            a = replace(a, payload={**a.payload, "batch_sizes": c.batch_sizes,
                                                    "accumulations": c.accumulations},
                                        reason=f"{a.reason}; clamped to the batch limits: {', '.join(c.notes)}")
                            clamped.append(", ".join(c.notes))
                        gain = adjust_gain(req, c.batch_sizes, c.accumulations) if self.cfg.guard else None
                        # Noise-chasing is refused: a change predicted to move the step by less than the
                        # BPTs' noise either way, or predicted slower while it moves the split further from
                        # the even one.  A predicted slowdown on the way back to the even split (what doing
                        # nothing runs) is the undo guard's to judge on what it measures: the BPTs it is
                        # predicted from lag a recovery (a transient straggler back to speed) that the
                        # policy may already have seen.
                        if gain is not None and (abs(gain) < self.cfg.adjust_min_gain or (
                                gain < 0 and uneven(c.batch_sizes, c.accumulations, self.setup.global_batch)
                                >= uneven(req.batch_sizes, req.accumulations, self.setup.global_batch))):
                            problem = (f"predicted to move the step by {gain * 100:+.1f} %"
                                       + (f", less than {self.cfg.adjust_min_gain * 100:.0f} %: within the noise "
                                          "of the BPTs" if abs(gain) < self.cfg.adjust_min_gain else
                                          ", slower, and no nearer the even split"))
            elif a.kind is ActionKind.BACKUP_WORKERS:
                b = a.payload.get("backup")
                if req.mode != "bsp":
                    problem = "backup workers only exist in BSP"
                elif not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < len(live):
                    problem = f"backup {b!r} must be an integer in [0, {len(live)}) (live workers)"
                elif self.cfg.guard and b > req.backup_workers and (
                        (new := backup_rate([_bpt(w) for w in live], b))
                        <= (old := backup_rate([_bpt(w) for w in live], req.backup_workers))):
                    # More backups pay only when the workers they let a step leave behind are slower than the
                    # share of the step's gradients they discard (the discarded records are trained again).
                    problem = (f"{b} backup worker(s) would train {new / old * 100 if old else 0:.0f} % of what "
                               f"{req.backup_workers} train per second (the measured BPTs): slower")
                else:
                    problem = ""
            else:  # ADJUST_LR
                scale = a.payload.get("scale")
                ok = isinstance(scale, int | float) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0
                problem = "" if ok else f"scale {scale!r} must be a positive finite number"
            if problem:
                refuse(a, f"{a.kind.value}: {problem}")
            else:
                execute.append(a)

        reason = f"{len(execute)} to execute, {len(refused)} refused"
        return Review(execute=execute, refused=refused, reason=reason, clamped=tuple(clamped))

    def round(self, req: PolicyRequest, answer: object, now: float) -> Round:
        """Plan the round: the policy's ``answer`` (a :class:`PolicyDecision`, or the text of why
        there is none) reviewed, falling back to ``none`` when unusable, plus the batch-size re-send."""
        fallback, why = False, ""
        if isinstance(answer, str):
            fallback, why = True, answer
            answer = PolicyDecision(self.job, "none", [], reason=f"fallback to none: {why}")
        review = self.review(req, answer, now)
        if review.fallback:
            fallback, why = True, review.reason
        todo = [] if review.fallback else list(review.execute)
        undo = list(self.pending_undo)
        self.pending_undo = ()
        # The policy's actions of an undone kind were refused (held); an undo re-sends the batch sizes anyway.
        todo = [a for a in todo if not any(u.kind is a.kind for u in undo)]
        running = all_workers_running(req.stats)
        resync = (self.resync and bool(self.setup.batch_sizes) and running
                  and not any(a.kind is ActionKind.ADJUST_BS for a in (*todo, *undo)))
        if resync:
            todo.insert(0, PolicyAction(ActionKind.ADJUST_BS, payload={
                "batch_sizes": dict(self.setup.batch_sizes), "accumulations": dict(self.setup.accumulations)},
                reason="re-send the batch sizes to a worker relaunched since they were set"))
        ms = getattr(answer, "decision_ms", 0.0)
        reason = (f"policy {self.policy} unusable, none used: {why}" if fallback
                  else str(getattr(answer, "reason", "")) + _clamp_note(review))
        if undo:
            reason = f"{undo[0].reason}; {reason}"
        return Round(
            request=req, policy=self.policy, execute=(*undo, *todo),
            refused=tuple(_refused(r) for r in review.refused), fallback=fallback, reason=reason,
            decision_ms=float(ms) if isinstance(ms, int | float) else 0.0,
            resync=resync, all_running=running, undo=len(undo),
        )

    def applied(self, rnd: Round, errors: Sequence[str], now: float, round_ms: float = 0.0) -> ControllerDecision:
        """Record what was carried out of ``rnd`` (``errors[i]`` for ``rnd.execute[i]``, "" = done):
        cool-downs, the setup, the re-send flag; returns the round's :class:`ControllerDecision`."""
        if len(errors) != len(rnd.execute):
            raise ValueError(f"{len(errors)} results for {len(rnd.execute)} actions")
        executed: list[PolicyAction] = []
        failed: list[RefusedAction] = []
        for action, err in zip(rnd.execute, errors, strict=True):
            if err:
                failed.append(RefusedAction(action.kind.value, action.node, err))
                continue
            executed.append(action)
            if action.kind is ActionKind.KILL_RESTART:
                self.restarts.append((action.node, now))
            self.setup = self.setup.apply(action)
        # The policy's guarded actions (not an undo, nor the re-send) go on trial against the job before them.
        first = rnd.undo + (1 if rnd.resync else 0)
        self._open_trial(rnd.request, [a for a, err in list(zip(rnd.execute, errors, strict=True))[first:] if not err],
                         now)
        kinds = {a.kind for a in executed}
        if ActionKind.ADJUST_BS in kinds and rnd.all_running:
            self.resync = False  # every worker has the current batch sizes again
        if ActionKind.KILL_RESTART in kinds and self.setup.mode == "bsp" and self.setup.batch_sizes:
            self.resync = True  # the relaunched node (a PS: every worker) comes back with B / n
        return ControllerDecision(
            self.job, now, rnd.policy, executed, list(rnd.refused), failed, rnd.fallback,
            reason=rnd.reason, decision_ms=rnd.decision_ms, round_ms=round_ms)
