"""Streaming datasets from a JetStream stream (pacer.data.stream) over a real nats-server and shard service."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from pacer.bus import Bus
from pacer.contracts.shards import DatasetMode, DatasetSpec
from pacer.data.formats import ads_table
from pacer.data.stream import (
    StreamError,
    StreamSource,
    check_data_stream,
    parse_stream_uri,
    stream_uri,
)
from pacer.embedded import EmbeddedNats
from pacer.shards.client import ShardAdmin, ShardClient

ROOT = Path(__file__).resolve().parents[2]


def sample(i: int) -> dict[str, Any]:
    """Row ``i``: every kind of value; ``w`` missing from every 7th row, ``tags`` empty in every 5th."""
    row: dict[str, Any] = {"i": i, "x": i / 4, "name": f"n{i}", "tags": [f"t{j}" for j in range(i % 5)],
                           "ids": [i, i + 1]}
    if i % 7:
        row["w"] = float(i % 3)
    return row


async def make_stream(bus: Bus, name: str) -> None:
    await bus.js.add_stream(name=name, subjects=[f"{name}.samples"], allow_direct=True)


async def publish(bus: Bus, name: str, rows: list[dict[str, Any]]) -> list[int]:
    acks = await asyncio.gather(*(bus.js.publish(f"{name}.samples", msgpack.packb(r)) for r in rows))
    return [a.seq for a in acks]


def test_uris() -> None:
    assert stream_uri("ADS") == "jetstream://ADS"
    assert parse_stream_uri("jetstream://ADS") == "ADS"
    with pytest.raises(StreamError):
        parse_stream_uri("s3://bucket/x")
    with pytest.raises(StreamError):
        stream_uri("a.b")
    assert check_data_stream("ADS-2_x") == "ADS-2_x"
    for reserved in ("KV_pacer-jobs", "OBJ_pacer-shard-snapshots", "PACER_EVENTS", "pacer_shardlog", "a,b", "x" * 65):
        with pytest.raises(StreamError):
            check_data_stream(reserved)


async def test_source_reads_exact_sequences_and_fails_clearly(nats_server: EmbeddedNats, bus: Bus) -> None:
    await make_stream(bus, "S1")
    await publish(bus, "S1", [{"junk": 1}] * 3)  # sequences 1-3 precede the dataset
    seqs = await publish(bus, "S1", [sample(i) for i in range(1000)])
    assert seqs == list(range(4, 1004))
    src = await asyncio.to_thread(StreamSource, nats_server.url, "S1", first_seq=4)
    try:
        assert src.rows == 1000
        assert dict(src.columns) == {"i": "int", "x": "float", "name": "string", "tags": "list<string>",
                                     "ids": "list<int>", "w": "float"}
        rng = random.Random(1)
        for _ in range(20):
            lo = rng.randrange(0, 1000)
            hi = rng.randrange(lo, 1001)
            cols = await asyncio.to_thread(src.read, lo, hi)
            assert cols["i"].dtype == np.int64 and cols["x"].dtype == np.float32 and cols["w"].dtype == np.float32
            assert cols["i"].tolist() == list(range(lo, hi))
            assert cols["x"].tolist() == [i / 4 for i in range(lo, hi)]
            assert cols["name"].tolist() == [f"n{i}" for i in range(lo, hi)]
            assert [list(t) for t in cols["tags"]] == [sample(i)["tags"] for i in range(lo, hi)]
            assert [t.tolist() for t in cols["ids"]] == [[i, i + 1] for i in range(lo, hi)]
            w = cols["w"].tolist()
            assert all(math.isnan(w[k]) if (lo + k) % 7 == 0 else w[k] == (lo + k) % 3 for k in range(hi - lo))
        only = await asyncio.to_thread(src.read, 10, 12, ["name"])
        assert list(only) == ["name"] and only["name"].tolist() == ["n10", "n11"]
        with pytest.raises(StreamError, match="outside"):
            await asyncio.to_thread(src.read, 990, 1001)

        # A message deleted from the stream: a range over it fails naming the sequence; others still read.
        await bus.js.delete_msg("S1", 4 + 500)
        with pytest.raises(StreamError, match="sequence 504 is missing"):
            await asyncio.to_thread(src.read, 400, 600)
        assert (await asyncio.to_thread(src.read, 501, 503))["i"].tolist() == [501, 502]
        # The last message deleted: found missing at once, not after a long wait.
        await bus.js.delete_msg("S1", 1003)
        with pytest.raises(StreamError, match="1003"):
            await asyncio.wait_for(asyncio.to_thread(src.read, 998, 1000), 4)
    finally:
        await asyncio.to_thread(src.close)


async def test_malformed_payload_and_purge(nats_server: EmbeddedNats, bus: Bus) -> None:
    await make_stream(bus, "S2")
    await publish(bus, "S2", [sample(i) for i in range(10)])
    await bus.js.publish("S2.samples", b"\xc1 not msgpack")  # sequence 11
    await bus.js.publish("S2.samples", msgpack.packb([1, 2, 3]))  # sequence 12: msgpack, not a map
    await publish(bus, "S2", [sample(i) for i in range(12, 20)])
    with StreamSource(nats_server.url, "S2", first_seq=1) as src:
        assert src.rows == 20 and src.kinds["i"] == "int"
        assert src.read(0, 10)["i"].tolist() == list(range(10))
        with pytest.raises(StreamError, match="sequence 11: payload is not msgpack"):
            src.read(5, 15)
        with pytest.raises(StreamError, match="sequence 12: payload is a msgpack list, not a map"):
            src.read(11, 13)
        assert src.malformed == 2
        assert src.read(12, 20)["i"].tolist() == list(range(12, 20))
        # Purged up to sequence 16: the start of a range is gone.
        await bus.js.purge_stream("S2", seq=16)
        with pytest.raises(StreamError, match="sequence 14 is missing"):
            src.read(13, 18)
        assert src.read(15, 20)["i"].tolist() == list(range(15, 20))
        # New messages: a read past rows refreshes; explicit kinds are honoured.
        await publish(bus, "S2", [sample(20)])
        assert src.read(20, 21)["i"].tolist() == [20] and src.rows == 21
    with StreamSource(nats_server.url, "S2", first_seq=16, kinds={"i": "float", "name": "string"}) as src:
        cols = src.read(0, 2)
        assert cols["i"].dtype == np.float32 and cols["i"].tolist() == [15.0, 16.0]
    with pytest.raises(StreamError, match="no JetStream stream"):
        StreamSource(nats_server.url, "NOPE", first_seq=1)


async def wait_status(admin: ShardAdmin, job: str, ds: str, ok: Any, timeout: float = 30.0) -> Any:
    """The dataset's status once ``ok(status)`` holds (polled: the follower runs on its own period)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        st = await admin.status(job, ds)
        if ok(st):
            return st
        assert asyncio.get_running_loop().time() < deadline, st
        await asyncio.sleep(0.05)


