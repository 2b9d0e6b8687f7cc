"""What a worker needs to read its shards: where the data is, in which order, read ahead of the steps.

Three pieces, no TensorFlow (the SDK's trainers and the services use them too):

* :class:`DataRef`: a dataset as the job service checked it (its URI, format,
  reader options, index directory and feature schema), passed to every
  worker and to a user's own trainer as one JSON value.  The data itself is
  read in place (:mod:`pacer.data.sources`), never copied.
* :func:`read_rows`: records ``[lo, hi)`` of a dataset in a *seeded order*.
  The shard service hands out record index ranges and counts progress by
  position, and near the end of an epoch it splits a range between workers
  (work stealing).  A permutation of the records can only be compatible with
  every such split if it maps each aligned block onto itself: record ``i`` is
  physical row ``b*B + perm_b(i - b*B)`` with ``b = i // B`` and ``perm_b`` a
  permutation of ``range(B)`` drawn from ``(seed, b)``.  Any range split then
  covers each physical row exactly once, a relaunched worker sees the same
  order, and the cost is at most two partial blocks read beyond a range.
  (The shard service shuffles the shards of every epoch, which mixes across
  blocks; this mixes within them.)
* :class:`ShardReader`: a shard read in chunks by a background thread, so the
  next chunk's I/O (object storage, Parquet decoding) overlaps the current
  steps' compute.

Concurrency: one :class:`ShardReader` at a time per source, read by one
thread (the reader's own); a source is not shared with another thread meanwhile.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: Records per block of the seeded order (module docstring).
ORDER_BLOCK = 256
#: Rows per background read of a shard: large enough to amortise a request to object storage.
CHUNK_ROWS = 8192

Columns = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class DataRef:
    """A checked dataset: enough for any process to open it in place."""

    uri: str
    format: str
    options: dict[str, Any] = field(default_factory=dict)  # csv/tsv reader options
    index_dir: str = ""  # where csv/tfrecord row-offset indexes are kept ("" = in memory, rebuilt)
    schema: dict[str, Any] = field(default_factory=dict)  # Schema.to_config(); {} = Criteo's
    seed: int = 0  # the order within blocks (read_rows)
    columns: dict[str, str] = field(default_factory=dict)  # a stream's column kinds, fixed at submit ({} = read)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DataRef:
        raw = json.loads(text)
        return cls(**{k: raw[k] for k in ("uri", "format", "options", "index_dir", "schema", "seed", "columns")
                      if k in raw})

    def with_uri(self, uri: str) -> DataRef:
        """The same reader settings for another dataset (the held-out one)."""
        return DataRef(uri, self.format, self.options, self.index_dir, self.schema, self.seed, self.columns)

    @property
    def streaming(self) -> bool:
        """A JetStream stream (:mod:`pacer.data.stream`): read in stream order, never shuffled."""
        return self.format == "stream"

    @property
    def order_seed(self) -> int | None:
        """The seed of :func:`read_rows` (None: in the dataset's own order, as a stream is trained)."""
        return None if self.streaming else self.seed

    def open(self, nats_url: str = "") -> Any:
        """The :class:`pacer.data.sources.Source` of this dataset (a stream's: on the bus at ``nats_url``,
        with the credentials of the environment)."""
        if self.streaming:
            from pacer.data.stream import StreamSource, parse_stream_uri

            return StreamSource(nats_url, parse_stream_uri(self.uri), first_seq=int(self.options["first_seq"]),
                                kinds=self.columns or None)
        from pacer.data.sources import open_source

        return open_source(self.uri, self.format, index_dir=self.index_dir or None, csv_options=self.options or None)

    def feature_schema(self) -> Any:
        """The :class:`pacer.data.schema.Schema` (Criteo's when the spec gave none)."""
        from pacer.data.schema import Schema

        return Schema.from_config(self.schema) if self.schema else Schema.criteo()


def seed_of(job: str) -> int:
    """A job's order seed: stable across processes and relaunches (``hash()`` is salted per process)."""
    return zlib.crc32(job.encode())


def block_perm(seed: int, block: int, size: int = ORDER_BLOCK) -> np.ndarray:
    """``perm_b`` of the module docstring: a permutation of ``range(size)`` from ``(seed, block)``."""
    return np.random.default_rng([seed & 0xFFFFFFFF, block]).permutation(size)


def read_rows(source: Any, lo: int, hi: int, columns: Sequence[str] | None, seed: int | None,
              block: int = ORDER_BLOCK) -> Columns:
    """Records ``[lo, hi)`` in the seeded order (``seed=None``: file order)."""
    if seed is None and hasattr(source, "refresh"):  # a stream: exactly [lo, hi) or an error
        return dict(source.read(lo, hi, columns))
    hi = min(hi, source.rows)
    if seed is None or hi <= lo:
        return dict(source.read(lo, hi, columns))
    first, last = lo // block, (hi - 1) // block
    base = first * block
    top = min((last + 1) * block, source.rows)
    raw = source.read(base, top, columns)
    idx = np.arange(lo, hi)
    b = idx // block
    offs = idx - b * block
    rows = np.empty(hi - lo, dtype=np.int64)
    for k in range(first, last + 1):
        size = min(block, source.rows - k * block)
        sel = b == k
        perm = block_perm(seed, k, block)
        # A short last block permutes only its own rows: keep perm's order of the values below size.
        perm = perm[perm < size] if size < block else perm
        rows[sel] = k * block - base + perm[offs[sel]]
    return {name: col[rows] for name, col in raw.items()}


def rows_of(cols: Mapping[str, np.ndarray]) -> int:
    """How many records a batch of columns holds."""
    return len(next(iter(cols.values()))) if cols else 0


def take(cols: Mapping[str, np.ndarray], a: int, b: int) -> Columns:
    return {k: v[a:b] for k, v in cols.items()}


def concat(parts: Sequence[Mapping[str, np.ndarray]]) -> Columns:
    if len(parts) == 1:
        return dict(parts[0])
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class ShardReader:
    """Records ``[start, end)`` read ahead in chunks by a background thread; ``get`` waits only for what it needs."""

    def __init__(self, pool: ThreadPoolExecutor, source: Any, start: int, end: int,
                 columns: Sequence[str] | None, seed: int | None, chunk: int = CHUNK_ROWS) -> None:
        if hasattr(source, "refresh"):  # a stream: its samples may have arrived after the source looked;
            self.start, self.end = start, end  # never clipped (a missing sample is a read error, not skipped)
        else:
            self.start, self.end = start, min(end, source.rows)
        self.chunk = max(1, chunk)
        self._chunks: list[Future[Columns]] = [
            pool.submit(read_rows, source, a, min(a + self.chunk, self.end), columns, seed)
            for a in range(self.start, self.end, self.chunk)]

    def __len__(self) -> int:
        return int(self.end - self.start)

    def get(self, pos: int, n: int) -> Columns:
        """Records ``[start + pos, start + pos + n)`` (clipped to the shard)."""
        stop = min(pos + n, len(self))
        parts = []
        while pos < stop:
            i, off = divmod(pos, self.chunk)
            cols = self._chunks[i].result()  # a read error surfaces here, in the training thread
            got = min(stop - pos, self.chunk - off)
            parts.append(take(cols, off, off + got))
            pos += got
        return concat(parts) if parts else {}

    def cancel(self) -> None:
        for f in self._chunks:
            f.cancel()
