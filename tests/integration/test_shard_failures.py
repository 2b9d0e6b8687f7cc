"""Failure tests of the shard service over a real nats-server (nothing faked).

kill -9 of the service process and of nats-server mid-run, a worker dying
while holding shards, FAILED parking after repeated holder deaths,
checkpoint/restore across a restart, straggler splits, streaming datasets,
and snapshots bounding replay.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from conftest import InProcessService, ServiceProcess, wait_ready
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import Bus, RetryPolicy
from pacer.codec import decode
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import (
    DatasetMode,
    DatasetSpec,
    DatasetStatus,
    LeaseReply,
    LeaseRequest,
    ShardEvent,
    ShardLease,
)
from pacer.embedded import EmbeddedNats
from pacer.shards.client import ShardAdmin, ShardClient
from pacer_services.shard_service.app import ShardServiceConfig

JOB = "jobf"
DS = "train"
SHARD = 100  # records per shard: batch_size 10 x batches_per_shard 10

pytestmark = pytest.mark.timeout(40)

# Admin calls that must ride out a restart of the service or of nats-server.
PATIENT = RetryPolicy(attempts=40, first_delay=0.05, max_delay=0.5)


def spec(records: int, **kw: Any) -> DatasetSpec:
    # Whole shards (tail_split off): these tests count shards and replay their order exactly.
    base: dict[str, Any] = dict(job=JOB, dataset=DS, records=records, batch_size=10, batches_per_shard=10,
                                tail_split=False)
    base.update(kw)
    return DatasetSpec(**base)


# ---------------------------------------------------------------- helpers
class Worker:
    """A ShardClient consuming in a loop; optionally slow and pausable at a gate."""

    def __init__(self, bus: Bus, node: str, delay: float = 0.0, gate: asyncio.Event | None = None, **kw: Any) -> None:
        self.node = node
        self.client = ShardClient(bus, JOB, DS, node, **kw)
        self.delay, self.gate = delay, gate
        self.got: list[ShardLease] = []  # every lease handed out, in order
        self.at_gate = asyncio.Event()
        self.finished = False

    async def run(self) -> None:
        c = self.client
        await c.start()
        while (s := await c.next()) is not None:
            self.got.append(s)
            if self.delay:
                await asyncio.sleep(self.delay)
            c.done(s)
            if self.gate is not None and not self.gate.is_set():
                self.at_gate.set()
                await self.gate.wait()
                self.at_gate.clear()
        await c.close()
        self.finished = True


async def wait_until(pred: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.02)


async def poll_status(
    admin: ShardAdmin, pred: Callable[[DatasetStatus], bool], within: float, what: str
) -> DatasetStatus:
    deadline = time.monotonic() + within
    while True:
        st = await admin.status(JOB, DS)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}; last status {st}")
        await asyncio.sleep(0.03)


async def settled_status(admin: ShardAdmin, quiet: float = 0.25, within: float = 5.0) -> DatasetStatus:
    """The status once it stopped changing for ``quiet`` seconds (no request in flight)."""
    deadline = time.monotonic() + within
    prev = await admin.status(JOB, DS)
    while True:
        await asyncio.sleep(quiet)
        cur = await admin.status(JOB, DS)
        if cur == prev:
            return cur
        if time.monotonic() > deadline:
            raise AssertionError("status never settled")
        prev = cur


async def pause(workers: list[Worker], gate: asyncio.Event, admin: ShardAdmin) -> DatasetStatus:
    gate.clear()
    await wait_until(lambda: all(w.at_gate.is_set() for w in workers), 10, "every worker at the gate")
    assert not any(w.finished for w in workers), "dataset too small: a worker finished before the pause"
    return await settled_status(admin)


def ranges(leases: Iterable[ShardLease], epoch: int) -> list[tuple[int, int]]:
    return sorted((s.start, s.end) for s in leases if s.epoch == epoch)


def assert_exact_cover(leases: list[ShardLease], records: int, epochs: int = 1) -> None:
    for epoch in range(epochs):
        pos = 0
        for a, b in ranges(leases, epoch):
            assert a == pos, f"epoch {epoch}: gap or overlap at {pos} (next range starts at {a})"
            pos = b
        assert pos == records, f"epoch {epoch}: covered up to {pos} of {records}"


def assert_covered(leases: list[ShardLease], records: int, epochs: int = 1) -> None:
    """At-least-once: every record of every epoch is in some lease (overlaps allowed)."""
    for epoch in range(epochs):
        reach = 0
        for a, b in ranges(leases, epoch):
            assert a <= reach, f"epoch {epoch}: records [{reach}, {a}) were never handed out"
            reach = max(reach, b)
        assert reach == records, f"epoch {epoch}: covered up to {reach} of {records}"


async def raw_lease(bus: Bus, node: str, want: int = 0, **kw: Any) -> LeaseReply:
    req = LeaseRequest(job=JOB, dataset=DS, node=node, want=want, **kw)
    return await bus.request(subjects.rpc(subjects.SHARD_SERVICE, JOB, subjects.ShardOp.LEASE), req, LeaseReply, 5.0)


async def gather_workers(workers: list[Worker], within: float) -> None:
    await asyncio.wait_for(asyncio.gather(*(w.run_task for w in workers)), within)  # type: ignore[attr-defined]


def launch(workers: list[Worker]) -> None:
    for w in workers:
        w.run_task = asyncio.create_task(w.run(), name=f"test-worker-{w.node}")  # type: ignore[attr-defined]


async def cancel_all(workers: list[Worker]) -> None:
    for w in workers:
        t = getattr(w, "run_task", None)
        if t is not None and not t.done():
            t.cancel()
        for bg in (w.client._hb, w.client._bg):
            if bg is not None and not bg.done():
                bg.cancel()
    await asyncio.sleep(0)


def expected_after_restore(at_ckpt: DatasetStatus) -> DatasetStatus:
    """What a checkpoint taken at ``at_ckpt`` restores to: DOING shards are TODO again."""
    return dataclasses.replace(
        at_ckpt,
        todo=at_ckpt.todo + at_ckpt.doing,
        doing=0,
        nodes=[dataclasses.replace(n, doing=0) for n in at_ckpt.nodes if n.records or n.shards_done],
    )


# ---------------------------------------------------------------- 1. kill -9 of the service process
async def test_service_kill9_mid_run_loses_no_shard(bus: Bus, service_process: ServiceProcess) -> None:
    records, epochs = 4000, 2
    service_process.start()
    await wait_ready(bus)
    admin = ShardAdmin(bus, retry=PATIENT)
    await admin.register(spec(records, epochs=epochs))
    workers = [Worker(bus, f"w{i}", delay=0.06) for i in range(4)]
    launch(workers)
    try:
        # Kill once consumption is well under way, but far from finished.
        await wait_until(lambda: sum(len(w.got) for w in workers) >= 16, 10, "16 shards handed out")
        service_process.kill()
        assert service_process.proc is not None and service_process.proc.returncode == -signal.SIGKILL
        handed_at_kill = sum(len(w.got) for w in workers)
        await asyncio.sleep(0.3)
        service_process.start()
        await wait_ready(bus)
        await gather_workers(workers, 25)
    finally:
        await cancel_all(workers)
    assert handed_at_kill < records * epochs // SHARD, "the kill came after the run ended"
    got = [s for w in workers for s in w.got]
    assert_covered(got, records, epochs)
    st = await admin.status(JOB, DS)
    assert st.finished and st.failed == 0 and st.failed_shards == []
    assert st.todo == 0 and st.doing == 0 and st.done == records * epochs // SHARD
    assert st.records_done == records * epochs
    assert all(w.client.finished for w in workers)


async def test_service_kill9_with_paused_holders_rebuilds_identical_state(
    bus: Bus, service_process: ServiceProcess
) -> None:
    records = 3000
    service_process.start()
    await wait_ready(bus)
    admin = ShardAdmin(bus, retry=PATIENT)
    await admin.register(spec(records, lease_s=60.0))
    gate = asyncio.Event()
    gate.set()
    workers = [Worker(bus, f"p{i}", delay=0.03, gate=gate) for i in range(3)]
    launch(workers)
    try:
        await wait_until(lambda: sum(len(w.got) for w in workers) >= 6, 10, "6 shards handed out")
        before = await pause(workers, gate, admin)
        assert before.doing > 0 and before.done > 0 and not before.finished
        service_process.kill()
        service_process.start()
        await wait_ready(bus)
        after = await admin.status(JOB, DS)
        assert after == before  # the in-memory state rebuilt from the log alone
        gate.set()
        await gather_workers(workers, 20)
    finally:
        await cancel_all(workers)
    # The holders stayed alive: nothing was handed out twice.
    assert_exact_cover([s for w in workers for s in w.got], records)
    st = await admin.status(JOB, DS)
    assert st.finished and st.records_done == records and st.records_duplicated == 0 and st.failed == 0
    assert sum(w.client.rejected for w in workers) == 0


# ---------------------------------------------------------------- 2. kill -9 of nats-server
async def test_nats_kill9_mid_run_and_while_paused(
    bus: Bus, nats_server: EmbeddedNats, shard_service: InProcessService
) -> None:
    records = 4000
    admin = ShardAdmin(bus, retry=PATIENT)
    await admin.register(spec(records, lease_s=60.0))
    gate = asyncio.Event()
    gate.set()
    workers = [Worker(bus, f"n{i}", delay=0.03, gate=gate) for i in range(3)]
    launch(workers)
    port = nats_server.port
    try:
        # (a) while consuming
        await wait_until(lambda: sum(len(w.got) for w in workers) >= 6, 10, "6 shards handed out")
        nats_server.kill()
        await asyncio.sleep(0.4)
        nats_server.restart()
        assert nats_server.port == port
        await wait_until(lambda: sum(len(w.got) for w in workers) >= 14, 15, "progress after the first restart")
        # (b) while every client is paused: the durable state is what the service serves after
        before = await pause(workers, gate, admin)
        assert before.doing > 0 and not before.finished
        nats_server.kill()
        await asyncio.sleep(0.3)
        nats_server.restart()
        after = await admin.status(JOB, DS)
        assert after == before
        gate.set()
        await gather_workers(workers, 20)
    finally:
        await cancel_all(workers)
    assert_covered([s for w in workers for s in w.got], records)
    st = await admin.status(JOB, DS)
    assert st.finished and st.failed == 0 and st.done == records // SHARD and st.records_done == records


# ---------------------------------------------------------------- 3. a worker dies holding shards
async def test_dead_holder_shards_return_after_lease(
    bus: Bus, nats_server: EmbeddedNats, shard_service: InProcessService
) -> None:
    records, lease = 2000, 1.0
    admin = ShardAdmin(bus)
    await admin.register(spec(records, lease_s=lease))
    doomed_bus = await Bus.connect(nats_server.url, name="doomed")
    doomed = ShardClient(doomed_bus, JOB, DS, "doomed", prefetch=4)
    await doomed.start()
    done_order: list[ShardLease] = []
    try:
        for _ in range(3):
            s = await doomed.next()
            assert s is not None
            doomed.done(s)
            done_order.append(s)
        await asyncio.sleep(0.1)  # let its background report-and-get land
        alive = await admin.status(JOB, DS)
        assert alive.doing > 0
        # The node dies: its connection goes away, it never closes the client.
        await doomed_bus.nc.close()
        t0 = time.monotonic()
        st = await poll_status(admin, lambda st: st.doing == 0, lease + 3.0, "the dead node's shards to return")
        returned_in = time.monotonic() - t0
    finally:
        for t in (doomed._hb, doomed._bg):
            if t is not None:
                t.cancel()
    assert returned_in < lease + 2.0
    assert st.done == alive.done and st.todo == alive.todo + alive.doing and st.failed == 0
    reported = done_order[: st.done]  # reports travel in order
    survivor = Worker(bus, "survivor")
    await asyncio.wait_for(survivor.run(), 15)
    assert_exact_cover(survivor.got + reported, records)
    final = await admin.status(JOB, DS)
    assert final.finished and final.records_done == records and final.failed == 0
    # Only what the dead node held was handed out twice.
    assert final.records_duplicated == alive.doing * SHARD


async def test_live_holder_of_a_long_shard_keeps_a_short_lease(bus: Bus, shard_service: InProcessService) -> None:
    """The heartbeat, not the worker's requests, must keep a 1 s lease alive."""
    records = 1000
    admin = ShardAdmin(bus)
    await admin.register(spec(records, lease_s=1.0))
    slow = ShardClient(bus, JOB, DS, "slow", prefetch=1)
    await slow.start()
    try:
        s = await slow.next()
        assert s is not None
        await asyncio.sleep(2.5)  # reading one long shard: no report-and-get in between
        st = await admin.status(JOB, DS)
        assert st.doing == 1 and st.records_duplicated == 0, "a live holder lost its lease"
        slow.done(s)
    finally:
        await slow.close()
    assert slow.rejected == 0
    rest = Worker(bus, "rest")
    await asyncio.wait_for(rest.run(), 10)
    assert_exact_cover([*rest.got, s], records)
    final = await admin.status(JOB, DS)
    assert final.finished and final.records_duplicated == 0


