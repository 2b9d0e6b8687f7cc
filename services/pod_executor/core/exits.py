"""Pure core of the pod-executor: how a node's exit is classified and answered.

AntDT §V-D: node errors are *retryable* (proactive termination for
KILL_RESTART, network errors, eviction, preemption) or *unretryable*
(configuration or programming errors of the user), which must fail the job.
DLRover 2023 §4.2: a node that fails with OOM is relaunched with double the
memory (a PS OOM in the sampling stage doubles the PS count instead; that is
the brain's decision, not this core's).

``on_exit`` turns one observed exit into a decision; ``reconcile`` turns a
plan and the nodes that exist into the starts and stops that close the gap;
``resize_targets`` and ``resize_batch`` decide the rolling replacement that
gives running workers a new plan's CPU and memory.
Deterministic, no IO, no clock: time comes in as ``now``.  Both the live
executor (local processes or Kubernetes) and the cluster simulator use it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

# Exit codes with a meaning of their own (the trainer's and the shell's).
EXIT_OK = 0
EXIT_RESTART = 75  # the trainer asks to be relaunched (KILL_RESTART); see pacer.trainer.worker
EXIT_USAGE = 2  # argparse and most CLIs: bad arguments / configuration
SIGKILL = 9
SIGTERM = 15


class ExitReason(str, enum.Enum):
    """Why a node's process ended, as the executor classifies it."""

    COMPLETED = "completed"  # exit 0
    RESTART_REQUESTED = "restart_requested"  # KILL_RESTART: the trainer exited 75
    KILLED = "killed"  # SIGKILL/SIGTERM not sent by us (node lost, kernel, operator)
    OOM = "oom"  # over its memory limit (kubelet: OOMKilled; local: our limit)
    EVICTED = "evicted"  # the cluster took the node back (Kubernetes: Evicted)
    PREEMPTED = "preempted"  # a higher-priority job took the resources
    NETWORK = "network"  # the trainer reported a lost PS / connection failure
    USER_ERROR = "user_error"  # the user's code raised (non-zero exit, not one of the above)
    CONFIG_ERROR = "config_error"  # bad arguments or configuration (exit 2, image/config errors)


# AntDT §V-D: which reasons may be retried by relaunching the node.
RETRYABLE: frozenset[ExitReason] = frozenset({
    ExitReason.RESTART_REQUESTED,
    ExitReason.KILLED,
    ExitReason.OOM,
    ExitReason.EVICTED,
    ExitReason.PREEMPTED,
    ExitReason.NETWORK,
})

# Kubernetes container/pod reasons -> ours.
_K8S_REASONS: dict[str, ExitReason] = {
    "OOMKilled": ExitReason.OOM,
    "Evicted": ExitReason.EVICTED,
    "Preempting": ExitReason.PREEMPTED,
    "DeadlineExceeded": ExitReason.KILLED,
    "NodeLost": ExitReason.KILLED,
    "Shutdown": ExitReason.KILLED,
    "Deleted": ExitReason.KILLED,  # the pod object was deleted under a running trainer
    "ErrImagePull": ExitReason.CONFIG_ERROR,
    "ImagePullBackOff": ExitReason.CONFIG_ERROR,
    "CreateContainerConfigError": ExitReason.CONFIG_ERROR,
    "InvalidImageName": ExitReason.CONFIG_ERROR,
}


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """What the backend observed when a node's process ended."""

    code: int | None  # exit code; None when it died of a signal
    signal: int | None = None
    k8s_reason: str = ""  # container terminated reason or pod status reason
    oom: bool = False  # the backend saw the memory limit crossed
    by_executor: bool = False  # we stopped it ourselves (scale-down, migration)
    network_error: bool = False  # the trainer's last words name a lost PS/connection


def classify(info: ExitInfo) -> ExitReason:
    """One observed exit -> its reason (AntDT §V-D)."""
    if info.oom or info.k8s_reason == "OOMKilled":
        return ExitReason.OOM
    if info.k8s_reason in _K8S_REASONS:
        return _K8S_REASONS[info.k8s_reason]
    if info.code == EXIT_OK:
        return ExitReason.COMPLETED
    if info.code == EXIT_RESTART:
        return ExitReason.RESTART_REQUESTED
    if info.signal in (SIGKILL, SIGTERM) or info.code in (128 + SIGKILL, 128 + SIGTERM, -SIGKILL, -SIGTERM):
        return ExitReason.KILLED
    if info.network_error:
        return ExitReason.NETWORK
    if info.code == EXIT_USAGE:
        return ExitReason.CONFIG_ERROR
    return ExitReason.USER_ERROR


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """The blueprint of one node: role, slot and resources."""

    role: str  # worker | ps
    index: int
    cpu: float = 1.0
    memory_mb: int = 1024


@dataclass(frozen=True, slots=True)
class Node:
    """A node as the executor tracks it."""

    spec: NodeSpec
    restarts: int = 0  # relaunches after retryable failures (not counting KILL_RESTART)
    requested_restarts: int = 0  # relaunches asked for by KILL_RESTART
    state: str = "pending"  # pending | running | exited
    oom_memory_mb: int = 0  # the memory an OOM relaunch gave it (0: none); see resize_targets

    @property
    def name(self) -> str:
        return f"{self.spec.role}-{self.spec.index}"


