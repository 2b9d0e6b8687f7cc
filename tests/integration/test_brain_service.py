"""The brain service over a real nats-server: cold and warm starts, the config DB, bad input."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import pytest
from conftest import InProcess, eventually, wait_ready
from pacer import subjects
from pacer.bus import NO_RETRY, Bus, RetryPolicy
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

pytestmark = pytest.mark.timeout(180)

# How long a test waits for the brain to act: a bound for a hung test only (the brain's fits run in a
# thread, slow on a loaded machine); every wait ends as soon as its condition holds.
WAIT_S = 60.0


T = TypeVar("T")


def spec(name: str, model: str = "wide_deep", extra: str = ""):  # type: ignore[no-untyped-def]
    return parse_job_spec(f"name: {name}\nmodel: {model}\ndataset: {{path: /data/day0.rec}}\n{extra}")


@pytest.fixture
async def brain(nats_server: EmbeddedNats) -> AsyncIterator[InProcess[BrainService]]:
    b = InProcess(nats_server.url, BrainService)
    await b.start()
    yield b
    await b.stop()


async def plan_for(bus: Bus, name: str, model: str = "wide_deep", extra: str = "") -> ResourcePlan:
    """The brain's plan for a new job, asked as the job service asks: a temporary ``unavailable`` (the job's
    owner changing, which a CPU-starved run saw right after the brain started) is retried."""
    return await bus.request(subjects.brain_rpc(name, subjects.BrainOp.PLAN),
                             PlanRequest(name, spec(name, model, extra), 1_000_000), ResourcePlan,
                             retry=RetryPolicy(attempts=5))


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
    async def enough() -> HistoryList | None:
        h = await history(bus)
        return h if len(h.jobs) >= n else None

    got: HistoryList = await eventually(enough, WAIT_S, f"fewer than {n} jobs in the brain's history")
    return got


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
    await wait_ready(bus, "brain")  # its subscriptions are visible to other connections
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
    from pacer_services.cli.main import main

    await finish(bus, "listed", 6, 2, 2.0, model="dcn")
    await wait_history(bus, 1)
    rc = await asyncio.to_thread(main, ["history", "--nats", nats_server.url])
    out = capsys.readouterr().out
    assert rc == 0 and "listed" in out and "dcn" in out and "2,000" in out
    rc = await asyncio.to_thread(main, ["history", "--nats", nats_server.url, "--model", "xdeepfm"])
    assert rc == 0 and "empty" in capsys.readouterr().out


def stats_window(job: str, t: float, ps_rss_mb: float, done: int, total: int = 10_000_000,
                 ps_cpu_percent: float = 90.0) -> Any:
    from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, ShardSummary

    def node(name: str, role: str, rss_mb: float) -> NodeStats:
        return NodeStats(node=name, role=role, bpt_short_s=0.1, bpt_long_s=0.1, speed_samples_per_s=1000.0,
                         samples_total=done, cpu_percent=ps_cpu_percent if role == "ps" else 90.0, rss_bytes=int(rss_mb * (1 << 20)), last_seen=t,
                         state=Liveness.RUNNING, pending_s=0.0, restarts=0, slowdown_short=1.0,
                         slowdown_long=1.0)

    return JobStatistics(job=job, ts=t, window_short_s=300.0, window_long_s=600.0, throughput_samples_per_s=2000.0,
                         nodes=[node("ps-0", "ps", ps_rss_mb), node("ps-1", "ps", 500.0),
                                node("worker-0", "worker", 700.0), node("worker-1", "worker", 700.0)],
                         shards=ShardSummary(todo=5, doing=2, done=3, failed=0, records_done=done,
                                             records_total=total))


async def applied(bus: Bus, svc: BrainService | None, plan: ResourcePlan) -> None:
    """The executor's part: ``plan`` applied (an ``applied`` event), and the brain has folded it in."""
    from pacer.contracts.executor import ExecutorEvent, ExecutorEventKind

    await bus.publish(subjects.executor_event(plan.job, "applied"),
                      ExecutorEvent(plan.job, ExecutorEventKind.APPLIED, time.time(), plan=plan, overhead_s=30.0))
    assert svc is not None
    await eventually(lambda: svc.in_force(plan.job) == plan, WAIT_S, f"the brain did not learn {plan.job}'s plan")


