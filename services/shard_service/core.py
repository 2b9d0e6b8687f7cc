"""Pure core of the shard service: dataset shard state as a fold of a log.

AntDT §IV (Stateful Dynamic Data Sharding: TODO/DOING/DONE, at-least-once)
and DLRover 2023 §3.3 (dynamic sharding with TODO/DOING queues), hardened:
leases, a DONE state, FAILED parking instead of silent drops, splits for
straggler-sized shards (DLRover-RM §5.1), streaming datasets, checkpoints,
re-served pieces for records whose gradients were discarded (BSP backup
workers drop late gradients: those records were consumed but not trained),
and a tail without idle nodes: rate-weighted pieces of the last TODO shards
(weighted factoring) and, once none is left, work stealing from the DOING
shard of the node expected to finish last.

Every change of state is a *log record* (a short list).  Decision methods
(``register``, ``lease``, ``expire``, ``node_died``, ...) build records and
apply each at once through :meth:`JobShards.apply`; replaying the durable log
calls the very same ``apply``, so the state rebuilt after a restart equals the
state before it by construction.

No IO, no clock, no global randomness: time comes in as ``now`` and every
random choice is seeded from the dataset spec.  Not thread-safe: the service
calls one job's core from one task at a time.

Lease deadlines are deliberately *not* logged (a heartbeat would otherwise
cost an append); after a rebuild every holder gets a fresh lease, which can
only delay, never lose, a shard.  Nor are the nodes' rates: both steer
decisions (piece sizes, steals), whose outcome is logged; neither is state.
"""

from __future__ import annotations

import enum
import math
import random
import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pacer.codec import from_dict, to_dict
from pacer.contracts.shards import (
    REPORTS_PER_LEASE,
    DatasetMode,
    DatasetSpec,
    DatasetStatus,
    LeaseReply,
    LeaseRequest,
    NodeShardStats,
    Rejected,
    ShardLease,
    ShardRange,
)
from pacer.errors import Conflict, NotFound, PacerError, ValidationError
from pacer.ids import is_token

# Most shards a single lease request may ask for; more is a client bug.
MAX_WANT = 64
# Record counts (records * epochs, a stream's total) must fit the wire's int64.
MAX_RECORDS = 2**63 - 1
# The end of a finite dataset (``DatasetSpec.tail_split``), weighted factoring (Hummel,
# Schmidt, Uma and Wein, "Load-sharing in heterogeneous systems via weighted factoring",
# SPAA 1996): a grant is at most the requester's share of the records left (its rate over
# the sum of the active nodes' rates) divided by TAIL_FACTOR, so the pieces shrink
# geometrically and every node runs out of data within about one smallest piece of the
# others.  The smallest piece is 1 / TAIL_MIN_PIECES of a shard at the mean rate, and never
# less than one batch (a batch does not span two shards).
TAIL_FACTOR = 2
TAIL_MIN_PIECES = 32
# Work stealing at the end of a finite dataset (``DatasetSpec.tail_split``), after Blumofe and
# Leiserson, "Scheduling multithreaded computations by work stealing" (JACM 1999): a node that asks
# for work when no TODO shard is left takes the last part of a DOING shard of another node, the
# node expected to finish last (its records left over its rate), instead of idling until that node
# is done.  The records left of that node and of the requester are shared in proportion to their
# rates, so both finish together.  The holder keeps a margin: what it read since its last report
# and until it learns of the cut (its next request, at most lease_s / REPORTS_PER_LEASE away, its
# client's heartbeat), at its rate, plus STEAL_SLACK_S for a step in flight and progress reported
# every few steps; never less than a batch.  A steal is made only when the stolen part is at least
# STEAL_MIN_BATCHES batches and the holder's time left is at least STEAL_GAIN times what the requester
# needs for the stolen part and what it holds already: then the last of the two finishes sooner.
# Nothing is stolen while no node reported a rate (the margin could not be sized).
STEAL_MIN_BATCHES = 2
STEAL_GAIN = 1.5
STEAL_SLACK_S = 2.0
# A node is not granted the pieces of its own discarded records while another node can take them
# (a node whose gradients are discarded is usually the slowest, and would only lose them again).
# Skipping them scans the head of the TODO queue, where they sit; a node with this many of its
# own pieces in a row there gets nothing this time (the others are taking them).
OWN_PIECES_SCAN = 256


@dataclass(frozen=True, slots=True)
class ShardLimits:
    """Bounds on the work and memory one request can cause, checked before any of it starts.

    Every shard is an object in memory and a row of every snapshot: building
    1,000,000 one-record shards held the service's event loop for 15 s and
    took 280 MB (issue 21), and the snapshots and rebuilds of such a job
    kept stalling it.  Measured on the 2-core development machine: creating
    a shard costs ~4.5 us, a snapshot ~1 us and rebuilding one from a
    snapshot ~7 us per shard.  The defaults keep one request's work (a
    register, a new epoch, an append) under ~0.25 s there, a snapshot or
    checkpoint of the largest job (taken between two decisions, on the event
    loop, so that it is consistent; encoded in a thread) under ~0.5 s, and
    its rebuild under ~4 s, in a thread (``effects.ShardLogStore.load``).  The
    service reads them from ``PACER_SHARD_MAX_*`` (docs/settings.md); the
    simulators use the defaults.  The fold (:meth:`JobShards.apply`) never
    checks them: a log written under other limits still replays.
    """

    shards_per_epoch: int = 50_000  # shards one register, one new epoch or one append may create
    shards_per_job: int = 500_000  # shards a job's datasets may need over all their epochs (memory, snapshots)
    datasets_per_job: int = 16
    epochs: int = 10_000  # epochs of a finite dataset
    nodes_per_dataset: int = 10_000  # distinct nodes that may consume a dataset (each is kept in its status)
    report_ids: int = 10_000  # ids in each list of a lease request (held, done, progress, discarded, failed, released)


DEFAULT_LIMITS = ShardLimits()


class ShardState(str, enum.Enum):
    """Lifecycle of a shard.

    TODO -> DOING (granted to a node, under lease) -> DONE (reported consumed).
    A DOING shard whose holder dies, whose lease expires or whose holder fails
    to read it goes back to TODO; once its failures reach ``max_failures`` it
    is parked FAILED instead (never dropped) until an operator retries it.
    DONE is terminal.
    """

    TODO = "todo"
    DOING = "doing"
    DONE = "done"
    FAILED = "failed"


