"""Two instances of the shard service sharing jobs by per-job ownership (issue 13), on real nats-servers.

* two in-process instances: one owner per job (the lease's holder, the only
  one holding the job's runtime); requests that reach the other instance are
  forwarded and answered by the owner;
* two real OS processes on the 3-server cluster: the owner of a job is
  killed with SIGKILL while workers' ShardClients train; the other instance
  takes the job over from the log and the run finishes with every shard
  DONE exactly once per epoch (read back from the shard log itself);
* a stale owner (its clock stands still, so it never renews and never
  doubts its lease): after the other instance took the job over, its append
  is refused by the log (fenced), it answers 'unavailable' and drops the job
  instead of rebuilding it;
* a graceful stop of the owner (a rolling update) hands the job over with
  nothing handed out twice; node deaths, from the consumer both instances
  share, are applied once each by the job's owner; forwarding works under
  pacer.security's users (the ``shard`` user's lease and forward rights).
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgpack
import pytest
from conftest import (
    InProcess,
    InProcessService,
    ServiceProcess,
    connect_cluster,
    eventually,
    wait_ready,
)
from pacer import security, subjects
from pacer.bus import Bus
from pacer.codec import encode
from pacer.contracts.common import decode_reply
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetSpec, DatasetStatus, LeaseReply, LeaseRequest
from pacer.embedded import EmbeddedCluster, EmbeddedNats
from pacer.errors import PacerError, Unavailable
from pacer.ownership import FORWARDED_BY, LEASE_BUCKET, ORIGINAL_SUBJECT, forward_subject, lease_key
from pacer.shards.client import ShardAdmin
from pacer.subjects import ShardOp
from pacer_services.shard_service.app import ShardService, ShardServiceConfig
from pacer_services.shard_service.effects import ShardLogStore
from test_shard_failures import (
    DS,
    JOB,
    PATIENT,
    SHARD,
    Worker,
    assert_covered,
    assert_exact_cover,
    cancel_all,
    gather_workers,
    launch,
)

pytestmark = pytest.mark.timeout(120)

TTL = 3.0


def cfg(instance: str) -> ShardServiceConfig:
    return ShardServiceConfig(instance=instance, lease_ttl_s=TTL, reap_interval_s=0.05, progress_interval_s=0.2)


def spec(job: str, records: int, **kw: object) -> DatasetSpec:
    """Whole shards (tail_split off): these tests count shards exactly."""
    return DatasetSpec(job=job, dataset=DS, records=records, batch_size=10, batches_per_shard=10,  # type: ignore[arg-type]
                       tail_split=False, **kw)


async def owner(bus: Bus, job: str) -> str | None:
    try:
        kv = await bus.js.key_value(LEASE_BUCKET)
        entry = await kv.get(lease_key(subjects.SHARD_SERVICE, job))
    except Exception:
        return None
    return entry.value.decode() if entry.value else None


async def log_records(bus: Bus, job: str) -> list[list[object]]:
    """Every record of the job's shard log, in order (read straight from the stream)."""
    last = (await bus.js.get_last_msg(subjects.SHARD_LOG_STREAM, subjects.shard_log(job))).seq
    sub = await bus.js.subscribe(subjects.shard_log(job), ordered_consumer=True)
    out: list[list[object]] = []
    try:
        while True:
            m = await sub.next_msg(timeout=5.0)
            out.extend(msgpack.unpackb(m.data, raw=False, strict_map_key=False))
            if m.metadata.sequence.stream >= (last or 0):
                return out
    finally:
        await sub.unsubscribe()


def done_per_epoch(records: list[list[object]]) -> Counter[tuple[int, object]]:
    """(epoch, shard) -> how many times the log says it was DONE."""
    epoch, done = 0, Counter[tuple[int, object]]()
    for rec in records:
        if rec[0] == "epoch":
            epoch = int(rec[2])  # type: ignore[call-overload]
        elif rec[0] == "done":
            done[(epoch, rec[2])] += 1
    return done


# ---------------------------------------------------------------- 1. one owner per job; forwarding
async def test_one_owner_per_job_and_the_other_instance_forwards(nats_server: EmbeddedNats, bus: Bus) -> None:
    await one_owner_and_forwarding(nats_server.url, nats_server.url, bus)