async def running_job(bus: Bus, name: str, svc: BrainService | None) -> None:
    """A running job with the user's resources (the brain does not re-plan it, it only prevents OOMs): the job
    service's record, and its plan applied by the executor (2 workers x (1 CPU, 2,048 MiB), 2 PS x (1 CPU,
    1,024 MiB))."""
    plan = ResourcePlan(name, 2, 2, 1.0, 2048, 1.0, 1024, PlanSource.USER)
    rec = JobRecord(name, spec(name, extra="resources: {workers: 2, ps: 2}\n"), JobState.RUNNING, time.time(),
                    plan=plan, records=10_000_000)
    await (await bus.kv(subjects.JOB_BUCKET)).put(name, encode(rec))
    await applied(bus, svc, plan)


async def test_a_ps_whose_memory_grows_gets_more_before_it_would_oom(
        brain: InProcess[BrainService], bus: Bus) -> None:
    """DLRover-RM §5.3: ps-0 grows 30 MiB per 10 s window; at 2,000 samples/s the job has ~80 min
    left, far past its 1,024 MiB limit: a plan with more PS memory goes out before the OOM."""

    got = await collect(bus, subjects.events_of("job", kind=subjects.JobEventKind.PLAN), ResourcePlan)
    await running_job(bus, "growing", brain.svc)
    await running_job(bus, "flat", brain.svc)
    t0 = time.time()
    for i in range(8):
        await bus.publish(subjects.monitor_statistics("growing"), stats_window("growing", t0 + 10 * i, 600 + 30 * i,
                                                                                 200_000 + 20_000 * i))
        await bus.publish(subjects.monitor_statistics("flat"), stats_window("flat", t0 + 10 * i, 600.0,
                                                                              200_000 + 20_000 * i))
    await eventually(lambda: got, WAIT_S, "no plan")
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
    from pacer.contracts.brain import BrainDecision
    from pacer.contracts.executor import ExecutorEvent, ExecutorEventKind
    from pacer_services.brain.app import BrainConfig
    from pacer_services.brain.core.cluster import ScalingKind

    cfg = BrainConfig(cpu_quota=16.0, node_cpu=4.0, adjust_interval_s=60.0, settle_s=20.0)
    b = InProcess(nats_server.url, lambda bb: BrainService(bb, config=cfg))
    svc = await b.start()
    try:
        plans = await collect(bus, subjects.job_event("auto", subjects.JobEventKind.PLAN), ResourcePlan)
        decisions = await collect(bus, subjects.brain_decision("auto"), BrainDecision)
        first = await plan_for(bus, "auto")
        user = await plan_for(bus, "fixed", extra="resources: {workers: 2}")
        assert "auto" in svc.autoscalers and "fixed" not in svc.autoscalers  # user resources: not re-planned
        await bus.publish(subjects.executor_event("auto", "applied"),
                          ExecutorEvent("auto", ExecutorEventKind.APPLIED, time.time(), plan=first, overhead_s=15.0))
        await eventually(lambda: svc.autoscalers["auto"].plan == first, WAIT_S, "the applied event was not folded in")
        await bus.nc.publish(subjects.monitor_statistics("auto"), b"\x00not msgpack")
        t0 = time.time()
        # 2 workers using 0.9 cores each, 2 PS using 0.3 cores together, 2,000 samples/s
        for i in range(4):
            w = stats_window("auto", t0 + 30 * i, 600.0, 100_000 * i, ps_cpu_percent=15.0)
            await bus.publish(subjects.monitor_statistics("auto"), w)
        await eventually(lambda: plans and decisions, WAIT_S, "no plan and decision")
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
        await eventually(lambda: svc.autoscalers["auto"].plan == plans[0], WAIT_S, "the new plan was not folded in")
        auto = svc.autoscalers["auto"]
        assert [(r.kind, r.pause_s) for r in auto.pauses] == [(ScalingKind.WORKERS if plans[0].ps == first.ps
                                                               else ScalingKind.PS, 42.0)]
        assert auto.overhead_model().pause_s(first, plans[0]) == 42.0
        assert user.workers == 2
        # its end records what its readings said, and a similar job's warm start brings it as the prior of
        # its calibration (what its one configuration cannot tell)
        learnt = auto.learnt_calibration()
        assert learnt is not None
        await finish(bus, "auto", plans[0].workers, plans[0].ps, plans[0].worker_cpu)
        await eventually(lambda: "auto" in svc.history, WAIT_S, "the job end was not recorded")
        assert svc.history["auto"].calibration == learnt and svc.history["auto"].coefficients == auto.learnt()
        assert "warm start" in (await plan_for(bus, "auto-2")).reason
        assert svc.autoscalers["auto-2"].warm and svc.autoscalers["auto-2"].prior_calibration == learnt
    finally:
        await b.stop()


