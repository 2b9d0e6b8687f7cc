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
at least one gradient per step.  A decision that is not a decision for this
job (wrong job, unknown action kinds, wrong types) is refused as a whole
with ``fallback=True``: the service then runs ``none`` and emits an event.

One :class:`ControllerCore` per job.  No IO, no clock: ``now`` comes in as an
argument (controller time, seconds).  Not thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import JobStatistics, NodeState
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest

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


class ControllerCore:
    """The controller's rules for one job: build the policy request, review the decision, track restarts."""

    def __init__(self, job: str, cfg: ControllerConfig | None = None) -> None:
        self.job = job
        self.cfg = cfg or ControllerConfig()
        self.restarts: list[tuple[str, float]] = []  # (node, when) of executed KILL_RESTARTs, oldest first

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

    def request(self, stats: JobStatistics, setup: JobSetup, now: float) -> PolicyRequest:
        """The :class:`PolicyRequest` for this round: statistics, the setup of the live workers, the cool-down."""
        if stats.job != self.job:
            raise ValueError(f"statistics of job {stats.job!r} given to the controller of {self.job!r}")
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

    def review(self, req: PolicyRequest, decision: PolicyDecision, now: float) -> Review:
        """Split ``decision`` into actions to execute and refused ones, each refusal with its reason."""
        why = _malformed(req, decision)
        if why:
            actions = getattr(decision, "actions", None)
            items = list(actions) if isinstance(actions, list) else [decision]
            bad = [Refusal(a, f"malformed decision: {why}") for a in items]
            return Review(refused=bad, fallback=True, reason=f"malformed decision ({why}): falling back to none")

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

    def applied(self, action: PolicyAction, now: float) -> None:
        """Record an executed action: a KILL_RESTART starts its node's cool-down."""
        if action.kind is ActionKind.KILL_RESTART:
            self.restarts.append((action.node, now))
