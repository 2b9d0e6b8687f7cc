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

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pacer.codec import doc, message
from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import JobStatistics
from pacer.errors import ValidationError
from pacer.ids import is_token

#: Sane ranges of a :class:`PolicyRequest` (:func:`validate_request`).  Far above any real job (AntDT's
#: largest global batch is 81,920; DLRover-RM's jobs run hundreds of workers), far below what would make
#: a decision allocate or loop without bound (a global batch of 2**64 - 1 took AntDT-DD into a
#: MemoryError, issue 21).
MAX_GLOBAL_BATCH = 1 << 24
MAX_NODES = 10_000
MAX_ACCUMULATION = 1024
MAX_PARAMS = 64


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
    batch_caps: dict[str, int] = field(default_factory=dict, metadata=doc(
        "worker -> the largest B_i its device holds, where lower than max_batch (the controller clamps ADJUST_BS to it)"))
    device_groups: dict[str, str] = field(default_factory=dict, metadata=doc("worker -> device group (AntDT-DD)"))
    params: dict[str, Any] = field(default_factory=dict, metadata=doc("policy parameters from the job spec"))
    restart_blocked: list[str] = field(default_factory=list, metadata=doc("nodes in KILL_RESTART cool-down"))
    held: dict[str, float] = field(default_factory=dict, metadata=doc(
        "action kind -> seconds the controller still refuses it: the last one made the job slower and was undone"))


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


def _in(name: str, value: float, lo: float, hi: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and lo <= value <= hi):
        raise ValidationError(f"{name}: must be a finite number in [{lo!r}, {hi!r}], got {value!r}")


def _count(name: str, items: Iterable[Any] | dict[str, Any], most: int) -> None:
    n = len(items)  # type: ignore[arg-type]
    if n > most:
        raise ValidationError(f"{name}: {n} entries, more than the {most} allowed")


def _nodes(name: str, names: Iterable[str]) -> None:
    for node in names:
        if not is_token(node):
            raise ValidationError(f"{name}: {node!r} is not a valid node id (1-64 of [A-Za-z0-9_-])")


_NODE_NUMBERS = ("bpt_short_s", "bpt_long_s", "speed_samples_per_s", "samples_total", "cpu_percent", "rss_bytes",
                 "last_seen", "pending_s", "restarts", "slowdown_short", "slowdown_long", "init_s")


def validate_request(req: PolicyRequest) -> None:
    """Raise :class:`ValidationError` naming the first field of ``req`` outside its sane range.

    Checked by the policy shell (:mod:`pacer.policy`) before any policy runs, so a
    request no policy could sensibly decide on gets an ``invalid`` error reply, never a decision that
    allocates or loops without bound.  Policies check their own ``params`` (their ranges differ).
    """
    if not is_token(req.job):
        raise ValidationError(f"job: {req.job!r} is not a valid id (1-64 of [A-Za-z0-9_-])")
    if req.mode not in ("asp", "bsp"):
        raise ValidationError(f"mode: must be asp or bsp, got {req.mode!r}")
    _in("global_batch", req.global_batch, 1, MAX_GLOBAL_BATCH)
    _in("min_batch", req.min_batch, 0, req.global_batch)
    _in("max_batch", req.max_batch, 0, MAX_GLOBAL_BATCH)
    _in("backup_workers", req.backup_workers, 0, MAX_NODES)
    for name, table, lo, hi in (("batch_sizes", req.batch_sizes, 0, MAX_GLOBAL_BATCH),
                                ("accumulations", req.accumulations, 0, MAX_ACCUMULATION)):
        _count(name, table, MAX_NODES)
        _nodes(name, table)
        for node, v in table.items():
            _in(f"{name}.{node}", v, lo, hi)
    _count("batch_caps", req.batch_caps, MAX_NODES)
    _nodes("batch_caps", req.batch_caps)
    for node, v in req.batch_caps.items():
        _in(f"batch_caps.{node}", v, 0, MAX_GLOBAL_BATCH)
    _count("device_groups", req.device_groups, MAX_NODES)
    _nodes("device_groups", req.device_groups)
    _count("restart_blocked", req.restart_blocked, MAX_NODES)
    _count("held", req.held, len(ActionKind))
    for kind, left in req.held.items():
        _in(f"held.{kind}", left, 0, math.inf)
    _count("params", req.params, MAX_PARAMS)
    st = req.stats
    _count("stats.nodes", st.nodes, MAX_NODES)
    for key in ("ts", "window_short_s", "window_long_s", "throughput_samples_per_s", "slowness_ratio"):
        _in(f"stats.{key}", getattr(st, key), 0, math.inf)
    _in("stats.pending_nodes", st.pending_nodes, 0, MAX_NODES)
    for n in st.nodes:
        if not is_token(n.node):
            raise ValidationError(f"stats.nodes: {n.node!r} is not a valid node id (1-64 of [A-Za-z0-9_-])")
        # One comparison per number (False for NaN, inf and negatives): 1,000 nodes cost ~2 ms, not ~10.
        if not all(0 <= v < math.inf for v in (
                n.bpt_short_s, n.bpt_long_s, n.speed_samples_per_s, n.samples_total, n.cpu_percent, n.rss_bytes,
                n.last_seen, n.pending_s, n.restarts, n.slowdown_short, n.slowdown_long, n.init_s)):
            for key in _NODE_NUMBERS:  # name the first bad one
                _in(f"stats.nodes.{n.node}.{key}", getattr(n, key), 0, math.inf)
    if st.shards is not None:
        for key in ("todo", "doing", "done", "failed", "records_done", "records_total", "datasets"):
            _in(f"stats.shards.{key}", getattr(st.shards, key), 0, math.inf)
