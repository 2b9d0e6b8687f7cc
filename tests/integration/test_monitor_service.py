"""The monitor service over a real nats-server: stragglers, statistics events, deaths,
dead-lettering, and a restart that rebuilds the windows from the stream.

Windows are short (L_trans 3 s, L_per 30 s) and the agent metrics carry
timestamps spread over the last 6 s, so that the slow node's evidence reaches
back further than L_trans (persistent) without the test waiting for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from conftest import InProcess
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import NO_RETRY, Bus
from pacer.contracts.agent import AgentMetrics, Heartbeat
from pacer.contracts.common import Health
from pacer.contracts.monitor import JobStatistics, Liveness, StatsQuery, StragglerKind
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetMode, DatasetStatus, ProgressEvent
from pacer.embedded import EmbeddedNats
from pacer.errors import NotFound
from pacer_services.monitor.app import MonitorService, MonitorServiceConfig
from pacer_services.monitor.core import MonitorConfig

pytestmark = pytest.mark.timeout(40)

JOB = "job1"
BPT = {"w0": 0.1, "w1": 0.1, "w2": 0.3}  # w2 is three times slower
SPEED = {"w0": 100.0, "w1": 100.0, "w2": 33.0}


def config() -> MonitorServiceConfig:
    return MonitorServiceConfig(interval_s=0.2, core=MonitorConfig(window_short_s=3.0, window_long_s=30.0))


def in_process(url: str) -> InProcess[MonitorService]:
    cfg = config()
    return InProcess(url, lambda b: MonitorService(b, cfg))


@pytest.fixture
async def monitor(nats_server: EmbeddedNats) -> AsyncIterator[InProcess[MonitorService]]:
    m = in_process(nats_server.url)
    await m.start()
    yield m
    await m.stop()


def metrics(node: str, ts: float, job: str = JOB) -> AgentMetrics:
    return AgentMetrics(
        job=job, node=node, role="worker", ts=ts, local_step=0, iteration=0, bpt_s=BPT[node], batch_size=32,
        samples_per_s=SPEED[node], samples_total=0, cpu_percent=50.0, rss_bytes=1 << 20, last_action_seq=0,
        last_action_iteration=-1, primary=node == "w0", steps=10,
    )


async def publish_history(bus: Bus, span_s: float = 6.0, step_s: float = 0.5) -> None:
    """Metrics of the three workers with timestamps over the last ``span_s`` seconds, stored durably."""
    now = time.time()
    t = now - span_s
    while t <= now:
        for node in BPT:
            await bus.publish_durable(subjects.agent_metrics(JOB), metrics(node, t))
        t += step_s


async def stats(bus: Bus, job: str = JOB) -> JobStatistics:
    # One try (a retry would hide a missing answer), but a patient one: under load an answer takes a while.
    return await bus.request(subjects.monitor_stats(job), StatsQuery(job), JobStatistics, timeout=10.0,
                             retry=NO_RETRY)


async def until(check: Callable[[JobStatistics], bool], bus: Bus, within_s: float = 30.0) -> JobStatistics:
    deadline = time.monotonic() + within_s
    last: JobStatistics | None = None
    while time.monotonic() < deadline:
        try:
            last = await stats(bus)
            if check(last):
                return last
        except NotFound:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {within_s}s; last statistics: {last}")


def by_node(st: JobStatistics) -> dict[str, object]:
    return {n.node: n for n in st.nodes}


def classified(st: JobStatistics) -> dict[str, StragglerKind]:
    return {n.node: n.straggler for n in st.nodes}


def has_history(st: JobStatistics) -> bool:
    return len(st.nodes) == 3 and all(n.bpt_long_s > 0 for n in st.nodes) and st.nodes[2].straggler is not StragglerKind.NONE


async def health(bus: Bus) -> Health:
    return await bus.request(subjects.health(subjects.MONITOR_SERVICE), None, Health, timeout=2.0, retry=NO_RETRY)


async def test_straggler_statistics_and_death(bus: Bus, monitor: InProcess[MonitorService]) -> None:
    published: asyncio.Queue[JobStatistics] = asyncio.Queue()

    async def on_stats(msg: Msg) -> None:
        from pacer.codec import decode

        await published.put(decode(JobStatistics, msg.data))

    sub = await bus.nc.subscribe(subjects.monitor_statistics(JOB), cb=on_stats)
    await publish_history(bus)
    status = DatasetStatus(
        job=JOB, dataset="train", mode=DatasetMode.FINITE, epoch=0, epochs=1, todo=5, doing=2, done=3, failed=0,
        records_total=1000, records_done=300, records_duplicated=0, finished=False, closed=True,
    )
    await bus.publish_durable(subjects.event("shard", JOB, subjects.ShardEventKind.PROGRESS), ProgressEvent(time.time(), status))
    # Heartbeats are live only (never stored): a plain publish, heard on the monitor's subscription.
    await bus.publish(subjects.agent_heartbeat(JOB), Heartbeat(JOB, "w0", "worker", time.time(), "host-1", True, True))

    st = await until(lambda s: has_history(s) and s.shards is not None, bus)
    assert classified(st) == {"w0": StragglerKind.NONE, "w1": StragglerKind.NONE, "w2": StragglerKind.PERSISTENT}
    w2 = st.nodes[2]
    assert w2.slowdown_long == pytest.approx(3.0)
    assert w2.bpt_long_s == pytest.approx(0.3)
    # Throughput is the sum of the workers' speeds over the short window.
    assert st.throughput_samples_per_s == pytest.approx(sum(SPEED.values()))
    assert all(n.state is Liveness.RUNNING for n in st.nodes)
    assert st.shards is not None and st.shards.records_done == 300 and st.shards.todo == 5

    # The periodic statistics event for the job.
    ev = await asyncio.wait_for(published.get(), 5.0)
    while len(ev.nodes) < 3:
        ev = await asyncio.wait_for(published.get(), 5.0)
    assert ev.job == JOB and classified(ev)["w2"] is StragglerKind.PERSISTENT
    await sub.unsubscribe()

    # The executor says w2 died: it is dead, out of the throughput, no longer a straggler.
    await bus.publish_durable(
        subjects.event("node", JOB, subjects.NodeEventKind.DIED), NodeEvent(JOB, "w2", "died", time.time(), "killed", "worker")
    )
    st = await until(lambda s: s.nodes[2].state is Liveness.DEAD, bus)
    assert st.nodes[2].straggler is StragglerKind.NONE
    assert st.throughput_samples_per_s == pytest.approx(SPEED["w0"] + SPEED["w1"])

    with pytest.raises(NotFound):
        await stats(bus, "nosuchjob")


async def test_an_instance_that_loses_a_job_stops_exporting_its_gauges(
        bus: Bus, monitor: InProcess[MonitorService]) -> None:
    """/metrics of an old owner would keep the job's last numbers (and fire its straggler alert) for good."""
    from pacer import metrics as prom

    await publish_history(bus)
    await until(has_history, bus)
    deadline = time.monotonic() + 30
    while JOB not in prom.JOBS.latest:  # the owner's next statistics interval sets them
        assert time.monotonic() < deadline, "the owner never exported the job's gauges"
        await asyncio.sleep(0.05)
    svc = monitor.svc
    assert svc is not None
    await svc.own.drop(JOB)  # gives the job up as a hand-over would: on_lost, then the lease released
    assert JOB not in prom.JOBS.latest
    assert f'pacer_job_stragglers{{job="{JOB}"' not in prom.generate_latest(prom.REGISTRY).decode()


