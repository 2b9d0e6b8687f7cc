"""The executor's longer moves of a running job, as IO around the core's decisions.

* memory grown in place on running pods (a plan that only adds memory);
* the rolling worker replacement (DLRover-RM §5.1): :func:`.core.resize_batch`
  picks the next batch, stopped with the intent ``resize`` and started again
  with its new size by the exit handling;
* the seamless PS migration (DLRover-RM §5.2): :func:`.core.migration_start`
  and :func:`.core.record.begin_migration` start the new PS beside the old
  cluster, and each reconcile pass steps it on (:func:`.core.migration_step`).

Each runs in the job's own worker (:class:`pacer.owned.queues.JobQueues`), like every change of
its record.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pacer.contracts.common import Role
from pacer.contracts.executor import (
    ExecutorJob,
    MigrationPhase,
    NodeIntent,
    NodePhase,
    NodeRecord,
    PodPhase,
)
from pacer.errors import Conflict, NotFound, PacerError
from pacer.trainer.cluster import ClusterDesc
from pacer_services.pod_executor import core
from pacer_services.pod_executor.core import effects as fx
from pacer_services.pod_executor.core import record

if TYPE_CHECKING:
    from pacer_services.pod_executor.app import ExecutorService

log = logging.getLogger("pacer.executor")


async def grow(svc: ExecutorService, ej: ExecutorJob, specs: tuple[core.NodeSpec, ...]) -> bool:
    """Raise running nodes' memory in place (``plan_change``'s ``grow``); False when the backend
    refuses one (a Kubernetes older than 1.33, a pod that just ended): the caller then applies
    the plan by a migration or a replacement.  Before the plan's intent is saved: a crash in
    between leaves bigger pods than the record says, and the plan's redelivery grows them again
    (a resize to the same size is a no-op)."""
    nodes = {n.node: n for n in ej.nodes}
    for spec in specs:
        n = nodes.get(f"{spec.role}-{spec.index}")
        if n is None:
            continue
        try:
            await svc.io.grow(ej, n, spec.memory_mb)
        except (Conflict, NotFound) as exc:
            svc.counters.inc("memory_grow_refused")
            log.warning("in-place memory resize refused; applying the plan without it",
                        extra={"fields": {"job": ej.job, "node": n.node, "error": exc.message}})
            return False
    return True


def worker_phase(svc: ExecutorService, ej: ExecutorJob, n: NodeRecord) -> core.WorkerPhase:
    st = svc.io.current(ej, n)
    if st is None or st.phase is PodPhase.EXITED:
        return core.WorkerPhase.GONE
    if n.intent is not NodeIntent.NONE:
        return core.WorkerPhase.STOPPING
    return core.WorkerPhase.RUNNING if n.running_at else core.WorkerPhase.PENDING


async def resize_step(svc: ExecutorService, ej: ExecutorJob) -> None:
    """Start the next batch of a rolling worker replacement (:func:`.core.resize_batch`), if one is due.

    After a plan and on every reconcile pass.  Not while a PS migration
    runs: it restarts every worker anyway and gives each the size it is due.
    """
    if not ej.state.active or ej.migration is not MigrationPhase.NONE:
        return
    live = [n for n in ej.nodes if n.role == Role.WORKER and record.live(n)]
    if not any(n.resize_memory_mb for n in live):
        return
    views = [core.ResizeView(n.index, worker_phase(svc, ej, n),
                             bool(n.resize_memory_mb) and n.intent is NodeIntent.NONE) for n in live]
    picked = set(core.resize_batch(views, svc.cfg.policy))
    batch = tuple(n.node for n in live if n.index in picked)
    if not batch:
        return
    # intent first: reconcile stops a pod whose stop a crash swallowed
    await svc.io.apply(ej, (fx.SetIntent(batch, NodeIntent.RESIZE), fx.SaveRecord(),
                            *(fx.DeletePod(b) for b in batch)))
    svc.counters.inc("workers_resized", len(batch))
    log.info("replacing workers with their new size", extra={"fields": {"job": ej.job, "nodes": list(batch)}})


async def start_migration(svc: ExecutorService, ej: ExecutorJob, ps: dict[int, tuple[float, int]], reason: str,
                          stop_first: bool = False) -> None:
    """Move the job's PS to new resources (or a new PS count) without stopping training first.

    DLRover-RM §5.2, seamless migration (:mod:`.core.migration`): the new
    PS pods (:func:`.core.migration_start`) are created beside the old
    cluster, which keeps training; the reconcile passes then step the
    migration through its phases (:func:`.core.migration_step`).
    ``stop_first``: a stop-and-restart instead (a PS's KILL_RESTART whose
    policy priced the pause below training on at the slow PS's pace):
    the same phases, but training stops at once.
    """
    if ej.migration is not MigrationPhase.NONE:
        raise Conflict(f"job {ej.job!r}: a PS migration is already under way ({ej.migration.value})")
    if not svc.cfg.checkpoint_root or not svc.cfg.agents:
        raise Conflict("PS migration needs checkpoints (PACER_CHECKPOINT_ROOT) and agent sidecars")
    old = ClusterDesc.from_json(ej.cluster)
    new = svc.backend.cluster(ej.job, len(ps), len(old.workers))
    by_index = {n.index: n for n in ej.nodes if n.role == Role.PS}
    live = {i: p.name for i, n in by_index.items()
            if (p := svc.io.current(ej, n)) is not None and p.phase is not PodPhase.EXITED}
    start = core.migration_start([core.PsView(i, n.state is NodePhase.REMOVED, live.get(i, ""))
                                  for i, n in by_index.items()], ps)
    await svc.io.apply(ej, record.begin_migration(ej, start, new.to_json(), svc.clock(), reason, stop_first))
    svc.counters.inc("migrations")
    log.info("PS migration started", extra={"fields": {"job": ej.job, "reason": reason}})


async def migrate_step(svc: ExecutorService, ej: ExecutorJob) -> None:
    """One step of a PS migration under way (:func:`.core.migration_step`), on a reconcile pass."""
    ps = [n for n in ej.nodes if n.role == Role.PS and n.state is not NodePhase.REMOVED]
    workers = [n for n in ej.nodes if n.role == Role.WORKER and record.live(n)]
    draining = tuple(n.node for n in workers if n.intent is NodeIntent.MIGRATE
                     and (p := svc.io.current(ej, n)) is not None and p.phase is not PodPhase.EXITED)
    step = core.migration_step(core.MigrationView(
        ej.migration, all(n.running_at for n in ps), tuple(n.node for n in workers), draining,
        ej.checkpoint, tuple(ej.retiring), ej.migration_stop_first))
    if step.stuck:
        raise Conflict(f"job {ej.job!r}: {step.stuck}")
    if not step.effects:
        return
    try:
        await svc.io.apply(ej, step.effects)
    except PacerError as exc:
        if not any(isinstance(e, fx.RequestCheckpoint) for e in step.effects) or ej.migration is not (
                MigrationPhase.STARTING_PS):
            raise
        svc.counters.inc("migration_retries")
        log.warning("migration of %s waits: the chief's agent did not take the checkpoint command (%s); "
                    "training goes on", ej.job, exc.message)
        return
    if step.phase is MigrationPhase.NONE:
        log.info("PS migration: workers restarted on the new cluster",
                 extra={"fields": {"job": ej.job, "checkpoint": ej.checkpoint}})
