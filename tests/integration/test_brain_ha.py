"""Two brain instances on a real nats-server (issue 13): one owner per job, hand-over, fencing.

Both instances run in-process (``InProcess``); the job service's record, the
executor's ``applied`` event and the monitor's statistics windows are
published by the test as those services would.  The job is a zero-config
one on a cold start, so its first plan is the sample stage's: the sample is
measured on two valid windows (the first window after the plan runs starts
the settle time, each later one 30 s on is a valid measurement), then the
optimize plan (DLRover 2023 Eq. 10-11) is published as a plan event and a
``BrainDecision``.  An owner is "killed" by closing its NATS connection
(its lease stays behind, unrenewed, as after a SIGKILL; not
``InProcess.stop``, which would cancel the other instance's tasks too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import InProcess, eventually
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import NO_RETRY, Bus
from pacer.codec import decode, encode
from pacer.contracts.brain import BrainDecision, PlanRequest
from pacer.contracts.executor import ExecutorEvent, ExecutorEventKind
from pacer.contracts.jobs import JobRecord, JobSpec, JobState, PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, ShardSummary
from pacer.embedded import EmbeddedNats
from pacer.jobs.spec import parse_job_spec
from pacer.lease import Lease
from pacer.ownership import LEASE_BUCKET, lease_key, state_key
from pacer_services.brain.app import BrainConfig, BrainService
from pacer_services.brain.core.autoscaler import Stage, autoscaler_state, load_autoscaler_state
from pacer_services.brain.state import Outgoing, OwnedJob, decode_state, encode_state

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
TTL = 2.0
CFG = dict(cpu_quota=16.0, node_cpu=4.0, adjust_interval_s=60.0, settle_s=20.0, lease_ttl_s=TTL)


def spec(name: str) -> JobSpec:
    return parse_job_spec(f"name: {name}\nmodel: wide_deep\ndataset: {{path: /data/day0.rec}}\n")


def window(job: str, plan: ResourcePlan, t: float, done: int) -> JobStatistics:
    """A window of ``plan`` running: each worker using 0.9 cores, the PS 0.15 each, 2,000 samples/s."""
    def node(name: str, role: str, cpu: float) -> NodeStats:
        return NodeStats(node=name, role=role, bpt_short_s=0.1, bpt_long_s=0.1, speed_samples_per_s=1000.0,
                         samples_total=done, cpu_percent=cpu * 100, rss_bytes=600 << 20, last_seen=t,
                         state=Liveness.RUNNING, pending_s=0.0, restarts=0, slowdown_short=1.0, slowdown_long=1.0)

    nodes = [node(f"worker-{i}", "worker", 0.9) for i in range(plan.workers)]
    nodes += [node(f"ps-{j}", "ps", 0.15) for j in range(plan.ps)]
    return JobStatistics(job=job, ts=t, window_short_s=300.0, window_long_s=600.0, throughput_samples_per_s=2000.0,
                         nodes=nodes, shards=ShardSummary(todo=5, doing=2, done=3, failed=0, records_done=done,
                                                          records_total=10_000_000))


async def collect(bus: Bus, subject: str, cls: type[T]) -> list[T]:
    got: list[T] = []

    async def on_msg(msg: Msg) -> None:
        got.append(decode(cls, msg.data))

    await bus.nc.subscribe(subject, cb=on_msg)
    await bus.nc.flush()
    return got


def brain(url: str, name: str, clock: Any = None) -> InProcess[BrainService]:
    def build(b: Bus) -> BrainService:
        svc = BrainService(b, config=BrainConfig(instance=name, **CFG))  # type: ignore[arg-type]
        if clock is not None:
            svc.own.clock = clock  # a frozen process: it neither renews its leases nor doubts them
        return svc

    return InProcess(url, build)


async def owner_of(bus: Bus, job: str) -> str | None:
    kv = await bus.kv(LEASE_BUCKET)
    try:
        entry = await kv.get(lease_key(subjects.BRAIN_SERVICE, job))
    except Exception:
        return None
    return entry.value.decode() if entry.value else None


async def saved(bus: Bus, job: str) -> OwnedJob | None:
    kv = await bus.kv(LEASE_BUCKET)
    try:
        entry = await kv.get(state_key(subjects.BRAIN_SERVICE, job))
    except Exception:
        return None
    return decode_state(entry.value) if entry.value else None


def sample_windows(st: OwnedJob | None) -> int:
    """Valid windows of the sample plan in a saved state."""
    if st is None or st.auto is None:
        return 0
    return sum(int(m["n"]) for _, m in st.auto.state["measured"])


@dataclass
class Job:
    name: str
    first: ResourcePlan
    plans: list[ResourcePlan]
    decisions: list[BrainDecision]
    t0: float


async def start_job(bus: Bus, name: str) -> Job:
    """The job service's record, the brain's first plan (asked as the job service does), the executor's
    ``applied`` event; and lists of every plan event and BrainDecision of the job from now on."""
    plans = await collect(bus, subjects.job_event(name, subjects.JobEventKind.PLAN), ResourcePlan)
    decisions = await collect(bus, subjects.brain_decision(name), BrainDecision)
    first = await bus.request(subjects.brain_rpc(name, subjects.BrainOp.PLAN), PlanRequest(name, spec(name), 10**6),
                              ResourcePlan, retry=NO_RETRY)
    await (await bus.kv(subjects.JOB_BUCKET)).put(name, encode(JobRecord(name, spec(name), JobState.RUNNING,
                                                                           time.time(), plan=first)))
    await bus.publish_durable(subjects.executor_event(name, "applied"),
                              ExecutorEvent(name, ExecutorEventKind.APPLIED, time.time(), plan=first, overhead_s=10.0))
    return Job(name, first, plans, decisions, time.time())


async def feed(bus: Bus, job: Job, i: int) -> None:
    await bus.publish(subjects.monitor_statistics(job.name), window(job.name, job.first, job.t0 + 30 * i, 1000 * i))


async def hearing(bus: Bus, svc: BrainService) -> None:
    """Until ``svc`` receives the monitor's statistics: a window of a job nobody runs, published until one
    arrives.  A window published right after a second instance started was seen to miss it in about
    1 run of this file in 5 (its subscription was flushed, the next window did arrive): the tests whose
    standby must hear a given window wait for this first.  In production statistics are periodic, so a
    missed first window only delays the standby by one."""
    nobody = ResourcePlan("nobody", 1, 1, 1.0, 1024, 1.0, 1024, PlanSource.USER)
    for _ in range(100):
        if svc.counters.values.get("statistics", 0):
            return
        await bus.publish(subjects.monitor_statistics("nobody"), window("nobody", nobody, time.time(), 0))
        await asyncio.sleep(0.1)
    raise AssertionError(f"{svc.own.instance} never received a statistics window")


@pytest.fixture
async def url(nats_server: EmbeddedNats) -> AsyncIterator[str]:
    yield nats_server.url


async def stop_all(*brains: InProcess[BrainService]) -> None:
    for b in brains:
        with contextlib.suppress(Exception):
            await b.stop()


async def test_two_brains_one_owner_publishes_each_decision_once(url: str, bus: Bus) -> None:
    """Two instances hear every window and fold every event; the job's owner alone steps its autoscaler and
    publishes: one optimize plan and one decision, and its first plan was asked through either instance."""
    a, b = brain(url, "brain-a"), brain(url, "brain-b")
    sa, sb = await a.start(), await b.start()
    try:
        job = await start_job(bus, "ha-one")
        first_owner = await owner_of(bus, "ha-one")
        assert first_owner in ("brain-a", "brain-b")
        own, other = (sa, sb) if first_owner == "brain-a" else (sb, sa)
        assert "ha-one" in own.autoscalers and "ha-one" not in other.autoscalers
        await eventually(lambda: own.autoscalers["ha-one"].plan == job.first, 10, "the owner did not learn the plan")
        await eventually(lambda: other.in_force("ha-one") == job.first, 10, "the standby did not fold the event")
        for i in range(4):
            await feed(bus, job, i)
        await eventually(lambda: job.decisions and job.plans, 15, "no decision")
        await asyncio.sleep(0.5)  # a second copy would have come by now
        assert len(job.decisions) == 1 and len(job.plans) == 1, (job.decisions, job.plans)
        assert job.decisions[0].rule == "optimize" and job.decisions[0].previous == job.first
        assert own.counters.values.get("replans", 0) == 1 and other.counters.values.get("replans", 0) == 0
        assert "ha-one" not in other.autoscalers
        await feed(bus, job, 4)
        await eventually(lambda: other.own.wanted("ha-one"), 10, "the other instance is not standing by")
        assert "ha-one" not in other.autoscalers and len(job.decisions) == 1
        # The stream holds it once too (not only what this subscription saw).
        history = await bus.replay(subjects.brain_decision("ha-one"))
        assert len(history) == 1
        # A second plan request reaches the owner whichever instance receives it.
        again = await bus.request(subjects.brain_rpc("ha-one", subjects.BrainOp.PLAN),
                                  PlanRequest("ha-one", spec("ha-one"), 10**6), ResourcePlan, retry=NO_RETRY)
        assert again.job == "ha-one" and "ha-one" not in other.autoscalers
    finally:
        await stop_all(a, b)


async def test_owner_dies_mid_sample_the_other_continues_the_sample(url: str, bus: Bus) -> None:
    """The owner measured one valid window of the sample plan, saved beside its lease, then died.  The other
    instance takes the job over one TTL later, loads the sample stage with that window, and the very next
    window completes the sample: the optimize plan goes out once, from the new owner.  (Started afresh,
    it would need the settle time and two more windows; resumed from the record, no optimize at all.)"""
    a = brain(url, "brain-a")
    sa = await a.start()
    b = brain(url, "brain-b")
    try:
        job = await start_job(bus, "ha-die")  # only brain-a runs: it owns the job
        assert await owner_of(bus, "ha-die") == "brain-a"
        await eventually(lambda: sa.autoscalers["ha-die"].plan == job.first, 10, "brain-a did not learn the plan")
        sb = await b.start()
        await hearing(bus, sb)
        await feed(bus, job, 0)  # running: the settle time starts
        await feed(bus, job, 1)  # a valid window of the sample plan
        await eventually(lambda: sample_windows(sa.state_of("ha-die")) == 1, 10, "brain-a measured nothing")
        st = await eventually(lambda: _saved_with(bus, "ha-die", 1), 10, "the measured window was not saved")
        assert st.auto is not None and st.auto.state["stage"] == Stage.SAMPLE.value
        await eventually(lambda: sb.own.wanted("ha-die"), 10, "brain-b never heard of the job")
        assert not sb.autoscalers and not job.decisions

        await sa.bus.nc.close()  # brain-a dies: its lease stays behind, unrenewed
        await eventually(lambda: sb.own.owns("ha-die"), 6 * TTL + 10, "brain-b did not take the job over")
        auto = sb.autoscalers["ha-die"]
        assert auto.stage is Stage.SAMPLE and auto.plan == job.first
        assert sum(m.n for m in auto.measured.values()) == 1  # the sample brain-a measured
        assert sb.counters.values.get("autoscalers_handed_over", 0) == 1
        await feed(bus, job, 2)  # the second valid window: the sample is complete
        await eventually(lambda: job.decisions and job.plans, 15, "brain-b did not go on with the sample")
        await asyncio.sleep(0.5)
        assert len(job.decisions) == 1 and len(job.plans) == 1
        d = job.decisions[0]
        assert d.rule == "optimize" and d.previous == job.first and d.measured_throughput == pytest.approx(2000.0)
        assert sb.counters.values.get("replans", 0) == 1
        assert len(await bus.replay(subjects.brain_decision("ha-die"))) == 1
        st = await saved(bus, "ha-die")
        assert st is not None and st.auto is not None and st.auto.state["stage"] == Stage.ADJUST.value
        assert st.published == 1 and not st.outbox  # published, and written down as such
    finally:
        await stop_all(b, a)


async def _saved_with(bus: Bus, job: str, windows: int) -> OwnedJob | None:
    st = await saved(bus, job)
    return st if sample_windows(st) == windows else None


async def test_a_stale_owner_can_neither_save_nor_publish(url: str, bus: Bus) -> None:
    """brain-a's clock stands still: it stops renewing but keeps believing it owns the job.  brain-b takes
    the job over.  The window that completes the sample reaches both: brain-a decides too, but its fenced
    save is refused by the server, so it publishes nothing; brain-b's optimize plan is the only one."""
    a = brain(url, "brain-a", clock=lambda: 1000.0)
    sa = await a.start()
    b = brain(url, "brain-b")
    try:
        job = await start_job(bus, "ha-stale")
        assert await owner_of(bus, "ha-stale") == "brain-a"
        await eventually(lambda: sa.autoscalers["ha-stale"].plan == job.first, 10, "brain-a did not learn the plan")
        sb = await b.start()
        await hearing(bus, sb)
        await feed(bus, job, 0)
        await feed(bus, job, 1)
        await eventually(lambda: _saved_with(bus, "ha-stale", 1), 10, "the measured window was not saved")
        await eventually(lambda: sb.own.owns("ha-stale"), 6 * TTL + 10, "brain-b did not take the job over")
        assert await owner_of(bus, "ha-stale") == "brain-b"
        assert sa.own.owns("ha-stale")  # the stale owner still believes it
        await feed(bus, job, 2)
        await eventually(lambda: sa.counters.values.get("fenced", 0) >= 1, 15, "brain-a's save was not refused")
        await eventually(lambda: job.decisions, 15, "brain-b published nothing")
        await asyncio.sleep(0.5)
        assert len(job.decisions) == 1 and len(job.plans) == 1
        assert sa.counters.values.get("replans", 0) == 0 and sb.counters.values.get("replans", 0) == 1
        assert len(await bus.replay(subjects.job_event("ha-stale", subjects.JobEventKind.PLAN))) == 1
    finally:
        await stop_all(b, a)


