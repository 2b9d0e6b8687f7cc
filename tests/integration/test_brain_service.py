"""The brain service over a real nats-server: cold and warm starts, the config DB, bad input."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from conftest import InProcess
from pacer import subjects
from pacer.bus import NO_RETRY, Bus
from pacer.codec import encode
from pacer.contracts.brain import HistoryList, HistoryQuery, PlanRequest
from pacer.contracts.jobs import (
    JobEvent,
    JobProgress,
    JobRecord,
    JobState,
    PlanSource,
    ResourcePlan,
)
from pacer.embedded import EmbeddedNats
from pacer.errors import ValidationError
from pacer.jobs.spec import DEFAULT_PLAN, parse_job_spec
from pacer_services.brain.app import BrainService

pytestmark = pytest.mark.timeout(60)


def spec(name: str, model: str = "wide_deep", extra: str = ""):  # type: ignore[no-untyped-def]
    return parse_job_spec(f"name: {name}\nmodel: {model}\ndataset: {{path: /data/day0.rec}}\n{extra}")


@pytest.fixture
async def brain(nats_server: EmbeddedNats) -> AsyncIterator[InProcess[BrainService]]:
    b = InProcess(nats_server.url, BrainService)
    await b.start()
    yield b
    await b.stop()


async def plan_for(bus: Bus, name: str, model: str = "wide_deep", extra: str = "") -> ResourcePlan:
    return await bus.request(subjects.brain_rpc(name, subjects.BrainOp.PLAN),
                             PlanRequest(name, spec(name, model, extra), 1_000_000), ResourcePlan, retry=NO_RETRY)


async def finish(bus: Bus, name: str, workers: int, ps: int, worker_cpu: float, model: str = "wide_deep") -> None:
    plan = ResourcePlan(name, workers, ps, worker_cpu, 4096, 4.0, 8192, PlanSource.BRAIN)
    now = time.time()
    rec = JobRecord(name, spec(name, model), JobState.COMPLETED, now - 600, started_at=now - 500,
                    finished_at=now, plan=plan, records=1_000_000,
                    progress=JobProgress(shards_total=10, shards_done=10, records_done=1_000_000,
                                         records_total=1_000_000))
    await (await bus.kv(subjects.JOB_BUCKET)).put(name, encode(rec))
    await bus.publish_durable(subjects.job_event(name, "completed"),
                              JobEvent(name, JobState.COMPLETED, now, "every dataset finished", JobState.RUNNING))


async def history(bus: Bus, model: str = "") -> HistoryList:
    return await bus.request(subjects.brain_rpc(subjects.ALL_JOBS, subjects.BrainOp.HISTORY),
                             HistoryQuery(model), HistoryList, retry=NO_RETRY)


async def wait_history(bus: Bus, n: int) -> HistoryList:
    for _ in range(100):
        h = await history(bus)
        if len(h.jobs) >= n:
            return h
        await asyncio.sleep(0.05)
    raise AssertionError(f"config DB has {len(h.jobs)} jobs, not {n}")


async def test_cold_start_then_warm_start_from_finished_jobs(brain: InProcess[BrainService], bus: Bus) -> None:
    cold = await plan_for(bus, "new-1")
    assert cold.source is PlanSource.BRAIN and "cold start" in cold.reason
    assert (cold.workers, cold.ps, cold.worker_memory_mb) == (DEFAULT_PLAN.workers, DEFAULT_PLAN.ps,
                                                              DEFAULT_PLAN.worker_memory_mb)
    await finish(bus, "old-a", 8, 4, 3.0)
    await finish(bus, "old-b", 12, 4, 3.0)
    await finish(bus, "old-dcn", 2, 1, 1.0, model="dcn")
    h = await wait_history(bus, 3)
    assert {e.job for e in h.jobs} == {"old-a", "old-b", "old-dcn"}
    assert all(e.throughput == pytest.approx(2000.0, rel=0.05) for e in h.jobs)  # 1M records in 500 s
    warm = await plan_for(bus, "new-2")
    assert "warm start" in warm.reason and warm.reason.index("old-b") < warm.reason.index("old-dcn")
    # Alg. 1 by hand, mu = 0.6, least similar first (old-dcn, then old-a, then the newer twin old-b):
    # workers 2 -> 0.6*8 + 0.4*2 = 5.6 -> 0.6*12 + 0.4*5.6 = 9.44; ps 1 -> 2.8 -> 3.52; cpu 1 -> 2.2 -> 2.68
    assert (warm.workers, warm.ps, warm.worker_cpu) == (9, 4, 2.7)
    limited = await plan_for(bus, "new-3", extra="limits: {max_workers: 5}\n")
    assert limited.workers == 5  # the spec's limits still win
    assert [e.job for e in (await history(bus, "dcn")).jobs] == ["old-dcn"]


async def test_config_db_survives_a_restart_and_bad_requests_are_refused(
        brain: InProcess[BrainService], bus: Bus, nats_server: EmbeddedNats) -> None:
    await finish(bus, "kept", 6, 2, 2.0)
    await wait_history(bus, 1)
    await brain.stop()
    again = InProcess(nats_server.url, BrainService)
    await again.start()
    try:
        assert [e.job for e in (await history(bus)).jobs] == ["kept"]
        assert "warm start" in (await plan_for(bus, "after")).reason
        with pytest.raises(ValidationError, match="job"):
            await bus.request(subjects.brain_rpc("x1", subjects.BrainOp.PLAN), PlanRequest("x2", spec("x2")),
                              ResourcePlan, retry=NO_RETRY)
        with pytest.raises(ValidationError, match="limit"):
            await bus.request(subjects.brain_rpc(subjects.ALL_JOBS, subjects.BrainOp.HISTORY), HistoryQuery("", 0),
                              HistoryList, retry=NO_RETRY)
        await bus.nc.publish(subjects.brain_rpc("x3", subjects.BrainOp.PLAN), b"\x01")  # garbage: no crash
        assert (await plan_for(bus, "still-up")).source is PlanSource.BRAIN
    finally:
        await again.stop()


async def test_pacer_history_lists_the_config_db(brain: InProcess[BrainService], bus: Bus,
                                                 nats_server: EmbeddedNats,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from pacer.cli import main

    await finish(bus, "listed", 6, 2, 2.0, model="dcn")
    await wait_history(bus, 1)
    rc = await asyncio.to_thread(main, ["history", "--nats", nats_server.url])
    out = capsys.readouterr().out
    assert rc == 0 and "listed" in out and "dcn" in out and "2,000" in out
    rc = await asyncio.to_thread(main, ["history", "--nats", nats_server.url, "--model", "xdeepfm"])
    assert rc == 0 and "empty" in capsys.readouterr().out


def stats_window(job: str, t: float, ps_rss_mb: float, done: int, total: int = 10_000_000,
                 ps_cpu_percent: float = 90.0) -> Any:
    from pacer.contracts.monitor import JobStatistics, NodeState, NodeStats, ShardSummary

    def node(name: str, role: str, rss_mb: float) -> NodeStats:
        return NodeStats(node=name, role=role, bpt_short_s=0.1, bpt_long_s=0.1, speed_samples_per_s=1000.0,
                         samples_total=done, cpu_percent=ps_cpu_percent if role == "ps" else 90.0, rss_bytes=int(rss_mb * (1 << 20)), last_seen=t,
                         state=NodeState.RUNNING, pending_s=0.0, restarts=0, slowdown_short=1.0,
                         slowdown_long=1.0)

    return JobStatistics(job=job, ts=t, window_short_s=300.0, window_long_s=600.0, throughput_samples_per_s=2000.0,
                         nodes=[node("ps-0", "ps", ps_rss_mb), node("ps-1", "ps", 500.0),
                                node("worker-0", "worker", 700.0), node("worker-1", "worker", 700.0)],
                         shards=ShardSummary(todo=5, doing=2, done=3, failed=0, records_done=done,
                                             records_total=total))


async def running_job(bus: Bus, name: str) -> None:
    plan = ResourcePlan(name, 2, 2, 1.0, 2048, 1.0, 1024, PlanSource.BRAIN)
    rec = JobRecord(name, spec(name), JobState.RUNNING, time.time(), plan=plan, records=10_000_000)
    await (await bus.kv(subjects.JOB_BUCKET)).put(name, encode(rec))


async def test_a_ps_whose_memory_grows_gets_more_before_it_would_oom(
        brain: InProcess[BrainService], bus: Bus) -> None:
    """DLRover-RM §5.3: ps-0 grows 30 MiB per 10 s window; at 2,000 samples/s the job has ~80 min
    left, far past its 1,024 MiB limit: a plan with more PS memory goes out before the OOM."""
    from pacer.codec import decode

    got: list[ResourcePlan] = []

    async def on_plan(msg: Any) -> None:
        got.append(decode(ResourcePlan, msg.data))

    await bus.nc.subscribe(subjects.events_of("job", kind=subjects.JobEventKind.PLAN), cb=on_plan)
    await running_job(bus, "growing")
    await running_job(bus, "flat")
    t0 = time.time()
    for i in range(8):
        await bus.publish(subjects.monitor_statistics("growing"), stats_window("growing", t0 + 10 * i, 600 + 30 * i,
                                                                                 200_000 + 20_000 * i))
        await bus.publish(subjects.monitor_statistics("flat"), stats_window("flat", t0 + 10 * i, 600.0,
                                                                              200_000 + 20_000 * i))
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.05)
    assert [p.job for p in got] == ["growing"]  # the flat job needs nothing
    plan = got[0]
    assert plan.source is PlanSource.BRAIN and "OOM prevention" in plan.reason and "ps-0" in plan.reason
    assert plan.ps_memory_mb > 1024 and plan.worker_memory_mb == 2048  # only the PS memory moves
    assert plan.ps_memory_mb % 64 == 0
    # while it would still be within its limit for a long time: nothing more within the cool-down
    await bus.publish(subjects.monitor_statistics("growing"), stats_window("growing", t0 + 90, 880, 400_000))
    await asyncio.sleep(0.5)
    assert len(got) == 1


async def test_a_zero_config_job_is_re_planned_while_it_runs(nats_server: EmbeddedNats, bus: Bus) -> None:
    """DLRover 2023 §4.2 over the bus: the cold plan is measured as the sample; once the executor says
    it is applied and the monitor's windows show it running, the brain publishes the optimize plan
    (Eq. 10-11) as a plan event and a BrainDecision; the executor's reported pause feeds Eq. 8;
    malformed statistics are counted and change nothing."""
    from pacer.codec import decode
    from pacer.contracts.brain import BrainDecision
    from pacer.contracts.executor import ExecutorEvent, ExecutorEventKind
    from pacer_services.brain.app import BrainConfig
    from pacer_services.brain.core.cluster import ScalingKind

    cfg = BrainConfig(cpu_quota=16.0, node_cpu=4.0, adjust_interval_s=60.0, settle_s=20.0)
    b = InProcess(nats_server.url, lambda bb: BrainService(bb, config=cfg))
    svc = await b.start()
    try:
        plans: list[ResourcePlan] = []
        decisions: list[BrainDecision] = []

        async def on_plan(msg: Any) -> None:
            plans.append(decode(ResourcePlan, msg.data))

        async def on_decision(msg: Any) -> None:
            decisions.append(decode(BrainDecision, msg.data))

        await bus.nc.subscribe(subjects.job_event("auto", subjects.JobEventKind.PLAN), cb=on_plan)
        await bus.nc.subscribe(subjects.brain_decision("auto"), cb=on_decision)
        first = await plan_for(bus, "auto")
        user = await plan_for(bus, "fixed", extra="resources: {workers: 2}")
        assert "auto" in svc.autoscalers and "fixed" not in svc.autoscalers  # user resources: not re-planned
        await bus.publish(subjects.executor_event("auto", "applied"),
                          ExecutorEvent("auto", ExecutorEventKind.APPLIED, time.time(), plan=first, overhead_s=15.0))
        await bus.nc.publish(subjects.monitor_statistics("auto"), b"\x00not msgpack")
        t0 = time.time()
        # 2 workers using 0.9 cores each, 2 PS using 0.3 cores together, 2,000 samples/s
        for i in range(4):
            w = stats_window("auto", t0 + 30 * i, 600.0, 100_000 * i, ps_cpu_percent=15.0)
            await bus.publish(subjects.monitor_statistics("auto"), w)
        for _ in range(100):
            if plans and decisions:
                break
            await asyncio.sleep(0.05)
        assert len(plans) == 1 and len(decisions) == 1, (plans, decisions)
        d = decisions[0]
        assert d.rule == "optimize" and d.stage == "adjust" and d.previous is not None
        assert (d.previous.workers, d.previous.ps) == (first.workers, first.ps)
        # Eq. 10 on the measured sample: N_w = floor(16 / (w-hat + s-hat)) = 15 (w-hat 0.9, s-hat 0.3 / 2);
        # Eq. 11: s_total = 16 - 15 x 0.9 = 2.5 -> 1 PS of 2 CPUs; 15 x 1 + 2 > 16, so one worker goes
        assert (plans[0].workers, plans[0].ps, plans[0].ps_cpu) == (14, 1, 2.0)
        assert plans[0].source is PlanSource.BRAIN and "N_w=15.2 (Eq. 10)" in plans[0].reason
        assert d.measured_throughput == pytest.approx(2000.0) and d.plan == plans[0]
        assert sum(v for k, v in svc.counters.snapshot().items() if k.startswith("bad_events")) == 1
        # the executor applies it and reports the pause it paid: the next decision's Eq. 8 overhead
        await bus.publish(subjects.executor_event("auto", "applied"),
                          ExecutorEvent("auto", ExecutorEventKind.APPLIED, time.time(), plan=plans[0],
                                        overhead_s=42.0))
        for _ in range(100):
            if svc.autoscalers["auto"].plan == plans[0]:
                break
            await asyncio.sleep(0.05)
        auto = svc.autoscalers["auto"]
        assert [(r.kind, r.pause_s) for r in auto.pauses] == [(ScalingKind.WORKERS if plans[0].ps == first.ps
                                                               else ScalingKind.PS, 42.0)]
        assert auto.overhead_model().pause_s(first, plans[0]) == 42.0
        assert user.workers == 2
    finally:
        await b.stop()
