"""Pure core of the pod-executor: every decision, no IO, no clock (time comes in as ``now``).

* :mod:`.model`: ``NodeSpec`` / ``Node`` / ``Plan`` / ``ExecutorPolicy``;
* :mod:`.node`: a node's lifecycle, one transition table;
* :mod:`.exits`: an exit's reason and answer (AntDT §V-D, DLRover's x2 memory);
* :mod:`.plan`: what a plan change starts, stops, replaces and migrates;
* :mod:`.resize`: the rolling worker replacement (DLRover-RM §5.1);
* :mod:`.migration`: the seamless PS migration's phases (DLRover-RM §5.2);
* :mod:`.effects`: the IO a decision asks for, applied by the service.

The live executor (local processes or Kubernetes) and the simulators call
the same functions.
"""

from pacer_services.pod_executor.core.exits import (
    EXIT_OK,
    EXIT_RESTART,
    EXIT_USAGE,
    RETRYABLE,
    SIGKILL,
    SIGTERM,
    ExitDecision,
    ExitInfo,
    ExitReason,
    classify,
    on_exit,
)
from pacer_services.pod_executor.core.model import EXITED, ExecutorPolicy, Node, NodeSpec, Plan
from pacer_services.pod_executor.core.node import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    can_move,
    legacy_state,
    transition,
)
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
    "EXITED",
    "EXIT_OK",
    "EXIT_RESTART",
    "EXIT_USAGE",
    "RETRYABLE",
    "SIGKILL",
    "SIGTERM",
    "TERMINAL",
    "TRANSITIONS",
    "ExecutorPolicy",
    "ExitDecision",
    "ExitInfo",
    "ExitReason",
    "IllegalTransition",
    "Node",
    "NodeSpec",
    "Plan",
    "PlanChange",
    "Reconcile",
    "ResizeView",
    "WorkerPhase",
    "can_move",
    "classify",
    "legacy_state",
    "on_exit",
    "plan_change",
    "reconcile",
    "relaunch_resized",
    "resize_batch",
    "resize_batch_size",
    "resize_rounds",
    "resize_targets",
    "transition",
]
