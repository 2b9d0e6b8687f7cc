"""Two instances of the pod-executor (issue 13) over a real nats-server and the real local backend.

Both instances run in-process (the real runtime) on one pod root, as two
executors of one machine would: each watches every pod, only the owner of a
job (lease ``executor.<job>`` in ``pacer-leases``) acts for it.  The pods
run a small stand-in program that waits for the test to write its exit code
into a control file (no TensorFlow).  What the executor did is read back
from the durable node events (``Bus.replay``) and the pod directories.

The killed owner is an OS process of its own (:func:`serve`), ended with
SIGKILL: no lease is released, no work drained; its pods (supervisor
processes in their own sessions) keep running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import InProcess, connect_cluster, eventually, until_ok, wait_ready
from nats.aio.msg import Msg
from pacer import security, subjects
from pacer.bus import Bus
from pacer.codec import decode, encode
from pacer.contracts.common import decode_reply
from pacer.contracts.executor import (
    CommandKind,
    CommandResult,
    ExecutorCommand,
    ExecutorEvent,
    ExecutorStatus,
    JobQuery,
    PodSpec,
)
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.contracts.nodes import NodeEvent
from pacer.embedded import EmbeddedCluster, EmbeddedNats
from pacer.jobs.spec import parse_job_spec
from pacer.ownership import LEASE_BUCKET, lease_key
from pacer.runtime import RuntimeConfig, run_service
from pacer_services.pod_executor import launch
from pacer_services.pod_executor.app import ExecutorConfig, ExecutorService
from pacer_services.pod_executor.backends.local import LocalBackend
from pacer_services.pod_executor.core import ExecutorPolicy

pytestmark = pytest.mark.timeout(120)

JOB = "exha"
TTL = 3.0
# Waits for its control file, then exits with the code written there.
STANDIN = (
    "import os, sys, time\n"
    "p = sys.argv[1]\n"
    "while not os.path.exists(p): time.sleep(0.05)\n"
    "sys.exit(int(open(p).read().strip() or 0))\n"
)


class Two:
    """Executor instances named ``exec-a``, ``exec-b`` on one pod root and one bus."""

    def __init__(self, url: str, root: Path, ctrl: Path) -> None:
        self.url, self.root, self.ctrl = url, root, ctrl
        self.procs: dict[str, InProcess[ExecutorService]] = {}
        self.svcs: dict[str, ExecutorService] = {}
        self.children: list[subprocess.Popen[bytes]] = []
        self.bus: Bus | None = None  # the test's client (set by the fixture)

    def cfg(self, name: str) -> ExecutorConfig:
        return ExecutorConfig(root=self.root, reconcile_s=0.1, cluster_every_s=0.5, delete_grace_s=2.0,
                              durable="executor-ha-test", policy=ExecutorPolicy(relaunch_budget=3),
                              instance=name, lease_ttl_s=TTL, claim_at_start_s=0.5, max_worker_slots=4)

    def build_pod(self, rec: JobRecord, plan: ResourcePlan, cluster: Any, role: str, index: int, generation: int,
                  cpu: float, memory_mb: int, port: int, cfg: launch.LaunchConfig,
                  restore: bool = False) -> PodSpec:
        node = f"{role}-{index}"
        name = launch.pod_name(rec.job, node, generation)
        return PodSpec(name=name, job=rec.job, node=node, role=role, index=index, generation=generation, cpu=cpu,
                       memory_mb=memory_mb, command=["python", "-c", STANDIN, str(self.ctrl / name)])

    async def start(self, name: str, tweak: Callable[[ExecutorService], None] | None = None) -> ExecutorService:
        def build(b: Bus) -> ExecutorService:
            svc = ExecutorService(b, LocalBackend(self.root, poll_s=0.05), self.cfg(name),
                                  pod_builder=self.build_pod)
            if tweak is not None:
                tweak(svc)
            return svc

        self.procs[name] = InProcess(self.url, build)
        self.svcs[name] = await self.procs[name].start()
        return self.svcs[name]

    def spawn(self, name: str, log_path: Path) -> subprocess.Popen[bytes]:
        """An instance as an OS process of its own (:func:`serve`), to be killed with SIGKILL."""
        here = Path(__file__).parent
        code = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import test_executor_ha as t; "
                f"t.serve({self.url!r}, {str(self.root)!r}, {str(self.ctrl)!r}, {name!r})")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=out,
                                    env={**os.environ, "PACER_LOG_LEVEL": "INFO"})
        self.children.append(proc)
        return proc

    async def stop_all(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                await proc.stop()
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
                child.wait()

    def exit(self, node: str, generation: int, code: int) -> None:
        (self.ctrl / launch.pod_name(JOB, node, generation)).write_text(str(code))

    def pods_on_disk(self) -> list[str]:
        return sorted(d.name for d in self.root.glob("*/*") if d.is_dir())


def serve(url: str, root: str, ctrl: str, name: str) -> None:
    """Run one executor instance until SIGTERM (the body of :meth:`Two.spawn`'s process)."""
    two = Two(url, Path(root), Path(ctrl))

    async def factory(b: Bus, rc: RuntimeConfig) -> ExecutorService:
        return ExecutorService(b, LocalBackend(two.root, poll_s=0.05), two.cfg(name), pod_builder=two.build_pod)

    asyncio.run(run_service(factory, RuntimeConfig(nats_url=url, instance=name)))


@pytest.fixture
async def cluster_bus(nats_cluster: EmbeddedCluster, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Bus]:
    """The test's client of the 3-server cluster; the instances it starts make buckets at replicas 3."""
    monkeypatch.setenv("PACER_REPLICAS", "3")
    b = await connect_cluster(nats_cluster, "test-exec-ha")
    await b.ensure_streams()
    yield b
    await b.close()


@contextlib.asynccontextmanager
async def harness(url: str, bus: Bus, tmp_path: Path) -> AsyncIterator[Two]:
    ctrl = tmp_path / "ctrl"
    ctrl.mkdir()
    spec = parse_job_spec(f"name: {JOB}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    rec = JobRecord(JOB, spec, JobState.PLANNING, time.time(), data_path="/data/train.rec", records=1000)
    jobs = await bus.kv(subjects.JOB_BUCKET)
    await until_ok(lambda: jobs.put(JOB, encode(rec)))  # a fresh bucket's subjects reach every server soon after
    await bus.kv(LEASE_BUCKET)
    two = Two(url, tmp_path / "pods", ctrl)
    two.bus = bus
    try:
        yield two
    finally:
        await two.stop_all()
        for d in (tmp_path / "pods").glob("*/*"):  # let every stand-in still running end
            (ctrl / d.name).write_text("0")


@pytest.fixture
async def env(nats_server: EmbeddedNats, bus: Bus, tmp_path: Path) -> AsyncIterator[Two]:
    """Two instances' harness on one nats-server."""
    async with harness(nats_server.url, bus, tmp_path) as two:
        yield two


@pytest.fixture
async def cluster_env(nats_cluster: EmbeddedCluster, cluster_bus: Bus, tmp_path: Path) -> AsyncIterator[Two]:
    """The same on the 3-server cluster."""
    async with harness(nats_cluster.url, cluster_bus, tmp_path) as two:
        yield two


def client(two: Two) -> Bus:
    assert two.bus is not None
    return two.bus


def plan(workers: int = 2, ps: int = 1) -> ResourcePlan:
    return ResourcePlan(JOB, workers, ps, 0.5, 256, 0.5, 256, PlanSource.USER)


async def owner(bus: Bus) -> str | None:
    kv = await bus.kv(LEASE_BUCKET)
    try:
        entry = await kv.get(lease_key(subjects.EXECUTOR_SERVICE, JOB))
    except Exception:
        return None
    return entry.value.decode() if entry.value else None


async def node_events(bus: Bus, kind: str) -> list[NodeEvent]:
    return [decode(NodeEvent, m.data) for m in await bus.replay(subjects.node_event(JOB, kind))]


async def executor_events(bus: Bus, kind: str) -> list[ExecutorEvent]:
    return [decode(ExecutorEvent, m.data) for m in await bus.replay(subjects.executor_event(JOB, kind))]


async def per_generation(bus: Bus, kind: str) -> Counter[tuple[str, int]]:
    return Counter((e.node, e.generation) for e in await node_events(bus, kind))


def running(bus: Bus, node: str, generation: int) -> Callable[[], Any]:
    async def check() -> bool:
        return (node, generation) in await per_generation(bus, "running")
    return check


async def ask(bus: Bus, svc: ExecutorService, op: str, body: Any, cls: type[Any]) -> Any:
    """Hand one request to this very instance (as the queue group might); the reply comes over the bus."""
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    await bus.nc.flush()
    try:
        await svc.router.on_rpc(Msg(svc.bus.nc, subject=subjects.executor_rpc(JOB, op), reply=inbox, data=encode(body)))
        reply = await sub.next_msg(timeout=30)
    finally:
        await sub.unsubscribe()
    return decode_reply(cls, reply.data)


async def applied_by_one_owner(two: Two, bus: Bus) -> tuple[str, str]:
    """Publish the first plan; wait until it is applied; (owner, other)."""
    await bus.publish_durable(subjects.job_event(JOB, subjects.JobEventKind.PLAN), plan())
    await eventually(lambda: executor_events(bus, "applied"), 30, "the plan was not applied")
    who = await owner(bus)
    assert who in two.svcs, who
    other = next(n for n in two.svcs if n != who)
    return who, other


async def test_one_owner_creates_each_pod_once_and_a_command_to_the_other_is_forwarded(env: Two) -> None:
    two, bus = env, client(env)
    a, b = await two.start("exec-a"), await two.start("exec-b")
    who, other = await applied_by_one_owner(two, bus)
    await eventually(lambda: two.svcs[who].own.owned() == [JOB], 10, "the lease's holder does not act as owner")
    assert two.svcs[other].own.owned() == []
    await eventually(lambda: two.svcs[other].own.wanted(JOB), 10, "the other instance is no standby (it saw the pods)")
    created = await per_generation(bus, "created")
    assert created == Counter({("ps-0", 0): 1, ("worker-0", 0): 1, ("worker-1", 0): 1})
    assert two.pods_on_disk() == sorted(launch.pod_name(JOB, n, 0) for n in ("ps-0", "worker-0", "worker-1"))

    # A restart of worker-1 asked of the instance that does not own the job: forwarded, done once.
    cmd = ExecutorCommand(JOB, "worker-1", CommandKind.RESTART, "test", command_id="cmd-1")
    res = await ask(bus, two.svcs[other], subjects.ExecutorOp.COMMAND, cmd, CommandResult)
    assert res.done and res.pod == launch.pod_name(JOB, "worker-1", 1)
    assert two.svcs[other].own.forwarded == 1
    await eventually(running(bus, "worker-1", 1), 30, "worker-1 was not restarted")
    again = await ask(bus, two.svcs[other], subjects.ExecutorOp.COMMAND, cmd, CommandResult)  # a client's retry
    assert again.detail == "already done"
    st = await ask(bus, two.svcs[other], subjects.ExecutorOp.STATUS, JobQuery(JOB), ExecutorStatus)
    assert {n.node: n.generation for n in st.nodes} == {"ps-0": 0, "worker-0": 0, "worker-1": 1}
    created = await per_generation(bus, "created")
    assert created == Counter({("ps-0", 0): 1, ("worker-0", 0): 1, ("worker-1", 0): 1, ("worker-1", 1): 1})
    assert a.counters.snapshot().get("pods_existed", 0) + b.counters.snapshot().get("pods_existed", 0) == 0


async def test_a_killed_owner_is_replaced_and_the_exit_it_missed_is_relaunched_once(env: Two, tmp_path: Path) -> None:
    await killed_owner(env, tmp_path)


async def test_a_killed_owner_is_replaced_on_the_3_server_cluster(cluster_env: Two, tmp_path: Path) -> None:
    await killed_owner(cluster_env, tmp_path)


async def killed_owner(two: Two, tmp_path: Path) -> None:
    bus = client(two)
    first = two.spawn("exec-a", tmp_path / "exec-a.log")
    await wait_ready(bus, subjects.EXECUTOR_SERVICE, timeout=60)
    await bus.publish_durable(subjects.job_event(JOB, subjects.JobEventKind.PLAN), plan())
    await eventually(lambda: executor_events(bus, "applied"), 30, "the plan was not applied")
    assert await owner(bus) == "exec-a"
    survivor = await two.start("exec-b")
    await eventually(lambda: survivor.own.wanted(JOB), 10, "the other instance is no standby")
    assert not survivor.own.owns(JOB)

    first.send_signal(signal.SIGKILL)
    first.wait()
    two.exit("worker-1", 0, 137)  # killed (128 + 9): retryable; nobody acts for the job at that moment
    await eventually(lambda: survivor.own.owns(JOB), 6 * TTL, "the survivor did not take the job over")
    assert await owner(bus) == "exec-b"
    await eventually(running(bus, "worker-1", 1), 30, "the survivor did not relaunch worker-1")
    died = [e for e in await node_events(bus, "died") if e.node == "worker-1"]
    assert [(e.generation, e.relaunch) for e in died] == [(0, True)]
    created = await per_generation(bus, "created")
    assert created == Counter({("ps-0", 0): 1, ("worker-0", 0): 1, ("worker-1", 0): 1, ("worker-1", 1): 1})

    # Later work goes through the survivor: a plan with a third worker, then the teardown.
    await bus.publish_durable(subjects.job_event(JOB, subjects.JobEventKind.PLAN), plan(workers=3))
    await eventually(running(bus, "worker-2", 0), 30, "the second plan was not applied")
    st = await bus.request(subjects.executor_rpc(JOB, subjects.ExecutorOp.TEARDOWN), JobQuery(JOB),
                           ExecutorStatus, timeout=20.0)
    assert st.state == "tearing_down"
    await eventually(lambda: executor_events(bus, "torn_down"), 30, "the job was not torn down")
    created = await per_generation(bus, "created")
    assert created == Counter({("ps-0", 0): 1, ("worker-0", 0): 1, ("worker-1", 0): 1, ("worker-1", 1): 1,
                               ("worker-2", 0): 1})
    assert len(await executor_events(bus, "torn_down")) == 1


async def test_a_stale_owner_is_refused_and_creates_no_pod(env: Two) -> None:
    two, bus = env, client(env)
    frozen = 1000.0

    def freeze(svc: ExecutorService) -> None:
        svc.own.clock = lambda: frozen  # its time stands still: it never renews, and never doubts its lease

    stale = await two.start("exec-a", freeze)
    await bus.publish_durable(subjects.job_event(JOB, subjects.JobEventKind.PLAN), plan())
    await eventually(lambda: executor_events(bus, "applied"), 30, "the plan was not applied")
    assert await owner(bus) == "exec-a"
    fresh = await two.start("exec-b")
    await eventually(lambda: fresh.own.owns(JOB), 6 * TTL, "the job was not taken over from the frozen owner")
    assert await owner(bus) == "exec-b"
    assert stale.own.owns(JOB), "the frozen instance should still believe it owns the job"

    # Both see worker-0 die; both believe they own the job.  Only the new owner may relaunch it.
    two.exit("worker-0", 0, 137)
    await eventually(running(bus, "worker-0", 1), 30, "the owner did not relaunch worker-0")
    await eventually(lambda: not stale.own.owns(JOB), 20, "the stale owner kept the job")
    refused = stale.counters.snapshot()
    assert refused.get("fenced", 0) + refused.get("kv_conflicts", 0) >= 1, refused
    died = [e for e in await node_events(bus, "died") if e.node == "worker-0"]
    assert [(e.generation, e.relaunch) for e in died] == [(0, True)]  # no died event from the stale owner
    created = await per_generation(bus, "created")
    assert created == Counter({("ps-0", 0): 1, ("worker-0", 0): 1, ("worker-1", 0): 1, ("worker-0", 1): 1})
    assert launch.pod_name(JOB, "worker-0", 2) not in two.pods_on_disk()
    # The new owner answers for the job, whichever instance is asked.
    st = await ask(bus, stale, subjects.ExecutorOp.STATUS, JobQuery(JOB), ExecutorStatus)
    assert {n.node: n.generation for n in st.nodes}["worker-0"] == 1


async def test_a_plan_redelivered_after_a_later_one_is_not_applied(env: Two) -> None:
    """A plan handed back by the non-owner can reach the owner after the next plan: the older one is skipped."""
    two, bus = env, client(env)
    await two.start("exec-a")
    await two.start("exec-b")
    who, _ = await applied_by_one_owner(two, bus)
    await bus.publish_durable(subjects.job_event(JOB, subjects.JobEventKind.PLAN), plan(workers=3))
    await eventually(running(bus, "worker-2", 0), 30, "the second plan was not applied")
    first = (await bus.replay(subjects.job_event(JOB, subjects.JobEventKind.PLAN)))[0]
    assert decode(ResourcePlan, first.data).workers == 2
    owner_svc = two.svcs[who]
    ignored = owner_svc.counters.snapshot().get("plans_ignored", 0)
    await owner_svc._on_job_event(first)  # as the consumer would hand it over, late
    assert owner_svc.counters.snapshot().get("plans_ignored", 0) == ignored + 1
    st = await ask(bus, owner_svc, subjects.ExecutorOp.STATUS, JobQuery(JOB), ExecutorStatus)
    assert st.plan.workers == 3 and "worker-2" in {n.node for n in st.nodes}
    assert ("worker-2", 1) not in await per_generation(bus, "created")
    died = [e for e in await node_events(bus, "died") if e.node == "worker-2"]
    assert died == []  # not scaled back down

async def test_a_graceful_stop_hands_the_job_over_and_leaves_its_pods_alone(env: Two) -> None:
    two, bus = env, client(env)
    await two.start("exec-a")
    await two.start("exec-b")
    who, other = await applied_by_one_owner(two, bus)
    survivor = two.svcs[other]
    await eventually(lambda: survivor.own.wanted(JOB), 10, "the other instance is no standby")
    await two.procs[who].stop()  # SIGTERM-like: drains, then releases its leases
    await eventually(lambda: survivor.own.owns(JOB), 6 * TTL, "the other instance did not take the job over")
    assert await owner(bus) == other
    two.exit("worker-0", 0, 137)
    await eventually(running(bus, "worker-0", 1), 30, "the new owner did not relaunch worker-0")
    created = await per_generation(bus, "created")  # the hand-over itself created nothing
    assert created == Counter({("ps-0", 0): 1, ("worker-0", 0): 1, ("worker-1", 0): 1, ("worker-0", 1): 1})
    st = await bus.request(subjects.executor_rpc(JOB, subjects.ExecutorOp.STATUS), JobQuery(JOB), ExecutorStatus,
                           timeout=20.0)
    assert {n.node: (n.generation, n.phase.value) for n in st.nodes} == {
        "ps-0": (0, "running"), "worker-0": (1, "running"), "worker-1": (0, "running")}

async def test_two_instances_work_with_the_executor_users_permissions(tmp_path: Path) -> None:
    """On a server with pacer.security's users: the instances connect as ``executor``, the client as
    ``jobs`` (which stores job records, publishes plans and may command the executor): leases, the owner's
    state, forwarding and the owner's answer to a forwarded request are allowed."""
    roles = list(security.ROLES)
    users = {r: (f"pw-{i}", r) for i, r in enumerate(roles)}
    srv = EmbeddedNats(store_dir=tmp_path / "nats", authorization=security.render_authorization(users)).start()
    client: Bus | None = None
    two: Two | None = None
    try:
        client = await Bus.connect(security.with_credentials(srv.url, "jobs", users["jobs"][0]))
        await client.ensure_streams()
        spec = parse_job_spec(f"name: {JOB}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
        rec = JobRecord(JOB, spec, JobState.PLANNING, time.time(), data_path="/data/train.rec", records=1000)
        await (await client.kv(subjects.JOB_BUCKET)).put(JOB, encode(rec))
        ctrl = tmp_path / "ctrl"
        ctrl.mkdir()
        two = Two(security.with_credentials(srv.url, "executor", users["executor"][0]), tmp_path / "pods", ctrl)
        await two.start("exec-a")
        await two.start("exec-b")
        await client.publish_durable(subjects.job_event(JOB, subjects.JobEventKind.PLAN), plan())
        await eventually(lambda: executor_events(client, "applied"), 30, "the plan was not applied")
        who = next(n for n, s in two.svcs.items() if s.own.owns(JOB))
        other = next(n for n in two.svcs if n != who)
        cmd = ExecutorCommand(JOB, "worker-0", CommandKind.RESTART, "test", command_id="cmd-p")
        res = await ask(client, two.svcs[other], subjects.ExecutorOp.COMMAND, cmd, CommandResult)
        assert res.done and res.pod == launch.pod_name(JOB, "worker-0", 1)
        assert two.svcs[other].own.forwarded == 1
        await eventually(running(client, "worker-0", 1), 30, "worker-0 was not restarted")
    finally:
        if two is not None:
            await two.stop_all()
            for d in (tmp_path / "pods").glob("*/*"):
                (tmp_path / "ctrl" / d.name).write_text("0")
        if client is not None:
            await client.close()
        srv.stop()
