"""Rolling worker replacement: how running workers get a new plan's CPU and memory.

A plan may give workers another CPU or memory size.  Creating new workers with
it is not enough: the running ones must get it too.  A PS holds part of the
model and moves by a seamless migration (DLRover-RM §5.2, :mod:`.migration`);
a worker in PS training holds no state (its DOING shards go back to TODO
through its ``died`` event and are trained again), so it gets its new size by
being replaced: its pod stops, a pod of the new size takes the slot and pulls
shards from the queue with no re-partitioning (DLRover-RM §5.1, "fast
elasticity": a stop-and-restart with adjusted CPU/memory).  Done a batch at a
time, the job keeps training throughout.  Pure: no IO, no clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from pacer.contracts.common import Role
from pacer_services.pod_executor.core.model import DEFAULT_POLICY, ExecutorPolicy, Node, NodeSpec


def resize_targets(wanted: NodeSpec, workers: Iterable[Node]) -> tuple[NodeSpec, ...]:
    """The live workers whose size differs from the plan's ``wanted``, each with the size it gets.

    CPU is the plan's.  Memory is the plan's too, except that a worker the
    executor relaunched with more memory after an OOM (DLRover 2023 §4.2's x2,
    ``Node.oom_memory_mb``) never gets less than that: a plan that gave it
    less would bring the OOM back, and the relaunch budget would pay for it.
    PS are never here (see above).  Sorted by slot.
    """
    out: list[NodeSpec] = []
    for n in workers:
        if n.spec.role != Role.WORKER or not n.live:
            continue
        target = replace(n.spec, cpu=wanted.cpu, memory_mb=max(wanted.memory_mb, n.oom_memory_mb))
        if (target.cpu, target.memory_mb) != (n.spec.cpu, n.spec.memory_mb):
            out.append(target)
    return tuple(sorted(out, key=lambda s: s.index))


class WorkerPhase(str, enum.Enum):
    """Where a live worker is, as a rolling replacement counts it."""

    RUNNING = "running"  # its pod runs: it trains
    PENDING = "pending"  # its pod exists but does not run yet
    STOPPING = "stopping"  # its pod is being stopped (a replacement or a restart under way)
    GONE = "gone"  # no live pod: a relaunch is due


@dataclass(frozen=True, slots=True)
class ResizeView:
    """One live worker of a job during a rolling replacement."""

    index: int
    phase: WorkerPhase
    queued: bool  # it still has to be replaced with the plan's size


def resize_batch_size(workers: int, policy: ExecutorPolicy = DEFAULT_POLICY) -> int:
    """How many of ``workers`` may be down at once while they are replaced: a fraction, at least one.

    With the default 0.25 at least three quarters of the workers keep training
    (throughput drops by at most a quarter while a batch starts) and any job
    is through in about four rounds of pod starts: one at a time would take a
    round per worker (a TF worker starts in 2.5-4 s here, 5-10 s when four
    start together; on Kubernetes a pod may also wait to be scheduled and pull
    its image), all at once would stop training and ask the scheduler for
    every new pod together.
    """
    fraction: float = policy.resize_fraction
    return max(1, math.floor(workers * fraction))


def resize_batch(workers: Sequence[ResizeView], policy: ExecutorPolicy = DEFAULT_POLICY) -> tuple[int, ...]:
    """The queued workers to replace now (slot indices), given every live worker of the job.

    Every worker that does not run counts against :func:`resize_batch_size`,
    whatever the cause (replaced, restarted, relaunched after a failure,
    starting), so the next batch begins only once the last one runs and a
    replacement never adds to an outage.  A queued worker whose pod is still
    pending costs no training to replace and is taken at once; a stopping or
    gone one gets its new size from the relaunch already due.  Highest slots
    first, so the chief (worker 0: checkpoints, the job's result) goes last.
    """
    limit = resize_batch_size(len(workers), policy)
    room = limit - sum(1 for w in workers if w.phase is not WorkerPhase.RUNNING)
    free = [w.index for w in workers if w.queued and w.phase is WorkerPhase.PENDING]
    running = sorted((w.index for w in workers if w.queued and w.phase is WorkerPhase.RUNNING), reverse=True)
    return tuple(sorted(free, reverse=True)) + tuple(running[:max(0, room)])


def relaunch_resized(relaunch: NodeSpec, target: NodeSpec, oom: bool) -> NodeSpec:
    """The spec for a node relaunched while a replacement to ``target`` is due: the target now.

    Whatever ended the old pod (the replacement itself, a KILL_RESTART, a
    failure), the next pod takes the new size, so the node is not replaced a
    second time.  After an OOM it gets the larger of the doubled memory and
    the target.
    """
    memory = max(target.memory_mb, relaunch.memory_mb) if oom else target.memory_mb
    return replace(relaunch, cpu=target.cpu, memory_mb=memory)


def resize_rounds(targets: Iterable[int], workers: int, policy: ExecutorPolicy = DEFAULT_POLICY) -> tuple[tuple[int, ...], ...]:
    """The batches a rolling replacement of the ``targets`` slots goes through among ``workers`` live workers.

    What :func:`resize_batch` picks round after round when every replacement
    runs again before the next round and nothing else is down: the batch
    order of the live executor in a quiet job (highest slot first, the chief
    last).  The simulators charge a replacement by it.
    """
    queued = set(targets)
    slots = sorted(set(range(workers)) | queued)
    rounds: list[tuple[int, ...]] = []
    while queued:
        batch = resize_batch([ResizeView(i, WorkerPhase.RUNNING, i in queued) for i in slots], policy)
        if not batch:  # cannot happen (a batch is at least one), but never loop forever
            break
        rounds.append(batch)
        queued -= set(batch)
    return tuple(rounds)
