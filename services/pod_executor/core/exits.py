"""How a node's exit is classified and answered.

AntDT §V-D: node errors are *retryable* (proactive termination for
KILL_RESTART, network errors, eviction, preemption) or *unretryable*
(configuration or programming errors of the user), which must fail the job.
DLRover 2023 §4.2: a node that fails with OOM is relaunched with double the
memory (a PS OOM in the sampling stage doubles the PS count instead; that is
the brain's decision, not this core's).

``on_exit`` turns one observed exit into a decision; ``answer_exit`` adds
what the executor knows about the node (a stop it sent and why, a scale-down,
a replacement due) and says what happens next.  Deterministic, no IO,
no clock.  Both the live executor (local processes or Kubernetes) and the
simulators use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from pacer.contracts import executor
from pacer.contracts.common import Role
from pacer.contracts.executor import NodeIntent
from pacer_services.pod_executor.core.model import DEFAULT_POLICY, ExecutorPolicy, Node, NodeSpec
from pacer_services.pod_executor.core.resize import relaunch_resized

# Exit codes with a meaning of their own (the trainer's and the shell's).
EXIT_OK = 0
EXIT_RESTART = 75  # the trainer asks to be relaunched (KILL_RESTART); see pacer.trainer.worker
EXIT_USAGE = 2  # argparse and most CLIs: bad arguments / configuration
EXIT_REFUSED = executor.EXIT_REFUSED  # the bus refused the pod's credentials for good (its agent gave up)
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
    REFUSED = "refused"  # the bus refused the pod's credentials for good (exit 77): an expired token, most likely


# AntDT §V-D: which reasons may be retried by relaunching the node.
RETRYABLE: frozenset[ExitReason] = frozenset({
    ExitReason.RESTART_REQUESTED,
    ExitReason.KILLED,
    ExitReason.OOM,
    ExitReason.EVICTED,
    ExitReason.PREEMPTED,
    ExitReason.NETWORK,
    ExitReason.REFUSED,  # a new pod of a running job gets a fresh token; an ended job's is not relaunched
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
    if info.code == EXIT_REFUSED:
        return ExitReason.REFUSED
    if info.code == EXIT_USAGE:  # the trainer said its configuration is wrong: words in its log do not retry it
        return ExitReason.CONFIG_ERROR
    if info.network_error:
        return ExitReason.NETWORK
    return ExitReason.USER_ERROR


@dataclass(frozen=True, slots=True)
class ExitDecision:
    reason: ExitReason
    retryable: bool
    relaunch: NodeSpec | None  # the spec to relaunch with, or None
    fail_job: bool = False
    detail: str = ""


def on_exit(node: Node, info: ExitInfo, policy: ExecutorPolicy = DEFAULT_POLICY, *,
            ps_lost: bool = False) -> ExitDecision:
    """Decide what to do about a node whose process ended.

    ``ps_lost``: a PS of the job died unasked just before.  A worker that then
    exits because it lost its PS (NETWORK) failed through no fault of its
    own: it is relaunched without spending its budget, or one flaky PS would
    fail a job of healthy workers (found by the chaos runs).
    """
    reason = classify(info)
    if info.by_executor:
        return ExitDecision(reason, True, None, detail="stopped by the executor")
    if reason is ExitReason.COMPLETED:
        return ExitDecision(reason, False, None, detail="finished")
    if reason is ExitReason.RESTART_REQUESTED:
        # Asked for (KILL_RESTART): not a failure, no budget spent.
        return ExitDecision(reason, True, node.spec, detail="KILL_RESTART")
    if reason is ExitReason.NETWORK and ps_lost and node.spec.role == Role.WORKER:
        return ExitDecision(reason, True, node.spec, detail=f"{node.name}: lost its PS, which died (no budget spent)")
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


class ExitOutcome(str, enum.Enum):
    """What follows a node's exit."""

    FINISHED = "finished"  # exit 0: the node is done (a ``finished`` event with the trainer's result)
    MIGRATING = "migrating"  # stopped for a PS migration: the migration starts it on the next cluster
    RELAUNCH = "relaunch"  # its next pod is created now
    FAIL_JOB = "fail_job"  # an unretryable error or a spent budget: the job fails
    NOTHING = "nothing"  # stopped for good (scaled away, stopped, torn down) or the job is over


@dataclass(frozen=True, slots=True)
class ExitAnswer:
    outcome: ExitOutcome
    decision: ExitDecision  # the exit as :func:`on_exit` judged it alone
    reason: str  # the ``died`` event's reason
    detail: str
    relaunch: NodeSpec | None = None  # RELAUNCH: the next pod's spec
    requested: bool = False  # the relaunch was asked for (KILL_RESTART, a command, a replacement): no budget spent
    oom: bool = False  # the relaunch answers an OOM (its memory is the node's new floor)
    restore: bool = False  # the next pod restores the newest checkpoint (a chief that lost its PS)


def answer_exit(node: Node, info: ExitInfo, *, intent: NodeIntent = NodeIntent.NONE, removed: bool = False,
                active: bool = True, resize_to: NodeSpec | None = None,
                policy: ExecutorPolicy = DEFAULT_POLICY, ps_lost: bool = False) -> ExitAnswer:
    """What the executor does after ``node``'s pod ended.

    ``intent`` is why the executor itself stopped it (``info.by_executor``),
    ``removed`` that it was scaled away or stopped for good, ``active`` that
    the job still runs (starting, running or completing), ``resize_to`` the
    size a rolling replacement has due for it: whatever ended the pod, the
    next one takes that size (:func:`.resize.relaunch_resized`), ``ps_lost``
    that a PS of the job died unasked just before (:func:`on_exit`).
    """
    d = on_exit(node, info, policy, ps_lost=ps_lost)
    if d.reason is ExitReason.COMPLETED:
        return ExitAnswer(ExitOutcome.FINISHED, d, d.reason.value, d.detail)
    if intent == NodeIntent.MIGRATE:
        return ExitAnswer(ExitOutcome.MIGRATING, d, "migrating", d.detail)
    restart = info.by_executor and intent in (NodeIntent.RESTART, NodeIntent.RESIZE) and not removed
    relaunch: NodeSpec | None = None
    if restart:  # a restart (KILL_RESTART), migration command or replacement stopped it: start it again
        relaunch = node.spec
    elif not removed and active and not info.by_executor:
        relaunch = d.relaunch
    oom = not restart and d.reason is ExitReason.OOM
    reason, detail = ("restart_requested" if restart else d.reason.value), d.detail
    if relaunch is not None and resize_to is not None:  # a replacement was due: this relaunch is it
        relaunch = relaunch_resized(relaunch, resize_to, oom)
        if intent == NodeIntent.RESIZE and restart:
            reason = "resized"
        detail = f"{detail}; relaunched with {relaunch.cpu:g} CPU / {relaunch.memory_mb} MiB (plan)"
    if relaunch is not None:
        chief = node.spec.role == Role.WORKER and node.spec.index == 0
        return ExitAnswer(ExitOutcome.RELAUNCH, d, reason, detail, relaunch,
                          requested=restart or d.reason is ExitReason.RESTART_REQUESTED
                          or (ps_lost and d.reason is ExitReason.NETWORK and node.spec.role == Role.WORKER),
                          oom=oom,
                          restore=chief and d.reason is ExitReason.NETWORK)
    if d.fail_job and active and not removed and not info.by_executor:
        return ExitAnswer(ExitOutcome.FAIL_JOB, d, reason, detail)
    return ExitAnswer(ExitOutcome.NOTHING, d, reason, detail)