async def test_forwarding_works_with_the_shard_users_permissions(tmp_path: Path) -> None:
    """The same on a server with pacer.security's users: the services connect as ``shard``, the client
    as ``jobs`` (which may call the shard service): leases, forwarding and the owner's answer are allowed."""
    roles = list(security.ROLES)
    users = {r: (f"pw-{i}", r) for i, r in enumerate(roles)}
    srv = EmbeddedNats(store_dir=tmp_path / "nats", authorization=security.render_authorization(users)).start()
    try:
        shard_url = security.with_credentials(srv.url, "shard", users["shard"][0])
        client = await Bus.connect(security.with_credentials(srv.url, "jobs", users["jobs"][0]))
        try:
            await one_owner_and_forwarding(shard_url, shard_url, client)
        finally:
            await client.close()
    finally:
        srv.stop()


async def one_owner_and_forwarding(url_a: str, url_b: str, bus: Bus) -> None:
    a, b = InProcessService(url_a, cfg("shard-a")), InProcessService(url_b, cfg("shard-b"))
    await a.start()
    await b.start()
    svcs = {"shard-a": a, "shard-b": b}
    try:
        admin = ShardAdmin(bus, retry=PATIENT)
        jobs = [f"ha{i}" for i in range(4)]
        for j in jobs:
            await admin.register(spec(j, 1000))
        for j in jobs:
            holder = await owner(bus, j)
            assert holder in svcs, holder
            other = "shard-b" if holder == "shard-a" else "shard-a"
            own, oth = svcs[holder].svc, svcs[other].svc
            assert own is not None and oth is not None
            assert j in own.jobs and own.own.owns(j)
            assert j not in oth.jobs and not oth.own.owns(j), f"{other} holds {j} too"
        # Every request reaches the instance that does not own the job: the owner stops listening to
        # the queue group (its forward subject stays), so each one is forwarded and answered by it.
        j = jobs[0]
        holder = await owner(bus, j)
        assert holder is not None
        own_svc = svcs[holder].svc
        other_svc = svcs["shard-b" if holder == "shard-a" else "shard-a"].svc
        assert own_svc is not None and other_svc is not None and own_svc._sub is not None
        await own_svc._sub.unsubscribe()
        await own_svc.bus.nc.flush()
        before = other_svc.counters.values["requests_forwarded"]
        granted = 0
        for i in range(5):
            req = LeaseRequest(job=j, dataset=DS, node=f"n{i}", want=2)
            reply = await bus.request(subjects.rpc(subjects.SHARD_SERVICE, j, ShardOp.LEASE), req, LeaseReply, 5.0)
            granted += len(reply.shards)
        st = await admin.status(j, DS)
        assert granted == 10 and st.doing == 10 and st.todo == 0
        assert other_svc.counters.values["requests_forwarded"] - before >= 6  # 5 leases and the status
        assert j not in other_svc.jobs  # it only passed them on
        assert own_svc.jobs[j].core.status(DS).doing == 10
    finally:
        await b.stop()
        await a.stop()


# ---------------------------------------------------------------- 2. the owner killed mid-run
class Proc(ServiceProcess):  # type: ignore[misc]
    """The shard service as a real OS process with a given instance name, on the cluster."""

    def __init__(self, url: str, log_path: Path, instance: str) -> None:
        super().__init__(url, log_path)
        self.instance = instance

    def start(self) -> None:
        env = {**os.environ, "PACER_NATS_URL": self.url, "PACER_LOG_LEVEL": "INFO", "PACER_REPLICAS": "3",
               "PACER_INSTANCE": self.instance, "PACER_LEASE_TTL_S": str(TTL)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pacer_services.shard_service.main"], env=env, stdout=log, stderr=log
            )

    def started(self) -> bool:
        return "shard state rebuilt" in self.log_path.read_text(errors="replace")


@pytest.fixture
async def cbus(nats_cluster: EmbeddedCluster) -> AsyncIterator[Bus]:
    b = await connect_cluster(nats_cluster, "test-shard-ha")
    await b.ensure_streams()
    await b.kv(LEASE_BUCKET)  # at replicas 3, before any service makes it
    yield b
    await b.close()