def streaming(job: str, ds: str, stream: str, first_seq: int, **kw: Any) -> DatasetSpec:
    return DatasetSpec(job=job, dataset=ds, records=0, mode=DatasetMode.STREAMING, shuffle=False, stream=stream,
                       first_seq=first_seq, **{"batch_size": 10, "batches_per_shard": 4, **kw})


async def test_followed_stream_feeds_two_workers_one_killed(nats_server: EmbeddedNats, bus: Bus,
                                                           shard_service: object) -> None:
    job, ds, stream = "online", "clicks", "CLICKS"
    await make_stream(bus, stream)
    await publish(bus, stream, [{"junk": True}] * 5)  # older messages, not part of the dataset
    first_seq = 6
    admin = ShardAdmin(bus)
    await admin.register(streaming(job, ds, stream, first_seq, lease_s=2.0, max_wait_s=0.5, idle_close_s=1.5))

    bursts, per_burst = 5, 130
    published: list[int] = []

    async def produce() -> None:
        for b in range(bursts):
            published.extend(await publish(bus, stream, [{"i": b * per_burst + k, "x": float(k)}
                                                           for k in range(per_burst)]))
            await asyncio.sleep(0.3)

    trained: list[tuple[str, int, int]] = []  # (node, first sequence, one past the last)
    regranted = [0]  # records of shards granted again after the killed worker's lease expired
    a_has_its_shards = asyncio.Event()  # b starts then: it must not take the shards a is to train

    async def train(node: str, src: StreamSource, lo: int, hi: int) -> None:
        cols = await asyncio.to_thread(src.read, lo, hi, ["i"])
        assert cols["i"].tolist() == list(range(lo, hi))  # record i is sample i
        trained.append((node, first_seq + lo, first_seq + hi))

    async def worker_a() -> None:
        """Trains three shards, then dies halfway through its fourth (its progress reached the service)."""
        c = ShardClient(bus, job, ds, "a", prefetch=2)
        await c.start()
        with StreamSource(nats_server.url, stream, first_seq=first_seq) as src:
            for _ in range(3):
                s = await c.next()
                assert s is not None
                await train("a", src, s.start, c.end_of(s))
                c.done(s)
            s = await c.next()
            assert s is not None
            a_has_its_shards.set()
            half = (s.end - s.start) // 2
            await train("a", src, s.start, s.start + half)
            c.progress(s, s.start + half - s.offset)
        await c.close(release=False)  # killed: holds its shards until the lease expires

    async def worker_b() -> None:
        await a_has_its_shards.wait()
        c = ShardClient(bus, job, ds, "b", prefetch=2, poll_s=0.05)
        await c.start()
        with StreamSource(nats_server.url, stream, first_seq=first_seq) as src:
            while (s := await c.next()) is not None:
                if s.attempt:
                    regranted[0] += s.end - s.start
                await train("b", src, s.start, c.end_of(s))
                c.done(s)
        await c.close()

    await asyncio.wait_for(asyncio.gather(produce(), worker_a(), worker_b()), 60)
    total = bursts * per_burst
    assert published == list(range(first_seq, first_seq + total))

    # Every sequence trained, and exactly once: the killed worker's progress was kept, its unread shards
    # were granted again from where it stopped.
    counts = np.zeros(first_seq + total, dtype=np.int64)
    for _, a, b in trained:
        counts[a:b] += 1
    assert counts[:first_seq].sum() == 0 and (counts[first_seq:] == 1).all(), np.flatnonzero(counts[first_seq:] != 1)
    assert {n for n, _, _ in trained} == {"a", "b"}
    st = await admin.status(job, ds)
    assert st.closed and st.finished and st.records_total == total
    # Full shards were cut as soon as they existed, the rest of each burst after max_wait_s: more
    # shards than full ones, fewer than one per poll.
    assert total // 40 < st.done <= total // 40 + 2 * bursts, st
    # The service counts each record done once; what it granted again after the loss it counts as
    # duplicated (an upper bound on records trained twice: it cannot know the dead worker's unreported
    # reads; here there were none, the progress it reported before dying was kept).
    assert st.records_done == total and sum(n.records for n in st.nodes) == total, st
    assert regranted[0] > 0 and st.records_duplicated == regranted[0], st


