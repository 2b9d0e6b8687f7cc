"""``pacer up --cluster 3``: the embedded stack on three clustered nats-servers (issue 13).

The real Stack (secured, TLS) with the shard service: its stream and KV
are at replicas 3, the services and the operator get every server's URL,
and killing any one nats-server (kill -9) leaves the shard service serving:
a dataset registered before the kill is there after it, and new progress is
recorded while the server is down.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pacer.bus import Bus
from pacer.contracts.shards import DatasetSpec
from pacer.embedded import EmbeddedCluster
from pacer.shards.client import ShardAdmin, ShardClient
from pacer_services.cli.stack import Stack


async def test_the_stack_survives_a_nats_server_kill(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "stack", services=["shard"], cluster=3)
    await asyncio.to_thread(stack.start)
    try:
        assert isinstance(stack.nats, EmbeddedCluster)
        assert len(stack.url.split(",")) == 3 and stack.env["PACER_REPLICAS"] == "3"
        bus = await Bus.connect(stack.url, name="test-cluster")
        try:
            spec = DatasetSpec(job="hc-job", dataset="train", records=4000, batch_size=10, batches_per_shard=10,
                               epochs=1)
            await ShardAdmin(bus).register(spec)
            info = await bus.js.stream_info(await _shard_stream(bus))
            assert info.config.num_replicas == 3
            leader = info.cluster.leader if info.cluster else None
            victim = stack.nats.index_of(leader) if leader else 0
            stack.nats.kill(victim)  # the shard stream's leader, SIGKILL

            client = ShardClient(bus, "hc-job", "train", "worker-0")  # retries as a worker does
            await client.start()
            for _ in range(3):  # progress while a server is down: elected, served, stored
                shard = await client.next()
                assert shard is not None
                client.done(shard)
            await client.close(release=True)  # reports flushed, unread prefetched shards handed back
            status = await _retry(lambda: ShardAdmin(bus).status("hc-job", "train"))
            # A prefetch in flight at close may leave shards leased to worker-0 until their lease ends.
            assert status.done == 3 and status.todo + status.doing == 37 and status.failed == 0
            await asyncio.to_thread(stack.nats.restart, victim)
        finally:
            await bus.close()
    finally:
        await asyncio.to_thread(stack.stop)


async def _shard_stream(bus: Bus) -> str:
    names = [n async for n in _stream_names(bus)]
    shard = [n for n in names if "SHARD" in n.upper()]
    assert shard, names
    return shard[0]


async def _stream_names(bus: Bus):  # type: ignore[no-untyped-def]
    for s in await bus.js.streams_info():
        yield s.config.name


async def _retry(call, attempts: int = 40):  # type: ignore[no-untyped-def]
    """A call during a leader election may time out once or twice; the stack must come back."""
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return await call()
        except Exception as e:
            last = e
            await asyncio.sleep(0.25)
    assert last is not None
    raise last