async def test_a_killed_owner_loses_no_shard_and_none_is_done_twice(
        nats_cluster: EmbeddedCluster, cbus: Bus, tmp_path: Path) -> None:
    records, epochs = 3000, 2
    a = Proc(nats_cluster.url, tmp_path / "shard-a.log", "shard-a")
    b = Proc(nats_cluster.url, tmp_path / "shard-b.log", "shard-b")
    workers: list[Worker] = []
    try:
        a.start()
        await wait_ready(cbus, timeout=30)
        admin = ShardAdmin(cbus, retry=PATIENT)
        await admin.register(spec(JOB, records, epochs=epochs, lease_s=5.0))
        assert await owner(cbus, JOB) == "shard-a"
        b.start()  # competes for the job from its start, as a standby
        await eventually(b.started, 30, "shard-b never started")
        workers = [Worker(cbus, f"w{i}", delay=0.05) for i in range(4)]
        launch(workers)
        await eventually(lambda: sum(len(w.got) for w in workers) >= 12, 20, "12 shards handed out")
        a.kill()
        assert a.proc is not None and a.proc.returncode == -signal.SIGKILL
        handed_at_kill = sum(len(w.got) for w in workers)
        await gather_workers(workers, 90)
        assert await owner(cbus, JOB) == "shard-b"
        st = await admin.status(JOB, DS)
    finally:
        await cancel_all(workers)
        a.kill()
        b.stop()
    total = records * epochs // SHARD
    assert handed_at_kill < total, "the kill came after the run ended"
    got = [s for w in workers for s in w.got]
    assert_covered(got, records, epochs)
    assert st.finished and st.failed == 0 and st.done == total
    assert st.records_done == records * epochs
    # Records handed out twice are only the re-granted ones, and the core counted every one of them.
    assert sum(s.end - s.start for s in got) - records * epochs <= st.records_duplicated
    done = done_per_epoch(await log_records(cbus, JOB))
    assert len(done) == total and set(done.values()) == {1}, "a shard was DONE twice in an epoch, or never"


# ---------------------------------------------------------------- 3. a stale owner is fenced
async def test_a_stale_owner_cannot_append_and_drops_the_job(nats_server: EmbeddedNats, bus: Bus) -> None:
    frozen = 1000.0

    def build_frozen(b: Bus) -> ShardService:
        svc = ShardService(b, ShardLogStore(b.js), cfg("shard-a"))
        svc.own.clock = lambda: frozen  # its time stands still: it never renews, and never doubts its lease
        return svc

    a: InProcess[ShardService] = InProcess(nats_server.url, build_frozen)
    b = InProcessService(nats_server.url, cfg("shard-b"))
    sa = await a.start()
    try:
        admin = ShardAdmin(bus, retry=PATIENT)
        await admin.register(spec(JOB, 1000))
        assert await owner(bus, JOB) == "shard-a"
        first = await bus.request(subjects.rpc(subjects.SHARD_SERVICE, JOB, ShardOp.LEASE),
                                  LeaseRequest(job=JOB, dataset=DS, node="n1", want=1), LeaseReply, 5.0)
        assert len(first.shards) == 1
        sb = await b.start()
        await eventually(lambda: sb.own.owns(JOB), 6 * TTL, "b never took over the lease a stopped renewing")
        assert sa.own.owns(JOB) and JOB in sa.jobs  # a still believes it owns the job ...
        before = await admin.status(JOB, DS)
        # ... and is asked directly (as if the other instance forwarded to it): a grant it cannot append.
        lease_subject = subjects.rpc(subjects.SHARD_SERVICE, JOB, ShardOp.LEASE)
        raw = await bus.nc.request(
            forward_subject(subjects.SHARD_SERVICE, "shard-a"),
            encode(LeaseRequest(job=JOB, dataset=DS, node="n2", want=3)),
            timeout=10.0, headers={ORIGINAL_SUBJECT: lease_subject, FORWARDED_BY: "test"})
        with pytest.raises(PacerError) as ei:
            decode_reply(LeaseReply, raw.data)
        assert isinstance(ei.value, Unavailable) and ei.value.temporary, ei.value
        assert sa.counters.values["jobs_given_up"] == 1 and sa.counters.values.get("rebuilds", 0) == 0
        assert JOB not in sa.jobs and not sa.own.owns(JOB)  # dropped, not rebuilt
        after = await admin.status(JOB, DS)
        assert after == before  # nothing of the stale grant reached the log
        assert sb.jobs[JOB].core.status(DS) == after
        # Clients keep being served, whichever instance they reach.
        for i in range(4):
            r = await bus.request(lease_subject, LeaseRequest(job=JOB, dataset=DS, node=f"m{i}", want=1),
                                  LeaseReply, 5.0)
            assert len(r.shards) == 1
        final = await admin.status(JOB, DS)
        assert final.doing == before.doing + 4
        assert isinstance(await admin.status(JOB, DS), DatasetStatus)
    finally:
        await b.stop()
        await a.stop()
        await asyncio.sleep(0)


