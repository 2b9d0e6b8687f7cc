"""The seeded order of a dataset's records and the read-ahead of a shard (pacer.data.feed)."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from pacer.data.feed import ORDER_BLOCK, DataRef, ShardReader, read_rows, seed_of


class ArraySource:
    """A source over in-memory columns (the pure order logic needs no storage); counts the rows it reads."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.cols = {"id": np.arange(rows, dtype=np.int64), "x": np.arange(rows, dtype=np.float32) * 0.5}
        self.rows_read = 0

    def read(self, lo: int, hi: int, columns: Any = None) -> dict[str, np.ndarray]:
        hi = min(hi, self.rows)
        self.rows_read += hi - lo
        return {k: v[lo:hi] for k, v in self.cols.items() if columns is None or k in columns}


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3000), cuts=st.lists(st.integers(0, 3000), max_size=8), seed=st.integers(0, 2**32 - 1))
def test_any_split_of_the_records_reads_each_once(rows: int, cuts: list[int], seed: int) -> None:
    """Work stealing, resumes and re-served discards split ranges anywhere: the parts must still
    cover every record exactly once."""
    src = ArraySource(rows)
    bounds = sorted({0, rows, *(c for c in cuts if c < rows)})
    got = np.concatenate([read_rows(src, a, b, None, seed)["id"] for a, b in itertools.pairwise(bounds)])
    assert sorted(got.tolist()) == list(range(rows))
    # Reading the whole at once gives the very same order as the parts.
    assert got.tolist() == read_rows(src, 0, rows, None, seed)["id"].tolist()


def test_the_order_is_seeded_shuffled_and_the_same_for_every_reader() -> None:
    src = ArraySource(5 * ORDER_BLOCK)
    a = read_rows(src, 0, src.rows, ["id"], seed=7)["id"]
    b = read_rows(ArraySource(5 * ORDER_BLOCK), 0, src.rows, ["id"], seed=7)["id"]  # another process, a relaunch
    c = read_rows(src, 0, src.rows, ["id"], seed=8)["id"]
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()
    assert a.tolist() != list(range(src.rows))  # shuffled...
    assert np.all(a // ORDER_BLOCK == np.arange(src.rows) // ORDER_BLOCK)  # ...within aligned blocks only
    assert read_rows(src, 0, 10, None, seed=None)["id"].tolist() == list(range(10))  # no seed: file order


def test_columns_stay_aligned_under_the_order() -> None:
    src = ArraySource(1000)
    cols = read_rows(src, 100, 900, None, seed=3)
    assert np.array_equal(cols["x"], cols["id"].astype(np.float32) * 0.5)


def test_a_range_reads_at_most_two_partial_blocks_more() -> None:
    src = ArraySource(10 * ORDER_BLOCK)
    read_rows(src, ORDER_BLOCK + 5, 3 * ORDER_BLOCK + 7, None, seed=1)
    assert src.rows_read == 3 * ORDER_BLOCK


def test_shard_reader_gives_the_shard_in_pieces_equal_to_one_read() -> None:
    src = ArraySource(20_000)
    with ThreadPoolExecutor(1) as pool:
        r = ShardReader(pool, src, 1234, 17_000, None, seed=5, chunk=3000)
        assert len(r) == 17_000 - 1234
        parts = []
        pos = 0
        for size in (1, 999, 2500, 3001, 7000, 100_000):
            got = r.get(pos, size)
            parts.append(got["id"])
            pos += len(got["id"])
        assert pos == len(r)
    whole = read_rows(ArraySource(20_000), 1234, 17_000, None, seed=5)["id"]
    # Chunks are read separately but the order is a function of the record index alone.
    assert np.concatenate(parts).tolist() == whole.tolist()


def test_data_ref_round_trips_and_a_bare_path_is_a_record_file() -> None:
    ref = DataRef("s3://b/x-*.parquet", "parquet", {"delimiter": ","}, "/idx", {"label": "y"}, seed_of("job-a"))
    assert DataRef.from_json(ref.to_json()) == ref
    assert ref.with_uri("s3://b/test.parquet").format == "parquet"
    assert seed_of("job-a") == seed_of("job-a") != seed_of("job-b")


class Lease:
    def __init__(self, shard: int, start: int, end: int) -> None:
        self.shard, self.start, self.end, self.offset = shard, start, end, 0


class ShardsClient:
    """Hands out fixed shards; records what the feed reports."""

    def __init__(self, shards: list[Lease]) -> None:
        self.shards, self.calls = list(shards), []  # type: ignore[var-annotated]

    def next(self, wait: bool = True) -> Lease | None:
        return self.shards.pop(0) if self.shards else None

    def end_of(self, shard: Lease) -> int:
        return shard.end

    def failed(self, shard: Lease) -> None:
        self.calls.append(("failed", shard.shard))

    def done(self, shard: Lease) -> None:
        self.calls.append(("done", shard.shard))

    def progress(self, shard: Lease, end: int) -> None:
        self.calls.append(("progress", shard.shard, end))

    def trained(self, n: int) -> None:
        pass

    def report_soon(self) -> None:
        pass


class CorruptFrom(ArraySource):
    """Rows from ``bad`` on cannot be parsed (a malformed line deep in a file)."""

    def __init__(self, rows: int, bad: int) -> None:
        super().__init__(rows)
        self.bad = bad

    def read(self, lo: int, hi: int, columns: Any = None) -> dict[str, np.ndarray]:
        from pacer.data.sources import CorruptData

        if hi > self.bad:
            raise CorruptData("data.csv", "column 'x' is not a float", line=self.bad + 2)
        return super().read(lo, hi, columns)


def test_an_unreadable_shard_is_reported_failed_and_the_feed_goes_on() -> None:
    from pacer.trainer.worker import ShardFeed

    client = ShardsClient([Lease(0, 0, 100), Lease(1, 100, 200), Lease(2, 200, 300)])
    feed = ShardFeed(client, CorruptFrom(300, bad=150), None, seed=None)
    got = []
    while (b := feed.batch(50)) is not None:
        got.extend(b["id"].tolist())
        feed.commit(report_progress=False)
    assert got == list(range(100))  # shard 1 holds the bad row; shard 2 is read after it, so fails too
    assert ("failed", 1) in client.calls and ("failed", 2) in client.calls and ("done", 0) in client.calls
    assert feed.read_errors == 2
