"""Pure core of the pod-executor: every decision, no IO, no clock (time comes in as ``now``).

* :mod:`.model`: ``NodeSpec`` / ``Node`` / ``Plan`` / ``ExecutorPolicy``;
* :mod:`.node`: a node's lifecycle, one transition table;
* :mod:`.exits`: an exit's reason and answer (AntDT §V-D, DLRover's x2 memory);
* :mod:`.plan`: what a plan change starts, stops, replaces and migrates;
* :mod:`.resize`: the rolling worker replacement (DLRover-RM §5.1);
* :mod:`.migration`: the seamless PS migration's phases (DLRover-RM §5.2);
* :mod:`.passes`: one reconcile pass over a job (observe, then decide);
* :mod:`.cluster`: the cluster's queue and free capacity, for the brain;
* :mod:`.effects`: the IO a decision asks for, applied by the service.

The live executor (local processes or Kubernetes) and the simulators call
the same functions.
"""

from pacer_services.pod_executor.core.cluster import cluster_status
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
from pacer_services.pod_executor.core.exits import (
    EXIT_OK,
    EXIT_RESTART,
    EXIT_USAGE,
    RETRYABLE,
    SIGKILL,
    SIGTERM,
    ExitAnswer,
    ExitDecision,
    ExitInfo,
    ExitOutcome,
    ExitReason,
    answer_exit,
    classify,
    on_exit,
)
from pacer_services.pod_executor.core.migration import (
    CHIEF,
    MigrationStart,
    MigrationStep,
    MigrationView,
    PsView,
    migration_start,
    migration_step,
)
from pacer_services.pod_executor.core.model import (
    DEFAULT_POLICY,
    EXITED,
    ExecutorPolicy,
    Node,
    NodeSpec,
    Plan,
)
from pacer_services.pod_executor.core.node import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    can_move,
    legacy_state,
    transition,
)
from pacer_services.pod_executor.core.passes import JobView, NodeView, ReconcilePass, reconcile_pass
from pacer_services.pod_executor.core.plan import PlanChange, Reconcile, plan_change, reconcile
from pacer_services.pod_executor.core.resize import (
    ResizeView,
    WorkerPhase,
    relaunch_resized,
    resize_batch,
    resize_batch_size,
    resize_rounds,
    resize_targets,
)

__all__ = [
    "CHIEF",
    "DEFAULT_POLICY",
    "EXITED",
    "EXIT_OK",
    "EXIT_RESTART",
    "EXIT_USAGE",
    "RETRYABLE",
    "SIGKILL",
    "SIGTERM",
    "TERMINAL",
    "TRANSITIONS",
    "CreatePod",
    "DeletePod",
    "DeletePods",
    "Effect",
    "EnterPhase",
    "ExecutorPolicy",
    "ExitAnswer",
    "ExitDecision",
    "ExitInfo",
    "ExitOutcome",
    "ExitReason",
    "IllegalTransition",
    "JobView",
    "MigrationStart",
    "MigrationStep",
    "MigrationView",
    "Node",
    "NodeSpec",
    "NodeView",
    "Plan",
    "PlanChange",
    "PsView",
    "Reconcile",
    "ReconcilePass",
    "RequestCheckpoint",
    "ResizeView",
    "RestartNodes",
    "RestoreShards",
    "SaveRecord",
    "SetIntent",
    "SwitchCluster",
    "WorkerPhase",
    "answer_exit",
    "can_move",
    "classify",
    "cluster_status",
    "legacy_state",
    "migration_start",
    "migration_step",
    "on_exit",
    "plan_change",
    "reconcile",
    "reconcile_pass",
    "relaunch_resized",
    "resize_batch",
    "resize_batch_size",
    "resize_rounds",
    "resize_targets",
    "transition",
]
