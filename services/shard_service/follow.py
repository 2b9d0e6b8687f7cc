"""Following a streaming dataset's JetStream stream: its new samples become shards.

A streaming dataset registered with ``DatasetSpec.stream`` (the job service
does it for a ``jetstream://`` dataset) is followed by the instance that owns
the job: every ``follow_interval_s`` it reads the stream's last sequence and
asks :func:`decide` what to append.  The decision is pure and the append is
the core's own (``JobShards.append``, committed to the shard log like any
request), made from the records the core knows *after* reading the stream:
so an append is never made twice for the same samples, whichever instance
follows, however often the loop or a failover repeats a round (the state the
core rebuilds from its log is the truth; :class:`Follow` only remembers
timings, and a new owner starts them afresh).

Cutting: a full shard (``batch_size * batches_per_shard`` samples) is
appended as soon as it exists; the samples of a partial one once the oldest
of them has waited ``max_wait_s`` (so a slow stream still trains within that
bound).  Closing: once every sample is appended and the stream got nothing
new for ``idle_close_s`` (0 = never: an online job runs until stopped), the
dataset is closed, and the job finishes when its last shard is done.
"""

from __future__ import annotations

from dataclasses import dataclass

from pacer.contracts.shards import DatasetSpec


@dataclass
class Follow:
    """Timings of one followed dataset (in memory only)."""

    avail: int = -1  # samples of the stream from first_seq at the last round
    changed_at: float = 0.0  # when ``avail`` last changed (or the follow began)
    waiting_since: float | None = None  # when samples beyond the known records were first seen


def decide(f: Follow, avail: int, known: int, spec: DatasetSpec, now: float,
           max_records: int | None = None) -> tuple[int, bool]:
    """``(records to append, close)`` for a stream holding ``avail`` samples from ``first_seq`` of which
    the dataset knows ``known``; ``max_records`` caps one append (the shards one append may create)."""
    if avail != f.avail:
        f.avail, f.changed_at = avail, now
    new = avail - known
    if new <= 0:
        f.waiting_since = None
        return 0, spec.idle_close_s > 0 and now - f.changed_at >= spec.idle_close_s
    if f.waiting_since is None:
        f.waiting_since = now
    shard = spec.batch_size * spec.batches_per_shard
    n = new if now - f.waiting_since >= spec.max_wait_s else new // shard * shard
    if max_records is not None:
        n = min(n, max_records // shard * shard or shard)
    if n >= new:
        f.waiting_since = None
    # else: what is left keeps the time its oldest part was first seen (cut no later than max_wait_s)
    return n, False
