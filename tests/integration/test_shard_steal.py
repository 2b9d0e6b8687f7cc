"""Work stealing over a real nats-server: a fast client takes the end of a slow client's shard.

The dataset is one shard of 2,000 records.  A slow client (a step of 10 records every 0.1 s)
takes it; once its rate is known, a fast client asks for work: nothing is TODO, so the service
cuts the slow client's shard and grants its end to the fast one.  The slow client learns its
shorter lease from its next heartbeat (``LeaseReply.shortened``, ``ShardClient.end_of``) and
stops there.  Every record is trained, each extra read is counted as duplicated, and the slow
client trains only a part of the shard.  Nothing here depends on how fast the machine is: the
assertions are about which records were read, never about time.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from conftest import InProcessService, eventually
from pacer.bus import Bus, RetryPolicy
from pacer.contracts.shards import DatasetSpec
from pacer.shards.client import ShardAdmin, ShardClient

JOB = "steal"
RECORDS = 2_000
BATCH = 10
PATIENT = RetryPolicy(attempts=100, first_delay=0.05, max_delay=0.5)

pytestmark = pytest.mark.timeout(120)


class Reader:
    """Reads its shards batch by batch (one step = one batch, then ``step_s`` of sleep), never
    across the end the service says now (``end_of``); reports progress after every step."""

    def __init__(self, bus: Bus, node: str, step_s: float) -> None:
        self.client = ShardClient(bus, JOB, "train", node, prefetch=1, poll_s=0.05, retry=PATIENT)
        self.step_s = step_s
        self.reads: Counter[int] = Counter()
        self.holding = asyncio.Event()

    async def run(self) -> None:
        c = self.client
        await c.start()
        while (shard := await c.next()) is not None:
            self.holding.set()
            pos = shard.start
            while pos < (end := c.end_of(shard)):
                hi = min(end, pos + BATCH)
                await asyncio.sleep(self.step_s)  # the step: the end may move meanwhile, the batch is trained
                self.reads.update(range(pos, hi))
                c.trained(hi - pos)
                c.progress(shard, hi - shard.offset)
                pos = hi
            c.done(shard)
        await c.close()


async def test_a_fast_client_takes_the_tail_of_a_slow_one_and_the_slow_one_stops_there(
    bus: Bus, shard_service: InProcessService
) -> None:
    admin = ShardAdmin(bus)
    await admin.register(DatasetSpec(job=JOB, dataset="train", records=RECORDS, batch_size=BATCH,
                                     batches_per_shard=RECORDS // BATCH, lease_s=2.0))
    slow, fast = Reader(bus, "slow", 0.1), Reader(bus, "fast", 0.002)
    slow_task = asyncio.create_task(slow.run())
    await asyncio.wait_for(slow.holding.wait(), 30)
    # The service sizes the margin the holder keeps by its rate: ask once the slow client reported one.
    await eventually(lambda: slow.client.rate > 0, within=30, what="the slow client never measured its rate")
    await asyncio.wait_for(asyncio.gather(fast.run(), slow_task), 90)

    st = await admin.status(JOB, "train")
    assert st.finished and st.records_done == st.records_total == RECORDS
    reads = slow.reads + fast.reads
    assert sorted(reads) == list(range(RECORDS)), "every record trained"
    assert sum(n - 1 for n in reads.values()) == st.records_duplicated, "each record read twice is counted"
    # the slow client learnt that its shard ends earlier, and stopped there
    assert slow.client.records_stolen > 0
    assert sum(slow.reads.values()) < RECORDS // 2, "the slow client kept most of its shard"
    assert sum(fast.reads.values()) > RECORDS // 2
    assert shard_service.svc is not None
    counters = shard_service.svc.counters.values
    assert counters["shards_stolen"] >= 1 and counters["records_stolen"] >= slow.client.records_stolen