async def test_bad_message_is_dead_lettered_and_service_keeps_going(bus: Bus, monitor: InProcess[MonitorService]) -> None:
    dead: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_dead(msg: Msg) -> None:
        await dead.put(msg)

    await bus.nc.subscribe(subjects.dead_letter(subjects.MONITOR_SERVICE), cb=on_dead)
    await bus.js.publish(subjects.agent_metrics(JOB), b"\xc1 not msgpack")
    # Valid message, but the body names another job than the subject.
    await bus.publish_durable(subjects.agent_metrics(JOB), metrics("w0", time.time(), job="otherjob"))

    first = await asyncio.wait_for(dead.get(), 5.0)
    second = await asyncio.wait_for(dead.get(), 5.0)
    assert first.data == b"\xc1 not msgpack"
    assert first.headers is not None and "msgpack" in first.headers["Pacer-Error"]
    assert first.headers["Pacer-Subject"] == subjects.agent_metrics(JOB)
    assert second.headers is not None and "otherjob" in second.headers["Pacer-Error"]

    h = await health(bus)
    assert h.status == "ready"
    assert h.counters.get("bad_events") == 2

    # The loop is still alive: good messages after the bad ones are applied and queries answered.
    await publish_history(bus, span_s=1.0)
    st = await until(lambda s: len(s.nodes) == 3, bus)
    assert st.job == JOB


