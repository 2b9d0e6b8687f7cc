"""The balance rule of pacer.ownership on a real nats-server: jobs spread over the instances of a service.

Two :class:`Ownership` instances of a toy service run on their own
connections, with a short balance period.  What must hold: the jobs one
instance took first spread to an even split within a bounded time, one move
at a time; at no sampled instant do both instances believe they own a job;
once even, nothing moves any more; a job handed over that nobody takes comes
back; a graceful close takes the instance's presence away; the rounds work
under a service's NATS user.  Then two real monitors and two real shard
services: their jobs spread and are served after the move (the shard jobs
with the state their log carried over).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import InProcess, InProcessService, eventually
from nats.aio.msg import Msg
from pacer import security, subjects
from pacer.bus import NO_RETRY, Bus
from pacer.codec import decode
from pacer.contracts.agent import AgentMetrics
from pacer.contracts.monitor import JobStatistics, StatsQuery
from pacer.contracts.shards import DatasetSpec, LeaseReply, LeaseRequest
from pacer.embedded import EmbeddedNats
from pacer.lease import Lease
from pacer.ownership import LEASE_BUCKET, Ownership, presence_key
from pacer.shards.client import ShardAdmin
from pacer.subjects import ShardOp
from pacer_services.monitor.app import MonitorService, MonitorServiceConfig
from pacer_services.monitor.core import MonitorConfig
from pacer_services.shard_service.app import ShardServiceConfig
from test_shard_failures import DS, PATIENT

pytestmark = pytest.mark.timeout(120)

SERVICE = "toy"
TTL = 2.0
PERIOD = 1.0
JOBS = [f"job-{i}" for i in range(6)]


@dataclass
class Toy:
    """One instance of the toy service: its ownership and what its callbacks saw."""

    bus: Bus
    name: str
    period: float = PERIOD
    service: str = SERVICE
    acquired: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    own: Ownership | None = None
    _runner: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> Ownership:
        async def acquired(job: str, lease: Lease) -> None:
            self.acquired.append(job)

        async def lost(job: str) -> None:
            self.lost.append(job)

        own = self.own = Ownership(self.bus, self.service, acquired, lost, instance=self.name, ttl_s=TTL,
                                   balance_every_s=self.period)
        ready = asyncio.Event()

        async def run() -> None:
            async with asyncio.TaskGroup() as tg:
                await own.start(tg)
                ready.set()
                await self._stop.wait()
                await own.close()

        self._runner = asyncio.create_task(run())
        await ready.wait()
        return own

    async def stop(self) -> None:
        self._stop.set()
        if self._runner is not None:
            await asyncio.wait_for(self._runner, 20)
            self._runner = None


@pytest.fixture
async def toys(nats_server: EmbeddedNats) -> AsyncIterator[tuple[Toy, Toy]]:
    a = Toy(await Bus.connect(nats_server.url, name="toy-a"), "a")
    b = Toy(await Bus.connect(nats_server.url, name="toy-b"), "b")
    yield a, b
    for x in (a, b):
        with contextlib.suppress(Exception):
            await x.stop()
        await x.bus.close()


class Sampler:
    """Samples both instances' beliefs every few ms: any job owned by both at one instant is recorded."""

    def __init__(self, a: Ownership, b: Ownership) -> None:
        self.a, self.b = a, b
        self.both: list[str] = []
        self.samples = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.both += [j for j in JOBS if self.a.owns(j) and self.b.owns(j)]
            self.samples += 1
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_six_jobs_taken_by_one_instance_spread_three_three_and_stay(toys: tuple[Toy, Toy]) -> None:
    ta, tb = toys
    a = await ta.start()
    for j in JOBS:
        a.want(j)
    await eventually(lambda: len(a.owned()) == 6, 30, lambda: f"a owns {a.owned()}")
    b = await tb.start()
    for j in JOBS:
        b.want(j)  # b hears of every job too: a standby for each
    sampler = Sampler(a, b)
    try:
        await eventually(lambda: len(a.owned()) == 3 and len(b.owned()) == 3, 60,
                         lambda: f"a owns {a.owned()}, b owns {b.owned()}")
        # Three hand-overs landed (one that found no taker on a slow machine would be taken back).
        assert a.given_up - a.taken_back == 3 and b.given_up == 0, (a.given_up, a.taken_back, b.given_up)
        assert len(tb.acquired) == 3 and set(tb.acquired) <= set(ta.lost) and tb.lost == []
        # Balanced: several more periods (each instance's rounds find nothing to do), nothing moves.
        rounds_before = (len(ta.acquired), len(tb.acquired), len(ta.lost), len(tb.lost))
        holders, live = await a.read_service()
        assert live == {"a", "b"}
        assert sorted(holders.values()) == ["a"] * 3 + ["b"] * 3
        for _ in range(5):
            assert await a.balance_once() == [] and await b.balance_once() == []
            await asyncio.sleep(PERIOD)
        assert (len(ta.acquired), len(tb.acquired), len(ta.lost), len(tb.lost)) == rounds_before
        assert len(a.owned()) == 3 and len(b.owned()) == 3 and a.given_up - a.taken_back == 3 and b.given_up == 0
    finally:
        await sampler.stop()
    assert sampler.samples > 100 and sampler.both == [], sampler.both
    # A graceful close deletes b's presence at once: a counts only itself (and takes b's jobs).
    await tb.stop()
    _, live = await a.read_service()
    assert live == {"a"}
    await eventually(lambda: len(a.owned()) == 6, 30, lambda: f"a owns {a.owned()}")