async def test_a_dead_owners_outbox_is_published_once(url: str, bus: Bus) -> None:
    """A plan the last owner saved in its outbox is published by the next owner under the same message id:
    stored once whether the dead owner published it ("ghost-1") or died first ("ghost-2")."""
    for name, already in (("ghost-1", True), ("ghost-2", False)):
        await (await bus.kv(subjects.JOB_BUCKET)).put(name, encode(JobRecord(
            name, parse_job_spec(f"name: {name}\nmodel: wide_deep\ndataset: {{path: /d.rec}}\n"
                                 "resources: {workers: 2, ps: 1}\n"), JobState.RUNNING, time.time())))
        plan = ResourcePlan(name, 2, 1, 1.0, 4096, 1.0, 2048, PlanSource.BRAIN, reason="OOM prevention")
        lease = await Lease.open(bus, LEASE_BUCKET, lease_key(subjects.BRAIN_SERVICE, name), "ghost", TTL)
        assert await lease.acquire()
        await lease.fenced_put(state_key(subjects.BRAIN_SERVICE, name), encode_state(OwnedJob(
            oom_plan=plan, oom_at=time.time(), published=1, outbox=[Outgoing(f"brain-{name}-1-plan", plan=plan)])))
        if already:
            await bus.publish_durable(subjects.job_event(name, subjects.JobEventKind.PLAN), plan,
                                      msg_id=f"brain-{name}-1-plan")
    c = brain(url, "brain-c")
    sc = await c.start()
    try:
        for name in ("ghost-1", "ghost-2"):
            for _ in range(100):  # statistics are plain messages: until brain-c takes the job over
                await bus.publish(subjects.monitor_statistics(name), window(name, ResourcePlan(
                    name, 2, 1, 1.0, 4096, 1.0, 2048, PlanSource.USER), time.time(), 1000))
                if sc.own.owns(name):
                    break
                await asyncio.sleep(0.2)
            assert sc.own.owns(name)
            st = await eventually(lambda n=name: saved(bus, n), 10)
            await eventually(lambda n=name: _outbox_empty(bus, n), 10, "the outbox was not cleared")
            got = await bus.replay(subjects.job_event(name, subjects.JobEventKind.PLAN))
            assert len(got) == 1, name
            assert decode(ResourcePlan, got[0].data).reason == "OOM prevention"
            assert st is not None and sc.oom_plans[name].reason == "OOM prevention"  # pending, not yet applied
    finally:
        await stop_all(c)