@dataclass(frozen=True, slots=True)
class ExecutorPolicy:
    """Configurable limits of the executor."""

    relaunch_budget: int = 3  # retryable failures per node before the job fails
    oom_memory_factor: float = 2.0  # DLRover: relaunch an OOM-killed node with x2 memory
    max_memory_mb: int = 64 * 1024  # never ask for more than this per node
    resize_fraction: float = 0.25  # rolling worker replacement: at most this share of the workers down at once


@dataclass(frozen=True, slots=True)
class ExitDecision:
    reason: ExitReason
    retryable: bool
    relaunch: NodeSpec | None  # the spec to relaunch with, or None
    fail_job: bool = False
    detail: str = ""


def on_exit(node: Node, info: ExitInfo, policy: ExecutorPolicy = ExecutorPolicy()) -> ExitDecision:
    """Decide what to do about a node whose process ended."""
    reason = classify(info)
    if info.by_executor:
        return ExitDecision(reason, True, None, detail="stopped by the executor")
    if reason is ExitReason.COMPLETED:
        return ExitDecision(reason, False, None, detail="finished")
    if reason is ExitReason.RESTART_REQUESTED:
        # Asked for (KILL_RESTART): not a failure, no budget spent.
        return ExitDecision(reason, True, node.spec, detail="KILL_RESTART")
    if reason not in RETRYABLE:
        return ExitDecision(reason, False, None, fail_job=True,
                            detail=f"{node.name}: unretryable {reason.value} (exit {info.code}, signal {info.signal})")
    if node.restarts >= policy.relaunch_budget:
        return ExitDecision(reason, True, None, fail_job=True,
                            detail=f"{node.name}: relaunch budget of {policy.relaunch_budget} spent ({reason.value})")
    spec = node.spec
    if reason is ExitReason.OOM:
        if spec.memory_mb >= policy.max_memory_mb:
            return ExitDecision(reason, True, None, fail_job=True,
                                detail=f"{node.name}: OOM at the memory cap of {policy.max_memory_mb} MB")
        spec = replace(spec, memory_mb=min(policy.max_memory_mb, int(spec.memory_mb * policy.oom_memory_factor)))
    return ExitDecision(reason, True, spec, detail=f"{node.name}: relaunch after {reason.value}")


@dataclass(frozen=True, slots=True)
class Plan:
    """How many nodes of each role, with what resources (from the brain or the default)."""

    workers: int
    ps: int
    worker: NodeSpec = field(default_factory=lambda: NodeSpec("worker", 0))
    ps_spec: NodeSpec = field(default_factory=lambda: NodeSpec("ps", 0))


@dataclass(frozen=True, slots=True)
class Reconcile:
    start: tuple[NodeSpec, ...]
    stop: tuple[str, ...]  # node names


def reconcile(plan: Plan, nodes: dict[str, Node]) -> Reconcile:
    """Starts and stops that make the live nodes match the plan.

    Scale-up fills the lowest free slots; scale-down stops the highest slots
    first (their shards go back through the node-death event).  Resources of
    running nodes are not changed here: that is a migration.
    """
    start: list[NodeSpec] = []
    stop: list[str] = []
    for role, want, template in (("worker", plan.workers, plan.worker), ("ps", plan.ps, plan.ps_spec)):
        live = sorted((n for n in nodes.values() if n.spec.role == role and n.state != "exited"),
                      key=lambda n: n.spec.index)
        have = {n.spec.index for n in live}
        missing = [i for i in range(want) if i not in have]
        start.extend(replace(template, role=role, index=i) for i in missing)
        stop.extend(n.name for n in live if n.spec.index >= want)
    return Reconcile(tuple(start), tuple(stop))


# ------------------------------------------------------------ rolling worker replacement
#
# A plan may give workers another CPU or memory size.  Creating new workers with
# it is not enough: the running ones must get it too.  A PS holds part of the
# model and moves by a seamless migration (DLRover-RM §5.2); a worker in PS
# training holds no state (its DOING shards go back to TODO through its `died`
# event and are trained again), so it gets its new size by being replaced: its
# pod stops, a pod of the new size takes the slot and pulls shards from the
# queue with no re-partitioning (DLRover-RM §5.1, "fast elasticity": a stop-
# and-restart with adjusted CPU/memory).  Done a batch at a time, the job
# keeps training throughout.


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
        if n.spec.role != "worker" or n.state == "exited":
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


def resize_batch_size(workers: int, policy: ExecutorPolicy = ExecutorPolicy()) -> int:
    """How many of ``workers`` may be down at once while they are replaced: a fraction, at least one.

    With the default 0.25 at least three quarters of the workers keep training
    (throughput drops by at most a quarter while a batch starts) and any job
    is through in about four rounds of pod starts: one at a time would take a
    round per worker (a TF worker starts in 2.5-4 s here, 5-10 s when four
    start together; on Kubernetes a pod may also wait to be scheduled and pull
    its image), all at once would stop training and ask the scheduler for
    every new pod together.
    """
    return max(1, math.floor(workers * policy.resize_fraction))


def resize_batch(workers: Sequence[ResizeView], policy: ExecutorPolicy = ExecutorPolicy()) -> tuple[int, ...]:
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
