"""Fencing and start-up on a three-server cluster, where JetStream answers differently from one server.

* A compare-and-set lost while a rival's write to the same subject is in
  flight is refused with err_code 10164 on a cluster (10071 on one server):
  the shard log must report it as :class:`Fenced` (the writer rebuilds from
  the log), not as a passing outage.
* A replicated KV bucket has no leader while its servers lack a quorum
  (and for ~5 s after its leader died): ``Bus.kv`` waits for one instead
  of failing a service's start.
"""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
from conftest import connect_cluster, until_ok
from pacer.embedded import EmbeddedCluster
from pacer_services.shard_service.effects import Fenced, ShardLogStore


async def test_a_lost_race_on_the_shard_log_is_fenced_not_unavailable(nats_cluster: EmbeddedCluster) -> None:
    bus = await connect_cluster(nats_cluster, "fence")
    try:
        await bus.ensure_streams()
        stores = [ShardLogStore(bus.js, replicas=3) for _ in range(12)]
        results = await asyncio.gather(*(s.append("race-job", [["x", i]], expected_last_seq=0)
                                         for i, s in enumerate(stores)), return_exceptions=True)
        won = [r for r in results if isinstance(r, int)]
        lost = [r for r in results if not isinstance(r, int)]
        assert len(won) == 1, results
        assert lost and all(isinstance(r, Fenced) for r in lost), [type(r).__name__ for r in lost]
        assert await stores[0].last_seq("race-job") == won[0]
    finally:
        await bus.close()


async def test_bus_kv_waits_for_a_quorum_to_come_back(nats_cluster: EmbeddedCluster) -> None:
    """Two of three servers down: no leader until one is back, later than one lookup's 5 s timeout."""
    bus = await connect_cluster(nats_cluster, "kv-wait")
    try:
        kv = await bus.kv("wait-bucket")
        await until_ok(lambda: kv.put("k", b"v1"))
        info = await bus.js.stream_info("KV_wait-bucket")
        assert info.cluster is not None and info.cluster.leader
        leader = nats_cluster.index_of(info.cluster.leader)
        other = next(i for i in range(3) if i != leader)
        nats_cluster.kill(leader)
        nats_cluster.kill(other)

        async def back_later() -> None:
            await asyncio.sleep(7.0)
            await asyncio.to_thread(nats_cluster.restart, other, 120.0)

        comeback = asyncio.create_task(back_later())
        again = await bus.kv("wait-bucket", wait_s=120.0)  # a single lookup would time out first
        await comeback
        for _ in range(240):  # the restarted server may still be catching up: the value, once it serves
            try:
                entry = await again.get("k")
                break
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError,
                    nats.js.errors.NoStreamResponseError):
                await asyncio.sleep(0.25)
        assert entry.value == b"v1"
    finally:
        await bus.close()