async def _outbox_empty(bus: Bus, job: str) -> bool:
    st = await saved(bus, job)
    return st is not None and not st.outbox


def test_an_autoscaler_state_round_trips_through_json() -> None:
    """What a new owner loads decides like the original: same stage, samples and next decision."""
    cfg = BrainConfig(**CFG)  # type: ignore[arg-type]
    first = ResourcePlan("rt", 2, 2, 4.0, 2048, 4.0, 2048, PlanSource.BRAIN)
    orig = cfg.autoscaler(spec("rt"), first, warm=False)
    orig.applied(first, 0.0)
    t0 = 1000.0
    for i in range(2):
        assert orig.step(t0 + 30 * i, window("rt", first, t0 + 30 * i, 1000 * i)) is None
    data = json.dumps(autoscaler_state(orig))
    copy = cfg.autoscaler(spec("rt"), first, warm=False)
    load_autoscaler_state(copy, json.loads(data))
    assert copy.stage is Stage.SAMPLE and copy.plan == first
    assert {k: m.n for k, m in copy.measured.items()} == {k: m.n for k, m in orig.measured.items()} != {}
    w = window("rt", first, t0 + 60, 2000)
    d1, d2 = orig.step(t0 + 60, w), copy.step(t0 + 60, w)
    assert d1 is not None and d2 is not None and d1.plan == d2.plan and d1.rule == d2.rule
    assert autoscaler_state(orig) == autoscaler_state(copy)
    with pytest.raises((KeyError, ValueError, TypeError)):
        load_autoscaler_state(cfg.autoscaler(spec("rt"), first, warm=False), {"stage": "nowhere"})
    with pytest.raises(ValueError):
        decode_state(b'{"seq": 1}')