# ---------------------------------------------------------------- 4. FAILED parking
async def test_shard_whose_holders_die_five_times_is_parked_until_retried(
    bus: Bus, shard_service: InProcessService
) -> None:
    records = 1000
    admin = ShardAdmin(bus)
    await admin.register(spec(records, lease_s=60.0, max_failures=5))
    events: list[ShardEvent] = []

    async def on_event(m: Msg) -> None:
        events.append(decode(ShardEvent, m.data))

    sub = await bus.nc.subscribe(subjects.event("shard", JOB, "*"), cb=on_event)
    await bus.nc.flush()
    victim = -1
    for i in range(5):
        node = f"mortal{i}"
        reply = await raw_lease(bus, node, want=1)
        assert len(reply.shards) == 1
        lease = reply.shards[0]
        if i == 0:
            victim = lease.shard
        assert lease.shard == victim, "a requeued shard must be served first"
        assert lease.attempt == i
        await bus.publish_durable(subjects.event("node", JOB, "died"), NodeEvent(JOB, node, "died", time.time(), "killed"))
        st = await poll_status(admin, lambda st: st.doing == 0, 5, f"death {i} to be processed")
    assert st.failed == 1 and st.failed_shards == [victim] and st.todo == records // SHARD - 1
    await wait_until(lambda: any(e.kind == "parked" for e in events), 3, "the parked event")
    mine = [e for e in events if e.shard == victim and e.kind in ("requeued", "parked")]
    assert [e.kind for e in mine] == ["requeued"] * 4 + ["parked"]
    parked = mine[-1]
    assert parked.node == "mortal4" and parked.dataset == DS and parked.job == JOB and "5 failures" in parked.detail

    healthy = Worker(bus, "healthy", poll_s=0.05)
    task = asyncio.create_task(healthy.run())
    try:
        st = await poll_status(
            admin, lambda st: st.done == records // SHARD - 1, 10, "everything but the parked shard to be done"
        )
        assert not st.finished and st.failed == 1 and st.todo == 0 and st.doing == 0
        probe = await raw_lease(bus, "probe", want=1)
        assert not probe.finished and probe.exhausted and probe.shards == []
        await asyncio.sleep(0.2)
        assert not task.done() and not healthy.client.finished
        retried = await admin.retry_failed(JOB, DS)
        assert retried.failed == 0 and retried.failed_shards == []
        await asyncio.wait_for(task, 10)
    finally:
        await sub.unsubscribe()
        await cancel_all([healthy])
    assert healthy.got[-1].shard == victim
    assert_exact_cover(healthy.got, records)
    final = await admin.status(JOB, DS)
    assert final.finished and final.failed == 0 and final.records_done == records


