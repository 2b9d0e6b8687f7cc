"""Shard-service messages: datasets, leases (combined report-and-get), status, events.

Request subjects are ``pacer.rpc.shard.<job>.<op>`` (see :mod:`pacer.subjects`);
events are ``pacer.events.shard.<job>.<kind>``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pacer.codec import doc, message

# A holder's client sends a lease request at least every ``lease_s / REPORTS_PER_LEASE`` (its
# heartbeat, with the progress queued since the last one): the lease survives three lost
# heartbeats, and the service knows how stale a holder's last reported progress can be when it
# cuts the holder's shard near the end of a dataset (``LeaseReply.shortened``).
REPORTS_PER_LEASE = 4


class DatasetMode(str, enum.Enum):
    """How a dataset's records come to exist."""

    FINITE = "finite"  # a fixed record count, read for ``epochs`` epochs
    STREAMING = "streaming"  # record ranges appended while the job runs (online learning)


@message("shard.DatasetSpec")
@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """A dataset of one job, as registered with the shard service (``register``).

    A shard covers ``batch_size * batches_per_shard`` records (the last one of
    a range may be shorter).  Registering the same spec again is a no-op;
    registering a different spec under the same name is a conflict.
    """

    job: str
    dataset: str
    records: int = field(metadata=doc("record count (streaming: records known at registration)"))
    batch_size: int = field(metadata=doc("records per batch, > 0"))
    batches_per_shard: int = field(default=100, metadata=doc("as AntDT: 100 batches per shard"))
    epochs: int = field(default=1, metadata=doc("finite mode only; streaming datasets have one"))
    shuffle: bool = field(default=True, metadata=doc("shuffle shard order within each epoch"))
    seed: int = field(default=0, metadata=doc("seed of the shard order and of per-shard seeds"))
    mode: DatasetMode = DatasetMode.FINITE
    max_failures: int = field(
        default=5, metadata=doc("failures (holder died, lease expired, read failed) before a shard is parked FAILED")
    )
    lease_s: float = field(default=30.0, metadata=doc("lease of a DOING shard, renewed by any request of its holder"))
    tail_split: bool = field(default=True, metadata=doc(
        "near the end of a finite dataset, grant ever smaller pieces, sized by each node's rate (weighted "
        "factoring), so that all nodes run out of data together instead of waiting for the last shard"))
    stream: str = field(default="", metadata=doc(
        "streaming only: the JetStream stream whose samples are the records (record i = sequence first_seq + i); "
        "the shard service appends them as they arrive; empty = the caller appends"))
    first_seq: int = field(default=1, metadata=doc("the stream sequence of record 0"))
    max_wait_s: float = field(default=5.0, metadata=doc(
        "a partial shard of new samples is cut once its oldest sample waited this long (else only full shards)"))
    idle_close_s: float = field(default=0.0, metadata=doc(
        "close the dataset (the job can finish) once the stream got nothing new for this long; 0 = never"))


@message("shard.ShardProgress")
@dataclass(frozen=True, slots=True)
class ShardProgress:
    """Records of a held shard consumed so far (counted from the shard's offset)."""

    shard: int
    consumed: int


@message("shard.ShardRange")
@dataclass(frozen=True, slots=True)
class ShardRange:
    """Records [start, end) of a held shard, counted from the shard's offset like ``ShardProgress.consumed``."""

    shard: int
    start: int = field(metadata=doc("first position, 0 <= start < end"))
    end: int = field(metadata=doc("one past the last position, <= the shard's length"))


@message("shard.LeaseRequest")
@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """Combined report-and-get, also the holder's heartbeat (``lease``).

    Processed in this order: ``done`` shards become DONE, ``progress`` is
    recorded, ``discarded`` ranges become new TODO pieces (served again, to
    another node when one can take them), ``failed`` shards go back to TODO
    (one failure each), ``released`` shards go back to TODO (no failure), then
    up to ``want`` new shards are granted; when a finite dataset with
    ``tail_split`` has no TODO shard left, the requester may be granted the
    last part of the shard of the node expected to finish last instead (work
    stealing; that holder learns it from ``LeaseReply.shortened``).  Any lease
    request renews the node's lease on every shard it holds.  DOING shards of
    this node that are neither in ``held`` nor reported (a reply that was
    lost) are returned again first.

    A holder whose shard was cut may report progress past the new end (up to
    the end it was granted; also beside ``done`` of that shard): it is
    accepted, and the records past the new end are counted as duplicated.
    """

    job: str
    dataset: str
    node: str
    want: int = field(default=0, metadata=doc("how many new shards to grant (the prefetch top-up)"))
    held: list[int] = field(default_factory=list, metadata=doc("shards the client holds and is still reading"))
    done: list[int] = field(default_factory=list, metadata=doc("shards fully consumed"))
    progress: list[ShardProgress] = field(default_factory=list)
    failed: list[int] = field(default_factory=list, metadata=doc("shards the holder could not read"))
    released: list[int] = field(default_factory=list, metadata=doc("shards handed back unread (scale-down)"))
    max_records: int = field(
        default=0, metadata=doc("if > 0, split shards so that none granted is longer (straggler-sized shards)")
    )
    rate: float = field(
        default=0.0, metadata=doc("records per second the node trains now (0: not known yet); its share of the "
                                  "data left near the end of a dataset (``DatasetSpec.tail_split``)")
    )
    discarded: list[ShardRange] = field(default_factory=list, metadata=doc(
        "records this node consumed whose gradients were discarded (BSP backup workers: a late gradient is "
        "dropped as stale); each range, of a shard it holds or reports done in this request, within what it "
        "consumed and after any range it reported before, is served again"))