def test_a_warm_jobs_priors_are_handed_over_with_its_state() -> None:
    """A new owner rebuilds a warm job's autoscaler with the similar jobs' coefficients and calibration
    (the prior of its one configuration's model); a state saved before the calibration prior existed
    still loads, without one."""
    from pacer_services.brain.core.calibration import Calibration
    from pacer_services.brain.core.fitting import Coefficients
    from pacer_services.brain.state import AutoscalerSeed, seed_of

    cfg = BrainConfig(**CFG)  # type: ignore[arg-type]
    first = ResourcePlan("wm", 8, 4, 4.0, 2048, 2.0, 2048, PlanSource.BRAIN)
    prior = Coefficients(0.004, 0.0012, 0.04, 0.0, 0.1)
    cal = Calibration(worker_overhead=1.2, worker_cost=0.005, worker_parallel=5.0, ps_overhead=0.5,
                      ps_cost=0.0013, ps_skew=1.5, ps_parallel=8.0, memory_skew=1.6)
    auto = cfg.autoscaler(spec("wm"), first, warm=True, prior=prior, prior_calibration=cal)
    back = decode_state(encode_state(OwnedJob(seq=3, auto=seed_of(auto))))
    assert back.auto is not None
    assert (back.auto.prior, back.auto.prior_calibration, back.auto.warm) == (prior, cal, True)
    old = json.loads(encode_state(OwnedJob(seq=3, auto=seed_of(auto))))
    del old["auto"]["prior_calibration"]
    seed = decode_state(json.dumps(old).encode()).auto
    assert isinstance(seed, AutoscalerSeed) and seed.prior == prior and seed.prior_calibration is None


