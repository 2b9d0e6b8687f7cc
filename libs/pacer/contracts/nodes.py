"""Node events: what the pod-executor says about the nodes of a job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pacer.codec import doc, message


@message("node.NodeEvent")
@dataclass(frozen=True, slots=True)
class NodeEvent:
    """A node's lifecycle event, on ``pacer.events.node.<job>.<kind>``.

    Kinds the pod-executor publishes (:class:`pacer.subjects.NodeEventKind`):
    ``created`` (a pod was made for the node; it is pending), ``running``
    (its trainer runs; ``pending_s`` says how long it waited), ``died`` (it
    ended for any reason but finishing its work: ``reason`` is the classified
    exit reason, and ``relaunch`` says whether a new pod follows), and
    ``finished`` (the trainer exited 0; ``result`` carries what it reported,
    e.g. the chief's held-out AUC).

    ``died`` is consumed by the shard service: the node's DOING shards go back
    to TODO at once instead of waiting for their lease to expire.
    """

    job: str
    node: str
    kind: str = field(metadata=doc("created | running | died | finished (subjects.NodeEventKind)"))
    ts: float = field(metadata=doc("unix time (s) when the executor observed it"))
    reason: str = field(default="", metadata=doc("classified exit reason, e.g. killed, oom, evicted"))
    role: str = field(default="", metadata=doc("worker | ps | chief"))
    pod: str = field(default="", metadata=doc("the pod (incarnation) this event is about"))
    generation: int = field(default=0, metadata=doc("0 for the node's first pod, +1 per relaunch"))
    exit_code: int | None = field(default=None, metadata=doc("died/finished: the trainer's exit code (null: a signal)"))
    pending_s: float = field(default=0.0, metadata=doc("running: seconds from created to running"))
    restarts: int = field(default=0, metadata=doc("relaunches of this node after failures so far"))
    cpu: float = field(default=0.0, metadata=doc("CPU limit of the pod"))
    memory_mb: int = field(default=0, metadata=doc("memory limit of the pod (MiB)"))
    relaunch: bool = field(default=False, metadata=doc("died: a new pod will replace this one"))
    detail: str = field(default="", metadata=doc("human-readable explanation"))
    result: dict[str, Any] = field(default_factory=dict, metadata=doc("finished: the trainer's result (chief: auc, logloss, steps)"))