async def test_a_job_nobody_takes_comes_back_and_balancing_pauses(toys: tuple[Toy, Toy]) -> None:
    """b is live (its presence key is there) but never hears of a's jobs: a hands one over, nobody
    takes it, a takes it back about two TTLs later and then gives nothing up for a while."""
    ta, tb = toys
    a = await ta.start()
    b = await tb.start()
    for j in JOBS[:3]:
        a.want(j)
    await eventually(lambda: len(a.owned()) == 3, 30, lambda: f"a owns {a.owned()}")
    await eventually(lambda: a.given_up == 1, 30, "a handed nothing over")
    gone = next(j for j in JOBS[:3] if not a.owns(j))
    await eventually(lambda: a.taken_back == 1 and a.owns(gone), 30, lambda: f"{gone} is not back")
    assert b.owned() == [] and ta.lost == [gone] and ta.acquired.count(gone) == 2
    # Paused for a few periods after a hand-over that found no taker: the job stays, nothing else moves.
    for _ in range(2):
        assert await a.balance_once() == []
        await asyncio.sleep(PERIOD)
    assert a.given_up == 1 and len(a.owned()) == 3


async def test_balancing_off_writes_no_presence_and_moves_nothing(toys: tuple[Toy, Toy]) -> None:
    ta, tb = toys
    ta.period = tb.period = 0.0
    a = await ta.start()
    b = await tb.start()
    for j in JOBS[:4]:
        a.want(j)
    await eventually(lambda: len(a.owned()) == 4, 30, lambda: f"a owns {a.owned()}")
    for j in JOBS[:4]:
        b.want(j)
    holders, live = await a.read_service()
    assert live == set() and sorted(holders.values()) == ["a"] * 4
    kv = await ta.bus.kv(LEASE_BUCKET)
    for name in ("a", "b"):
        with pytest.raises(Exception, match="not found"):
            await kv.get(presence_key(SERVICE, name))
    assert await a.balance_once() == []
    await asyncio.sleep(3 * PERIOD)
    assert len(a.owned()) == 4 and b.owned() == [] and a.given_up == 0