# ---------------------------------------------------------------- 5. checkpoint / restore across a restart
async def test_checkpoint_restore_survives_restart(bus: Bus, nats_server: EmbeddedNats) -> None:
    records = 3000
    cfg = ShardServiceConfig(reap_interval_s=0.05, progress_interval_s=0.2)
    svc = InProcessService(nats_server.url, cfg)
    await svc.start()
    admin = ShardAdmin(bus, retry=PATIENT)
    try:
        await admin.register(spec(records, lease_s=60.0))
        a = ShardClient(bus, JOB, DS, "a", prefetch=4)
        await a.start()
        done_order: list[ShardLease] = []

        async def consume(n: int) -> None:
            for _ in range(n):
                s = await a.next()
                assert s is not None
                a.done(s)
                done_order.append(s)

        await consume(6)
        at_ckpt = await settled_status(admin)
        assert at_ckpt.doing > 0 and at_ckpt.done > 0
        ck = await admin.checkpoint(JOB, DS, "c1")
        assert ck.records_done == at_ckpt.records_done and ck.shards == records // SHARD
        done_at_ckpt = done_order[: at_ckpt.done]

        await consume(6)
        await a.close()
        moved_on = await admin.status(JOB, DS)
        assert moved_on.done > at_ckpt.done

        restored = await admin.restore(JOB, DS, "c1")
        assert restored == expected_after_restore(at_ckpt)
        assert restored != moved_on

        # Restart: the log now holds a restore record that replay resolves via the object store.
        await svc.stop()
        svc = InProcessService(nats_server.url, cfg)
        started = await svc.start()
        assert started.counters.values["records_replayed"] > 0
        assert await admin.status(JOB, DS) == restored

        w = Worker(bus, "b")
        await asyncio.wait_for(w.run(), 15)
        assert_exact_cover(w.got + done_at_ckpt, records)
        final = await admin.status(JOB, DS)
        assert final.finished and final.records_done == records and final.failed == 0
    finally:
        await svc.stop()