async def test_a_worker_whose_memory_grows_gets_more_worker_memory_before_it_would_oom(
        brain: InProcess[BrainService], bus: Bus) -> None:
    """DLRover-RM §5.3 for workers: worker-1 of one job grows 20 MiB per 10 s window from 1,500 MiB (at most
    1,640 MiB here, under its 2,048 MiB limit, which it would cross within the lead of 15 min); the job has
    ~80 min left.  The brain publishes a plan with more worker memory (the executor then replaces the
    workers), leaving the PS memory alone; a job whose workers stay flat gets no plan."""
    from dataclasses import replace

    from pacer.contracts.monitor import JobStatistics

    def with_rss(stats: JobStatistics, node: str, rss_mb: float) -> JobStatistics:
        return replace(stats, nodes=[replace(n, rss_bytes=int(rss_mb * (1 << 20))) if n.node == node else n
                                     for n in stats.nodes])

    got = await collect(bus, subjects.events_of("job", kind=subjects.JobEventKind.PLAN), ResourcePlan)
    await running_job(bus, "wgrow", brain.svc)  # 2 workers x 2,048 MiB, 2 PS x 1,024 MiB
    await running_job(bus, "wflat", brain.svc)
    t0 = time.time()
    published: list[float] = []
    for i in range(8):
        done = 200_000 + 20_000 * i
        rss = 1500.0 + 20.0 * i
        published.append(rss)
        await bus.publish(subjects.monitor_statistics("wgrow"),
                          with_rss(stats_window("wgrow", t0 + 10 * i, 600.0, done), "worker-1", rss))
        await bus.publish(subjects.monitor_statistics("wflat"),
                          with_rss(stats_window("wflat", t0 + 10 * i, 600.0, done), "worker-1", 1500.0))
    await eventually(lambda: got, WAIT_S, "no plan")
    await asyncio.sleep(0.3)  # a plan for the flat job would have come by now too
    assert [p.job for p in got] == ["wgrow"]
    plan = got[0]
    assert max(published) < 2048  # raised before the limit, not after an OOM
    assert plan.source is PlanSource.BRAIN and "OOM prevention" in plan.reason and "worker-1" in plan.reason
    assert "worker-0" not in plan.reason and "ps-" not in plan.reason
    # sized for the job's end: 2 MiB/s for the (10M - 340k) / 2,000 records/s left, x 1.2 headroom
    end_mb = published[-1] + 2.0 * (10_000_000 - 340_000) / 2000.0
    assert 1.2 * end_mb <= plan.worker_memory_mb <= 1.25 * end_mb and plan.worker_memory_mb % 64 == 0
    assert (plan.ps_memory_mb, plan.workers, plan.ps, plan.worker_cpu) == (1024, 2, 2, 1.0)


