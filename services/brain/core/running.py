"""What the executor runs for a job, from its events alone: the plan in force and the plan as run.

The brain never reads the executor's KV.  It folds the events the executor
publishes into one :class:`~pacer.contracts.brain.RunningJob` per job:

* ``pacer.events.executor.<job>.applied`` (:class:`ExecutorEvent`): the
  plan in force is the event's plan (every node of it ran once);
* ``pacer.events.node.<job>.created`` / ``running`` (:class:`NodeEvent`):
  the pod the executor made for a node, with its CPU and memory, which can
  be more than the plan's after an OOM relaunch (the executor doubles the
  memory and never gives that node less again, ``pod_executor.core.resize``).

:func:`as_run` turns a record into the plan as the job really ran, DLRover-RM
Alg. 1's A^i for the config DB: the applied plan's counts, each role with
the largest CPU and memory its nodes (within those counts) were given.

Every fold returns a new record whose ``seq`` is the event's stream
sequence; :func:`is_new` tells a redelivered event (the durable consumer
delivers at least once) from a new one, so folding is idempotent.

Pure: no IO, no clock.
"""

from __future__ import annotations

from dataclasses import replace

from pacer.contracts.brain import NodeSize, RunningJob
from pacer.contracts.common import Role
from pacer.contracts.executor import ExecutorEvent
from pacer.contracts.jobs import ResourcePlan
from pacer.contracts.nodes import NodeEvent
from pacer.subjects import NodeEventKind

__all__ = ["SIZED_KINDS", "as_run", "is_new", "on_applied", "on_node"]

SIZED_KINDS = (NodeEventKind.CREATED, NodeEventKind.RUNNING)  # node events that carry the pod's size


def is_new(rec: RunningJob | None, seq: int) -> bool:
    """Whether the event at stream sequence ``seq`` has not been folded into ``rec`` yet."""
    return rec is None or seq > rec.seq


def on_applied(rec: RunningJob | None, ev: ExecutorEvent, seq: int) -> RunningJob:
    """``rec`` after the executor's ``applied`` event: its plan is in force.

    Node sizes stay: nodes that the plan resized are re-created, and their
    ``created`` events follow; an OOM-relaunched node keeps its memory.
    """
    base = rec if rec is not None else RunningJob(ev.job)
    if ev.plan is None:
        return replace(base, seq=seq)
    return replace(base, plan=ev.plan, applied_at=ev.ts, seq=seq)


def on_node(rec: RunningJob | None, ev: NodeEvent, seq: int) -> RunningJob | None:
    """``rec`` after a node event: ``created`` / ``running`` record the node's pod size; others only
    advance ``seq`` (None: no record to advance, e.g. a job's pods dying after it ended)."""
    if ev.kind not in SIZED_KINDS or ev.cpu <= 0 or ev.memory_mb <= 0:
        return replace(rec, seq=seq) if rec is not None else None
    base = rec if rec is not None else RunningJob(ev.job)
    nodes = {n.node: n for n in base.nodes}
    nodes[ev.node] = NodeSize(ev.node, ev.role or ev.node.rsplit("-", 1)[0], ev.cpu, ev.memory_mb)
    return replace(base, nodes=[nodes[k] for k in sorted(nodes)], seq=seq)


def _index(node: str) -> int:
    try:
        return int(node.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def as_run(rec: RunningJob | None, plan: ResourcePlan) -> ResourcePlan:
    """The plan as the job ran at the end (DLRover-RM Alg. 1's A^i): what a similar job should start from.

    ``plan`` is the job's own record of its plan (the fallback, and where
    the other fields come from).  Counts are the last applied plan's; CPU
    and memory per role the largest its nodes within those counts were
    given (an OOM relaunch doubled one); a role none of whose nodes was
    seen keeps the applied plan's amounts.
    """
    if rec is None or rec.plan is None:
        return plan
    ran = rec.plan
    workers = [n for n in rec.nodes if n.role == Role.WORKER and 0 <= _index(n.node) < ran.workers]
    ps = [n for n in rec.nodes if n.role == Role.PS and 0 <= _index(n.node) < ran.ps]
    return replace(
        plan, workers=ran.workers, ps=ran.ps,
        worker_cpu=max([ran.worker_cpu, *(n.cpu for n in workers)]),
        worker_memory_mb=max([ran.worker_memory_mb, *(n.memory_mb for n in workers)]),
        ps_cpu=max([ran.ps_cpu, *(n.cpu for n in ps)]),
        ps_memory_mb=max([ran.ps_memory_mb, *(n.memory_mb for n in ps)]),
        reason="as run (the executor's last applied plan and the nodes it created)")