def test_a_jobs_team_is_handed_over_with_its_state() -> None:
    """The namespace (the team whose quota the job counts against) survives a handover; a state saved before
    teams had quotas loads in the default namespace."""
    from pacer_services.brain.state import seed_of

    cfg = BrainConfig(**CFG)  # type: ignore[arg-type]
    first = ResourcePlan("ns", 2, 1, 2.0, 2048, 2.0, 2048, PlanSource.BRAIN)
    auto = cfg.autoscaler(spec("ns"), first, warm=False, namespace="team-a")
    back = decode_state(encode_state(OwnedJob(seq=1, auto=seed_of(auto))))
    assert back.auto is not None and back.auto.namespace == "team-a"
    assert cfg.autoscaler(back.auto.spec, back.auto.first, warm=False, namespace=back.auto.namespace).namespace == "team-a"
    old = json.loads(encode_state(OwnedJob(seq=1, auto=seed_of(auto))))
    del old["auto"]["namespace"]
    seed = decode_state(json.dumps(old).encode()).auto
    assert seed is not None and seed.namespace == "default"


async def test_cluster_rounds_run_at_the_cluster_lease_holder_which_takes_the_autoscaled_jobs(
        url: str, bus: Bus) -> None:
    """While the cluster's capacity is unknown, whoever hears of a job first plans it alone.  Once the
    executor's ClusterStatus makes the capacity known, the rounds (across jobs) run only at the holder of
    ``brain._cluster``: the other instance hands its autoscaled job over at the job's next window, the
    holder claims it and feeds its windows to its rounds.  When the holder dies, the other instance
    takes the rounds and the job over."""
    from pacer.contracts.executor import ClusterStatus

    a = brain(url, "brain-a")
    sa = await a.start()
    b = brain(url, "brain-b")
    sb = await b.start()
    try:
        assert sa.own.owns("_cluster") and not sb.own.owns("_cluster")
        plan = ResourcePlan("cl-x", 2, 1, 1.0, 2048, 4.0, 4096, PlanSource.BRAIN)
        await (await bus.kv(subjects.JOB_BUCKET)).put("cl-x", encode(JobRecord(
            "cl-x", spec("cl-x"), JobState.RUNNING, time.time(), plan=plan)))
        await bus.publish_durable(subjects.executor_event("cl-x", "applied"),
                                  ExecutorEvent("cl-x", ExecutorEventKind.APPLIED, time.time(), plan=plan))
        assert await sb.own.claim("cl-x")  # brain-b heard of it first
        await eventually(lambda: sa.in_force("cl-x") == plan and sb.in_force("cl-x") == plan, 10)
        await bus.publish(subjects.monitor_statistics("cl-x"), window("cl-x", plan, time.time(), 1000))
        await eventually(lambda: "cl-x" in sb.autoscalers, 10, "brain-b did not plan its job")
        assert sa.counters.values.get("cluster_rounds", 0) == 0

        status = ClusterStatus(time.time(), "kubernetes", 0, 0, 32.0, 16.0, 1 << 20, 1 << 20,
                               reserves_capacity=True, machines=[])
        await bus.publish(subjects.cluster_status(), status)
        await eventually(lambda: sa.cluster is not None and sb.cluster is not None, 10)
        for i in range(1, 100):
            await bus.publish(subjects.monitor_statistics("cl-x"), window("cl-x", plan, time.time() + i, 1000 + i))
            if sa.counters.values.get("cluster_round_jobs", 0) >= 1:
                break
            await asyncio.sleep(0.2)
        assert sa.own.owns("cl-x") and not sb.own.owns("cl-x") and "cl-x" not in sb.autoscalers
        assert sb.counters.values.get("jobs_handed_to_rounds", 0) == 1
        assert sa.counters.values.get("cluster_round_jobs", 0) >= 1
        assert sb.counters.values.get("cluster_round_jobs", 0) == 0
        assert sa.autoscalers["cl-x"].plan == plan  # the state brain-b saved: the plan in force

        # brain-b stands by for the job; the holder dies: brain-b takes the rounds and the job over.
        await bus.publish(subjects.monitor_statistics("cl-x"), window("cl-x", plan, time.time() + 200, 2000))
        await eventually(lambda: sb.own.wanted("cl-x"), 10, "brain-b does not stand by for the job")
        await sa.bus.nc.close()
        for i in range(1, 150):
            await bus.publish(subjects.monitor_statistics("cl-x"), window("cl-x", plan, time.time() + 300 + i,
                                                                          3000 + i))
            if sb.counters.values.get("cluster_round_jobs", 0) >= 1:
                break
            await asyncio.sleep(0.2)
        assert sb.own.owns("_cluster") and sb.own.owns("cl-x")
        assert sb.counters.values.get("cluster_round_jobs", 0) >= 1
    finally:
        await stop_all(b, a)