# ---------------------------------------------------------------- 4. a graceful stop (a rolling update)
async def test_a_graceful_stop_of_the_owner_hands_the_job_over_without_re_serving(
        nats_server: EmbeddedNats, bus: Bus) -> None:
    records, epochs = 2000, 2
    svcs = {"shard-a": InProcessService(nats_server.url, cfg("shard-a")),
            "shard-b": InProcessService(nats_server.url, cfg("shard-b"))}
    for s in svcs.values():
        await s.start()
    workers: list[Worker] = []
    stopped: list[str] = []
    try:
        admin = ShardAdmin(bus, retry=PATIENT)
        await admin.register(spec(JOB, records, epochs=epochs))
        first = await owner(bus, JOB)
        assert first in svcs
        workers = [Worker(bus, f"w{i}", delay=0.03) for i in range(3)]
        launch(workers)
        await eventually(lambda: sum(len(w.got) for w in workers) >= 10, 20, "10 shards handed out")
        await svcs[first].stop()  # drains its commits, then releases the job's lease
        stopped.append(first)
        handed_at_stop = sum(len(w.got) for w in workers)
        await gather_workers(workers, 60)
        second = await owner(bus, JOB)
        assert second in svcs and second != first
        st = await admin.status(JOB, DS)
        log = await log_records(bus, JOB)
    finally:
        await cancel_all(workers)
        for name, s in svcs.items():
            if name not in stopped:
                await s.stop()
    total = records * epochs // SHARD
    assert handed_at_stop < total, "the stop came after the run ended"
    got = [s for w in workers for s in w.got]
    # Nothing was lost in the hand-over, so nothing was handed out twice.
    assert_exact_cover(got, records, epochs)
    assert st.finished and st.done == total and st.records_done == records * epochs and st.records_duplicated == 0
    done = done_per_epoch(log)
    assert len(done) == total and set(done.values()) == {1}


# ---------------------------------------------------------------- 5. node deaths reach the owner
async def test_a_node_death_is_applied_by_the_owner_whichever_instance_receives_it(
        nats_server: EmbeddedNats, bus: Bus) -> None:
    svcs = {"shard-a": InProcessService(nats_server.url, cfg("shard-a")),
            "shard-b": InProcessService(nats_server.url, cfg("shard-b"))}
    for s in svcs.values():
        await s.start()
    try:
        admin = ShardAdmin(bus, retry=PATIENT)
        jobs = [f"nd{i}" for i in range(4)]  # likely owned by both instances between them
        for j in jobs:
            await admin.register(spec(j, 1000, lease_s=600.0))
            r = await bus.request(subjects.rpc(subjects.SHARD_SERVICE, j, ShardOp.LEASE),
                                  LeaseRequest(job=j, dataset=DS, node="victim", want=3), LeaseReply, 5.0)
            assert len(r.shards) == 3
        for j in jobs:  # one event per job, each to whichever instance the shared consumer picks
            await bus.publish_durable(subjects.event("node", j, subjects.NodeEventKind.DIED),
                                      NodeEvent(j, "victim", subjects.NodeEventKind.DIED, time.time(), "killed"))
        for j in jobs:
            try:
                st = await poll(functools.partial(admin.status, j, DS), lambda s: s.doing == 0, 20,
                                f"{j}'s shards back")
            except AssertionError as exc:  # what the consumer and each instance saw, for the report
                info = await bus.js.consumer_info(subjects.EVENTS_STREAM, cfg("x").node_events_durable)
                seen = {n: {k: v for k, v in s.svc.counters.values.items() if "node" in k}
                        for n, s in svcs.items() if s.svc is not None}
                owners = {n: sorted(s.svc.jobs) for n, s in svcs.items() if s.svc is not None}
                raise AssertionError(f"{exc}; consumer: delivered {info.delivered}, ack pending "
                                     f"{info.num_ack_pending}, pending {info.num_pending}, redelivered "
                                     f"{info.num_redelivered}; counters {seen}; jobs {owners}") from None
            assert st.todo == 10 and st.done == 0
        applied = {n: s.svc.counters.values["node_deaths"] for n, s in svcs.items() if s.svc is not None}
        owned = {n: sum(1 for j in jobs if s.svc is not None and j in s.svc.jobs) for n, s in svcs.items()}
        assert applied == owned, (applied, owned)  # each death applied once, by the job's owner
    finally:
        for s in svcs.values():
            await s.stop()


async def poll(get: Callable[[], Awaitable[DatasetStatus]], ok: Callable[[DatasetStatus], bool],
               within: float, what: str) -> DatasetStatus:
    deadline = time.monotonic() + within
    while True:
        st = await get()
        if ok(st) or time.monotonic() > deadline:
            assert ok(st), f"timed out waiting for {what}: {st}"
            return st
        await asyncio.sleep(0.05)
