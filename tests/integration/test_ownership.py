"""pacer.ownership on a real 3-server cluster: one owner per job, hand-over, fencing, forwarded requests.

Two :class:`Ownership` instances of one service run on their own connections
to ``nats_cluster`` (three real nats-servers, KV at replicas 3).  A crash is
an instance whose connection is closed without giving its leases up; a
frozen (stale) owner is one whose clock stands still, so it keeps believing
it owns the job after a rival took it over.  The last test checks, on a
server with users and permissions, that NATS lets the owner answer a request
another instance forwarded to it (``allow_responses``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
import pytest
from conftest import connect_cluster, eventually
from nats.aio.client import Client
from nats.aio.msg import Msg
from pacer import security
from pacer.bus import Bus
from pacer.embedded import EmbeddedCluster, EmbeddedNats
from pacer.lease import Lease, LeaseLost
from pacer.ownership import FORWARDED_BY, Ownership, forward_subject, state_key

pytestmark = pytest.mark.timeout(90)

SERVICE = "svc"
TTL = 3.0


@dataclass
class Instance:
    """One instance of a service: its bus, its ownership, what its callbacks saw."""

    bus: Bus
    name: str
    clock: Callable[[], float] | None = None
    acquired: list[tuple[str, int]] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    own: Ownership | None = None
    tg: asyncio.TaskGroup | None = None
    _runner: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self, on_forwarded: Callable[[Msg], object] | None = None) -> Ownership:
        async def acquired(job: str, lease: Lease) -> None:
            assert lease.token is not None
            self.acquired.append((job, lease.token))

        async def lost(job: str) -> None:
            self.lost.append(job)

        kwargs = {"clock": self.clock} if self.clock else {}
        self.own = Ownership(self.bus, SERVICE, acquired, lost, instance=self.name, ttl_s=TTL, **kwargs)  # type: ignore[arg-type]
        ready = asyncio.Event()

        async def run() -> None:
            async with asyncio.TaskGroup() as tg:
                self.tg = tg
                assert self.own is not None
                await self.own.start(tg, on_forwarded)  # type: ignore[arg-type]
                ready.set()
                await self._stop.wait()
                await self.own.close()

        self._runner = asyncio.create_task(run())
        await ready.wait()
        return self.own

    async def stop(self) -> None:
        self._stop.set()
        if self._runner is not None:
            await asyncio.wait_for(self._runner, 20)

    async def crash(self) -> None:
        """The connection goes, the leases stay behind (as after kill -9)."""
        await self.bus.nc.close()
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._runner
            self._runner = None


@pytest.fixture
async def pair(nats_cluster: EmbeddedCluster) -> AsyncIterator[tuple[Instance, Instance]]:
    a = Instance(await connect_cluster(nats_cluster, "own-a"), "a")
    b = Instance(await connect_cluster(nats_cluster, "own-b"), "b")
    yield a, b
    for x in (a, b):
        if x._runner is not None:
            await x.stop()
        if not x.bus.nc.is_closed:
            await x.bus.close()


async def ask(nc: Client, subject: str, data: bytes, headers: dict[str, str] | None = None) -> Msg:
    """A request, retried while the cluster has not yet spread the responder's interest to our server."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        try:
            reply: Msg = await nc.request(subject, data, timeout=5, headers=headers)
            return reply
        except nats.errors.NoRespondersError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def owners_over(instances: list[Instance], job: str, seconds: float) -> list[list[str]]:
    """Who owns ``job`` at each sample over ``seconds`` (both sampled at the same instant)."""
    loop = asyncio.get_running_loop()
    end, seen = loop.time() + seconds, []
    while loop.time() < end:
        seen.append([x.name for x in instances if x.own is not None and x.own.owns(job)])
        await asyncio.sleep(0.02)
    return seen


async def test_two_instances_one_owner_per_job_and_a_crashed_owner_is_taken_over(
        pair: tuple[Instance, Instance]) -> None:
    a, b = pair
    own_a, own_b = await a.start(), await b.start()
    for job in ("j1", "j2", "j3"):
        own_a.want(job)
        own_b.want(job)
    await eventually(lambda: all(own_a.owns(j) or own_b.owns(j) for j in ("j1", "j2", "j3")), 20,
                     "some job has no owner")
    for job in ("j1", "j2", "j3"):
        samples = await owners_over([a, b], job, 1.0)
        assert all(len(s) == 1 for s in samples), (job, [s for s in samples if len(s) != 1][:3])
    # Each job was acquired once, by one instance, and nobody lost it.
    assert sorted(j for j, _ in a.acquired + b.acquired) == ["j1", "j2", "j3"]
    assert a.lost == b.lost == []

    # j1's owner crashes: the other takes it over within a few TTLs, with a larger fencing token.
    victim, survivor = (a, b) if own_a.owns("j1") else (b, a)
    token = next(t for j, t in victim.acquired if j == "j1")
    victim_jobs = [j for j, _ in victim.acquired]
    await victim.crash()
    assert survivor.own is not None
    await eventually(lambda: all(survivor.own.owns(j) for j in ("j1", "j2", "j3")), 6 * TTL,
                     "the survivor did not take every job over")
    new = [t for j, t in survivor.acquired if j == "j1"]
    assert new and new[-1] > token
    assert sorted(j for j, _ in survivor.acquired) == ["j1", "j2", "j3"]
    assert victim_jobs  # the victim owned at least j1 before it went


