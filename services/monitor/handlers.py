"""Thin handlers of the monitor: decode -> check -> feed the pure core.

Event handlers are synchronous (the core is in memory) and raise
:class:`~pacer.errors.PacerError` for a message that can never be applied
(not msgpack, wrong schema, body and subject naming different jobs); the
service dead-letters those.  The rpc handler raises the same errors, which
the service turns into error replies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from pacer import subjects
from pacer.codec import decode
from pacer.contracts.agent import AgentMetrics, Heartbeat
from pacer.contracts.executor import ClusterStatus
from pacer.contracts.monitor import StatsQuery
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import ProgressEvent
from pacer.errors import ValidationError
from pacer.subjects import AgentEventKind, MonitorOp, ShardEventKind
from pacer_services.monitor.core import MonitorCore

if TYPE_CHECKING:
    from pacer_services.monitor.app import MonitorService

#: (subject job, message bytes, monitor time) -> applied to the core.
EventHandler = Callable[[str, bytes, float], None]
RpcHandler = Callable[[str, Msg], Awaitable[None]]

ANY_KIND = "*"


def parse_event(subject: str) -> tuple[str, str, str]:
    """``pacer.events.<domain>.<job>.<kind>`` -> (domain, job, kind)."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != subjects.PREFIX or parts[1] != "events":
        raise ValidationError(f"not an event subject: {subject!r}")
    return parts[2], parts[3], parts[4]


def _same_job(job: str, body_job: str) -> None:
    if body_job != job:
        raise ValidationError(f"job: body names {body_job!r} but the subject is for {job!r}")


def build_events(core: MonitorCore) -> dict[tuple[str, str], EventHandler]:
    """(domain, kind) -> handler; kind ``*`` matches every kind of the domain."""

    def metrics(job: str, data: bytes, now: float) -> None:
        m = decode(AgentMetrics, data)
        _same_job(job, m.job)
        core.observe_metrics(m, now)

    def heartbeat(job: str, data: bytes, now: float) -> None:
        hb = decode(Heartbeat, data)
        _same_job(job, hb.job)
        core.observe_heartbeat(hb, now)

    def node_event(job: str, data: bytes, now: float) -> None:
        ev = decode(NodeEvent, data)
        _same_job(job, ev.job)
        core.observe_node_event(ev, now)

    def progress(job: str, data: bytes, now: float) -> None:
        ev = decode(ProgressEvent, data)
        _same_job(job, ev.status.job)
        core.observe_shards(ev.status, now)

    def cluster(job: str, data: bytes, now: float) -> None:
        st = decode(ClusterStatus, data)
        core.observe_cluster(st.pending_pods, now, free_cpu=st.free_cpu if st.total_cpu else None,
                             total_cpu=st.total_cpu or None)

    return {
        ("cluster", "status"): cluster,
        (subjects.AGENT_SERVICE, AgentEventKind.METRICS): metrics,
        (subjects.AGENT_SERVICE, AgentEventKind.HEARTBEAT): heartbeat,
        ("node", ANY_KIND): node_event,
        ("shard", ShardEventKind.PROGRESS): progress,
    }


def build_rpc(svc: MonitorService) -> dict[str, RpcHandler]:
    async def stats(job: str, msg: Msg) -> None:
        q = decode(StatsQuery, msg.data)
        _same_job(job, q.job)
        await svc.bus.respond(msg, svc.core.statistics(job, svc.clock()))  # NotFound for an unknown job

    return {MonitorOp.STATS: stats}