S = ShardState
# The legal transitions, each with why it happens.  Everything else is
# rejected in ``_move``.
TRANSITIONS: dict[tuple[ShardState, ShardState], str] = {
    (S.TODO, S.DOING): "granted to a node under a lease",
    (S.DOING, S.DONE): "its holder reported it consumed (or consumed all of it, then was lost)",
    (S.DOING, S.TODO): "holder died, lease expired, holder failed or released it; failures below the limit",
    (S.DOING, S.FAILED): "failures reached max_failures: parked, reported, never dropped",
    (S.FAILED, S.TODO): "an operator asked to retry parked shards",
}
_STATE_CODE = {S.TODO: 0, S.DOING: 1, S.DONE: 2, S.FAILED: 3}
_CODE_STATE = {v: k for k, v in _STATE_CODE.items()}

# Why a DOING shard was lost; only ``released`` does not count as a failure.
LOSS_REASONS = frozenset({"died", "expired", "failed", "released"})


class IllegalTransition(PacerError):
    """A state change not in TRANSITIONS was attempted (a bug or a corrupt log)."""

    code = "illegal_transition"


class Shard:
    """Mutable per-shard state inside the core (never leaves it as-is)."""

    __slots__ = ("consumed", "cut", "discarder", "epoch", "failures", "floor", "given", "grants", "id", "length",
                 "node", "offset", "over", "seed", "state", "told")

    def __init__(self, sid: int, epoch: int, offset: int, length: int, seed: int) -> None:
        self.id = sid
        self.epoch = epoch
        self.offset = offset
        self.length = length
        self.seed = seed
        self.state = S.TODO
        self.node = ""
        self.consumed = 0  # records consumed, from offset; a re-grant resumes here
        self.failures = 0
        self.grants = 0
        # Discarded gradients: ``given`` records of this shard were handed to re-served pieces (they
        # count as done in those, not here); a discard may start no earlier than ``floor`` (the end
        # of the last one, or where the current holder's grant began), so none is re-served twice.
        self.given = 0
        self.floor = 0
        self.discarder = ""  # a re-served piece: the node whose gradients of these records were discarded
        # Work stealing: ``cut`` records were cut off the end of this DOING shard since it was granted to its
        # holder, which was sent ``told`` of them (``LeaseReply.shortened``) and reported ``over`` records past
        # the end read (counted duplicated).  A grant resets all three.
        self.cut = 0
        self.told = 0
        self.over = 0


@dataclass(slots=True)
class ShardEventOut:
    """An event the shell should publish (without its timestamp)."""

    kind: str
    dataset: str
    shard: int = -1
    node: str = ""
    epoch: int = -1
    detail: str = ""


@dataclass(slots=True)
class Outcome:
    """What a decision produced: log records to append, events, and a reply."""

    records: list[list[Any]] = field(default_factory=list)
    events: list[ShardEventOut] = field(default_factory=list)
    reply: Any = None


class Dataset:
    """The shard state of one dataset."""

    def __init__(self, spec: DatasetSpec) -> None:
        self.spec = spec
        self.shard_records = spec.batch_size * spec.batches_per_shard
        self.shards: dict[int, Shard] = {}
        self.todo: deque[int] = deque()
        self.doing: dict[str, set[int]] = {}  # node -> DOING shard ids
        self.failed: set[int] = set()
        self.epoch = -1
        self.records_known = 0  # records of one epoch known so far (streaming grows it)
        self.closed = spec.mode is DatasetMode.FINITE
        self.next_id = 0
        self.done_count = 0
        self.records_done = 0  # records of DONE shards, less those handed to re-served pieces (given)
        self.records_duplicated = 0
        self.records_reserved = 0  # records put back as pieces because their gradients were discarded
        self.node_records: dict[str, int] = {}
        self.node_done: dict[str, int] = {}
        self.node_discarded: dict[str, int] = {}
        self.was_finished = False
        self.todo_records = 0  # records not yet consumed of the TODO shards (kept by add_shards and move)

    # ------------------------------------------------------------ queries
    @property
    def doing_count(self) -> int:
        return sum(len(s) for s in self.doing.values())

    def records_left(self) -> int:
        """Records not yet handed out: the TODO shards' and, finite, the epochs still to come."""
        later = max(0, self.spec.epochs - 1 - self.epoch) * self.spec.records if self.spec.mode is DatasetMode.FINITE else 0
        return self.todo_records + later

    def finished(self) -> bool:
        last_epoch = self.spec.epochs - 1 if self.spec.mode is DatasetMode.FINITE else 0
        return (
            self.closed
            and self.epoch >= last_epoch
            and not self.todo
            and not self.failed
            and not any(self.doing.values())
        )

    def status(self, job: str, name: str) -> DatasetStatus:
        nodes = sorted(set(self.node_records) | set(self.doing) | set(self.node_discarded))
        return DatasetStatus(
            job=job,
            dataset=name,
            mode=self.spec.mode,
            epoch=self.epoch,
            epochs=self.spec.epochs,
            todo=len(self.todo),
            doing=self.doing_count,
            done=self.done_count,
            failed=len(self.failed),
            records_total=self.records_known * (self.spec.epochs if self.closed else max(self.epoch + 1, 1)),
            records_done=self.records_done,
            records_duplicated=self.records_duplicated,
            records_reserved=self.records_reserved,
            finished=self.finished(),
            closed=self.closed,
            failed_shards=sorted(self.failed),
            nodes=[
                NodeShardStats(
                    node=n,
                    doing=len(self.doing.get(n, ())),
                    records=self.node_records.get(n, 0),
                    shards_done=self.node_done.get(n, 0),
                    records_discarded=self.node_discarded.get(n, 0),
                )
                for n in nodes
            ],
        )

    def lease_of(self, sh: Shard) -> ShardLease:
        return ShardLease(
            shard=sh.id,
            epoch=sh.epoch,
            start=sh.offset + sh.consumed,
            end=sh.offset + sh.length,
            offset=sh.offset,
            seed=sh.seed,
            attempt=sh.grants - 1,
        )

    # ------------------------------------------------------------ mutation helpers
    def move(self, sh: Shard, to: ShardState) -> None:
        if (sh.state, to) not in TRANSITIONS:
            raise IllegalTransition(f"shard {sh.id}: {sh.state.value} -> {to.value} is not a legal transition")
        frm = sh.state
        if frm is S.TODO:
            self.todo_records -= sh.length - sh.consumed
        elif to is S.TODO:
            self.todo_records += sh.length - sh.consumed
        if frm is S.DOING:
            held = self.doing.get(sh.node)
            if held is not None:
                held.discard(sh.id)
                if not held:
                    del self.doing[sh.node]
        elif frm is S.FAILED:
            self.failed.discard(sh.id)
        sh.state = to
        if to is S.DONE:
            self.done_count += 1
            self.records_done += sh.length - sh.given
        elif to is S.FAILED:
            self.failed.add(sh.id)

    def add_shards(self, epoch: int, start: int, count: int, shuffle: bool) -> None:
        """Create shards over records [start, start + count) in ``epoch``."""
        size = self.shard_records
        n = (count + size - 1) // size
        base_seed = self.spec.seed * 1_000_003 + epoch
        ids = []
        for i in range(n):
            off = start + i * size
            sid = self.next_id + i
            seed = (base_seed * 1_000_033 + sid) & 0x7FFFFFFF
            self.shards[sid] = Shard(sid, epoch, off, min(size, start + count - off), seed)
            ids.append(sid)
        self.next_id += n
        self.todo_records += count
        if shuffle:
            random.Random(base_seed).shuffle(ids)
        self.todo.extend(ids)


