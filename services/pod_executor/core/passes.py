"""One reconcile pass over a job: what the executor must do to close the gap between its record and the pods.

Reconcile in two phases (Ray's autoscaler): the service first observes (its
record, the backend's pods, the stops it sent itself) into a :class:`JobView`,
then :func:`reconcile_pass` decides and the service acts.  What an action
could not do (a create refused, a delete lost in a crash) shows up in the
next observation and is decided again.  Pure: no IO; time comes in as ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pacer.contracts.common import Role
from pacer.contracts.executor import (
    ExecutorJobState,
    MigrationPhase,
    NodeIntent,
    NodePhase,
    PodPhase,
)


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node of the job as observed at the start of a pass."""

    node: str
    role: str
    state: NodePhase
    intent: NodeIntent
    pod: PodPhase | None  # the node's current pod as the backend reports it (None: the backend has none)
    exit_handled: bool  # the current pod's exit was handled already (generation <= handled)
    resize_due: bool  # a rolling replacement still has to give it a new size
    running_at: float  # when its current pod ran (0: not yet)
    stop_sent: bool  # this executor (not a crashed predecessor) sent the stop of the current pod
    stopping: bool  # the current pod is among the pods the record says the executor is stopping

    @property
    def live(self) -> bool:
        return self.state not in (NodePhase.REMOVED, NodePhase.FINISHED)

    @property
    def pod_live(self) -> bool:
        return self.pod is not None and self.pod is not PodPhase.EXITED


@dataclass(frozen=True, slots=True)
class JobView:
    state: ExecutorJobState
    migration: MigrationPhase
    applied: bool  # the current plan's ``applied`` event was published
    plan_at: float
    completing_since: float
    nodes: tuple[NodeView, ...]
    pods_left: bool  # some pod of the job (any generation, old PS included) has not exited


@dataclass(frozen=True, slots=True)
class ReconcilePass:
    recreate: tuple[str, ...] = ()  # nodes whose pod the record names but the backend lacks: create it
    restop: tuple[str, ...] = ()  # replacements decided whose stop a crash swallowed: stop again
    applied_overhead: float | None = None  # every node of the plan runs: publish ``applied`` with this overhead
    migrate: bool = False  # step the PS migration (:func:`.migration.migration_step`)
    resize: bool = False  # look for the rolling replacement's next batch (:func:`.resize.resize_batch`)
    teardown: str = ""  # stop every pod of the job, for this reason
    redelete: tuple[str, ...] = ()  # tearing down: stop again the pods whose stop a crash lost
    torn_down: bool = False  # tearing down and no pod is left: release the job's resources, say so


def reconcile_pass(job: JobView, now: float, completion_grace_s: float) -> ReconcilePass:
    """What one reconcile pass does for ``job`` (nothing at all once it is torn down)."""
    if job.state is ExecutorJobState.TORN_DOWN:
        return ReconcilePass()
    running = job.state.active or job.state is ExecutorJobState.COMPLETING
    live = [n for n in job.nodes if n.live]
    recreate: tuple[str, ...] = ()
    restop: tuple[str, ...] = ()
    if running:
        # a crash between saving a node's next generation and creating its pod
        recreate = tuple(n.node for n in live if n.pod is None and not n.exit_handled)
        # a replacement decided (intent saved), but a crash swallowed the stop
        restop = tuple(n.node for n in live if n.intent is NodeIntent.RESIZE and n.pod_live and not n.stop_sent)
    resizing = any(n.resize_due or n.intent is NodeIntent.RESIZE for n in live)
    overhead: float | None = None
    if (job.state.active and job.migration is MigrationPhase.NONE and not job.applied and not resizing and live
            and not recreate and all(n.running_at for n in live)):
        overhead = max(0.0, max(n.running_at for n in live) - job.plan_at)
    teardown = ""
    workers = [n for n in job.nodes if n.role == Role.WORKER and n.state is not NodePhase.REMOVED]
    if running and workers and all(n.state is NodePhase.FINISHED for n in workers):
        teardown = "every worker finished"
    elif job.state is ExecutorJobState.COMPLETING and now - job.completing_since > completion_grace_s:
        teardown = f"workers still running {completion_grace_s:.0f}s after completion"
    tearing = job.state in (ExecutorJobState.TEARING_DOWN, ExecutorJobState.FAILED)
    return ReconcilePass(
        recreate=recreate, restop=restop, applied_overhead=overhead,
        migrate=job.migration is not MigrationPhase.NONE and job.state.active,
        resize=job.state.active and job.migration is MigrationPhase.NONE,
        teardown=teardown,
        redelete=tuple(n.node for n in job.nodes if n.pod_live and not n.stopping) if tearing else (),
        torn_down=tearing and not job.pods_left,
    )
