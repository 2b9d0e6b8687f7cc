"""The executor's record changes, pure: what a job's record becomes, and the IO that follows, as effects.

The executor keeps one :class:`~pacer.contracts.executor.ExecutorJob` per job
in memory and in KV; every change of it is made here, never in the service
shell, and every function says what must follow as
:mod:`.effects` for ``applier.Effects.apply`` (which saves the record, makes
pods, publishes events).  The simulators make the same changes through the
same functions, so a node's bookkeeping after an exit exists once.

* :func:`move`: the one place a node's state changes (the table of :mod:`.node`);
* :func:`node_view` / :func:`normalise`: the core's view of a node, and old records brought up to date;
* :func:`restart_node`: a node's next generation (a restart, a resize, a migration's move);
* :func:`apply_exit`: the bookkeeping after :func:`.exits.answer_exit` judged a pod's end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pacer.contracts.common import Role
from pacer.contracts.executor import ExecutorJob, NodeIntent, NodePhase, NodeRecord
from pacer.contracts.nodes import NodeEvent
from pacer.subjects import NodeEventKind
from pacer_services.pod_executor.core import effects as fx
from pacer_services.pod_executor.core.exits import ExitAnswer, ExitOutcome
from pacer_services.pod_executor.core.model import Node, NodeSpec
from pacer_services.pod_executor.core.node import legacy_state, transition


def move(n: NodeRecord, to: NodePhase, intent: NodeIntent = NodeIntent.NONE) -> None:
    """The one place a node's state changes (checked against :data:`.node.TRANSITIONS`)."""
    n.state = transition(n.node, n.state, to, intent)
    n.finished, n.removed = to is NodePhase.FINISHED, to is NodePhase.REMOVED
    if to is NodePhase.STOPPING or intent is not NodeIntent.NONE:
        n.intent = intent
    elif to in (NodePhase.PENDING, NodePhase.REMOVED, NodePhase.FINISHED):
        n.intent = NodeIntent.NONE  # a new pod, or no pod to come: no stop pending


def node_view(n: NodeRecord) -> Node:
    """The core's view of a node of the record."""
    return Node(NodeSpec(n.role, n.index, n.cpu, n.memory_mb), n.restarts, n.requested_restarts,
                state=n.state.value, oom_memory_mb=n.oom_memory_mb)


def normalise(ej: ExecutorJob) -> None:
    """Give every node of a record written before ``NodeRecord.state`` its state (and a stop due its intent)."""
    for n in ej.nodes:
        if n.state is NodePhase.PENDING:
            n.state = legacy_state(finished=n.finished, removed=n.removed, intent=n.intent,
                                   running=bool(n.running_at))
        elif n.intent is not NodeIntent.NONE and n.state is NodePhase.RUNNING:
            n.state = NodePhase.STOPPING  # an intent saved by a hand (or an older executor) is a stop due


def restart_node(n: NodeRecord, restore: bool = False) -> None:
    """The node's next generation, with any size a rolling replacement has due for it (``restore``: its
    first pod restores the newest checkpoint)."""
    if n.resize_memory_mb:  # a worker resize of the same plan rides on this restart
        n.cpu, n.memory_mb = n.resize_cpu, n.resize_memory_mb
        n.resize_cpu, n.resize_memory_mb = 0.0, 0
    n.generation += 1
    n.restore = restore
    move(n, NodePhase.PENDING)


def node_event_of(job: str, role: str, e: fx.PublishNodeEvent, ts: float, pod: str) -> NodeEvent:
    """The node event a :class:`.effects.PublishNodeEvent` describes (``pod``: its pod's name when the
    effect names none)."""
    return NodeEvent(job=job, node=e.node, kind=e.kind, ts=ts, reason=e.reason, role=role, pod=e.pod or pod,
                     generation=e.generation, exit_code=e.exit_code, restarts=e.restarts, cpu=e.cpu,
                     memory_mb=e.memory_mb, relaunch=e.relaunch, detail=e.detail, result=dict(e.result))


def _event(n: NodeRecord, kind: str, **fields: Any) -> fx.PublishNodeEvent:
    """A node event as the node is now (before any relaunch changes it)."""
    return fx.PublishNodeEvent(n.node, kind, n.generation, n.restarts + n.requested_restarts, n.cpu, n.memory_mb,
                               **fields)


def apply_exit(ej: ExecutorJob, n: NodeRecord, ans: ExitAnswer, *, pod: str = "", exit_code: int | None = None,
               result: Mapping[str, Any] | None = None) -> tuple[fx.Effect, ...]:
    """The record after node ``n``'s pod ``pod`` ended and :func:`.exits.answer_exit` gave ``ans``, and
    what follows, in order.

    * finished: the node is done (unless it was removed meanwhile); the ``finished`` event carries
      the trainer's ``result`` (the chief's last output line);
    * migrating: it waits for the migration to start it on the next cluster; a chief's checkpoint
      (in its ``result``) becomes the job's;
    * relaunch: its budget (or the requested count) is spent by one, it takes the answer's size
      (an OOM's memory is its new floor) and its next generation, whose pod is created;
    * fail the job / nothing: the record is saved, and the job fails or nothing more happens.

    A ``died`` event precedes all but ``finished``; it describes the pod that ended.
    """
    result = dict(result or {})
    if ans.outcome is ExitOutcome.FINISHED:
        if n.state is not NodePhase.REMOVED:
            move(n, NodePhase.FINISHED)
        return (fx.SaveRecord(), _event(n, NodeEventKind.FINISHED, pod=pod, exit_code=0, reason=ans.reason,
                                        detail=ans.detail, result=result))
    if n.state in (NodePhase.PENDING, NodePhase.RUNNING, NodePhase.STOPPING):
        move(n, NodePhase.RELAUNCHING, n.intent)  # the pod is gone; what comes next is below
    died = _event(n, NodeEventKind.DIED, pod=pod, exit_code=exit_code, reason=ans.reason, detail=ans.detail,
                  relaunch=ans.outcome is ExitOutcome.MIGRATING or ans.relaunch is not None)
    if ans.outcome is ExitOutcome.MIGRATING:  # started again by the migration, on the next cluster
        ckpt = result.get("checkpoint")
        if n.role == Role.WORKER and n.index == 0 and isinstance(ckpt, str) and ckpt:
            ej.checkpoint = ckpt
        return fx.SaveRecord(), died
    if ans.outcome is ExitOutcome.RELAUNCH and ans.relaunch is not None:
        if ans.requested:
            n.requested_restarts += 1
        else:
            n.restarts += 1
        if ans.oom:
            n.oom_memory_mb = max(n.oom_memory_mb, ans.relaunch.memory_mb)
        n.cpu, n.memory_mb = ans.relaunch.cpu, ans.relaunch.memory_mb
        n.resize_cpu, n.resize_memory_mb = 0.0, 0
        n.restore = ans.restore
        n.generation += 1
        move(n, NodePhase.PENDING)
        return died, fx.CreatePod(n.node), fx.SaveRecord()
    if ans.outcome is ExitOutcome.FAIL_JOB:
        return died, fx.SaveRecord(), fx.FailJob(ans.detail)
    return died, fx.SaveRecord()
