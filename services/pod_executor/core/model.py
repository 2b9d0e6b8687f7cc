"""The executor core's domain objects: node blueprints, nodes, plans and the executor's limits.

Frozen dataclasses, no IO.  A :class:`NodeSpec` is to a :class:`Node` what a
class is to an object (torch elastic's ``WorkerSpec`` / ``Worker``); a
:class:`Plan` is a job's wanted nodes.  The live executor builds these views
from its KV record; the simulators build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pacer.contracts.common import Role
from pacer.contracts.executor import NodePhase

#: A node state that frees its slot in the simulators' views: the process
#: ended and nothing relaunched it (the live executor says ``relaunching``
#: or ``removed`` instead; see :mod:`.node`).
EXITED = "exited"


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """The blueprint of one node: role, slot and resources."""

    role: str  # a Role: worker | ps
    index: int
    cpu: float = 1.0
    memory_mb: int = 1024


@dataclass(frozen=True, slots=True)
class Node:
    """A node as the executor tracks it."""

    spec: NodeSpec
    restarts: int = 0  # relaunches after retryable failures (not counting KILL_RESTART)
    requested_restarts: int = 0  # relaunches asked for by KILL_RESTART
    # A NodePhase value (the live executor) or "exited" (the simulators: ended, slot free).
    state: str = NodePhase.PENDING.value
    oom_memory_mb: int = 0  # the memory an OOM relaunch gave it (0: none); see resize_targets

    @property
    def name(self) -> str:
        return f"{self.spec.role}-{self.spec.index}"

    @property
    def holds_slot(self) -> bool:
        """Its slot is taken (a plan does not start it again): anything but ended-for-good or removed."""
        return self.state not in (EXITED, NodePhase.REMOVED)

    @property
    def live(self) -> bool:
        """It has (or is about to have) a pod: neither ended, removed nor finished."""
        return self.holds_slot and self.state != NodePhase.FINISHED


@dataclass(frozen=True, slots=True)
class ExecutorPolicy:
    """Configurable limits of the executor."""

    relaunch_budget: int = 3  # retryable failures per node before the job fails
    oom_memory_factor: float = 2.0  # DLRover: relaunch an OOM-killed node with x2 memory
    max_memory_mb: int = 64 * 1024  # never ask for more than this per node
    resize_fraction: float = 0.25  # rolling worker replacement: at most this share of the workers down at once
    # A plan that only raises a role's memory raises its running nodes' limits in place (Kubernetes
    # >= 1.33's pod resize; the local supervisor reads the new limit) instead of replacing them:
    # no pause.  Off for a backend or cluster that cannot (the executor also falls back by itself).
    memory_in_place: bool = True


DEFAULT_POLICY = ExecutorPolicy()


@dataclass(frozen=True, slots=True)
class Plan:
    """How many nodes of each role, with what resources (from the brain or the default)."""

    workers: int
    ps: int
    worker: NodeSpec = field(default_factory=lambda: NodeSpec(Role.WORKER.value, 0))
    ps_spec: NodeSpec = field(default_factory=lambda: NodeSpec(Role.PS.value, 0))