# ------------------------------------------------------------------ the cluster: placement (Dike)


def cluster_status(machines: list[Any], *, backend: str = "kubernetes", reserves: bool = True,
                   total_cpu: float = 0.0, free_cpu: float = 0.0) -> Any:
    from pacer.contracts.executor import ClusterStatus

    return ClusterStatus(time.time(), backend, 0, 0, total_cpu, free_cpu, 1 << 20, 1 << 20,
                         reserves_capacity=reserves, machines=machines)


def machine(name: str, free_cpu: float, free_mb: int, **held: tuple[float, int]) -> Any:
    from pacer.contracts.executor import MachineInfo

    return MachineInfo(name, 16.0, 65536, free_cpu, free_mb, {j: c for j, (c, _) in held.items()},
                       {j: m for j, (_, m) in held.items()})


def check_placement(plan: ResourcePlan, machines: list[Any]) -> None:
    """Every node of the plan placed on a known machine, each within its free capacity plus the job's own."""
    nodes = {f"ps-{i}": (plan.ps_cpu, plan.ps_memory_mb) for i in range(plan.ps)}
    nodes |= {f"worker-{i}": (plan.worker_cpu, plan.worker_memory_mb) for i in range(plan.workers)}
    assert set(plan.placement) == set(nodes), plan.placement
    for m in machines:
        on = [nodes[n] for n, host in plan.placement.items() if host == m.name]
        assert sum(c for c, _ in on) <= m.free_cpu + m.held_cpu.get(plan.job, 0.0) + 1e-9, (m.name, plan.placement)
        assert sum(b for _, b in on) <= m.free_memory_mb + m.held_memory_mb.get(plan.job, 0), (m.name, plan.placement)
    assert {h for h in plan.placement.values()} <= {m.name for m in machines}


async def test_plans_carry_a_dike_placement_over_the_executors_machines(
        brain: InProcess[BrainService], bus: Bus) -> None:
    """Dike over the bus: with three machines known, the first plan (RPC) and an OOM-prevention plan
    (event) each place every node within what the machines can give the job, counting the job's own pods
    as its to move; a malformed ClusterStatus is counted and the last good one stays in use; with machines
    too small for the plan, the plan still goes out, unplaced, saying why."""

    svc = brain.svc
    assert svc is not None
    async def report(machines: list[Any]) -> None:
        """The executor's ClusterStatus, and wait until the brain has it."""
        await bus.publish(subjects.cluster_status(), cluster_status(machines))
        await eventually(lambda: svc.cluster is not None and svc.machines == machines, WAIT_S,
                         "the brain did not take the ClusterStatus")

    got = await collect(bus, subjects.job_event("growing", subjects.JobEventKind.PLAN), ResourcePlan)
    assert not (await plan_for(bus, "before")).placement  # no machines known yet: anywhere
    # "growing" runs 2 PS + 2 workers already, 3 CPUs and 6 GiB of them on m1.
    machines = [machine("m0", 2.0, 19456), machine("m1", 0.5, 1024, growing=(3.0, 6144)),
                machine("m2", 2.0, 19456)]
    await report(machines)
    await bus.nc.publish(subjects.cluster_status(), b"\x01 not msgpack")
    await bus.publish(subjects.cluster_status(), cluster_status([machine("x", float("nan"), 1024),
                                                                 machine("y", 1.0, 1024)]))
    await eventually(lambda: sum(v for k, v in svc.counters.snapshot().items() if k.startswith("bad_events")) >= 2,
                     WAIT_S, "the bad events were not counted")
    assert sum(v for k, v in svc.counters.snapshot().items() if k.startswith("bad_events")) == 2
    assert svc.machines == machines  # the last good one is still in use

    first = await plan_for(bus, "fresh")  # the default plan: 4 nodes of 1 CPU and 2,048 MiB
    check_placement(first, machines)
    assert "placed on" in first.reason and set(first.placement.values()) == {"m0", "m2"}

    await report(machines)  # the executor's next report (before "fresh" holds anything)
    await running_job(bus, "growing", svc)  # 2 workers x (1 CPU, 2,048 MiB), 2 PS x (1 CPU, 1,024 MiB)
    t0 = time.time()
    for i in range(8):
        await bus.publish(subjects.monitor_statistics("growing"),
                          stats_window("growing", t0 + 10 * i, 600 + 30 * i, 200_000 + 20_000 * i))
    await eventually(lambda: got, WAIT_S, "no plan")
    assert len(got) == 1 and "OOM prevention" in got[0].reason
    oom = got[0]
    assert oom.ps_memory_mb > 2048  # so a PS and a worker no longer share m0 or m2
    check_placement(oom, machines)
    # The workers fit only on m1, in the room the job's own pods hold there (0.5 CPUs are free).
    assert oom.placement["worker-0"] == oom.placement["worker-1"] == "m1"

    # Machines that cannot take the plan: it goes out anyway, without a placement, saying why.
    await report([machine("s0", 0.5, 512), machine("s1", 0.5, 512)])
    small = await plan_for(bus, "too-big")
    assert small.placement == {} and "no placement" in small.reason
    assert (small.workers, small.ps) == (DEFAULT_PLAN.workers, DEFAULT_PLAN.ps)


