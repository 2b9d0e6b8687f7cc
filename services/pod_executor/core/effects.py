"""The IO a core decision asks for, as data: the service applies them in order (``applier.py``).

Each effect is a small frozen dataclass naming the node (``worker-3``) it is
about; the service's applier knows the job.  Record changes (intents, the
migration phase, a node's next generation) are effects too, so that a
decision can be read as one list and tested without IO.  A failing effect
ends the list: what is left is decided again by the next reconcile pass
(errors of effects become inputs of the next cycle).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pacer.contracts.executor import MigrationPhase, NodeIntent


@dataclass(frozen=True, slots=True)
class SaveRecord:
    """Write the job's record (compare-and-set) before the IO that follows depends on it."""


@dataclass(frozen=True, slots=True)
class CreatePod:
    """Create the node's pod of its current generation (a ``created`` node event follows)."""

    node: str


@dataclass(frozen=True, slots=True)
class DeletePod:
    """Stop the node's current pod (noted in the record first, so its exit is known to be ours)."""

    node: str


@dataclass(frozen=True, slots=True)
class DeletePods:
    """Stop pods by name (a migration's old PS, which no node names any more)."""

    pods: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SetIntent:
    """The nodes are being stopped by the executor for ``intent`` (their state becomes ``stopping``)."""

    nodes: tuple[str, ...]
    intent: NodeIntent


@dataclass(frozen=True, slots=True)
class EnterPhase:
    """The job's PS migration enters ``phase``."""

    phase: MigrationPhase


@dataclass(frozen=True, slots=True)
class RequestCheckpoint:
    """Ask the node's agent to checkpoint (shard state + model) and exit for a restart.

    Refused or unanswered: the effects after it are not applied; the next
    pass asks again while the job keeps training.
    """

    node: str


@dataclass(frozen=True, slots=True)
class RestoreShards:
    """Roll the job's shard state back to ``checkpoint`` (the shard service)."""

    checkpoint: str


@dataclass(frozen=True, slots=True)
class SwitchCluster:
    """The job's cluster becomes the migration's next one; its plan is applied once the workers run there."""


@dataclass(frozen=True, slots=True)
class RestartNodes:
    """Give each node its next generation (with any size it is due); ``restore`` nodes restore the checkpoint."""

    nodes: tuple[str, ...]
    restore: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PublishNodeEvent:
    """Publish a node event (``pacer.events.node.<job>.<kind>``) as the node was when it was decided:
    its generation, restart count and size are those of the pod that ended, not of the next one."""

    node: str
    kind: str
    generation: int
    restarts: int
    cpu: float
    memory_mb: int
    pod: str = ""
    exit_code: int | None = None
    reason: str = ""
    relaunch: bool = False
    detail: str = ""
    result: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FailJob:
    """The job fails (an ``executor failed`` event, then every pod is torn down)."""

    reason: str


Effect = (SaveRecord | CreatePod | DeletePod | DeletePods | SetIntent | EnterPhase | RequestCheckpoint
          | RestoreShards | SwitchCluster | RestartNodes | PublishNodeEvent | FailJob)