# ================================================================ a real service: two monitors
async def test_two_monitors_spread_their_jobs_and_serve_them_after_the_move(
        nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    """mon-a hears of four jobs first and owns them all; mon-b starts (it replays the events: a standby for
    each); balancing moves two jobs to mon-b, one at a time, and both publish the statistics of the jobs
    they own and answer requests about them."""
    monkeypatch.setenv("PACER_BALANCE_EVERY_S", str(PERIOD))
    jobs = [f"bal{i}" for i in range(4)]
    bpt = {"w0": 0.1, "w1": 0.1, "w2": 0.3}
    core = MonitorConfig(window_short_s=3.0, window_long_s=30.0)
    mons = {name: InProcess(nats_server.url, lambda b, n=name: MonitorService(b, MonitorServiceConfig(
        interval_s=0.2, core=core, instance=n, lease_ttl_s=TTL))) for name in ("mon-a", "mon-b")}
    bus = await Bus.connect(nats_server.url, name="test-balance-monitor")
    await bus.ensure_streams()
    published: list[tuple[float, str]] = []

    async def on_stats(msg: Msg) -> None:
        published.append((asyncio.get_running_loop().time(), decode(JobStatistics, msg.data).job))

    sub = await bus.nc.subscribe(subjects.events_of(subjects.MONITOR_SERVICE, kind="statistics"), cb=on_stats)
    stop = asyncio.Event()

    async def agents() -> None:  # every job's workers report, as the agents would
        while not stop.is_set():
            for job in jobs:
                for n, b in bpt.items():
                    await bus.publish_durable(subjects.agent_metrics(job), AgentMetrics(
                        job=job, node=n, role="worker", ts=time.time(), local_step=0, iteration=0, bpt_s=b,
                        batch_size=32, samples_per_s=32 / b, samples_total=0, cpu_percent=50.0,
                        rss_bytes=1 << 20, last_action_seq=0, last_action_iteration=-1, primary=n == "w0",
                        steps=10))
            await asyncio.sleep(0.3)

    feeder = asyncio.create_task(agents())
    started: list[str] = []
    try:
        a = await mons["mon-a"].start()
        started.append("mon-a")
        await eventually(lambda: len(a.own.owned()) == 4, 30, lambda: f"mon-a owns {a.own.owned()}")
        b = await mons["mon-b"].start()
        started.append("mon-b")
        both: list[str] = []

        async def sample() -> None:
            while True:
                both.extend(j for j in jobs if a.own.owns(j) and b.own.owns(j))
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        try:
            await eventually(lambda: len(a.own.owned()) == 2 and len(b.own.owned()) == 2, 60,
                             lambda: f"mon-a owns {a.own.owned()}, mon-b owns {b.own.owned()}")
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        assert both == [], both
        assert a.own.given_up - a.own.taken_back == 2 and b.own.given_up == 0
        moved = b.own.owned()
        # Served after the move: every job's statistics come again (from its owner), mon-b publishes its
        # two, and a request about a moved job is answered with its windows (whichever instance it reaches).
        since = asyncio.get_running_loop().time()
        await eventually(lambda: {j for t, j in published if t > since} == set(jobs), 30,
                         lambda: f"statistics after the move: {sorted({j for t, j in published if t > since})}")
        n = b.counters.values.get("statistics_published", 0)
        await eventually(lambda: b.counters.values.get("statistics_published", 0) >= n + 4, 30,
                         "mon-b publishes nothing")
        for job in moved:
            st = await bus.request(subjects.monitor_stats(job), StatsQuery(job), JobStatistics, timeout=5.0,
                                   retry=NO_RETRY)
            assert st.job == job and {x.node for x in st.nodes} == set(bpt)
        assert a.own.owned() == sorted(set(jobs) - set(moved)) and b.own.owned() == moved
    finally:
        stop.set()
        await feeder
        await sub.unsubscribe()
        for name in reversed(started):
            with contextlib.suppress(Exception):
                await mons[name].stop()
        await bus.close()


async def test_balancing_with_a_service_users_permissions(tmp_path: Path) -> None:
    """The monitor's NATS user (pacer.security) may write its presence, read the leases and delete its
    consumer: two instances connected as that user spread four jobs 2/2."""
    mon = security.permissions("monitor", "monitor").to_conf()
    auth = ("authorization {\n  users = [\n    "
            f"{{user: monitor, password: pw-m, permissions: {json.dumps(mon)}}}\n  ]\n}}\n")
    srv = EmbeddedNats(store_dir=tmp_path / "nats", authorization=auth).start()
    url = srv.url.replace("nats://", "nats://monitor:pw-m@")
    ta = Toy(await Bus.connect(url, name="mon-a"), "a", service="monitor")
    tb = Toy(await Bus.connect(url, name="mon-b"), "b", service="monitor")
    try:
        a = await ta.start()
        for j in JOBS[:4]:
            a.want(j)
        await eventually(lambda: len(a.owned()) == 4, 30, lambda: f"a owns {a.owned()}")
        b = await tb.start()
        for j in JOBS[:4]:
            b.want(j)
        await eventually(lambda: len(a.owned()) == 2 and len(b.owned()) == 2, 60,
                         lambda: f"a owns {a.owned()}, b owns {b.owned()}")
        holders, live = await b.read_service()
        assert live == {"a", "b"} and sorted(holders.values()) == ["a", "a", "b", "b"]
        # No consumer left behind by the balance rounds (each deletes its own; one may be reading now).
        async def no_consumer() -> bool:
            return (await ta.bus.js.stream_info(f"KV_{LEASE_BUCKET}")).state.consumer_count == 0

        await eventually(no_consumer, 10, "a balance round left its consumer behind")
    finally:
        for x in (ta, tb):
            with contextlib.suppress(Exception):
                await x.stop()
            await x.bus.close()
        srv.stop()


# ================================================================ a real service: two shard services
async def test_two_shard_services_spread_their_jobs_and_the_moved_jobs_keep_their_state(
        nats_server: EmbeddedNats, bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """shard-a registers four datasets alone and hands out two shards of each; shard-b starts (it competes
    for every job with a log: a standby); two jobs move to it, their cores rebuilt from the log: each job
    still counts its two shards out, and hands out more, whoever owns it now."""
    monkeypatch.setenv("PACER_BALANCE_EVERY_S", str(PERIOD))

    def cfg(name: str) -> ShardServiceConfig:
        return ShardServiceConfig(instance=name, lease_ttl_s=TTL, reap_interval_s=0.05, progress_interval_s=0.2)

    jobs = [f"sb{i}" for i in range(4)]
    admin = ShardAdmin(bus, retry=PATIENT)

    async def lease(job: str, node: str) -> int:
        req = LeaseRequest(job=job, dataset=DS, node=node, want=2)  # "unavailable" while it moves: retried
        reply = await bus.request(subjects.rpc(subjects.SHARD_SERVICE, job, ShardOp.LEASE), req, LeaseReply,
                                  5.0, retry=PATIENT)
        return len(reply.shards)

    a, b = InProcessService(nats_server.url, cfg("shard-a")), InProcessService(nats_server.url, cfg("shard-b"))
    sa = await a.start()
    started = [a]
    try:
        for j in jobs:
            await admin.register(DatasetSpec(job=j, dataset=DS, records=1000, batch_size=10, batches_per_shard=10))
            assert await lease(j, "n0") == 2
        assert sa.own.owned() == sorted(jobs)
        sb = await b.start()
        started.append(b)
        both: list[str] = []

        async def sample() -> None:
            while True:
                both.extend(j for j in jobs if sa.own.owns(j) and sb.own.owns(j))
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        try:
            await eventually(lambda: len(sa.own.owned()) == 2 and len(sb.own.owned()) == 2, 60,
                             lambda: f"shard-a owns {sa.own.owned()}, shard-b owns {sb.own.owned()}")
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        assert both == [], both
        moved = sb.own.owned()
        assert all(j in sb.jobs for j in moved) and not any(j in sa.jobs for j in moved)
        for j in jobs:
            st = await admin.status(j, DS)
            assert st.doing == 2 and st.todo == 8, (j, st)  # the log carried the hand-out over
            assert await lease(j, "n1") == 2
            st = await admin.status(j, DS)
            assert st.doing == 4 and st.todo == 6, (j, st)
        for j in moved:
            assert sb.jobs[j].core.status(DS).doing == 4  # served by its new owner
    finally:
        for svc in reversed(started):
            with contextlib.suppress(Exception):
                await svc.stop()