async def test_follow_appends_each_sample_once_across_a_failover(nats_server: EmbeddedNats, bus: Bus) -> None:
    """Two shard-service instances; the owner is stopped mid-stream: the other follows on from the
    records the log holds, never appending a sample twice, and a partial shard waits for max_wait_s."""
    from conftest import InProcessService
    from pacer_services.shard_service.app import ShardServiceConfig

    job, ds, stream = "online2", "d", "S3"
    await make_stream(bus, stream)
    services = [InProcessService(nats_server.url, ShardServiceConfig(instance=name, lease_ttl_s=2.0,
                                                                     follow_interval_s=0.05))
                for name in ("one", "two")]
    for svc in services:
        await svc.start()
    admin = ShardAdmin(bus)
    try:
        await admin.register(streaming(job, ds, stream, 1, batch_size=5, batches_per_shard=2, max_wait_s=3600))
        await publish(bus, stream, [sample(i) for i in range(23)])  # two full shards of 10, 3 waiting
        await wait_status(admin, job, ds, lambda st: st.records_total >= 20)
        await asyncio.sleep(0.3)  # several more rounds: the 3 stay unappended (max_wait_s is an hour)
        assert (await admin.status(job, ds)).records_total == 20

        owner = next(s for s in services if s.svc.own.owns(job))
        await owner.stop()
        await publish(bus, stream, [sample(i) for i in range(23, 41)])  # 41: four full shards
        st = await wait_status(admin, job, ds, lambda st: st.records_total >= 40, timeout=30)
        other = next(s for s in services if s is not owner)
        assert other.svc.own.owns(job) and st.records_total == 40 and st.todo == 4, st
        assert not st.closed  # idle_close_s 0: an online job is never closed by the follower
    finally:
        for svc in services:
            with contextlib.suppress(Exception):
                await svc.stop()


async def test_producer_example(nats_server: EmbeddedNats, bus: Bus) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / "stream_producer.py"), nats_server.url,
        "--stream", "ADS", "--rows", "300", "--rate", "3000", "--seed", "7",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == {"published": 300, "first_seq": 1, "last_seq": 300}
    info = await bus.js.stream_info("ADS")
    assert info.state.messages == 300 and info.config.subjects == ["ADS.samples"]
    want = ads_table(300, 7)
    with StreamSource(nats_server.url, "ADS", first_seq=1) as src:
        assert src.rows == 300
        kinds = src.kinds
        assert kinds["click"] == "int" and kinds["price"] == "float" and kinds["user"] == "string"
        assert kinds["tags"] == "list<string>"
        cols = await asyncio.to_thread(src.read, 0, 300)
    assert cols["click"].tolist() == want.column("click").to_pylist()
    assert cols["user"].tolist() == want.column("user").to_pylist()
    assert [list(t) for t in cols["tags"]] == want.column("tags").to_pylist()
    np.testing.assert_allclose(cols["price"], want.column("price").to_numpy())
    # Run again: appends to the existing stream.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / "stream_producer.py"), nats_server.url,
        "--stream", "ADS", "--rows", "5", stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert json.loads(out) == {"published": 5, "first_seq": 301, "last_seq": 305}
