"""Two instances of the controller and of the monitor on a real 3-server cluster (issue 13).

The controller runs as two real OS processes (``python -m
pacer_services.controller.main``) so that its owner can be killed with
SIGKILL; the monitor runs as two in-process services.  The job's policy, its
agents and the pod-executor are test doubles on their real subjects (they
record what they were asked); statistics and agent metrics are published by
the test as the monitor and the agents would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import InProcess, connect_cluster, eventually, until_ok
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import NO_RETRY, Bus, RetryPolicy
from pacer.codec import decode, encode
from pacer.contracts.agent import ActionKind, AgentMetrics
from pacer.contracts.executor import CommandResult, ExecutorCommand
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, StatsQuery, StragglerKind
from pacer.contracts.policy import ControllerDecision, PolicyAction, PolicyDecision, PolicyRequest
from pacer.embedded import EmbeddedCluster
from pacer.errors import NotFound, ValidationError
from pacer.jobs.spec import parse_job_spec
from pacer.ownership import LEASE_BUCKET, lease_key, state_key
from pacer.policy import serve_policies
from pacer_services.controller.state import decode_state
from pacer_services.monitor.app import MonitorService, MonitorServiceConfig
from pacer_services.monitor.core import MonitorConfig

pytestmark = pytest.mark.timeout(150)

TTL = 3.0


@pytest.fixture
async def cbus(nats_cluster: EmbeddedCluster) -> AsyncIterator[Bus]:
    b = await connect_cluster(nats_cluster, "test-ha-services")
    await b.ensure_streams()
    await b.kv(LEASE_BUCKET)  # at replicas 3, before any service makes it
    await b.kv(subjects.JOB_BUCKET)
    yield b
    await b.close()


async def owner(bus: Bus, service: str, job: str) -> str | None:
    kv = await bus.kv(LEASE_BUCKET)
    try:
        entry = await kv.get(lease_key(service, job))
    except Exception:
        return None
    return entry.value.decode() if entry.value else None


# ================================================================ controller
def node(name: str, role: str = "worker", kind: StragglerKind = StragglerKind.NONE) -> NodeStats:
    bpt = 0.5 if kind is StragglerKind.PERSISTENT else 0.1
    return NodeStats(node=name, role=role, bpt_short_s=bpt, bpt_long_s=bpt, speed_samples_per_s=256 / bpt,
                     samples_total=1000, cpu_percent=90.0, rss_bytes=1 << 28, last_seen=time.time(),
                     state=Liveness.RUNNING, pending_s=1.0, restarts=0, slowdown_short=bpt / 0.1,
                     slowdown_long=bpt / 0.1, straggler=kind)


def statistics(job: str) -> JobStatistics:
    nodes = [node("worker-0"), node("worker-1", kind=StragglerKind.PERSISTENT), node("ps-0", "ps")]
    return JobStatistics(job=job, ts=time.time(), window_short_s=300.0, window_long_s=600.0,
                         throughput_samples_per_s=1000.0, nodes=nodes, cluster_busy=False)


async def add_job(bus: Bus, job: str, policy: str) -> None:
    spec = parse_job_spec(f"name: {job}\nmodel: wide_deep\ndataset:\n  path: /d.rec\nbatch_size: 512\n"
                          f"mode: asp\npolicies: {{straggler: {policy}}}\n")
    plan = ResourcePlan(job, 2, 1, 1.0, 2048, 1.0, 2048, PlanSource.DEFAULT)
    kv = await bus.kv(subjects.JOB_BUCKET)
    # right after the bucket's creation a server may not know its subjects yet (seen in CI)
    await until_ok(lambda: kv.put(job, encode(JobRecord(job, spec, JobState.RUNNING, time.time(), plan=plan))))


class ControllerProcess:
    def __init__(self, url: str, instance: str, log_path: Path) -> None:
        self.url, self.instance, self.log_path = url, instance, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ControllerProcess:
        env = {**os.environ, "PACER_NATS_URL": self.url, "PACER_REPLICAS": "3", "PACER_INSTANCE": self.instance,
               "PACER_CONTROLLER_EVERY_S": "0", "PACER_CONTROLLER_COOLDOWN_S": "3600",
               "PACER_POLICY_TIMEOUT_S": "2", "PACER_LEASE_TTL_S": str(TTL), "PACER_LOG_LEVEL": "INFO"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pacer_services.controller.main"],
                                         env=env, stdout=log, stderr=log)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


async def test_controller_owner_killed_the_other_takes_over_and_keeps_the_cool_down(
        cbus: Bus, nats_cluster: EmbeddedCluster, tmp_path: Path) -> None:
    """The policy asks for KILL_RESTART of worker-1 at every round; only the first may run.

    Two controller processes; the owner of the job restarts worker-1 once
    (a cool-down of an hour follows), then is killed with SIGKILL.  The other
    instance takes the job over within seconds, and its rounds refuse the
    restart because of the cool-down it loaded: one executor command in all.
    """
    asked: list[str] = []

    def always_restart(req: PolicyRequest) -> PolicyDecision:
        asked.append(req.job)
        return PolicyDecision(req.job, "restart-w1", [PolicyAction(ActionKind.KILL_RESTART, node="worker-1",
                                                                   reason="slow")])

    commands: list[ExecutorCommand] = []
    decisions: list[ControllerDecision] = []

    async def executor(msg: Msg) -> None:
        cmd = decode(ExecutorCommand, msg.data)
        commands.append(cmd)
        await cbus.respond(msg, CommandResult(cmd.job, cmd.node, cmd.command_id, True, "pod"))

    async def on_decision(msg: Msg) -> None:
        decisions.append(decode(ControllerDecision, msg.data))

    subs = await serve_policies(cbus, {"restart-w1": always_restart})
    subs.append(await cbus.nc.subscribe("pacer.rpc.executor.*.command", cb=executor))
    subs.append(await cbus.nc.subscribe(subjects.events_of(subjects.CONTROLLER_SERVICE, kind="decision"),
                                        cb=on_decision))
    await add_job(cbus, "hj1", "restart-w1")
    procs = [ControllerProcess(nats_cluster.url, name, tmp_path / f"{name}.log").start()
             for name in ("ctl-a", "ctl-b")]
    stop = asyncio.Event()

    async def monitor_double() -> None:  # statistics of hj1, as the monitor would publish them
        while not stop.is_set():
            await cbus.publish(subjects.monitor_statistics("hj1"), statistics("hj1"))
            await asyncio.sleep(0.3)

    publisher = asyncio.create_task(monitor_double())
    try:
        await eventually(lambda: commands, 60, "no KILL_RESTART was executed")
        first = await owner(cbus, subjects.CONTROLLER_SERVICE, "hj1")
        assert first in ("ctl-a", "ctl-b")
        assert commands[0].node == "worker-1" and f"-{first}-" in commands[0].command_id
        # The owner's state in KV holds the restart (its cool-down).
        kv = await cbus.kv(LEASE_BUCKET)
        st = decode_state((await kv.get(state_key(subjects.CONTROLLER_SERVICE, "hj1"))).value)
        assert [n for n, _ in st.restarts] == ["worker-1"]
        # Several more rounds by the owner alone: the restart is refused (cool-down), nobody else acts.
        n = len(decisions)
        await eventually(lambda: len(decisions) >= n + 3, 30, "no further rounds")
        assert len(commands) == 1

        victim = next(p for p in procs if p.instance == first)
        survivor = next(p for p in procs if p.instance != first)
        victim.kill()
        killed_at = len(decisions)
        took_over = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            took_over = await owner(cbus, subjects.CONTROLLER_SERVICE, "hj1")
            if took_over == survivor.instance:
                break
            await asyncio.sleep(0.2)
        assert took_over == survivor.instance, took_over
        # The new owner decides (rounds go on) and keeps the cool-down: still one command.
        await eventually(lambda: len(decisions) >= killed_at + 3, 30, "the new owner makes no decisions")
        later = decisions[killed_at:]
        assert len(commands) == 1, [c.command_id for c in commands]
        assert any("cool-down" in r.reason for d in later for r in d.refused), later[-1]
    finally:
        stop.set()
        await publisher
        for p in procs:
            p.stop()
        await subs.close()  # the policy's worker process too


# ================================================================ monitor
BPT = {"w0": 0.1, "w1": 0.1, "w2": 0.3}


def metrics(job: str, node_: str, ts: float) -> AgentMetrics:
    return AgentMetrics(
        job=job, node=node_, role="worker", ts=ts, local_step=0, iteration=0, bpt_s=BPT[node_], batch_size=32,
        samples_per_s=32 / BPT[node_], samples_total=0, cpu_percent=50.0, rss_bytes=1 << 20, last_action_seq=0,
        last_action_iteration=-1, primary=node_ == "w0", steps=10,
    )


async def stats(bus: Bus, job: str, query: object = None) -> JobStatistics:
    return await bus.request(subjects.monitor_stats(job), query if query is not None else StatsQuery(job),
                             JobStatistics, timeout=5.0, retry=NO_RETRY)


async def test_two_monitors_one_publishes_requests_reach_the_owner_and_a_stop_hands_over(
        cbus: Bus, nats_cluster: EmbeddedCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACER_REPLICAS", "3")
    core = MonitorConfig(window_short_s=3.0, window_long_s=30.0)
    mons = {name: InProcess(nats_cluster.url, lambda b, n=name: MonitorService(b, MonitorServiceConfig(
        interval_s=0.2, core=core, instance=n, lease_ttl_s=TTL))) for name in ("mon-a", "mon-b")}
    svcs = {name: await m.start() for name, m in mons.items()}
    published: list[str] = []

    async def on_stats(msg: Msg) -> None:
        published.append(decode(JobStatistics, msg.data).job)

    sub = await cbus.nc.subscribe(subjects.monitor_statistics("hm1"), cb=on_stats)
    first: str | None = ""
    try:
        now = time.time()
        for t in (now - 2, now - 1, now):
            for n in BPT:
                await cbus.publish_durable(subjects.agent_metrics("hm1"), metrics("hm1", n, t))
        await eventually(lambda: len(published) >= 3, 30, "no statistics published")
        first = await owner(cbus, subjects.MONITOR_SERVICE, "hm1")
        assert first in svcs
        other = next(n for n in svcs if n != first)
        await asyncio.sleep(1.0)
        # Exactly one instance publishes the job's statistics: the owner.
        assert svcs[first].counters.values.get("statistics_published", 0) > 0
        assert svcs[other].counters.values.get("statistics_published", 0) == 0
        # Both fold every event (hot standby).
        await eventually(lambda: "hm1" in svcs[other].core.jobs, 10, "the standby has no windows of hm1")

        # Requests reaching the non-owner only: its queue subscription is the only one left.
        rpc_sub = svcs[first]._rpc_sub
        assert rpc_sub is not None
        await rpc_sub.unsubscribe()
        await svcs[first].bus.nc.flush()
        before = svcs[first].counters.values.get("requests", 0)
        # A request can time out on a loaded machine (CI once saw 5 s pass with no reply) or,
        # for a moment, reach the owner's server over a route before the unsubscription did,
        # and be dropped there.  So the requests retry, and the counters are compared with
        # each other: every request the standby forwarded, the owner answered.
        for _ in range(3):
            st = await cbus.request(subjects.monitor_stats("hm1"), StatsQuery("hm1"), JobStatistics, timeout=5.0,
                                    retry=RetryPolicy(attempts=4))
            assert st.job == "hm1" and {x.node for x in st.nodes} == set(BPT)
        forwarded = svcs[other].counters.values.get("requests_forwarded", 0)
        assert forwarded >= 3
        assert svcs[first].counters.values.get("requests", 0) == before + forwarded  # the owner answered each
        # Bad input still gets a clear error reply, through the owner too; an unknown job: not_found.
        with pytest.raises(ValidationError):
            await stats(cbus, "hm1", StatsQuery("another-job"))
        with pytest.raises(NotFound):
            await stats(cbus, "no-such-job")

        # The owner is cut off (its connection goes, its leases stay behind): the other takes the
        # job over within a few TTLs and publishes its statistics.  (Not InProcess.stop: the runtime's
        # shutdown cancels every "pacer:" task of the process, the other instance's too.)
        await svcs[first].bus.nc.close()
        await eventually(lambda: svcs[other].own.owns("hm1"), 6 * TTL, lambda: f"the standby did not take hm1 over: {svcs[other].own.jobs} {[(j.lease.view, j.task) for j in svcs[other].own.jobs.values() if j.lease]}")
        n = svcs[other].counters.values.get("statistics_published", 0)
        await eventually(lambda: svcs[other].counters.values.get("statistics_published", 0) > n + 2, 10,
                         "the new owner publishes nothing")
        st = await stats(cbus, "hm1")  # answered by the new owner, same windows
        assert {x.node for x in st.nodes} == set(BPT)
    finally:
        await sub.unsubscribe()
        for name in sorted(mons, key=lambda n: n == first):  # the cut-off one last
            with contextlib.suppress(Exception):
                await mons[name].stop()


# ================================================================ the controller's state, pure
def test_controller_state_round_trips_and_refuses_garbage() -> None:
    from pacer_services.controller.core import ControllerCore, JobSetup
    from pacer_services.controller.state import encode_state, restore, snapshot

    core = ControllerCore("j", JobSetup(global_batch=512, mode="bsp", batch_sizes={"w0": 384, "w1": 128},
                                        accumulations={"w0": 1, "w1": 1}, backup_workers=1, params={"k": 2}))
    core.restarts, core.resync = [("w1", 100.0)], True
    data = encode_state(snapshot(core, last=99.0, planned=[("w0", 120.0)]))
    fresh = ControllerCore("j", JobSetup(global_batch=512))
    st = decode_state(data)
    restore(fresh, st)
    assert fresh.setup == core.setup and fresh.resync is True and st.last == 99.0
    assert fresh.restarts == [("w1", 100.0), ("w0", 120.0)]  # the intention counts as a restart
    assert core.restarts == [("w1", 100.0)]  # snapshot does not touch the core
    for bad in (b"", b"not json", b'{"v": 2}', b'{"v": 1, "setup": {}}', b"[1, 2]"):
        with pytest.raises(ValueError):
            decode_state(bad)


async def test_a_stale_controller_owner_cannot_restart_anything(
        cbus: Bus, nats_cluster: EmbeddedCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen owner (its clock stands still: it neither renews nor doubts its lease) is taken over;
    when it runs rounds again, its KILL_RESTART intentions are refused by the server and nothing is
    executed by it; no node is restarted twice."""
    from pacer_services.controller.app import ControllerService, ControllerServiceConfig
    from pacer_services.controller.core import ControllerConfig

    monkeypatch.setenv("PACER_REPLICAS", "3")
    order = [f"worker-{i}" for i in range(5)] + ["ps-0"]
    asked = [0]

    def cycle(req: PolicyRequest) -> PolicyDecision:  # the next node at every round
        asked[0] += 1
        return PolicyDecision(req.job, "cycle", [PolicyAction(ActionKind.KILL_RESTART, node=order[asked[0] % 6],
                                                              reason="cycle")])

    def six(job: str) -> JobStatistics:
        st = statistics(job)
        return JobStatistics(job=job, ts=st.ts, window_short_s=st.window_short_s, window_long_s=st.window_long_s,
                             throughput_samples_per_s=st.throughput_samples_per_s, cluster_busy=False,
                             nodes=[node(n, "ps" if n.startswith("ps") else "worker") for n in order])

    commands: list[ExecutorCommand] = []

    async def executor(msg: Msg) -> None:
        cmd = decode(ExecutorCommand, msg.data)
        commands.append(cmd)
        await cbus.respond(msg, CommandResult(cmd.job, cmd.node, cmd.command_id, True, "pod"))

    subs = await serve_policies(cbus, {"cycle": cycle})
    subs.append(await cbus.nc.subscribe("pacer.rpc.executor.*.command", cb=executor))
    await add_job(cbus, "hj2", "cycle")

    def config(name: str) -> ControllerServiceConfig:
        return ControllerServiceConfig(decide_every_s=0.0, policy_timeout_s=2.0, lease_ttl_s=TTL, instance=name,
                                       core=ControllerConfig(cooldown_s=3600.0, max_restarts_per_window=10, guard=False))

    def frozen_a(b: Bus) -> ControllerService:
        svc = ControllerService(b, config("ctl-a"))
        svc.own.clock = lambda: 1000.0
        return svc

    ctl_a = InProcess(nats_cluster.url, frozen_a)
    ctl_b = InProcess(nats_cluster.url, lambda b: ControllerService(b, config("ctl-b")))
    a = await ctl_a.start()
    started_b = False
    try:
        for _ in range(100):  # statistics are plain messages: resend until ctl-a (its lease bucket ready) acts
            await cbus.publish(subjects.monitor_statistics("hj2"), six("hj2"))
            if commands:
                break
            await asyncio.sleep(0.3)
        await eventually(lambda: commands, 30, "ctl-a restarted nothing")
        assert all("-ctl-a-" in c.command_id for c in commands)
        b = await ctl_b.start()
        started_b = True
        await cbus.publish(subjects.monitor_statistics("hj2"), six("hj2"))  # b claims the job on statistics
        deadline = time.monotonic() + 30
        while await owner(cbus, subjects.CONTROLLER_SERVICE, "hj2") != "ctl-b" and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await owner(cbus, subjects.CONTROLLER_SERVICE, "hj2") == "ctl-b"
        assert a.own.owns("hj2")  # the stale owner still believes it owns the job
        await asyncio.sleep(1.0)
        baseline = len(commands)
        for _ in range(40):
            if a.counters.values.get("fenced", 0) >= 1:
                break
            await cbus.publish(subjects.monitor_statistics("hj2"), six("hj2"))
            await asyncio.sleep(0.3)
        assert a.counters.values.get("fenced", 0) >= 1, a.counters.values
        assert b.own.owns("hj2") and b.counters.values.get("rounds", 0) >= 1  # the new owner decides
        assert not [c for c in commands[baseline:] if "-ctl-a-" in c.command_id]
        nodes = [c.node for c in commands]
        assert len(nodes) == len(set(nodes)), nodes  # no node restarted twice, whoever owned the job
    finally:
        if started_b:
            await ctl_b.stop()
        await ctl_a.stop()
        await subs.close()  # the policy's worker process too
