"""The seamless PS migration's phases as one pure step function (DLRover-RM §5.2).

(2) the new PS pods are created and initialised while the old PS and workers
keep training (``starting_ps``); only when every new PS runs does the short
pause begin: (1) the chief checkpoints the shard state and the model (flash
checkpoint, in shared memory) and every worker stops (``draining``); (3) the
shard state is restored to that checkpoint, the workers start again on the
new cluster, the chief restores the model into the new PS (re-cut for a new
PS count), and the old PS pods are stopped.  Records trained between the
checkpoint and the stop are trained again, none is lost.

:func:`migration_start` says which PS get a pod of the next cluster and which old
pods retire; :func:`migration_step` looks at one observation and returns the phase after
it with the effects that get there; the executor applies them in order and
calls it again on every reconcile pass.  Pure: no IO, no clock.

A stop-and-restart of a PS (AntDT §V-E2: KILL_RESTART of a server whose
slowness costs more than the pause; ``ExecutorJob.migration_stop_first``)
runs the same phases in another order: training stops at once (the chief
checkpoints from the old PS and every worker stops without waiting for the
new PS), the old PS pods stop as soon as the workers have, and the workers
start again on the new cluster once its PS run.  The new PS pods are created
at the start in both orders, so the pause is the longer of the drain and the
new PS's start, not their sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pacer.contracts.common import Role
from pacer.contracts.executor import MigrationPhase, NodeIntent
from pacer_services.pod_executor.core.effects import (
    CreatePod,
    DeletePod,
    DeletePods,
    Effect,
    EnterPhase,
    RequestCheckpoint,
    RestartNodes,
    RestoreShards,
    SaveRecord,
    SetIntent,
    SwitchCluster,
)
from pacer_services.pod_executor.core.model import NodeSpec

CHIEF = "worker-0"  # checkpoints, restores the model, writes the job's result


@dataclass(frozen=True, slots=True)
class MigrationView:
    """One job's migration as the executor sees it now."""

    phase: MigrationPhase
    ps_running: bool  # every PS of the next cluster runs
    workers: tuple[str, ...]  # the live workers (neither removed nor finished), the chief among them if live
    draining: tuple[str, ...]  # workers stopped for the migration whose pod still lives
    checkpoint: str  # the checkpoint id the chief reported on its way out ("": none yet)
    retiring: tuple[str, ...] = ()  # the old PS pods
    stop_first: bool = False  # a stop-and-restart: drain now, do not train on while the new PS start


@dataclass(frozen=True, slots=True)
class MigrationStep:
    phase: MigrationPhase  # the phase once the effects are applied
    effects: tuple[Effect, ...]
    stuck: str = ""  # the migration cannot go on (the service raises it as a conflict)


def migration_step(view: MigrationView) -> MigrationStep:
    """The next step of a job's PS migration (nothing to do is an empty step in the same phase)."""
    if view.phase is MigrationPhase.NONE:
        return MigrationStep(view.phase, ())
    if view.phase is MigrationPhase.STARTING_PS:
        if not view.ps_running and not view.stop_first:
            return MigrationStep(view.phase, ())  # the old cluster keeps training meanwhile
        chief = CHIEF in view.workers
        others = tuple(w for w in view.workers if w != CHIEF)
        # The chief checkpoints and exits by itself (75); the others are stopped once it took the command.
        return MigrationStep(MigrationPhase.DRAINING, (
            *((RequestCheckpoint(CHIEF),) if chief else ()),
            SetIntent(view.workers, NodeIntent.MIGRATE),
            EnterPhase(MigrationPhase.DRAINING),
            SaveRecord(),
            *(DeletePod(w) for w in others),
        ))
    # draining
    if view.draining:
        return MigrationStep(view.phase, ())
    if not view.checkpoint:
        return MigrationStep(view.phase, (), stuck="the chief stopped without a checkpoint; migration stuck")
    if not view.ps_running:
        # stop-first: the workers have stopped, so the old PS serve nobody: stop them now (their
        # resources may be what the new PS wait for) and wait for the new ones
        if view.retiring:
            return MigrationStep(view.phase, (DeletePods(view.retiring), SaveRecord()))
        return MigrationStep(view.phase, ())
    restore = (CHIEF,) if CHIEF in view.workers else ()
    return MigrationStep(MigrationPhase.NONE, (
        RestoreShards(view.checkpoint),
        SwitchCluster(),
        RestartNodes(view.workers, restore),
        SaveRecord(),  # intent first: a crash from here on is healed by reconcile
        *(CreatePod(w) for w in view.workers),
        DeletePods(view.retiring),
        SaveRecord(),
    ))


@dataclass(frozen=True, slots=True)
class PsView:
    """One PS node of the job when a migration starts."""

    index: int
    removed: bool  # scaled away earlier
    pod: str = ""  # its current pod while that lives ("": none)


@dataclass(frozen=True, slots=True)
class MigrationStart:
    start: tuple[NodeSpec, ...]  # every PS slot of the next cluster, with its size: a new pod beside the old
    retire: tuple[str, ...]  # the old PS pods: they serve until the workers moved, then stop
    remove: tuple[str, ...]  # PS nodes the next cluster has no slot for


def migration_start(ps: Sequence[PsView], wanted: Mapping[int, tuple[float, int]]) -> MigrationStart:
    """The PS pods a migration to ``wanted`` (slot -> (CPU, MiB)) creates, retires and removes.

    Every slot of the next cluster gets a new pod, also where the size did not
    change: the next cluster has new addresses, and the chief re-cuts the
    model over the new PS set when it restores the checkpoint.
    """
    start = tuple(NodeSpec(Role.PS.value, i, cpu, mem) for i, (cpu, mem) in sorted(wanted.items()))
    by_index = sorted(ps, key=lambda p: p.index)
    kept = [p for p in by_index if p.index in wanted]
    gone = [p for p in by_index if p.index not in wanted and not p.removed]
    return MigrationStart(start, tuple(p.pod for p in kept + gone if p.pod), tuple(f"ps-{p.index}" for p in gone))
