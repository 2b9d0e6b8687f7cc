"""Straggler-policy messages: what the controller asks a policy service, and what it answers.

A policy is a service (AntDT §V-E: the controller holds "different straggler
mitigation solutions, decoupled from the framework").  The controller sends
a :class:`PolicyRequest` on ``pacer.policy.<name>.decide`` for every
statistics window of a job that names the policy; the policy replies with a
:class:`PolicyDecision`.  The built-in policies (``antdt-nd``, ``antdt-dd``,
``lb-bsp``, ``backup-workers``, ``none``) are registered exactly the same
way, so a user's own policy is a first-class citizen.

The controller validates every decision (unknown nodes, batch sizes that do
not sum to the global batch, a malformed reply) and falls back to ``none``
with an event when a decision is unusable; the policy never talks to agents
or the executor itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pacer.codec import doc, message
from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import JobStatistics


@message("policy.PolicyRequest")
@dataclass(frozen=True, slots=True)
class PolicyRequest:
    """One decision round for one job: its statistics window plus what the controller knows of its setup."""

    job: str
    stats: JobStatistics
    mode: str = field(metadata=doc("asp | bsp"))
    global_batch: int = field(metadata=doc("B: samples per synchronous step over all workers"))
    batch_sizes: dict[str, int] = field(default_factory=dict, metadata=doc("current B_i per live worker"))
    accumulations: dict[str, int] = field(default_factory=dict, metadata=doc("current C_i per live worker (absent: 1)"))
    backup_workers: int = 0
    min_batch: int = field(default=1, metadata=doc("no worker's B_i may go below this"))
    max_batch: int = field(default=0, metadata=doc("no worker's B_i may exceed this (0: unbounded; AntDT-DD: device memory)"))
    device_groups: dict[str, str] = field(default_factory=dict, metadata=doc("worker -> device group (AntDT-DD)"))
    params: dict[str, Any] = field(default_factory=dict, metadata=doc("policy parameters from the job spec"))
    restart_blocked: list[str] = field(default_factory=list, metadata=doc("nodes in KILL_RESTART cool-down"))


@message("policy.PolicyAction")
@dataclass(frozen=True, slots=True)
class PolicyAction:
    """One action of AntDT Table II; ``node`` only for node actions (KILL_RESTART)."""

    kind: ActionKind
    node: str = ""
    payload: dict[str, Any] = field(default_factory=dict, metadata=doc(
        "ADJUST_BS {batch_sizes: {node: B_i}, accumulations: {node: C_i}}; ADJUST_LR {scale}; BACKUP_WORKERS {backup}"))
    reason: str = ""


@message("policy.PolicyDecision")
@dataclass(frozen=True, slots=True)
class PolicyDecision:
    """The reply to a :class:`PolicyRequest`: zero or more actions, each with its reason."""

    job: str
    policy: str
    actions: list[PolicyAction] = field(default_factory=list)
    reason: str = field(default="", metadata=doc("why (also when no action is taken)"))
    decision_ms: float = field(default=0.0, metadata=doc("time the policy spent deciding"))


@message("policy.RefusedAction")
@dataclass(frozen=True, slots=True)
class RefusedAction:
    """An action the controller did not execute, and why (cool-down, cluster busy, invalid, ...)."""

    kind: str
    node: str = ""
    reason: str = ""


@message("policy.ControllerDecision")
@dataclass(frozen=True, slots=True)
class ControllerDecision:
    """``pacer.events.controller.<job>.decision``: one decision round, what was done and why.

    ``fallback`` is true when the job's policy did not answer usably (no
    reply, a malformed or wrong-job reply) and the controller used ``none``.
    """

    job: str
    ts: float
    policy: str
    executed: list[PolicyAction] = field(default_factory=list)
    refused: list[RefusedAction] = field(default_factory=list)
    failed: list[RefusedAction] = field(default_factory=list, metadata=doc("accepted but not carried out (agent/executor error)"))
    fallback: bool = False
    reason: str = ""
    decision_ms: float = field(default=0.0, metadata=doc("the policy's own decision time"))
    round_ms: float = field(default=0.0, metadata=doc("statistics in to actions sent, as the controller measured it"))