async def test_a_stale_owner_write_is_refused(pair: tuple[Instance, Instance]) -> None:
    a, b = pair
    frozen = 1000.0
    a.clock = lambda: frozen  # a's time stands still: it never renews, and never doubts its lease
    own_a = await a.start()
    assert await own_a.claim("j1")
    await own_a.put_state("j1", b"a's state")
    own_b = await b.start()
    own_b.want("j1")
    await eventually(lambda: own_b.owns("j1"), 6 * TTL, "b never took over the lease a stopped renewing")
    assert own_a.owns("j1")  # a still believes it ...
    with pytest.raises(LeaseLost):  # ... but the server refuses its write
        await own_a.put_state("j1", b"stale")
    await own_b.put_state("j1", b"b's state")
    assert await own_b.get_state("j1") == b"b's state"
    assert own_b.kv is not None
    assert (await own_b.kv.get(state_key(SERVICE, "j1"))).value == b"b's state"


async def test_a_request_reaching_the_non_owner_is_answered_by_the_owner(pair: tuple[Instance, Instance]) -> None:
    a, b = pair
    answered_by: list[str] = []

    def handler(inst: Instance) -> Callable[[Msg], Awaitable[None]]:
        async def handle(msg: Msg) -> None:
            answered_by.append(inst.name)
            await inst.bus.nc.publish(msg.reply, f"{inst.name}:{msg.subject}:{msg.data.decode()}".encode())
        return handle

    own_a = await a.start(on_forwarded=handler(a))
    own_b = await b.start(on_forwarded=handler(b))
    assert await own_a.claim("j1")
    assert not await own_b.claim("j1", within=1.0)
    # Only the non-owner listens on the request subject: every request lands on it.
    subject = f"pacer.rpc.{SERVICE}.j1.echo"
    outcomes: list[str] = []

    async def on_request(msg: Msg) -> None:
        outcomes.append(await own_b.route(msg, "j1", handler(b)))

    await b.bus.nc.subscribe(subject, cb=on_request)
    await b.bus.nc.flush()
    client = a.bus.nc
    for i in range(3):
        reply = await ask(client, subject, f"q{i}".encode())
        assert reply.data.decode() == f"a:{subject}:q{i}"  # the owner saw the original subject and data
    assert outcomes == ["forwarded"] * 3 and answered_by == ["a"] * 3
    assert own_b.forwarded == 3

    # A forwarded request that reaches an instance not owning the job is not forwarded again.
    fwd = await ask(client, subject, b"x", headers={FORWARDED_BY: "someone"})
    assert outcomes[-1] == "unavailable" and b"unavailable" in fwd.data


# ------------------------------------------------------------ NATS permissions
FORWARD_A = forward_subject("monitor", "a")


def _users(forwarding: bool) -> str:
    """The monitor's permissions from pacer.security; without ``forwarding``, less its forward subjects."""
    mon = security.permissions("monitor", "monitor").to_conf()
    fwd = forward_subject("monitor", "*")
    assert fwd in mon["publish"]["allow"] and fwd in mon["subscribe"]["allow"]  # type: ignore[index]
    if not forwarding:
        for what in ("publish", "subscribe"):
            mon[what]["allow"].remove(fwd)  # type: ignore[index]
    api = security.permissions("api", "api").to_conf()
    users = [f"{{user: monitor, password: pw-m, permissions: {json.dumps(mon)}}}",
             f"{{user: api, password: pw-a, permissions: {json.dumps(api)}}}"]
    return "authorization {\n  users = [\n    " + "\n    ".join(users) + "\n  ]\n}\n"


@pytest.mark.parametrize("forwarding", [True, False])
async def test_the_owner_may_answer_a_forwarded_request(tmp_path: Path, forwarding: bool) -> None:
    """allow_responses covers the reply subject of a *forwarded* message: the owner answers the client.

    Without the forward subjects in the monitor's permissions (pacer.security
    grants them), the forward is refused by the server and the client gets no
    answer.
    """
    srv = EmbeddedNats(store_dir=tmp_path / "nats", authorization=_users(forwarding)).start()
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    try:
        owner = await nats.connect(srv.url, user="monitor", password="pw-m", error_cb=on_error,
                                   inbox_prefix=security.inbox_prefix("monitor"))
        other = await nats.connect(srv.url, user="monitor", password="pw-m", error_cb=on_error,
                                   inbox_prefix=security.inbox_prefix("monitor"))
        client = await nats.connect(srv.url, user="api", password="pw-a", error_cb=on_error,
                                    inbox_prefix=security.inbox_prefix("api"))

        async def answer(msg: Msg) -> None:
            await owner.publish(msg.reply, b"from the owner")

        async def forward(msg: Msg) -> None:
            await other.publish(FORWARD_A, msg.data, reply=msg.reply, headers={FORWARDED_BY: "b"})

        if forwarding:
            await owner.subscribe(FORWARD_A, cb=answer)
        await other.subscribe("pacer.rpc.monitor.*.stats", queue="monitor", cb=forward)
        for nc in (owner, other, owner, other):
            await nc.flush()
        if forwarding:
            reply = await client.request("pacer.rpc.monitor.j1.stats", b"q", timeout=5)
            assert reply.data == b"from the owner"
            assert not [e for e in errors if "violation" in str(e).lower()]
        else:
            with pytest.raises(nats.errors.TimeoutError):
                await client.request("pacer.rpc.monitor.j1.stats", b"q", timeout=1)
            await eventually(lambda: [e for e in errors if FORWARD_A in str(e)], 5, f"no violation: {errors}")
        for nc in (owner, other, client):
            await nc.close()
    finally:
        srv.stop()
