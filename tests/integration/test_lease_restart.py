"""A restarted instance (same instance name) takes its own lease back at once, not after a TTL.

A service killed and restarted under the same ``PACER_INSTANCE`` (a container
restart in its pod, the embedded stack's supervisor) used to wait out its
own dead incarnation's lease before serving again (the shard service's
restart went from ~1 s to over 6 s).  Another instance still waits the TTL.
Instance names must be unique among live instances (the pod name in
deploy/, ``<service>-<i>`` in the embedded stack).  Real nats-server and KV.
"""

from __future__ import annotations

from pacer.bus import Bus
from pacer.embedded import EmbeddedNats
from pacer.lease import Lease

BUCKET = "lease-restart-test"


async def test_own_name_is_taken_back_at_once_and_a_stranger_still_waits(nats_server: EmbeddedNats) -> None:
    bus = await Bus.connect(nats_server.url, name="lease-restart")
    try:
        before = await Lease.open(bus, BUCKET, "job-r", "shard-0", ttl_s=600)  # a TTL no test waits out
        assert await before.acquire()
        stranger = await Lease.open(bus, BUCKET, "job-r", "shard-1", ttl_s=600)
        assert not await stranger.acquire()
        assert not await stranger.acquire()  # and again: it must wait the whole TTL

        again = await Lease.open(bus, BUCKET, "job-r", "shard-0", ttl_s=600)  # the restarted process
        assert await again.acquire()
        assert again.token > before.token  # a new term, as after any take-over
        assert not await stranger.acquire()  # held, renewed by the new incarnation
        assert await again.renew() and again.held
    finally:
        await bus.close()