# ------------------------------------------------------------------ the cluster: one round across jobs


def truth_window(job: str, plan: ResourcePlan, ts: float, beta: float) -> Any:
    """A window of a job whose true throughput has DLRover-RM Eq. 1-5's form (the unit tests' Truth): 512
    samples per worker step, 0.02 core-s per sample on a worker (4 cores at most), 0.0133 core-s on the PS
    (which caps it), ``beta`` s of fixed cost per step."""
    from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, ShardSummary

    cw = min(plan.worker_cpu, 4.0)
    psi = min(plan.workers * 512 / (0.02 * 512 / cw + 0.002 * plan.workers / plan.ps + beta),
              plan.ps * plan.ps_cpu / 0.0133)
    w_use, p_use = min(cw, 0.02 * psi / plan.workers), min(plan.ps_cpu, 0.0133 * psi / plan.ps)

    def node(name: str, role: str, cpu: float, rss_mb: float) -> NodeStats:
        return NodeStats(node=name, role=role, bpt_short_s=0.1, bpt_long_s=0.1, speed_samples_per_s=0.0,
                         samples_total=0, cpu_percent=cpu * 100, rss_bytes=int(rss_mb * (1 << 20)), last_seen=ts,
                         state=Liveness.RUNNING, pending_s=0.0, restarts=0, slowdown_short=1.0, slowdown_long=1.0)

    nodes = [node(f"worker-{i}", "worker", w_use, 1500.0) for i in range(plan.workers)]
    nodes += [node(f"ps-{j}", "ps", p_use, 600.0 + 500.0 / plan.ps) for j in range(plan.ps)]
    return JobStatistics(job=job, ts=ts, window_short_s=60.0, window_long_s=300.0, throughput_samples_per_s=psi,
                         nodes=nodes, shards=ShardSummary(todo=1, doing=1, done=0, failed=0, records_done=0,
                                                          records_total=10**10))


def count(svc: BrainService, name: str) -> int:
    n: int = svc.counters.snapshot().get(name, 0)
    return n


async def collect(bus: Bus, subject: str, cls: type[T], into: list[T] | None = None) -> list[T]:
    """A list that every message on ``subject`` from now on is decoded into (``into``: an existing one)."""
    from pacer.codec import decode

    got: list[T] = [] if into is None else into

    async def on_msg(msg: Any) -> None:
        got.append(decode(cls, msg.data))

    await bus.nc.subscribe(subject, cb=on_msg)
    return got