@message("shard.ShardLease")
@dataclass(frozen=True, slots=True)
class ShardLease:
    """A shard granted to a node: read records [start, end) of the dataset."""

    shard: int
    epoch: int
    start: int = field(metadata=doc("first record to read (offset + records already consumed)"))
    end: int = field(metadata=doc("one past the last record"))
    offset: int = field(metadata=doc("the shard's first record; progress is counted from here"))
    seed: int = field(metadata=doc("seed for the record order inside the shard"))
    attempt: int = field(default=0, metadata=doc("how many times this shard was granted before"))


@message("shard.Rejected")
@dataclass(frozen=True, slots=True)
class Rejected:
    """A report the service refused (e.g. the node does not hold that shard)."""

    shard: int
    reason: str


@message("shard.LeaseReply")
@dataclass(frozen=True, slots=True)
class LeaseReply:
    """Reply to ``lease``: granted shards, held shards cut short for an idle node, and the dataset's state."""

    shards: list[ShardLease]
    lease_s: float
    finished: bool = field(metadata=doc("every shard of every epoch is DONE: stop asking"))
    exhausted: bool = field(
        default=False,
        metadata=doc("nothing to grant now although not finished (others hold shards, parked shards, or a stream awaits data): retry later"),
    )
    rejected: list[Rejected] = field(default_factory=list)
    shortened: list[ShardLease] = field(default_factory=list, metadata=doc(
        "shards this node holds whose end moved down since they were granted to it: near the end of a "
        "finite dataset the service gave their records from ``end`` on to an idle node (work stealing). "
        "Only ``end`` is news: stop reading the shard there and report it done as usual. Sent in every reply "
        "while the node holds the shard (applying it twice changes nothing); progress reported past the new "
        "end is accepted, those records counted as duplicated"))


@message("shard.DatasetRef")
@dataclass(frozen=True, slots=True)
class DatasetRef:
    """Names a dataset (``status``, ``retry_failed``)."""

    job: str
    dataset: str


@message("shard.NodeShardStats")
@dataclass(frozen=True, slots=True)
class NodeShardStats:
    """Per-node consumption, for the monitor."""

    node: str
    doing: int
    records: int = field(metadata=doc("records this node reported consumed"))
    shards_done: int
    records_discarded: int = field(
        default=0, metadata=doc("records this node consumed whose gradients were discarded (served again)"))


@message("shard.DatasetStatus")
@dataclass(frozen=True, slots=True)
class DatasetStatus:
    """Counts by state and per-node consumption of one dataset."""

    job: str
    dataset: str
    mode: DatasetMode
    epoch: int = field(metadata=doc("newest epoch whose shards exist"))
    epochs: int
    todo: int
    doing: int
    done: int
    failed: int
    records_total: int = field(metadata=doc("records over all epochs known so far"))
    records_done: int
    records_duplicated: int = field(
        metadata=doc("records handed out more than once (re-granted after a loss, or read by a holder past the end "
                     "its shard was cut to near the end of the dataset): an upper bound on records trained twice")
    )
    finished: bool
    closed: bool = field(metadata=doc("no more records will be appended (always true for finite datasets)"))
    failed_shards: list[int] = field(default_factory=list)
    nodes: list[NodeShardStats] = field(default_factory=list)
    records_reserved: int = field(default=0, metadata=doc(
        "records served again because the gradients they were trained with were discarded (BSP backup workers); "
        "records_done counts only records trained with a kept gradient"))


@message("shard.CheckpointRequest")
@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    """Take (``checkpoint``) or restore (``restore``) a dataset's shard state under an id."""

    job: str
    dataset: str
    checkpoint: str = field(metadata=doc("id stored beside the model checkpoint, [A-Za-z0-9_-]"))


@message("shard.CheckpointReply")
@dataclass(frozen=True, slots=True)
class CheckpointReply:
    """Reply to ``checkpoint``: the shard state is stored under ``checkpoint``."""

    job: str
    dataset: str
    checkpoint: str
    shards: int
    records_done: int


@message("shard.AppendRequest")
@dataclass(frozen=True, slots=True)
class AppendRequest:
    """Streaming mode: ``records`` new records exist; ``close`` ends the stream."""

    job: str
    dataset: str
    records: int
    close: bool = False


@message("shard.ShardEvent")
@dataclass(frozen=True, slots=True)
class ShardEvent:
    """An event of the shard service, on ``pacer.events.shard.<job>.<kind>``."""

    job: str
    dataset: str
    kind: str = field(metadata=doc("registered | epoch_started | requeued | parked | finished | checkpointed | restored"))
    ts: float
    shard: int = -1
    node: str = ""
    epoch: int = -1
    detail: str = ""


@message("shard.ProgressEvent")
@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """Periodic summary of a dataset, on ``pacer.events.shard.<job>.progress``."""

    ts: float
    status: DatasetStatus
