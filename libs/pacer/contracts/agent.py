"""Agent messages: metrics and heartbeats of the sidecars, actions, the two-phase barrier.

Subjects (builders in :mod:`pacer.subjects`):

* ``pacer.events.agent.<job>.metrics``   :class:`AgentMetrics`, every k trainer steps
* ``pacer.events.agent.<job>.heartbeat`` :class:`Heartbeat`, every second per agent
* ``pacer.events.agent.<job>.action``    :class:`ActionResult`, one per action
* ``pacer.rpc.agent.<job>.global_action`` :class:`GlobalAction` -> :class:`ActionResult`,
  served by the job's primary agent only
* ``pacer.rpc.agent.<job>.<node>.command`` :class:`NodeCommand` -> :class:`ActionResult`,
  served by that node's agent
* ``pacer.agent.<job>.prepare|commit|abort`` the primary's two-phase barrier
  (:class:`Prepare` -> :class:`Vote`, :class:`Commit` -> :class:`Ack`, :class:`Abort`);
  internal to the agents, documented so that a trace can be read.

Global actions follow AntDT section V-F (Fig. 6): the primary agent picks a
target iteration T ahead of every worker, every agent arms a local barrier at
T in its trainer, and only when all have voted yes is the action committed;
every worker then applies it at iteration T.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pacer.codec import doc, message


class ActionKind(str, enum.Enum):
    """The straggler-mitigation action set (AntDT Table II).

    Global actions (synchronised at one iteration over all workers):
    ``ADJUST_BS``, ``ADJUST_LR``, ``BACKUP_WORKERS``.  Node actions (one node,
    no barrier): ``KILL_RESTART``.  ``NONE`` is the dummy action: nothing is
    delivered to any trainer.
    """

    ADJUST_BS = "ADJUST_BS"  # payload {"batch_sizes": {node: B_i}, "accumulations": {node: C_i}}
    ADJUST_LR = "ADJUST_LR"  # payload {"scale": x}
    BACKUP_WORKERS = "BACKUP_WORKERS"  # payload {"backup": b}
    KILL_RESTART = "KILL_RESTART"  # the trainer exits cleanly (75); {"checkpoint": true}: the chief checkpoints first
    NONE = "NONE"


#: Kinds that need the two-phase barrier (everything else is a node action or NONE).
GLOBAL_KINDS = frozenset({ActionKind.ADJUST_BS, ActionKind.ADJUST_LR, ActionKind.BACKUP_WORKERS})


@message("agent.AgentMetrics")
@dataclass(frozen=True, slots=True)
class AgentMetrics:
    """A trainer's application and process state over its last k steps.

    Published by the node's agent on ``pacer.events.agent.<job>.metrics``
    every k trainer steps (default 10, as in AntDT's experiments); the window
    is exactly the k step records ending at ``local_step``.
    """

    job: str
    node: str
    role: str = field(metadata=doc("worker | ps | chief"))
    ts: float = field(metadata=doc("unix time (s) of the newest step in the window"))
    local_step: int = field(metadata=doc("the trainer's own step counter at the end of the window"))
    iteration: int = field(metadata=doc("the iteration that actions are synchronised on (global step)"))
    bpt_s: float = field(metadata=doc(
        "batch processing time: mean over the window's steps (s); role ps: the mean answer time of the "
        "TF GetStatus call the PS agent times against its PS (s)"))
    batch_size: int = field(metadata=doc("batch size of the newest step"))
    samples_per_s: float = field(metadata=doc("samples trained per second over the window; 0 for a PS"))
    samples_total: int = field(metadata=doc("samples trained by this trainer since it started"))
    cpu_percent: float = field(metadata=doc("CPU of the trainer process (100 = one core)"))
    rss_bytes: int = field(metadata=doc("resident memory of the trainer process"))
    last_action_seq: int = field(metadata=doc("node-local sequence number of the last action the trainer applied (0: none)"))
    last_action_iteration: int = field(metadata=doc("iteration at which it was applied (-1: none)"))
    primary: bool = field(metadata=doc("this node's agent is the job's primary agent"))
    last_action_id: str = field(default="", metadata=doc("wire id of that action (GlobalAction.action_id / NodeCommand.command_id)"))
    steps: int = field(default=0, metadata=doc("step records in the window (k); role ps: probes answered"))
    steps_total: int = field(default=0, metadata=doc("step records written by this trainer incarnation"))
    incarnation: int = field(default=0, metadata=doc("how many times a trainer attached to this node's IPC file"))
    exiting: bool = field(default=False, metadata=doc("the trainer said it is exiting"))


@message("agent.Heartbeat")
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """An agent is alive, on ``pacer.events.agent.<job>.heartbeat`` every second.

    The primary builds the membership of the two-phase barrier from these:
    agents heard within the member TTL whose trainer is alive and steps.
    """

    job: str
    node: str
    role: str
    ts: float = field(metadata=doc("unix time (s) when sent"))
    instance: str = field(metadata=doc("the agent process (host-pid); changes when it restarts"))
    primary: bool
    trainer_alive: bool = field(metadata=doc("a trainer process is attached and alive"))
    iteration: int = field(default=-1, metadata=doc("the trainer's current iteration (-1: unknown)"))
    bpt_s: float = field(default=0.0, metadata=doc("mean batch processing time of its recent steps (0: unknown)"))
    trainer_pid: int = 0


@message("agent.GlobalAction")
@dataclass(frozen=True, slots=True)
class GlobalAction:
    """Request to the primary agent (``pacer.rpc.agent.<job>.global_action``).

    Reply: :class:`ActionResult`.  Payloads: ADJUST_BS ``{"batch_sizes":
    {node: B_i}}``, ADJUST_LR ``{"scale": x}``, BACKUP_WORKERS ``{"backup": b}``.
    Sending the same ``action_id`` again returns the first result instead of
    applying the action twice.
    """

    job: str
    action_id: str = field(metadata=doc("idempotency key chosen by the sender (\"\": the primary makes one)"))
    kind: ActionKind
    payload: dict[str, Any] = field(default_factory=dict, metadata=doc("msgpack map, at most 4 KiB encoded"))
    reason: str = ""


@message("agent.NodeCommand")
@dataclass(frozen=True, slots=True)
class NodeCommand:
    """A node action (``pacer.rpc.agent.<job>.<node>.command``), no barrier.

    The node's agent delivers it to its trainer at the trainer's next
    iteration.  Reply: :class:`ActionResult`.
    """

    job: str
    node: str
    kind: ActionKind = field(metadata=doc("usually KILL_RESTART"))
    reason: str = ""
    command_id: str = field(default="", metadata=doc("idempotency key (\"\": the agent makes one)"))
    payload: dict[str, Any] = field(default_factory=dict)


@message("agent.ActionResult")
@dataclass(frozen=True, slots=True)
class ActionResult:
    """Outcome of a global action or node command: the reply, and an event on
    ``pacer.events.agent.<job>.action``.

    ``applied`` means committed into the trainers' IPC at ``target_iteration``
    on every node in ``nodes``; each trainer applies it when it reaches that
    iteration (visible as ``AgentMetrics.last_action_iteration``).
    """

    action_id: str
    applied: bool
    target_iteration: int = field(metadata=doc("-1 when nothing was committed"))
    nodes: list[str] = field(default_factory=list)
    detail: str = field(
        default="", metadata=doc("why it was not applied, or a warning (not named 'error': a reply with a top-level error field is an error reply)")
    )
    job: str = ""
    kind: ActionKind = ActionKind.NONE
    attempts: int = field(default=0, metadata=doc("two-phase rounds used (global actions)"))
    ts: float = 0.0


@message("agent.PrimaryRecord")
@dataclass(frozen=True, slots=True)
class PrimaryRecord:
    """Value of the KV key ``<job>.primary`` in bucket ``pacer-agents``: who is primary."""

    job: str
    node: str
    instance: str
    since: float = field(metadata=doc("unix time (s) when it was elected"))


@message("agent.Prepare")
@dataclass(frozen=True, slots=True)
class Prepare:
    """Phase one (``pacer.agent.<job>.prepare``): arm a barrier at ``target_iteration``.

    Every agent named in ``nodes`` replies a :class:`Vote` to the message's
    reply subject: yes if its trainer is still before the target.
    """

    job: str
    action_id: str
    target_iteration: int
    kind: ActionKind
    nodes: list[str] = field(metadata=doc("the participants; other agents ignore the message"))
    primary: str = field(default="", metadata=doc("the primary's instance (fencing / tracing)"))
    attempt: int = 1


@message("agent.Vote")
@dataclass(frozen=True, slots=True)
class Vote:
    """An agent's answer to :class:`Prepare`."""

    job: str
    action_id: str
    node: str
    yes: bool
    iteration: int = field(metadata=doc("the trainer's current iteration when it voted"))
    reason: str = field(default="", metadata=doc("why no: too_late | no_trainer | busy | ..."))


@message("agent.Commit")
@dataclass(frozen=True, slots=True)
class Commit:
    """Phase two (``pacer.agent.<job>.commit``): the action is decided.

    Participants write it into their trainer's IPC and reply an :class:`Ack`;
    the primary re-sends to those that did not ack.
    """

    job: str
    action_id: str
    target_iteration: int
    kind: ActionKind
    payload: dict[str, Any] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)


@message("agent.Abort")
@dataclass(frozen=True, slots=True)
class Abort:
    """Phase two, negative (``pacer.agent.<job>.abort``): release the barrier, apply nothing."""

    job: str
    action_id: str
    reason: str = ""


@message("agent.Ack")
@dataclass(frozen=True, slots=True)
class Ack:
    """An agent's answer to :class:`Commit`: the action is (or is not) in its trainer's IPC."""

    job: str
    action_id: str
    node: str
    ok: bool
    detail: str = field(default="", metadata=doc("why not, or a warning"))