async def run_two_jobs(nats_server: EmbeddedNats, bus: Bus, names: tuple[str, str], *, reserves: bool,
                       ticks: int = 10) -> tuple[list[float], list[Any]]:
    """Two running zero-config jobs (2 workers x 1 CPU + 1 PS x 4 CPUs each, as after a brain restart) of
    quota 20 CPUs each, on a cluster of 32 CPUs of which other tenants use 8; a window each per minute, the
    executor's ClusterStatus before each, and the executor's part played by the test: each plan published
    is applied at once.  Returns the CPUs the two hold after each tick, and every BrainDecision."""
    from pacer.contracts.brain import BrainDecision
    from pacer.contracts.executor import ExecutorEvent, ExecutorEventKind
    from pacer_services.brain.app import BrainConfig
    from pacer_services.brain.core.autoscaler import same_resources

    cfg = BrainConfig(cpu_quota=20.0, node_cpu=4.0, adjust_interval_s=120.0, settle_s=30.0, round_delay_s=0.3)
    b = InProcess(nats_server.url, lambda bb: BrainService(bb, config=cfg))
    svc = await b.start()
    plans: dict[str, ResourcePlan] = {}
    decisions: list[BrainDecision] = []
    published: list[ResourcePlan] = []
    try:
        for name in names:
            await collect(bus, subjects.job_event(name, subjects.JobEventKind.PLAN), ResourcePlan, published)
            await collect(bus, subjects.brain_decision(name), BrainDecision, decisions)
            plans[name] = ResourcePlan(name, 2, 1, 1.0, 2048, 4.0, 4096, PlanSource.BRAIN)
            job_spec = spec(name, extra="batch_size: 1024\n")
            rec = JobRecord(name, job_spec, JobState.RUNNING, time.time(), plan=plans[name], records=10**10)
            await (await bus.kv(subjects.JOB_BUCKET)).put(name, encode(rec))
            await applied(bus, svc, plans[name])  # the brain resumes the job from the executor's event
        held: list[float] = []
        t0 = time.time()
        for tick in range(1, ticks + 1):
            used = sum(p.workers * p.worker_cpu + p.ps * p.ps_cpu for p in plans.values())
            await bus.publish(subjects.cluster_status(), cluster_status(
                [], backend="kubernetes" if reserves else "local", reserves=reserves, total_cpu=32.0,
                free_cpu=32.0 - 8.0 - used if reserves else 32.0))
            free = 32.0 - 8.0 - used if reserves else 32.0
            await eventually(lambda free=free: svc.cluster is not None and svc.cluster.free_cpu == free, WAIT_S,
                             "the brain did not take the ClusterStatus")
            seen, fed, windows = len(published), count(svc, "cluster_round_jobs"), count(svc, "statistics")
            for name, beta in zip(names, (0.05, 2.0), strict=True):
                await bus.publish(subjects.monitor_statistics(name), truth_window(name, plans[name], t0 + 60 * tick,
                                                                                   beta))
            # Both windows handled: stepped one by one, or (cluster mode) fed to a round that has ended.
            def handled(windows: int = windows, fed: int = fed) -> bool:
                return count(svc, "statistics") == windows + 2 and (
                    not reserves or count(svc, "cluster_round_jobs") == fed + 2)

            await eventually(handled, WAIT_S)
            await eventually(lambda: len(published) == count(svc, "replans"), WAIT_S)
            for p in published[seen:]:
                plans[p.job] = p
                await bus.publish(subjects.executor_event(p.job, "applied"),
                                  ExecutorEvent(p.job, ExecutorEventKind.APPLIED, time.time(), plan=p, overhead_s=30.0))
            await eventually(lambda plans=plans: all(same_resources(svc.autoscalers[n].plan, plans[n])
                                                     for n in names if n in svc.autoscalers),
                             WAIT_S, "the plans were not applied")
            held.append(sum(p.workers * p.worker_cpu + p.ps * p.ps_cpu for p in plans.values()))
        return held, decisions
    finally:
        await b.stop()