class BrainProcess:
    """``python -m pacer_services.brain.main`` as a real OS process (so that it can be SIGKILLed)."""

    def __init__(self, url: str, instance: str, log_path: Path) -> None:
        self.url, self.instance, self.log_path = url, instance, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> BrainProcess:
        env = {**os.environ, "PACER_NATS_URL": self.url, "PACER_INSTANCE": self.instance,
               "PACER_LEASE_TTL_S": str(TTL), "PACER_BRAIN_CPU_QUOTA": "16", "PACER_BRAIN_NODE_CPU": "4",
               "PACER_BRAIN_ADJUST_S": "60", "PACER_BRAIN_SETTLE_S": "20", "PACER_LOG_LEVEL": "INFO"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pacer_services.brain.main"], env=env,
                                         stdout=log, stderr=log)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


async def test_owner_process_killed_mid_sample_the_other_process_goes_on(url: str, bus: Bus,
                                                                           tmp_path: Path) -> None:
    """Two brain processes; the job's owner has measured one valid window of the sample when it is
    SIGKILLed.  The other process takes the job over and the next window completes the sample: one
    optimize plan and one decision on the stream."""
    procs = {n: BrainProcess(url, n, tmp_path / f"{n}.log").start() for n in ("brain-0", "brain-1")}
    try:
        async def both_consuming() -> bool:  # each process's durable consumer exists: it has started
            names = {c.name for c in await bus.js.consumers_info(subjects.EVENTS_STREAM)}
            return {"brain-events-brain-0", "brain-events-brain-1"} <= names

        await eventually(both_consuming, 45, "the brain processes did not start")
        job = await start_job(bus, "ha-kill")
        first_owner = await owner_of(bus, "ha-kill")
        assert first_owner in procs
        await eventually(lambda: _plan_saved(bus, "ha-kill"), 15, "the owner did not learn the applied plan")
        await feed(bus, job, 0)
        await feed(bus, job, 1)
        st = await eventually(lambda: _saved_with(bus, "ha-kill", 1), 15, "the measured window was not saved")
        assert st.auto is not None and st.auto.state["stage"] == Stage.SAMPLE.value
        procs[first_owner].kill()
        other = next(n for n in procs if n != first_owner)
        await eventually(lambda: _owned_by(bus, "ha-kill", other), 6 * TTL + 15, "the other process took nothing")
        for _ in range(60):  # the window that completes the sample, until the new owner has loaded the job
            await feed(bus, job, 2)
            if job.decisions:
                break
            await asyncio.sleep(0.5)
        await eventually(lambda: job.decisions and job.plans, 15, "the new owner did not go on with the sample")
        assert job.decisions[0].rule == "optimize" and job.decisions[0].previous == job.first
        assert len(await bus.replay(subjects.brain_decision("ha-kill"))) == 1
        assert len(await bus.replay(subjects.job_event("ha-kill", subjects.JobEventKind.PLAN))) == 1
    finally:
        for p in procs.values():
            p.kill()


async def _owned_by(bus: Bus, job: str, instance: str) -> bool:
    return await owner_of(bus, job) == instance


async def _plan_saved(bus: Bus, job: str) -> bool:
    st = await saved(bus, job)
    return st is not None and st.auto is not None and st.auto.state["plan"] is not None
