"""Pure core of the controller: what a policy is asked, and which of its actions are carried out.

AntDT §V-E2 ("Time-cost and Gains of Actions"): KILL_RESTART is the one
heavyweight action.  A relaunch costs scheduling (pending time, dozens of
minutes when the cluster is busy) plus rebuilding the job's world, so the
controller guards it whatever the policy says:

* never while the cluster is busy (the monitor's ``cluster_busy``);
* never the same node twice within ``cooldown_s`` (a node that is still
  slow right after its restart is not helped by a second one);
* at most ``max_restarts_per_window`` restarts of the job within any
  ``cooldown_s`` window (and so per round).

Lightweight global actions are checked for consistency instead: ADJUST_BS
must name exactly the live workers with integer batch sizes within the
bounds whose sum of B_i * C_i is the global batch; BACKUP_WORKERS must keep
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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pacer.contracts.agent import ActionKind
from pacer.contracts.common import Role
from pacer.contracts.jobs import JobRecord
from pacer.contracts.monitor import JobStatistics, NodeState
from pacer.contracts.policy import (
    ControllerDecision,
    PolicyAction,
    PolicyDecision,
    PolicyRequest,
    RefusedAction,
)

from .policies import even_split, live_workers


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Guards of the controller (AntDT §V-E2)."""

    cooldown_s: float = 600.0  # no second KILL_RESTART of a node within this (one L_per)
    max_restarts_per_window: int = 1  # KILL_RESTARTs of one job within any cooldown_s window
    refuse_restart_when_busy: bool = True  # the pending time of a relaunch is unbounded when busy

    def __post_init__(self) -> None:
        if self.cooldown_s < 0 or self.max_restarts_per_window < 0:
            raise ValueError("cooldown_s and max_restarts_per_window must be >= 0")