async def test_a_cluster_round_shares_the_capacity_between_running_jobs(nats_server: EmbeddedNats,
                                                                        bus: Bus) -> None:
    """DLRover-RM §4.3 in the service: two zero-config jobs that could each grow to their 20-CPU quota share
    the 24 CPUs the cluster has for them (32 minus other tenants' 8, from the executor's ClusterStatus).
    Planned alone (the local backend reserves nothing, so the capacity is unknown) they take 40 between
    them; planned together, the round's model requests share what is left by the Eq. 11-14 greedy, in one
    round, and the two never hold more than 24."""
    alone, _ = await run_two_jobs(nats_server, bus, ("solo-a", "solo-b"), reserves=False)
    assert max(alone) > 24.0  # the control: without a known capacity nothing stops them
    together, decisions = await run_two_jobs(nats_server, bus, ("fast", "slow"), reserves=True)
    assert max(together) <= 24.0 + 1e-9, together
    by_ts: dict[float, set[str]] = {}
    for d in decisions:
        if d.rule == "model":
            by_ts.setdefault(d.ts, set()).add(d.job)
    both = [ts for ts, jobs in by_ts.items() if jobs == {"fast", "slow"}]
    assert both, [(d.job, d.ts, d.rule) for d in decisions]  # one round chose for both
    assert 21.0 < together[-1] <= 24.0  # what was left after the rules went to them, up to the capacity


async def test_an_oom_while_sampling_gets_the_sample_stages_answer(brain: InProcess[BrainService], bus: Bus) -> None:
    """DLRover 2023 §4.2 over the bus: a zero-config job (cold: its first plan is its sample) whose worker
    dies of OOM gets a plan with twice the worker memory, then one whose PS dies of OOM twice the PS; a
    worker killed for another reason, or an OOM of a job the brain does not plan, changes nothing, and a
    malformed event is counted."""
    from pacer.contracts.brain import BrainDecision
    from pacer.contracts.nodes import NodeEvent

    plans = await collect(bus, subjects.events_of("job", kind=subjects.JobEventKind.PLAN), ResourcePlan)
    decisions = await collect(bus, subjects.events_of("brain", kind="decision"), BrainDecision)
    first = await plan_for(bus, "sampling")  # a cold start: the autoscaler samples this plan
    auto = brain.svc.autoscalers["sampling"] if brain.svc is not None else None
    assert auto is not None
    auto.applied(first, time.time())

    def died(node: str, role: str, reason: str, job: str = "sampling") -> NodeEvent:
        return NodeEvent(job, node, "died", time.time(), reason=reason, role=role, relaunch=True)

    await bus.publish(subjects.node_event("sampling", "died"), died("worker-1", "worker", "killed"))
    await bus.publish(subjects.node_event("other", "died"), died("worker-0", "worker", "oom", job="other"))
    await bus.nc.publish(subjects.node_event("sampling", "died"), b"\x00garbage")
    await bus.publish(subjects.node_event("sampling", "died"), died("worker-0", "worker", "oom"))
    await eventually(lambda: plans, 5.0, "a plan after the worker OOM")
    assert len(plans) == 1
    assert plans[0].worker_memory_mb == 2 * first.worker_memory_mb
    assert (plans[0].workers, plans[0].ps, plans[0].ps_memory_mb) == (first.workers, first.ps, first.ps_memory_mb)
    auto.applied(plans[0], time.time())
    await bus.publish(subjects.node_event("sampling", "died"), died("ps-1", "ps", "oom"))
    await eventually(lambda: len(plans) == 2, 5.0, "a plan after the PS OOM")
    assert plans[1].ps == 2 * first.ps and plans[1].worker_memory_mb == plans[0].worker_memory_mb
    assert [d.rule for d in decisions] == ["sample-oom", "sample-oom"]
    assert decisions[0].previous is not None and decisions[0].previous.worker_memory_mb == first.worker_memory_mb
    assert count(brain.svc, "bad_events") >= 1  # type: ignore[arg-type]


