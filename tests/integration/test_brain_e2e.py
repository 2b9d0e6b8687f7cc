"""A zero-config job re-planned by the brain while it runs, on the embedded stack with real TensorFlow.

The brain measures the job's first plan as its sample (DLRover 2023 §4.2),
publishes the optimize plan (Eq. 10-11) within a small local quota, the
pod-executor applies it (more workers, a PS migration when the PS set
changes) and reports the pause, and the job still trains every record.
The adjust interval is cut to seconds so that this happens within a short
job; everything else is the production path.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conftest import job_client, read_events, running_stack
from pacer import subjects
from pacer.bus import NO_RETRY
from pacer.contracts.brain import BrainDecision, HistoryList, HistoryQuery
from pacer.contracts.executor import ExecutorEvent
from pacer.contracts.jobs import JobState
from pacer.contracts.nodes import NodeEvent
from pacer.data.criteo import generate, heldout_path
from pacer.errors import PacerError
from pacer.jobs.client import JobClient
from pacer_services.cli.stack import Stack

# the test's own deadline for the job is 420 s; the timeout is a hang guard above it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROWS = 96_000


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.rec"
    generate(path, ROWS, seed=11)
    generate(heldout_path(path), 4_000, seed=11, stream=1)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "PACER_MONITOR_INTERVAL_S": "2",
        "PACER_INJECT_STRAGGLERS": json.dumps({"*": {"kind": "persistent", "sleep_s": 0.4}}),
        "PACER_BATCHES_PER_SHARD": "5",
        "PACER_SHARD_LEASE_S": "20",
        "PACER_BRAIN_ADJUST_S": "12",
        "PACER_BRAIN_SETTLE_S": "4",
        "PACER_BRAIN_CPU_QUOTA": "6",  # room for the optimize plan to beat the 4-CPU default it samples
        "PACER_BRAIN_NODE_CPU": "2",
    }
    with running_stack(tmp_path_factory.mktemp("stack"), ["shard", "monitor", "jobs", "executor", "brain"], env) as st:
        yield st


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[JobClient]:
    async with job_client(stack.url, "brain-e2e") as c:
        yield c


async def test_the_brain_re_plans_a_running_zero_config_job_and_it_trains_every_record(
        stack: Stack, client: JobClient, data: Path) -> None:
    spec = (f"name: auto-1\nmodel: wide_deep\ndataset:\n  path: {data}\n  test_path: {heldout_path(data)}\n"
            "batch_size: 512\nlimits: {max_workers: 3}\n")
    for _ in range(120):  # the brain answers once it is up (the job service would fall back to the default)
        try:
            await client.bus.request(subjects.brain_rpc(subjects.ALL_JOBS, subjects.BrainOp.HISTORY),
                                     HistoryQuery(), HistoryList, retry=NO_RETRY, timeout=1.0)
            break
        except PacerError:
            await asyncio.sleep(0.25)
    rec = await client.submit("auto-1", spec)
    first = rec.plan
    assert first is not None and first.source.value == "brain" and "cold start" in first.reason
    deadline = time.monotonic() + 420
    while True:
        rec = await client.get("auto-1")
        if rec.state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED) and rec.torn_down:
            break
        assert time.monotonic() < deadline, f"job did not finish: {rec}"
        await asyncio.sleep(1.0)
    assert rec.state is JobState.COMPLETED, rec.reason
    p = rec.progress
    assert p.shards_done == p.shards_total > 0 and p.shards_failed == 0
    assert p.records_done == p.records_total == ROWS  # nothing lost across the re-plan
    assert 0.5 < float(rec.result["auc"]) <= 1.0

    decisions = await read_events(stack.url, subjects.brain_decision("auto-1"), BrainDecision)
    assert decisions, "the brain never re-planned the job"
    d = decisions[0]
    assert d.rule == "optimize" and d.previous is not None and d.measured_throughput > 0
    assert (d.previous.workers, d.previous.ps) == (first.workers, first.ps)
    assert d.plan.workers <= 3  # limits.max_workers
    assert d.plan.workers * d.plan.worker_cpu + d.plan.ps * d.plan.ps_cpu <= 6 + 1e-9  # the quota
    assert d.predicted_throughput > d.measured_throughput  # Eq. 8: a re-plan must promise more
    applied = await read_events(stack.url, subjects.executor_event("auto-1", "applied"), ExecutorEvent)
    in_force = [e for e in applied if e.plan is not None and (e.plan.workers, e.plan.ps, e.plan.worker_cpu,
                e.plan.ps_cpu) == (d.plan.workers, d.plan.ps, d.plan.worker_cpu, d.plan.ps_cpu)]
    assert in_force, applied
    # Applied means every worker runs with the plan's size, the ones that ran before the re-plan included
    # (replaced, or restarted by the PS migration, with the new CPU and memory).
    running = await read_events(stack.url, subjects.node_event("auto-1", "running"), NodeEvent)
    # The brain may raise the workers' memory after its re-plan (OOM prevention, DLRover-RM §5.3: a loaded
    # machine saw worker-0 raised to 4224 MiB while the re-plan's PS migration ran), so a worker's memory is
    # that of one of the brain's plans made before its pod ran, never the one before the re-plan.
    for w in (n for n in in_force[0].started if n.startswith("worker-")):
        last = [e for e in running if e.node == w and e.ts <= in_force[0].ts][-1]
        given = {x.plan.worker_memory_mb for x in decisions if x.ts <= last.ts}
        assert last.cpu == d.plan.worker_cpu and last.memory_mb in given, (w, last, [x.plan for x in decisions])
