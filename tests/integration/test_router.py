"""The one request router of the services that own jobs (pacer.owned.router), over a real nats-server.

Two instances of a small service, each an Ownership plus a Router exactly as the shard service, the
executor, the monitor and the brain wire them: a request reaching either instance is answered by the
job's owner; a job unknown everywhere is answered where it arrives, unclaimed; when the owner goes,
the other instance takes the job over and answers; a job-less request is answered by any instance.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import Bus
from pacer.embedded import EmbeddedNats
from pacer.errors import NotFound, Unavailable, remote_error
from pacer.lease import Lease
from pacer.owned.router import Router
from pacer.ownership import LEASE_BUCKET, Ownership, lease_key
from pacer.telemetry import Counters

SERVICE = "toy"
pytestmark = pytest.mark.timeout(60)


class Toy:
    """An instance: answers ``pacer.rpc.toy.<job>.who`` with its name, owning the jobs it is asked about."""

    def __init__(self, bus: Bus, name: str, known: set[str], balance_every_s: float = 0) -> None:
        self.bus, self.name, self.known = bus, name, known
        self.counters = Counters(f"{SERVICE}-{name}")
        self.acquired: list[str] = []
        self.own = Ownership(bus, SERVICE, self._acquired, self._lost, instance=name, ttl_s=1.5,
                             balance_every_s=balance_every_s)
        self.router = Router(bus, self.own, self.counters, {"who": self.who}, local_jobs=(subjects.ALL_JOBS,),
                             unknown=self._unknown)

    async def _acquired(self, job: str, lease: Lease) -> None:
        self.acquired.append(job)

    async def _lost(self, job: str) -> None:
        pass

    async def _unknown(self, job: str, op: str) -> bool:
        return job not in self.known  # "no record anywhere"

    async def who(self, job: str, msg: Msg) -> None:
        if job not in self.known and job != subjects.ALL_JOBS:
            raise NotFound(f"no job {job!r}")
        await msg.respond(json.dumps({"job": job, "by": self.name, "owner": self.own.owns(job)}).encode())

    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.own.start(tg, on_forwarded=self.router.on_forwarded)
        # One queue group per instance here, so that the test picks which instance a request reaches.
        await self.bus.nc.subscribe(f"{SERVICE}.{self.name}.>", cb=self._direct)

    async def _direct(self, msg: Msg) -> None:  # <toy>.<instance>.<rpc subject>: as if the queue group chose it
        msg.subject = msg.subject.split(".", 2)[2]
        await self.router.on_rpc(msg)


@pytest.fixture
async def toys(nats_server: EmbeddedNats) -> AsyncIterator[tuple[Toy, Toy]]:
    known = {"j1", "j2"}
    buses = [await Bus.connect(nats_server.url, name=f"toy-{n}") for n in ("a", "b")]
    a, b = Toy(buses[0], "a", known), Toy(buses[1], "b", known)
    async with asyncio.TaskGroup() as tg:
        await a.start(tg)
        await b.start(tg)
        await buses[0].nc.flush()
        await buses[1].nc.flush()
        yield a, b
        for t in (a, b):
            await t.own.close()
        for t in list(tg._tasks):
            t.cancel()
    for bus in buses:
        await bus.close()


async def ask(bus: Bus, via: str, job: str) -> dict[str, Any]:
    reply = await bus.nc.request(f"{SERVICE}.{via}.{subjects.rpc(SERVICE, job, 'who')}", b"", timeout=10)
    if reply.data.startswith(b"{"):
        return dict(json.loads(reply.data))
    err = msgpack.unpackb(reply.data)["error"]  # the service's error envelope
    raise remote_error(err["code"], err["message"], err["temporary"])


async def test_requests_reach_the_owner_and_follow_a_handover(bus: Bus, toys: tuple[Toy, Toy]) -> None:
    a, b = toys
    first = await ask(bus, "a", "j1")  # nobody owned j1: a claims it and answers
    assert first == {"job": "j1", "by": "a", "owner": True} and a.acquired == ["j1"]
    via_b = await ask(bus, "b", "j1")  # b forwards it to the owner
    assert via_b["by"] == "a" and b.counters.values["requests_forwarded"] == 1
    assert a.counters.values["requests_forwarded_in"] == 1 and not b.own.owns("j1")

    # A job unknown everywhere: answered where it arrives, and nobody holds a lease for it.
    with pytest.raises(NotFound):
        await ask(bus, "b", "ghost")
    assert not b.own.owns("ghost") and await b.own.owner_of("ghost") is None
    # A request about every job: any instance.
    assert (await ask(bus, "b", subjects.ALL_JOBS))["by"] == "b"

    # The owner goes (its leases released): the other instance, a standby since it forwarded, takes over.
    await a.own.close()
    for _ in range(200):
        if b.own.owns("j1"):
            break
        await asyncio.sleep(0.05)
    assert b.own.owns("j1") and "j1" in b.acquired
    assert await ask(bus, "b", "j1") == {"job": "j1", "by": "b", "owner": True}


async def test_a_lease_that_outlived_its_instance_is_not_forwarded_to(bus: Bus, nats_server: EmbeddedNats) -> None:
    """A lease naming an instance with no presence (gone, its release lost): no forward into silence."""
    ghost = await Lease.open(bus, LEASE_BUCKET, lease_key(SERVICE, "j2"), "gone", ttl_s=30.0)
    assert await ghost.acquire()
    c_bus = await Bus.connect(nats_server.url, name="toy-c")
    c = Toy(c_bus, "c", {"j2"}, balance_every_s=5.0)  # instances that balance announce their presence
    try:
        async with asyncio.TaskGroup() as tg:
            await c.start(tg)
            await c_bus.nc.flush()
            assert await c.own.owner_of("j2") == "gone" and await c.own.present("c")
            # Forwarded, the request would come back as "no responders"; the router says "retry" itself.
            with pytest.raises(Unavailable, match="changing owner"):
                await ask(bus, "c", "j2")
            assert c.own.owner_gone == 1 and c.counters.values.get("requests_forwarded", 0) == 0
            await c.own.close()
            for t in list(tg._tasks):
                t.cancel()
    finally:
        await c_bus.close()