# ---------------------------------------------------------------- 6. straggler splits
async def test_max_records_splits_every_lease(bus: Bus, shard_service: InProcessService) -> None:
    records = 2000
    admin = ShardAdmin(bus)
    await admin.register(spec(records, epochs=2))
    workers = [Worker(bus, f"s{i}", max_records=30) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 15)
    got = [s for w in workers for s in w.got]
    assert got and all(0 < s.end - s.start <= 30 for s in got)
    assert_exact_cover(got, records, epochs=2)
    st = await admin.status(JOB, DS)
    # 100 = 30 + 30 + 30 + 10: four leases per original shard.
    assert st.finished and st.done == len(got) == 4 * 2 * records // SHARD
    assert st.records_done == 2 * records and st.records_duplicated == 0


# ---------------------------------------------------------------- 7. streaming datasets
async def test_streaming_dataset_consumed_as_it_grows(bus: Bus, shard_service: InProcessService) -> None:
    admin = ShardAdmin(bus)
    st = await admin.register(spec(0, mode=DatasetMode.STREAMING, shuffle=False))
    assert st.todo == 0 and not st.closed and not st.finished
    w = Worker(bus, "streamer", poll_s=0.05)
    task = asyncio.create_task(w.run())
    try:
        await asyncio.sleep(0.2)
        assert not task.done() and w.got == []  # polling an empty, open stream
        for i in range(3):
            await admin.append(JOB, DS, 1000)
            await wait_until(lambda i=i: len(w.got) == 10 * (i + 1), 5, f"append {i} consumed")
            assert not task.done()
        closed = await admin.append(JOB, DS, 0, close=True)
        assert closed.closed
        await asyncio.wait_for(task, 10)
    finally:
        await cancel_all([w])
    assert_exact_cover(w.got, 3000)
    final = await admin.status(JOB, DS)
    assert final.finished and final.records_total == 3000 and final.records_done == 3000


