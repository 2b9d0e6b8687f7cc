"""Node events: what the pod-executor says about the nodes of a job."""

from __future__ import annotations

from dataclasses import dataclass, field

from pacer.codec import doc, message


@message("node.NodeEvent")
@dataclass(frozen=True, slots=True)
class NodeEvent:
    """A node's lifecycle event, on ``pacer.events.node.<job>.<kind>``.

    ``died`` is consumed by the shard service: the node's DOING shards go back
    to TODO at once instead of waiting for their lease to expire.
    """

    job: str
    node: str
    kind: str = field(metadata=doc("started | running | died | ..."))
    ts: float = field(metadata=doc("unix time (s) when the executor observed it"))
    reason: str = field(default="", metadata=doc("classified exit reason, e.g. killed, oom, evicted"))
    role: str = field(default="", metadata=doc("worker | ps | chief"))
