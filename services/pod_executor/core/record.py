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
* :func:`apply_exit`: the bookkeeping after :func:`.exits.answer_exit` judged a pod's end;
* :func:`apply_change`: a new plan's nodes (:func:`.plan.plan_change`: started, stopped, resizes due);
* :func:`node_command`: an operator's or controller's STOP / RESTART / MIGRATE of a worker;
* :func:`begin_migration`: a PS migration's start (the new PS beside the old cluster).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pacer.contracts.common import Role
from pacer.contracts.executor import (
    CommandKind,
    ExecutorCommand,
    ExecutorJob,
    ExecutorJobState,
    MigrationPhase,
    NodeIntent,
    NodePhase,
    NodeRecord,
)
from pacer.contracts.jobs import ResourcePlan
from pacer.contracts.nodes import NodeEvent
from pacer.subjects import NodeEventKind
from pacer_services.pod_executor.core import effects as fx
from pacer_services.pod_executor.core.exits import ExitAnswer, ExitOutcome
from pacer_services.pod_executor.core.migration import MigrationStart
from pacer_services.pod_executor.core.model import Node, NodeSpec
from pacer_services.pod_executor.core.node import legacy_state, transition
from pacer_services.pod_executor.core.plan import PlanChange


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


def live(n: NodeRecord) -> bool:
    """A node with a pod to keep: neither scaled away nor finished."""
    return n.state not in (NodePhase.REMOVED, NodePhase.FINISHED)


def queue_resize(ej: ExecutorJob, due: tuple[NodeSpec, ...]) -> None:
    """Mark every live worker with the size it is due (``PlanChange.resize``); a later plan overrides what an
    earlier one queued, and a worker scaled away or finished has nothing due."""
    by_index = {t.index: t for t in due}
    for n in ej.nodes:
        t = by_index.get(n.index) if n.role == Role.WORKER and live(n) else None
        n.resize_cpu, n.resize_memory_mb = (t.cpu, t.memory_mb) if t is not None else (0.0, 0)


def apply_change(ej: ExecutorJob, plan: ResourcePlan, change: PlanChange, now: float,
                 reason: str) -> tuple[fx.Effect, ...]:
    """The record under ``plan`` as ``change`` moves it there: new nodes (PS first), nodes scaled back up
    (a fresh pod of their next generation, with the plan's size), nodes scaled away, the resizes due;
    then save it (the intent first: a crash from there on is healed by reconcile), create the started
    pods and stop the stopped ones.  A migration or a resize step the change asks for is the caller's."""
    ej.plan, ej.plan_at, ej.applied, ej.reason = plan, now, False, reason
    ej.state = ExecutorJobState.STARTING if ej.state is ExecutorJobState.STARTING else ExecutorJobState.RUNNING
    have = {n.node: n for n in ej.nodes}
    started = [f"{s.role}-{s.index}" for s in sorted(change.start, key=lambda s: (s.role != Role.PS, s.index))]
    for s in change.start:
        n = have.get(f"{s.role}-{s.index}")
        if n is None:
            ej.nodes.append(NodeRecord(f"{s.role}-{s.index}", s.role, s.index, s.cpu, s.memory_mb))
        else:  # scaled back up: a fresh pod, nothing pending on it
            n.generation += 1
            n.cpu, n.memory_mb = s.cpu, s.memory_mb
            move(n, NodePhase.PENDING)
    for name in change.stop:
        move(have[name], NodePhase.REMOVED)
    queue_resize(ej, change.resize)
    return (fx.SaveRecord(), *(fx.CreatePod(name) for name in started), *(fx.DeletePod(name) for name in change.stop))


def node_command(ej: ExecutorJob, n: NodeRecord, cmd: ExecutorCommand, *, live_pod: bool) -> tuple[fx.Effect, ...]:
    """A STOP (the node is removed), or a RESTART / MIGRATE (with the command's size) of a worker: its live
    pod is stopped to start again (its exit is then a requested restart), or, with none running, its next
    pod is made now.  A PS is moved by a migration instead (the caller starts it).  The command's id is
    remembered (the last 64), so a repeated command is answered as done."""
    if cmd.kind is CommandKind.STOP:
        move(n, NodePhase.REMOVED)
    else:
        if cmd.kind is CommandKind.MIGRATE:
            n.cpu = cmd.cpu if cmd.cpu is not None else n.cpu
            n.memory_mb = cmd.memory_mb if cmd.memory_mb is not None else n.memory_mb
        if live_pod:
            move(n, NodePhase.STOPPING, NodeIntent.RESTART)
    remember_command(ej, cmd)
    if live_pod:
        return fx.SaveRecord(), fx.DeletePod(n.node)
    if cmd.kind is CommandKind.STOP:
        return (fx.SaveRecord(),)
    n.requested_restarts += 1  # nothing running to stop: the next pod now
    n.generation += 1
    move(n, NodePhase.PENDING)
    return fx.SaveRecord(), fx.CreatePod(n.node)


def remember_command(ej: ExecutorJob, cmd: ExecutorCommand) -> None:
    if cmd.command_id:
        ej.commands = [*ej.commands[-63:], cmd.command_id]


def begin_migration(ej: ExecutorJob, start: MigrationStart, next_cluster: str, now: float, reason: str,
                    stop_first: bool) -> tuple[fx.Effect, ...]:
    """The record as a PS migration starts (:func:`.migration.migration_start`'s ``start``): the next
    cluster, each new PS its next generation with its new size (the old pod's end is the migration's
    doing), the old PS pods to retire, the PS slots removed; then save it and create every PS pod."""
    ej.migration, ej.next_cluster, ej.migration_at, ej.checkpoint = (
        MigrationPhase.STARTING_PS, next_cluster, now, "")
    ej.migration_stop_first = stop_first
    ej.reason = f"migrating PS: {reason}"
    by_index = {n.index: n for n in ej.nodes if n.role == Role.PS}
    for s in start.start:
        n = by_index.get(s.index)
        if n is None:
            n = NodeRecord(f"ps-{s.index}", Role.PS.value, s.index, s.cpu, s.memory_mb, generation=-1)
            ej.nodes.append(n)
        else:
            n.handled = n.generation  # the old pod's end is the migration's doing
        n.generation += 1
        n.cpu, n.memory_mb, n.running_at = s.cpu, s.memory_mb, 0.0
        move(n, NodePhase.PENDING)
    ej.retiring.extend(start.retire)
    for name in start.remove:
        move(next(n for n in ej.nodes if n.node == name), NodePhase.REMOVED)
    return (fx.SaveRecord(), *(fx.CreatePod(n.node) for n in ej.nodes
                               if n.role == Role.PS and n.state is not NodePhase.REMOVED))