# ---------------------------------------------------------------- 8. snapshots bound replay
async def test_snapshots_bound_replay(bus: Bus, nats_server: EmbeddedNats) -> None:
    records = 30_000
    cfg = ShardServiceConfig(snapshot_every=200, reap_interval_s=0.05, progress_interval_s=0.2)
    svc = InProcessService(nats_server.url, cfg)
    first = await svc.start()
    admin = ShardAdmin(bus, retry=PATIENT)
    try:
        await admin.register(spec(records))
        workers = [Worker(bus, f"z{i}") for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 20)
        assert_exact_cover([s for w in workers for s in w.got], records)
        before = await admin.status(JOB, DS)
        assert before.finished
        await wait_until(lambda: first.counters.values["snapshots"] > 0, 5, "a snapshot")
        appended = first.counters.values["records_appended"]
        assert appended >= 2 * records // SHARD  # a grant and a done per shard
        await svc.stop()
        svc = InProcessService(nats_server.url, cfg)
        second = await svc.start()
        assert await admin.status(JOB, DS) == before
        replayed = second.counters.values["records_replayed"]
        # The newest stored snapshot covers at least snapshot_every records.
        assert replayed < appended and replayed <= appended - cfg.snapshot_every
    finally:
        await svc.stop()


# ---------------------------------------------------------------- graceful stop
async def test_graceful_stop_after_some_uptime_is_prompt(bus: Bus, nats_server: EmbeddedNats) -> None:
    """A SIGTERM-like stop must not hang on the node-events pull subscription."""
    svc = InProcessService(nats_server.url, ShardServiceConfig())
    await svc.start()
    try:
        admin = ShardAdmin(bus)
        await admin.register(spec(1000))
        await asyncio.sleep(3.0)  # a few node-event fetch cycles
    finally:
        t0 = time.monotonic()
        await svc.stop()
        took = time.monotonic() - t0
    assert took < 2.0, f"graceful stop took {took:.1f}s"
