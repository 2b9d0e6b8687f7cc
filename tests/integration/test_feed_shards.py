"""The worker's feed against a real shard service: a shard taken ahead and not read goes back at once."""

from __future__ import annotations

from pacer.bus import Bus
from pacer.contracts.shards import DatasetSpec
from pacer.shards.client import ShardAdmin, ShardClient


async def test_a_shard_put_back_is_released_on_close_and_served_to_another_node_at_once(
    bus: Bus, shard_service: object
) -> None:
    # A lease far longer than the test: only a release, not an expiry, can hand the shard on.
    await ShardAdmin(bus).register(DatasetSpec(job="pb", dataset="d", records=400, batch_size=10,
                                               batches_per_shard=10, lease_s=600.0))
    a = ShardClient(bus, "pb", "d", "worker-0", prefetch=2)
    first = await a.next()
    ahead = await a.next()  # taken ahead (ShardFeed._read_ahead), then the worker leaves before reading it
    assert first is not None and ahead is not None
    a.put_back(ahead)
    assert await a.next() == ahead  # given again to the same node first
    a.put_back(ahead)
    a.done(first)
    await a.close(release=True)
    b = ShardClient(bus, "pb", "d", "worker-1", prefetch=1)
    got = set()
    while (s := await b.next(wait=False)) is not None:
        got.add(s.shard)
        b.done(s)
    await b.close()
    assert ahead.shard in got and first.shard not in got