async def test_restart_rebuilds_windows_from_the_stream(bus: Bus, nats_server: EmbeddedNats) -> None:
    m = in_process(nats_server.url)
    await m.start()
    try:
        await publish_history(bus)
        before = await until(has_history, bus)
        assert classified(before)["w2"] is StragglerKind.PERSISTENT
    finally:
        await m.stop()

    # While the monitor is down: more of the same, which both the replay and
    # the durable consumer see; it must be applied once.
    now = time.time()
    for node in BPT:
        await bus.publish_durable(subjects.agent_metrics(JOB), metrics(node, now))

    svc = await m.start()
    try:
        after = await stats(bus)  # answered at once: the windows were rebuilt before the service was ready
        assert classified(after) == classified(before)
        assert after.nodes[2].slowdown_long == pytest.approx(3.0)
        assert after.throughput_samples_per_s == pytest.approx(sum(SPEED.values()))
        assert svc.counters.values["events_replayed"] == 3 * 13 + 3

        # The durable consumer resumed where it was: the backlog is acked, not applied twice ...
        deadline = time.monotonic() + 30  # a condition, bounded only so that a bug fails rather than hangs
        while svc.counters.values["events_already_replayed"] < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # At least the 3 sent while it was down; more when acks of the first run were still in
        # flight at its stop (at-least-once: JetStream redelivers them, and they are skipped too).
        assert svc.counters.values["events_already_replayed"] >= 3
        assert svc.counters.values["events"] == 3 * 13 + 3  # replayed only: nothing applied twice
        # ... and new events are applied.
        await bus.publish_durable(
            subjects.event("node", JOB, subjects.NodeEventKind.DIED), NodeEvent(JOB, "w1", "died", time.time(), "oom", "worker")
        )
        st = await until(lambda s: s.nodes[1].state is Liveness.DEAD, bus)
        assert st.nodes[1].straggler is StragglerKind.NONE
    finally:
        await m.stop()


async def test_cluster_status_from_the_executor_sets_cluster_busy(monitor: InProcess[MonitorService], bus: Bus) -> None:
    from pacer.contracts.executor import ClusterStatus

    await publish_history(bus)
    assert not (await until(lambda s: len(s.nodes) == 3, bus)).cluster_busy  # no cluster info: not busy
    await bus.publish_durable(subjects.cluster_status(), ClusterStatus(time.time(), "local", 2, 4, 8.0, 1.0))
    await until(lambda s: s.cluster_busy, bus)  # pods are queued
    await bus.publish_durable(subjects.cluster_status(), ClusterStatus(time.time(), "local", 0, 6, 8.0, 4.0))
    await until(lambda s: not s.cluster_busy, bus)  # queue empty, half the CPU free
    await bus.publish_durable(subjects.cluster_status(), ClusterStatus(time.time(), "local", 0, 6, 8.0, 0.1))
    await until(lambda s: s.cluster_busy, bus)  # almost no CPU left
    await bus.nc.publish(subjects.cluster_status(), b"\x01garbage")  # refused and dead-lettered, not fatal
    await bus.publish_durable(subjects.cluster_status(), ClusterStatus(time.time(), "local", 0, 6, 8.0, 4.0))
    await until(lambda s: not s.cluster_busy, bus)
    assert any(k.startswith("bad_events") for k in monitor.svc.counters.snapshot())