@dataclass(frozen=True, slots=True)
class JobSetup:
    """What the controller knows of a job's training setup; :meth:`apply` follows executed actions."""

    global_batch: int  # B
    mode: str = "bsp"  # asp | bsp
    batch_sizes: dict[str, int] = field(default_factory=dict)  # B_i (absent: B / n)
    accumulations: dict[str, int] = field(default_factory=dict)  # C_i (absent: 1)
    backup_workers: int = 0  # b
    min_batch: int = 1
    max_batch: int = 0  # 0: unbounded
    device_groups: dict[str, str] = field(default_factory=dict)  # worker -> device group (AntDT-DD)
    params: dict[str, Any] = field(default_factory=dict)  # the policy's parameters from the job spec

    @classmethod
    def of_record(cls, rec: JobRecord) -> JobSetup:
        """The setup a job starts with: the spec's B split evenly over the plan's workers (as launched)."""
        workers = rec.plan.workers if rec.plan else 1
        per = max(1, rec.spec.batch_size // workers)
        return cls(global_batch=per * workers, mode=rec.spec.mode.value,
                   backup_workers=rec.spec.backup_workers, min_batch=max(1, per // 8),
                   params=dict(rec.spec.policies.params))

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
    """Why an ADJUST_BS payload is unusable for ``req`` ("" if it is fine)."""
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
        if not _is_int(b) or b < req.min_batch:
            return f"{node}: batch size {b!r} is not an integer >= {req.min_batch}"
        if req.max_batch and b > req.max_batch:
            return f"{node}: batch size {b} > max batch {req.max_batch}"
    for node, c in accs.items():
        if not _is_int(c) or c < 1:
            return f"{node}: accumulation {c!r} is not an integer >= 1"
    total = sum(b * accs.get(n, 1) for n, b in sizes.items())
    if total != req.global_batch:
        return f"sum of B_i * C_i is {total}, the global batch is {req.global_batch}"
    return ""


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
    return bool(workers) and all(n.state is NodeState.RUNNING and n.bpt_short_s > 0 for n in workers)


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

    def request(self, stats: JobStatistics, now: float) -> PolicyRequest:
        """The :class:`PolicyRequest` for this round: statistics, the setup of the live workers, the cool-down."""
        if stats.job != self.job:
            raise ValueError(f"statistics of job {stats.job!r} given to the controller of {self.job!r}")
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
            device_groups={w: g for w, g in setup.device_groups.items() if w in workers},
            params=dict(setup.params),
            restart_blocked=self.restart_blocked(stats, now),
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
                elif node.state is not NodeState.RUNNING:
                    refuse(a, f"KILL_RESTART of {a.node}: node is {node.state.value}, not running")
                elif a.node in restarting:
                    refuse(a, f"KILL_RESTART of {a.node}: already restarting in this round")
                elif a.payload.get("migration", "restart") not in ("restart", "seamless"):
                    refuse(a, f"KILL_RESTART of {a.node}: migration {a.payload.get('migration')!r} is not restart or seamless")
                elif self.cfg.refuse_restart_when_busy and stats.cluster_busy:
                    refuse(a, f"KILL_RESTART of {a.node}: the cluster is busy, a relaunch could pend for long (AntDT §V-E2)")
                elif a.node in in_cooldown:
                    left = in_cooldown[a.node] + self.cfg.cooldown_s - now
                    refuse(a, f"KILL_RESTART of {a.node}: restarted {now - in_cooldown[a.node]:.0f}s ago, cool-down for {left:.0f}s more")
                elif budget <= 0:
                    refuse(a, f"KILL_RESTART of {a.node}: at most {self.cfg.max_restarts_per_window} restart(s) per {self.cfg.cooldown_s:g}s")
                else:
                    execute.append(a)
                    restarting.add(a.node)
                    budget -= 1
                continue
            # Global actions: one of each kind per round (the agents apply them at one iteration).
            if a.kind in seen_global:
                refuse(a, f"{a.kind.value}: only one per decision")
                continue
            seen_global.add(a.kind)
            if a.kind is ActionKind.ADJUST_BS:
                problem = check_adjust_bs(req, a.payload)
            elif a.kind is ActionKind.BACKUP_WORKERS:
                b = a.payload.get("backup")
                if req.mode != "bsp":
                    problem = "backup workers only exist in BSP"
                elif not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < len(live):
                    problem = f"backup {b!r} must be an integer in [0, {len(live)}) (live workers)"
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
        return Review(execute=execute, refused=refused, reason=reason)

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
        running = all_workers_running(req.stats)
        resync = (self.resync and bool(self.setup.batch_sizes) and running
                  and not any(a.kind is ActionKind.ADJUST_BS for a in todo))
        if resync:
            todo.insert(0, PolicyAction(ActionKind.ADJUST_BS, payload={
                "batch_sizes": dict(self.setup.batch_sizes), "accumulations": dict(self.setup.accumulations)},
                reason="re-send the batch sizes to a worker relaunched since they were set"))
        ms = getattr(answer, "decision_ms", 0.0)
        return Round(
            request=req, policy=self.policy, execute=tuple(todo),
            refused=tuple(_refused(r) for r in review.refused), fallback=fallback,
            reason=(f"policy {self.policy} unusable, none used: {why}" if fallback
                    else str(getattr(answer, "reason", ""))),
            decision_ms=float(ms) if isinstance(ms, int | float) else 0.0,
            resync=resync, all_running=running,
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
        kinds = {a.kind for a in executed}
        if ActionKind.ADJUST_BS in kinds and rnd.all_running:
            self.resync = False  # every worker has the current batch sizes again
        if ActionKind.KILL_RESTART in kinds and self.setup.mode == "bsp" and self.setup.batch_sizes:
            self.resync = True  # the relaunched node (a PS: every worker) comes back with B / n
        return ControllerDecision(
            self.job, now, rnd.policy, executed, list(rnd.refused), failed, rnd.fallback,
            reason=rnd.reason, decision_ms=rnd.decision_ms, round_ms=round_ms)
