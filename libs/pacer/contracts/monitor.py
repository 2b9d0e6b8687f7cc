"""Monitor messages: the job statistics that the controller and dashboards read.

The monitor (AntDT section V-D) folds agent metrics, node events, shard
progress and cluster information into sliding windows and publishes one
:class:`JobStatistics` per job: per-node batch processing time (BPT) over a
short and a long window (AntDT-ND's L_trans and L_per, section VI-A), the
straggler signal derived from them, node states, the job's throughput and
whether the cluster is busy (the "third party information" of V-D that gates
KILL_RESTART in AntDT-ND).

:class:`StatsQuery` asks the monitor for the current statistics of one job;
the reply is a :class:`JobStatistics`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pacer.codec import doc, message


class Liveness(str, enum.Enum):
    """What the monitor believes about a node.

    PENDING (created or relaunched, not yet running) -> RUNNING (the executor
    said so, or the node's agent reported) -> DEAD (the executor reported a
    death, or the node was silent for longer than the heartbeat timeout).
    A DEAD node becomes PENDING or RUNNING again when it is relaunched.
    """

    PENDING = "pending"
    RUNNING = "running"
    DEAD = "dead"


class StragglerKind(str, enum.Enum):
    """AntDT-ND's straggler classes (section VI-A, Eqs. for T_i^trans and T_i^per).

    ``PERSISTENT``: slow over the long window L_per (worker: KILL_RESTART when
    the cluster is not busy; server: KILL_RESTART).  ``TRANSIENT``: slow over
    the short window L_trans only (worker: ADJUST_BS).  ``NONE``: neither.
    """

    NONE = ""
    TRANSIENT = "transient"
    PERSISTENT = "persistent"


@message("monitor.NodeStats")
@dataclass(frozen=True, slots=True)
class NodeStats:
    """One node of a job, as seen by the monitor at ``JobStatistics.ts``."""

    node: str
    role: str = field(metadata=doc("worker | ps | chief (\"\" if not yet known)"))
    bpt_short_s: float = field(metadata=doc("mean batch processing time over the short window L_trans, weighted by steps (0: no data)"))
    bpt_long_s: float = field(metadata=doc("mean batch processing time over the long window L_per, weighted by steps (0: no data)"))
    speed_samples_per_s: float = field(metadata=doc("samples trained per second over the short window (0: no data or dead)"))
    samples_total: int = field(metadata=doc("samples trained by the node's trainer since it started (last report)"))
    cpu_percent: float = field(metadata=doc("CPU of the trainer process in the last report (100 = one core)"))
    rss_bytes: int = field(metadata=doc("resident memory of the trainer process in the last report"))
    last_seen: float = field(metadata=doc("monitor time (s) when the node's agent was last heard (0: never)"))
    state: Liveness
    pending_s: float = field(metadata=doc("seconds spent pending: the current pending interval, else the last one (0: never pending)"))
    restarts: int = field(metadata=doc("times the node came back after it died"))
    slowdown_short: float = field(metadata=doc("bpt_short_s / median bpt_short_s of the live peers of the same role (0: no peers or no data)"))
    slowdown_long: float = field(metadata=doc("bpt_long_s / median bpt_long_s of the live peers of the same role (0: no peers or no data)"))
    straggler: StragglerKind = field(default=StragglerKind.NONE, metadata=doc("\"\" | transient | persistent (AntDT-ND)"))
    init_s: float = field(default=0.0, metadata=doc(
        "seconds from the node's pod running to its trainer's first step, the last start-up measured (0: never)"))


@message("monitor.ShardSummary")
@dataclass(frozen=True, slots=True)
class ShardSummary:
    """Shard counts of a job, summed over its datasets (from the shard service's progress events)."""

    todo: int
    doing: int
    done: int
    failed: int
    records_done: int
    records_total: int = field(default=0, metadata=doc("records over all epochs known so far"))
    datasets: int = field(default=0, metadata=doc("datasets summed up"))
    finished: bool = field(default=False, metadata=doc("every dataset is finished"))
    updated: float = field(default=0.0, metadata=doc("monitor time (s) of the newest dataset status"))


@message("monitor.JobStatistics")
@dataclass(frozen=True, slots=True)
class JobStatistics:
    """The monitor's view of one job: what the controller decides on.

    Reply to :class:`StatsQuery`, and published periodically.
    """

    job: str
    ts: float = field(metadata=doc("monitor time (s) the statistics were computed at"))
    window_short_s: float = field(metadata=doc("L_trans: the short window (s)"))
    window_long_s: float = field(metadata=doc("L_per: the long window (s)"))
    throughput_samples_per_s: float = field(metadata=doc("sum of the speeds of the live non-ps nodes"))
    nodes: list[NodeStats] = field(default_factory=list, metadata=doc("sorted by node id"))
    cluster_busy: bool = field(default=False, metadata=doc("pods are queued in the cluster, capacity is short, or a node of this job waits too long"))
    pending_nodes: int = field(default=0, metadata=doc("nodes of this job in state pending"))
    shards: ShardSummary | None = field(default=None, metadata=doc("null until the shard service reported"))
    slowness_ratio: float = field(default=1.5, metadata=doc("lambda: a node is slow if its BPT >= lambda x the median of its peers"))


@message("monitor.StatsQuery")
@dataclass(frozen=True, slots=True)
class StatsQuery:
    """Ask the monitor for the current :class:`JobStatistics` of a job."""

    job: str