class NodeRates:
    """The last rate (records/s) of each node with a live lease on one dataset, with running sums."""

    __slots__ = ("known", "of", "total")

    def __init__(self) -> None:
        self.of: dict[str, float] = {}
        self.total = 0.0  # sum of the known (> 0) rates
        self.known = 0  # how many are known

    def set(self, node: str, rate: float) -> None:
        self.drop(node)
        self.of[node] = rate
        if rate > 0:
            self.total += rate
            self.known += 1

    def drop(self, node: str) -> None:
        old = self.of.pop(node, None)
        if old:
            self.total -= old
            self.known -= 1
        if not self.known:
            self.total = 0.0  # no drift left behind by the float sums

    def rate(self, node: str) -> float:
        """``node``'s rate; a node without one counts as the mean of the known ones (1.0 when none is known)."""
        return self.of.get(node) or (self.total / self.known if self.known else 1.0)

    def share(self, node: str) -> tuple[float, float]:
        """``node``'s share of the summed rates and its rate over the mean; a node without a
        rate counts as the mean of the known ones (every node equal when none is known)."""
        mean = self.total / self.known if self.known else 1.0
        mine = self.of.get(node) or mean
        total = self.total + (len(self.of) - self.known) * mean
        return mine / total, mine / mean


_NO_RATES = NodeRates()