async def test_a_restarted_brain_misses_nothing_the_executor_ran_and_records_it_as_run(
        nats_server: EmbeddedNats, bus: Bus) -> None:
    """The plan in force comes from the executor's events, read by a durable consumer into the brain's own KV:
    what the executor applied (and the pods it relaunched) while the brain was down is known after its
    restart, the running zero-config job is re-planned from it, and the config DB records the plan as run
    (an OOM relaunch's doubled PS memory).  The executor's KV is never read; a job end delivered twice
    updates its record (compare-and-set) instead of failing."""
    from dataclasses import replace

    import nats.js.errors
    from pacer.contracts.executor import ExecutorEvent, ExecutorEventKind
    from pacer.contracts.nodes import NodeEvent

    name = "resumed"
    first = ResourcePlan(name, 2, 2, 1.0, 2048, 1.0, 1024, PlanSource.BRAIN)
    grown = ResourcePlan(name, 3, 2, 1.0, 2048, 1.0, 1024, PlanSource.BRAIN)
    rec = JobRecord(name, spec(name), JobState.RUNNING, time.time() - 100, started_at=time.time() - 100,
                    plan=first, records=10_000_000)
    await (await bus.kv(subjects.JOB_BUCKET)).put(name, encode(rec))
    b = InProcess(nats_server.url, BrainService)
    svc = await b.start()
    try:
        await applied(bus, svc, first)
    finally:
        await b.stop()
    # while the brain is down: the executor applies a bigger plan and relaunches ps-1 after an OOM
    await bus.publish_durable(subjects.executor_event(name, "applied"),
                              ExecutorEvent(name, ExecutorEventKind.APPLIED, time.time(), plan=grown))
    await bus.publish_durable(subjects.node_event(name, "created"),
                              NodeEvent(name, "ps-1", "created", time.time(), role="ps", generation=1, cpu=1.0,
                                        memory_mb=2048))
    again = InProcess(nats_server.url, BrainService)
    svc = await again.start()
    try:
        await eventually(lambda: svc.in_force(name) == grown, WAIT_S, "the applied event sent while down")
        await eventually(lambda: any(n.node == "ps-1" and n.memory_mb == 2048 for n in svc.running[name].nodes),
                         WAIT_S, "the relaunch sent while down")
        await bus.publish(subjects.monitor_statistics(name), stats_window(name, time.time(), 600.0, 1000))
        await eventually(lambda: name in svc.autoscalers, WAIT_S, "the running zero-config job was not resumed")
        assert svc.autoscalers[name].plan == grown and count(svc, "autoscalers_resumed") == 1
        with pytest.raises(nats.js.errors.BucketNotFoundError):
            await bus.js.key_value(subjects.EXECUTOR_BUCKET)  # nobody created it: the brain never read it
        done = replace(rec, state=JobState.COMPLETED, finished_at=time.time(),
                       progress=JobProgress(shards_total=10, shards_done=10, records_done=1_000_000,
                                            records_total=1_000_000))
        await (await bus.kv(subjects.JOB_BUCKET)).put(name, encode(done))
        ended = JobEvent(name, JobState.COMPLETED, time.time(), "every dataset finished", JobState.RUNNING)
        await bus.publish_durable(subjects.job_event(name, "completed"), ended)
        h = await wait_history(bus, 1)
        assert [(e.job, e.workers, e.ps) for e in h.jobs] == [(name, 3, 2)]
        final = svc.history[name].final_plan
        assert final is not None and (final.ps_memory_mb, final.worker_memory_mb) == (2048, 2048)  # as run
        await eventually(lambda: name not in svc.running, WAIT_S)
        assert name not in await svc.store.running()  # its record is gone from the brain's KV too
        await bus.publish_durable(subjects.job_event(name, "completed"), replace(ended, ts=ended.ts + 1))
        await eventually(lambda: count(svc, "recorded") == 2, WAIT_S, "the second job end was not recorded")
        assert count(svc, "internal_errors") == 0 and count(svc, "bad_events") == 0
        assert svc.history[name].finished_at == ended.ts + 1  # updated at its revision
    finally:
        await again.stop()
