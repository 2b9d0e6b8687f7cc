import asyncio
from pacer.shards.client import ShardAdmin, ShardClient
from pacer.contracts.shards import DatasetSpec

async def test_probe(bus, shard_service):
    admin = ShardAdmin(bus)
    await admin.register(DatasetSpec(job="j", dataset="d", records=1000, batch_size=10, batches_per_shard=10, lease_s=1.0))
    c = ShardClient(bus, "j", "d", "slow", prefetch=1)
    await c.start()
    s = await c.next()
    await asyncio.sleep(2.5)   # a long shard: only the heartbeat keeps the lease
    st = await admin.status("j", "d")
    print(st)
    c.done(s)
    await c.close()
    assert st.doing == 1 and st.records_duplicated == 0