def tail_cap(ds: Dataset, rates: NodeRates, node: str) -> int:
    """The longest piece ``node`` may be granted now (0: no limit): weighted factoring near the
    end of a finite dataset (see :data:`TAIL_FACTOR`), never below the smallest piece."""
    if not ds.spec.tail_split or ds.spec.mode is not DatasetMode.FINITE or len(rates.of) < 2:
        return 0  # a node alone has nobody to wait for
    share, relative = rates.share(node)
    cap = max(ds.records_left() * share / TAIL_FACTOR, ds.shard_records * relative / TAIL_MIN_PIECES)
    b = ds.spec.batch_size
    cap_batches = -(-int(cap) // b) * b  # whole batches: a piece ends where a step of the nominal batch does
    return cap_batches if cap_batches < ds.shard_records else 0


def validate_spec(spec: DatasetSpec, limits: ShardLimits = DEFAULT_LIMITS) -> None:
    """Raise :class:`ValidationError` naming the first bad field (sizes checked against ``limits``)."""
    if not is_token(spec.job):
        raise ValidationError(f"job: {spec.job!r} is not a valid id (1-64 of [A-Za-z0-9_-])")
    if not is_token(spec.dataset):
        raise ValidationError(f"dataset: {spec.dataset!r} is not a valid id (1-64 of [A-Za-z0-9_-])")
    if spec.batch_size <= 0:
        raise ValidationError(f"batch_size: must be > 0, got {spec.batch_size}")
    if spec.batches_per_shard <= 0:
        raise ValidationError(f"batches_per_shard: must be > 0, got {spec.batches_per_shard}")
    if spec.records < 0 or (spec.mode is DatasetMode.FINITE and spec.records == 0):
        raise ValidationError(f"records: must be > 0 for a finite dataset, >= 0 for a stream, got {spec.records}")
    if not 1 <= spec.epochs <= limits.epochs:
        raise ValidationError(f"epochs: must be in [1, {limits.epochs}], got {spec.epochs}")
    if spec.mode is DatasetMode.STREAMING and spec.epochs != 1:
        raise ValidationError("epochs: a streaming dataset has exactly one epoch")
    if spec.max_failures < 1:
        raise ValidationError(f"max_failures: must be >= 1, got {spec.max_failures}")
    if spec.stream:
        if spec.mode is not DatasetMode.STREAMING:
            raise ValidationError("stream: only a streaming dataset follows a stream")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", spec.stream):
            raise ValidationError(f"stream: {spec.stream!r} is not a valid stream name (1-64 of [A-Za-z0-9_-])")
        if spec.first_seq < 1:
            raise ValidationError(f"first_seq: JetStream sequences start at 1, got {spec.first_seq}")
        if not 0 < spec.max_wait_s <= 86_400 or not 0 <= spec.idle_close_s <= 31 * 86_400:
            raise ValidationError("max_wait_s: must be in (0, 86400] and idle_close_s in [0, 31 days]")
    if not 0 < spec.lease_s <= 86_400:
        raise ValidationError(f"lease_s: must be in (0, 86400], got {spec.lease_s}")
    size = spec.batch_size * spec.batches_per_shard
    shards = -(-spec.records // size)
    if shards > limits.shards_per_epoch:
        raise ValidationError(
            f"records: {spec.records} records make {shards} shards of {size} per epoch, more than the "
            f"{limits.shards_per_epoch} allowed (PACER_SHARD_MAX_SHARDS_PER_EPOCH); use bigger shards "
            "(batches_per_shard)"
        )
    if spec.records * spec.epochs > MAX_RECORDS:
        raise ValidationError(f"epochs: records * epochs must be <= {MAX_RECORDS}, got {spec.records} * {spec.epochs}")
    if shards * spec.epochs > limits.shards_per_job:
        raise ValidationError(
            f"epochs: {spec.epochs} epochs of {shards} shards make {shards * spec.epochs}, more than the "
            f"{limits.shards_per_job} a job may hold (PACER_SHARD_MAX_SHARDS_PER_JOB); use bigger shards or fewer epochs"
        )


class JobShards:
    """All datasets of one job, with leases.  The unit the service keeps per job."""

    def __init__(self, job: str, limits: ShardLimits = DEFAULT_LIMITS) -> None:
        self.job = job
        self.limits = limits  # checked by the decisions only, never by the fold
        self.datasets: dict[str, Dataset] = {}
        # Lease deadline per (dataset, node), renewed by any request of the node for
        # that dataset: datasets may have different lease_s.
        self.deadlines: dict[tuple[str, str], float] = {}
        # Per dataset, the rate (records/s) each node with a live lease last reported (0: not
        # known); not logged either: relearnt from the next heartbeats after a rebuild.
        self.rates: dict[str, NodeRates] = {}
        self.transitions = 0  # records applied since start (live + replay)

    # ================================================================ the fold
    def apply(self, rec: list[Any], checkpoint: dict[str, Any] | None = None) -> None:
        """Apply one log record.  ``checkpoint`` carries the data of a ``restore``."""
        op = rec[0]
        self.transitions += 1
        if op == "reg":
            spec = from_dict(DatasetSpec, rec[1])
            self.datasets[spec.dataset] = Dataset(spec)
            return
        ds = self.datasets[rec[1]]
        if op == "grant":
            sh = ds.shards[rec[2]]
            if not ds.todo or ds.todo[0] != sh.id:
                ds.todo.remove(sh.id)  # not at the head: the requester's own pieces were skipped (or an old log)
            else:
                ds.todo.popleft()
            ds.move(sh, S.DOING)
            sh.node = rec[3]
            ds.doing.setdefault(sh.node, set()).add(sh.id)
            if sh.grants:
                ds.records_duplicated += sh.length - sh.consumed
            sh.grants += 1
            sh.floor = sh.consumed  # a holder may discard only records it consumed itself
            sh.cut = sh.told = sh.over = 0
        elif op == "done":
            sh = ds.shards[rec[2]]
            node = sh.node
            ds.node_records[node] = ds.node_records.get(node, 0) + sh.length - sh.consumed
            ds.node_done[node] = ds.node_done.get(node, 0) + 1
            sh.consumed = sh.length
            self._untold(ds, sh)
            ds.move(sh, S.DONE)
        elif op == "prog":
            sh = ds.shards[rec[2]]
            pos = rec[3]
            if pos > sh.length:
                # Read past the end its shard was cut to before the holder learnt of the cut: those
                # records are the stealer's too, trained twice (at-least-once), counted once each.
                ds.records_duplicated += max(0, pos - sh.length - sh.over)
                sh.over = max(sh.over, pos - sh.length)
                pos = sh.length
            ds.node_records[sh.node] = ds.node_records.get(sh.node, 0) + pos - sh.consumed
            sh.consumed = pos
        elif op == "lost":
            sh = ds.shards[rec[2]]
            self._untold(ds, sh)
            if sh.consumed >= sh.length:
                ds.move(sh, S.DONE)  # every record was consumed before the loss
            else:
                if rec[3] != "released":
                    sh.failures += 1
                if sh.failures >= ds.spec.max_failures:
                    ds.move(sh, S.FAILED)
                else:
                    ds.move(sh, S.TODO)
                    ds.todo.appendleft(sh.id)  # serve lost work first
            sh.node = ""
        elif op == "split":
            # [offset, offset+keep) stays with the shard, the rest becomes a new
            # TODO shard right behind it (DLRover-RM §5.1 straggler-sized shards).
            sh = ds.shards[rec[2]]
            keep, new_id = rec[3], rec[4]
            if sh.state is not S.TODO or not sh.consumed < keep < sh.length or new_id != ds.next_id:
                raise IllegalTransition(f"bad split of shard {sh.id} at {keep}")
            part = Shard(new_id, sh.epoch, sh.offset + keep, sh.length - keep, (sh.seed * 31 + new_id) & 0x7FFFFFFF)
            part.grants = sh.grants  # the moved records were handed out as often as the parent's
            part.discarder = sh.discarder  # a part of a re-served piece is one too
            # ``given`` stays with the shard: discards lie below ``consumed`` < keep.
            sh.length = keep
            ds.shards[new_id] = part
            ds.next_id += 1
            pos = ds.todo.index(sh.id) if ds.todo[0] != sh.id else 0
            ds.todo.insert(pos + 1, new_id)
        elif op == "disc":
            # Records [start, end) of the shard were consumed but their gradients were discarded:
            # a new TODO piece of the same epoch covers exactly them and is served first; they
            # count as done in the piece, no longer in the shard (``given``).
            sh = ds.shards[rec[2]]
            start, end, new_id, node = rec[3], rec[4], rec[5], rec[6]
            bound = sh.length if sh.state is S.DONE else sh.consumed
            if (sh.state not in (S.DOING, S.DONE) or not sh.floor <= start < end <= bound
                    or new_id != ds.next_id or not node):
                raise IllegalTransition(f"bad discard of shard {sh.id} [{start}, {end})")
            k = end - start
            piece = Shard(new_id, sh.epoch, sh.offset + start, k, (sh.seed * 31 + new_id) & 0x7FFFFFFF)
            piece.discarder = node
            ds.shards[new_id] = piece
            ds.next_id += 1
            ds.todo.appendleft(new_id)
            ds.todo_records += k
            sh.given += k
            sh.floor = end
            if sh.state is S.DONE:
                ds.records_done -= k
            ds.records_reserved += k
            ds.node_discarded[node] = ds.node_discarded.get(node, 0) + k
        elif op == "steal":
            # Work stealing: [offset+at, end) of a DOING shard becomes a new shard, DOING at once for
            # ``node``; its holder keeps [offset, offset+at).  The records never pass through TODO.
            sh = ds.shards[rec[2]]
            at, new_id, node = rec[3], rec[4], rec[5]
            if (sh.state is not S.DOING or not sh.consumed < at < sh.length or new_id != ds.next_id or not node
                    or node == sh.node):
                raise IllegalTransition(f"bad steal of shard {sh.id} at {at}")
            k = sh.length - at
            part = Shard(new_id, sh.epoch, sh.offset + at, k, (sh.seed * 31 + new_id) & 0x7FFFFFFF)
            part.discarder = sh.discarder  # a part of a re-served piece is one too
            part.state, part.node, part.grants = S.DOING, node, 1
            sh.length = at
            sh.cut += k
            ds.shards[new_id] = part
            ds.next_id += 1
            ds.doing.setdefault(node, set()).add(new_id)
        elif op == "told":
            # The holder was sent the end its shard was cut to (``LeaseReply.shortened``).
            sh = ds.shards[rec[2]]
            if sh.state is not S.DOING or not sh.cut:
                raise IllegalTransition(f"shard {sh.id} was not cut: nothing to tell")
            sh.told = sh.cut
        elif op == "epoch":
            ds.epoch = rec[2]
            if ds.spec.mode is DatasetMode.FINITE:
                ds.records_known = ds.spec.records
                ds.add_shards(rec[2], 0, ds.spec.records, ds.spec.shuffle)
            else:
                ds.records_known = 0
                self._append(ds, ds.spec.records)
        elif op == "append":
            self._append(ds, rec[2])
        elif op == "close":
            ds.closed = True
        elif op == "retry":
            for sid in sorted(ds.failed):
                sh = ds.shards[sid]
                ds.move(sh, S.TODO)
                sh.failures = 0
                ds.todo.appendleft(sid)
        elif op == "restore":
            if checkpoint is None:
                raise IllegalTransition("a restore record needs its checkpoint data")
            self.datasets[rec[1]] = dataset_from_snapshot(checkpoint)
        else:
            raise IllegalTransition(f"unknown log record {op!r}")

    @staticmethod
    def _untold(ds: Dataset, sh: Shard) -> None:
        """A cut shard leaves its holder, which may not have learnt of (all of) the cut: it may have
        read up to the end it knew, past the end the shard has now, so count those records as
        duplicated (an upper bound, as for a re-grant after a loss); what it reported past the end
        (``over``) was counted already."""
        ds.records_duplicated += max(0, sh.cut - sh.told - sh.over)

    @staticmethod
    def _append(ds: Dataset, count: int) -> None:
        if count > 0:
            ds.add_shards(0, ds.records_known, count, shuffle=False)
            ds.records_known += count

    # ================================================================ decisions
    def _do(self, out: Outcome, rec: list[Any]) -> None:
        self.apply(rec)
        out.records.append(rec)

    def _dataset(self, name: str) -> Dataset:
        try:
            return self.datasets[name]
        except KeyError:
            raise NotFound(f"job {self.job!r} has no dataset {name!r}") from None

    def shards_planned(self, but: str = "") -> int:
        """Shards the job's datasets (all but ``but``) hold or will create in their remaining epochs:
        what :attr:`ShardLimits.shards_per_job` bounds."""
        total = 0
        for name, ds in self.datasets.items():
            if name == but:
                continue
            total += len(ds.shards)
            if ds.spec.mode is DatasetMode.FINITE and ds.epoch < ds.spec.epochs - 1:
                per_epoch = -(-ds.spec.records // ds.shard_records)
                total += per_epoch * (ds.spec.epochs - 1 - ds.epoch)
        return total

    def register(self, spec: DatasetSpec) -> Outcome:
        lim = self.limits
        validate_spec(spec, lim)
        if spec.job != self.job:
            raise ValidationError(f"job: spec names job {spec.job!r}, request was for {self.job!r}")
        out = Outcome()
        old = self.datasets.get(spec.dataset)
        if old is not None:
            if old.spec != spec:
                raise Conflict(f"dataset {spec.dataset!r} of job {self.job!r} is registered with another spec")
        else:
            if len(self.datasets) >= lim.datasets_per_job:
                raise ValidationError(f"dataset: job {self.job!r} already has {len(self.datasets)} datasets, the most "
                                      "allowed (PACER_SHARD_MAX_DATASETS_PER_JOB)")
            need = -(-spec.records // (spec.batch_size * spec.batches_per_shard)) * spec.epochs
            have = self.shards_planned()
            if have + need > lim.shards_per_job:
                raise ValidationError(
                    f"records: this dataset needs {need} shards over its epochs and job {self.job!r} already "
                    f"holds {have}: more than the {lim.shards_per_job} a job may hold (PACER_SHARD_MAX_SHARDS_PER_JOB)")
            self._do(out, ["reg", to_dict(spec)])
            self._do(out, ["epoch", spec.dataset, 0])
            out.events.append(ShardEventOut("registered", spec.dataset, epoch=0))
        out.reply = self.datasets[spec.dataset].status(self.job, spec.dataset)
        return out

    def lease(self, req: LeaseRequest, now: float) -> Outcome:
        """Combined report-and-get; see :class:`LeaseRequest` for the order."""
        ds = self._dataset(req.dataset)
        node = req.node
        if not is_token(node):
            raise ValidationError(f"node: {node!r} is not a valid id (1-64 of [A-Za-z0-9_-])")
        if not 0 <= req.want <= MAX_WANT:
            raise ValidationError(f"want: must be in [0, {MAX_WANT}], got {req.want}")
        if req.max_records < 0:
            raise ValidationError(f"max_records: must be >= 0, got {req.max_records}")
        if not 0 <= req.rate < float("inf"):
            raise ValidationError(f"rate: must be a finite number >= 0, got {req.rate}")
        lim = self.limits
        for name, ids in (("held", req.held), ("done", req.done), ("progress", req.progress),
                          ("discarded", req.discarded), ("failed", req.failed), ("released", req.released)):
            if len(ids) > lim.report_ids:
                raise ValidationError(f"{name}: {len(ids)} entries, more than the {lim.report_ids} one request may "
                                      "carry (PACER_SHARD_MAX_REPORT_IDS); report in several requests")
        if (node not in ds.node_records and node not in ds.doing and node not in self.rates.get(req.dataset, _NO_RATES).of
                and len(ds.node_records) >= lim.nodes_per_dataset):
            raise ValidationError(f"node: dataset {req.dataset!r} already has {len(ds.node_records)} nodes, the most "
                                  "allowed (PACER_SHARD_MAX_NODES_PER_DATASET)")
        out = Outcome()
        rejected: list[Rejected] = []
        self.deadlines[(req.dataset, node)] = now + ds.spec.lease_s
        rates = self.rates.setdefault(req.dataset, NodeRates())
        rates.set(node, req.rate)
        shards = ds.shards

        def holder_check(sid: int) -> Shard | None:
            sh = shards.get(sid)
            if sh is None:
                rejected.append(Rejected(sid, "unknown_shard"))
            elif sh.state is not S.DOING:
                rejected.append(Rejected(sid, f"not_doing:{sh.state.value}"))
            elif sh.node != node:
                rejected.append(Rejected(sid, "not_holder"))
            else:
                return sh
            return None

        # Progress of a cut shard past its new end, reported beside its ``done``: how far its holder
        # read before it learnt of the cut (those records are counted duplicated, not refused).
        past = {p.shard: p.consumed for p in req.progress}
        past_done: set[int] = set()
        done_now: set[int] = set()
        for sid in req.done:
            sh = holder_check(sid)
            if sh is not None:
                pos = past.get(sid, 0)
                if sh.cut and sh.length < pos <= sh.length + sh.cut:
                    past_done.add(sid)
                    if pos - sh.length > sh.over:
                        self._do(out, ["prog", req.dataset, sid, pos])
                self._do(out, ["done", req.dataset, sid])
                done_now.add(sid)
        for p in req.progress:
            if p.shard in past_done:
                continue
            sh = holder_check(p.shard)
            if sh is not None:
                if not 0 <= p.consumed <= sh.length + sh.cut:  # a cut shard: up to the end it was granted
                    rejected.append(Rejected(p.shard, "bad_progress"))
                elif min(p.consumed, sh.length) > sh.consumed or p.consumed - sh.length > sh.over:
                    self._do(out, ["prog", req.dataset, p.shard, p.consumed])
        if req.discarded:
            self._discard(out, ds, req.dataset, node, req.discarded, done_now, holder_check, rejected)
        for reason, sids in (("failed", req.failed), ("released", req.released)):
            for sid in sids:
                if holder_check(sid) is not None:
                    self._lose(out, ds, req.dataset, sid, reason)

        granted: list[ShardLease] = []
        # Shards this node holds but does not know of: a reply was lost.
        mine = ds.doing.get(node)
        if mine:
            # Shards reported in this very request are known too (progress only).
            known = set(req.held)
            known.update(p.shard for p in req.progress)
            granted.extend(ds.lease_of(shards[s]) for s in sorted(mine) if s not in known)
        want = req.want - len(granted)
        while want > 0:
            if not ds.todo and not self._next_epoch(out, ds, req.dataset):
                break
            picked = self._pick(ds, rates, node)
            if picked is None:
                break  # only this node's own re-served pieces are left: another node takes them
            sh = picked
            cap = min((c for c in (req.max_records, tail_cap(ds, rates, node)) if c > 0), default=0)
            if cap and sh.length - sh.consumed > cap:
                self._do(out, ["split", req.dataset, sh.id, sh.consumed + cap, ds.next_id])
            self._do(out, ["grant", req.dataset, sh.id, node])
            granted.append(ds.lease_of(sh))
            want -= 1
        if want > 0 and not ds.todo:
            stolen = self._steal(out, ds, req.dataset, node, rates, now, req.max_records)
            if stolen is not None:
                granted.append(stolen)
        if not ds.todo:
            self._next_epoch(out, ds, req.dataset)
        # Every reply tells the node the ends its shards were cut to (idempotent: a lost reply is
        # healed by the next one); the first is logged, so a loss of the shard knows what it knew.
        shortened: list[ShardLease] = []
        for sid in sorted(ds.doing.get(node, ())):
            sh = shards[sid]
            if sh.cut:
                if sh.told < sh.cut:
                    self._do(out, ["told", req.dataset, sid])
                shortened.append(ds.lease_of(sh))
        finished = self._check_finished(out, ds, req.dataset)
        out.reply = LeaseReply(
            shards=granted,
            lease_s=ds.spec.lease_s,
            finished=finished,
            exhausted=not granted and not finished and req.want > 0,
            rejected=rejected,
            shortened=shortened,
        )
        return out

    def _steal(self, out: Outcome, ds: Dataset, name: str, node: str, rates: NodeRates, now: float,
               max_records: int) -> ShardLease | None:
        """Work stealing (see :data:`STEAL_GAIN`): cut the DOING shard of the node expected to finish
        last and grant its last part to ``node``; None when no steal is worth it."""
        if not ds.spec.tail_split or ds.spec.mode is not DatasetMode.FINITE or ds.todo:
            return None
        if not rates.known:
            return None  # no node reported a rate: who finishes last, and the holder's margin, are unknown
        if self.shards_planned() >= self.limits.shards_per_job:
            return None
        shards = ds.shards

        def left(sids: Iterable[int]) -> int:
            return sum(shards[s].length - shards[s].consumed for s in sids)

        # The holder expected to finish last: its records left over its rate (ties: the first by name).
        holder, t_holder = "", 0.0
        for h in sorted(ds.doing):
            if h != node and (t := left(ds.doing[h]) / rates.rate(h)) > t_holder:
                holder, t_holder = h, t
        if not holder:
            return None
        cand = [shards[s] for s in sorted(ds.doing[holder]) if shards[s].discarder != node]
        if not cand:
            return None  # only pieces of the requester's own discarded records: it would lose them again
        sh = max(cand, key=lambda s: s.length - s.consumed)
        r_h, r_q = rates.rate(holder), rates.rate(node)
        left_h, left_q = left(ds.doing[holder]), left(ds.doing.get(node, ()))
        b = ds.spec.batch_size
        deadline = self.deadlines.get((name, holder))
        since = max(0.0, now - (deadline - ds.spec.lease_s)) if deadline is not None else 0.0
        margin = max(b, math.ceil(r_h * (max(since, ds.spec.lease_s / REPORTS_PER_LEASE) + STEAL_SLACK_S)))
        # Both finish together: (left_h - k) / r_h == (left_q + k) / r_q.
        k = (left_h * r_q - left_q * r_h) / (r_h + r_q)
        k = min(k, sh.length - sh.consumed - margin)
        if max_records:
            k = min(k, max_records)
        k = int(max(k, 0)) // b * b  # whole batches: the piece ends where a step of the nominal batch does
        if k < STEAL_MIN_BATCHES * b:
            return None
        if t_holder < STEAL_GAIN * (left_q + k) / r_q:
            return None  # the requester would not be done with it clearly before the holder with the rest
        new_id = ds.next_id
        self._do(out, ["steal", name, sh.id, sh.length - k, new_id, node])
        return ds.lease_of(shards[new_id])

    def _discard(self, out: Outcome, ds: Dataset, name: str, node: str, ranges: list[ShardRange],
                 done_now: set[int], holder_check: Callable[[int], Shard | None], rejected: list[Rejected]) -> None:
        """Put each valid discarded range back as a TODO piece; reject the others, one reason each."""
        room = self.limits.shards_per_job - self.shards_planned()
        for r in ranges:
            sh = ds.shards.get(r.shard)
            if r.shard in done_now and sh is not None:
                bound = sh.length  # reported done in this very request: every record was consumed
            else:
                sh = holder_check(r.shard)
                if sh is None:
                    continue
                bound = sh.consumed
            if not 0 <= r.start < r.end <= sh.length + sh.cut:
                rejected.append(Rejected(r.shard, "bad_discard"))
                continue
            if r.end > sh.length:
                # Read past the end its shard was cut to: those records are the stealer's, which trains them.
                if r.start >= sh.length:
                    continue
                r = ShardRange(r.shard, r.start, sh.length)
            if r.end > bound:
                rejected.append(Rejected(r.shard, "discard_not_consumed"))  # beyond the reported progress
            elif r.start < sh.floor:
                # Overlaps a range reported before (a retried request that did land, most likely),
                # or records a previous holder consumed: never re-served twice.
                rejected.append(Rejected(r.shard, "discard_repeated"))
            elif room <= 0:
                rejected.append(Rejected(r.shard, "shard_limit"))  # PACER_SHARD_MAX_SHARDS_PER_JOB
            else:
                self._do(out, ["disc", name, r.shard, r.start, r.end, ds.next_id, node])
                room -= 1

    @staticmethod
    def _pick(ds: Dataset, rates: NodeRates, node: str) -> Shard | None:
        """The TODO shard to grant ``node`` next: the head of the queue, except the pieces of
        ``node``'s own discarded records while another node with a live lease can take them."""
        if len(rates.of) < 2:
            return ds.shards[ds.todo[0]]  # alone: its own pieces rather than nothing
        for i, sid in enumerate(ds.todo):
            sh = ds.shards[sid]
            if sh.discarder != node:
                return sh
            if i + 1 >= OWN_PIECES_SCAN:
                break
        return None

    def _next_epoch(self, out: Outcome, ds: Dataset, name: str) -> bool:
        """Create the next epoch's shards once the current TODO queue is empty."""
        if ds.spec.mode is DatasetMode.FINITE and ds.epoch < ds.spec.epochs - 1:
            self._do(out, ["epoch", name, ds.epoch + 1])
            out.events.append(ShardEventOut("epoch_started", name, epoch=ds.epoch))
            return True
        return False

    def _lose(self, out: Outcome, ds: Dataset, name: str, sid: int, reason: str) -> None:
        sh = ds.shards[sid]
        node = sh.node
        self._do(out, ["lost", name, sid, reason])
        if sh.state is S.FAILED:
            out.events.append(
                ShardEventOut("parked", name, sid, node, sh.epoch, f"{reason}; {sh.failures} failures")
            )
        elif sh.state is S.TODO:
            out.events.append(ShardEventOut("requeued", name, sid, node, sh.epoch, reason))

    def _check_finished(self, out: Outcome, ds: Dataset, name: str) -> bool:
        fin = ds.finished()
        if fin and not ds.was_finished:
            out.events.append(ShardEventOut("finished", name, epoch=ds.epoch))
        ds.was_finished = fin
        return fin

    def expire(self, now: float) -> Outcome:
        """Return the shards of every node whose lease ran out to TODO."""
        out = Outcome()
        for key in [k for k, t in self.deadlines.items() if t < now]:
            del self.deadlines[key]
            name, node = key
            if name in self.rates:
                self.rates[name].drop(node)
            ds = self.datasets[name]
            for sid in sorted(ds.doing.get(node, ())):
                self._lose(out, ds, name, sid, "expired")
            self._check_finished(out, ds, name)
        return out

    def node_died(self, node: str) -> Outcome:
        """A node-death event: its DOING shards go back at once."""
        out = Outcome()
        for name, ds in self.datasets.items():
            self.deadlines.pop((name, node), None)
            if name in self.rates:
                self.rates[name].drop(node)
            for sid in sorted(ds.doing.get(node, ())):
                self._lose(out, ds, name, sid, "died")
            self._check_finished(out, ds, name)
        return out

    def renew_all(self, now: float) -> None:
        """After a rebuild: every holder gets a fresh lease (deadlines are not logged)."""
        for name, ds in self.datasets.items():
            for node in ds.doing:
                self.deadlines[(name, node)] = now + ds.spec.lease_s

    def append(self, name: str, records: int, close: bool) -> Outcome:
        ds = self._dataset(name)
        if ds.spec.mode is not DatasetMode.STREAMING:
            raise ValidationError(f"dataset {name!r} is finite: only streaming datasets take appends")
        if records < 0:
            raise ValidationError(f"records: must be >= 0, got {records}")
        lim = self.limits
        shards = -(-records // ds.shard_records)
        if shards > lim.shards_per_epoch:
            raise ValidationError(f"records: {records} records make {shards} shards, more than the "
                                  f"{lim.shards_per_epoch} one append may create (PACER_SHARD_MAX_SHARDS_PER_EPOCH); "
                                  "append less at once")
        if shards and self.shards_planned() + shards > lim.shards_per_job:
            raise ValidationError(f"records: {shards} more shards would exceed the {lim.shards_per_job} a job may hold "
                                  "(PACER_SHARD_MAX_SHARDS_PER_JOB)")
        if ds.records_known + records > MAX_RECORDS:
            raise ValidationError(f"records: the stream would exceed {MAX_RECORDS} records")
        if ds.closed and (records or not close):
            raise Conflict(f"dataset {name!r} is closed: no more records can be appended")
        out = Outcome()
        if records:
            self._do(out, ["append", name, records])
        if close and not ds.closed:
            self._do(out, ["close", name])
        self._check_finished(out, ds, name)
        out.reply = ds.status(self.job, name)
        return out

    def retry_failed(self, name: str) -> Outcome:
        ds = self._dataset(name)
        out = Outcome()
        if ds.failed:
            self._do(out, ["retry", name])
        out.reply = ds.status(self.job, name)
        return out

    def status(self, name: str) -> DatasetStatus:
        return self._dataset(name).status(self.job, name)

    def checkpoint(self, name: str) -> dict[str, Any]:
        """A consistent snapshot of one dataset in which DOING shards are TODO again.

        Taken between two decisions, so it is consistent by construction; the
        model checkpoint saved beside it covers what DONE and progress say.
        """
        snap = dataset_snapshot(self._dataset(name))
        codes = snap["state"]
        requeue = []
        for i, c in enumerate(codes):
            if c == _STATE_CODE[S.DOING]:
                # As a live loss would: fully consumed -> DONE, else back to TODO.
                full = snap["consumed"][i] >= snap["length"][i]
                codes[i] = _STATE_CODE[S.DONE if full else S.TODO]
                snap["node"][i] = ""
                if not full:
                    requeue.append(snap["id"][i])
        snap["todo"] = requeue + snap["todo"]
        return snap

    def restore(self, name: str, checkpoint_id: str, snap: dict[str, Any]) -> Outcome:
        self._dataset(name)
        if snap.get("spec", {}).get("dataset") != name:
            raise ValidationError(f"checkpoint {checkpoint_id!r} is not of dataset {name!r}")
        spec = from_dict(DatasetSpec, snap["spec"])
        shards = len(snap.get("id", ()))
        if spec.mode is DatasetMode.FINITE:  # the epochs still to come are created from it too
            per_epoch = -(-spec.records // (spec.batch_size * spec.batches_per_shard))
            shards += per_epoch * max(0, spec.epochs - 1 - int(snap.get("epoch", 0)))
        if self.shards_planned(but=name) + shards > self.limits.shards_per_job:
            raise ValidationError(f"checkpoint: {checkpoint_id!r} holds {shards} shards; with the job's other "
                                  f"datasets more than the {self.limits.shards_per_job} a job may hold "
                                  "(PACER_SHARD_MAX_SHARDS_PER_JOB)")
        out = Outcome()
        rec = ["restore", name, checkpoint_id]
        self.apply(rec, checkpoint=snap)
        out.records.append(rec)
        out.events.append(ShardEventOut("restored", name, detail=checkpoint_id))
        out.reply = self.datasets[name].status(self.job, name)
        return out

    def settle(self) -> None:
        """After a replay: remember which datasets already finished, so that
        'finished' is announced once per dataset, not again after a restart."""
        for ds in self.datasets.values():
            ds.was_finished = ds.finished()

    # ================================================================ snapshots
    def snapshot(self) -> dict[str, Any]:
        return {"v": 1, "job": self.job, "datasets": {n: dataset_snapshot(d) for n, d in self.datasets.items()}}

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any]) -> JobShards:
        js = cls(snap["job"])
        for name, d in snap["datasets"].items():
            js.datasets[name] = dataset_from_snapshot(d)
        return js


def dataset_snapshot(ds: Dataset) -> dict[str, Any]:
    """Columnar plain-data form of a dataset (compact in msgpack)."""
    sh = list(ds.shards.values())
    return {
        "spec": to_dict(ds.spec),
        "epoch": ds.epoch,
        "records_known": ds.records_known,
        "closed": ds.closed,
        "next_id": ds.next_id,
        "records_duplicated": ds.records_duplicated,
        "records_reserved": ds.records_reserved,
        "node_records": dict(ds.node_records),
        "node_done": dict(ds.node_done),
        "node_discarded": dict(ds.node_discarded),
        "id": [s.id for s in sh],
        "epoch_of": [s.epoch for s in sh],
        "offset": [s.offset for s in sh],
        "length": [s.length for s in sh],
        "seed": [s.seed for s in sh],
        "state": [_STATE_CODE[s.state] for s in sh],
        "node": [s.node for s in sh],
        "consumed": [s.consumed for s in sh],
        "failures": [s.failures for s in sh],
        "grants": [s.grants for s in sh],
        "given": [s.given for s in sh],
        "floor": [s.floor for s in sh],
        "discarder": [s.discarder for s in sh],
        "cut": [s.cut for s in sh],
        "told": [s.told for s in sh],
        "over": [s.over for s in sh],
        "todo": list(ds.todo),
    }


def dataset_from_snapshot(d: dict[str, Any]) -> Dataset:
    ds = Dataset(from_dict(DatasetSpec, d["spec"]))
    ds.epoch = d["epoch"]
    ds.records_known = d["records_known"]
    ds.closed = d["closed"]
    ds.next_id = d["next_id"]
    ds.records_duplicated = d["records_duplicated"]
    ds.node_records = dict(d["node_records"])
    ds.node_done = dict(d["node_done"])
    # Snapshots and checkpoints taken before discarded gradients were re-served, or before shards were cut
    # by work stealing, lack these: none then.
    ds.records_reserved = d.get("records_reserved", 0)
    ds.node_discarded = dict(d.get("node_discarded", {}))
    n = len(d["id"])
    cols = zip(
        d["id"], d["epoch_of"], d["offset"], d["length"], d["seed"], d["state"], d["node"],
        d["consumed"], d["failures"], d["grants"], d.get("given", [0] * n), d.get("floor", [0] * n),
        d.get("discarder", [""] * n), d.get("cut", [0] * n), d.get("told", [0] * n), d.get("over", [0] * n),
        strict=True,
    )
    for sid, ep, off, ln, seed, code, node, cons, fails, grants, given, floor, discarder, cut, told, over in cols:
        sh = Shard(sid, ep, off, ln, seed)
        sh.state = _CODE_STATE[code]
        sh.node, sh.consumed, sh.failures, sh.grants = node, cons, fails, grants
        sh.given, sh.floor, sh.discarder = given, floor, discarder
        sh.cut, sh.told, sh.over = cut, told, over
        ds.shards[sid] = sh
        if sh.state is S.DOING:
            ds.doing.setdefault(node, set()).add(sid)
        elif sh.state is S.DONE:
            ds.done_count += 1
            ds.records_done += ln - given
        elif sh.state is S.FAILED:
            ds.failed.add(sid)
    ds.todo = deque(d["todo"])
    ds.todo_records = sum(ds.shards[sid].length - ds.shards[sid].consumed for sid in ds.todo)
    ds.was_finished = ds.finished()
    return ds


def fold(job: str, records: Iterable[list[Any]]) -> JobShards:
    """Rebuild a job's state from its whole log (tests and tools)."""
    js = JobShards(job)
    for rec in records:
        js.apply(rec)
    js.settle()
    return js
