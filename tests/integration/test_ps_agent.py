"""A real slow parameter server: its agent measures it, the monitor flags it, antdt-nd migrates it.

Embedded stack with every service (shard, monitor, jobs, executor,
controller, policies); BSP Wide&Deep jobs of 2 PS + 2 workers where ps-1's
first pod turns CPU-throttled 15 s after it started (``PACER_INJECT_STRAGGLERS``
``{"ps-1": {"cpu": ..., "start_s": ...}}``: the local pod supervisor's
SIGSTOP/SIGCONT quota; a migrated PS is a new pod elsewhere, healthy).  Nothing in the trainers is faked: the PS
agents time a real TF RPC against their PS (``pacer.agent.agent``,
"Servers").  Windows are scaled down from AntDT's 5/10 min as in
``test_stragglers_e2e.py``: L_trans 6 s, L_per 12 s, a decision every 3 s.

Both jobs run in this one test, one after the other on the same stack, so
the JCT comparison is relative within one run of a shared machine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import job_client, running_stack
from pacer import subjects
from pacer.codec import decode
from pacer.contracts.agent import ActionKind, AgentMetrics
from pacer.contracts.jobs import JobRecord, JobState
from pacer.contracts.monitor import JobStatistics, StragglerKind
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.policy import ControllerDecision
from pacer.data.criteo import generate
from pacer.jobs.client import JobClient
from pacer_services.cli.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROWS = 150_000
PS_CPU = 0.05  # ps-1's first pod gets 5 % of a core ...
PS_SLOW_AFTER_S = 15.0  # ... from 15 s after it started (its TF import and the workers' start are not slowed)
T = TypeVar("T")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.rec"
    generate(path, ROWS, seed=13)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "PACER_INJECT_STRAGGLERS": json.dumps({"ps-1": {"cpu": PS_CPU, "start_s": PS_SLOW_AFTER_S}}),
        "PACER_MONITOR_INTERVAL_S": "2", "PACER_MONITOR_WINDOW_SHORT_S": "6", "PACER_MONITOR_WINDOW_LONG_S": "12",
        "PACER_CONTROLLER_EVERY_S": "3", "PACER_BATCHES_PER_SHARD": "5", "PACER_AGENT_REPORT_EVERY_S": "1",
    }
    with running_stack(tmp_path_factory.mktemp("stack"),
                       ["shard", "monitor", "jobs", "executor", "controller", "policies"], env) as st:
        yield st


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[JobClient]:
    async with job_client(stack.url, "ps-agent-test") as c:
        yield c


def spec(name: str, data: Path, policy: str) -> str:
    return (f"name: {name}\nmodel: wide_deep\ndataset: {{path: {data}}}\nbatch_size: 512\nmode: bsp\n"
            f"policies: {{straggler: {policy}}}\n")


async def run_to_end(client: JobClient, job: str, timeout: float = 400.0) -> JobRecord:
    deadline = time.monotonic() + timeout
    while True:
        rec = await client.get(job)
        if rec.state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED) and rec.torn_down:
            return rec
        assert time.monotonic() < deadline, f"{job} did not end: {rec}"
        await asyncio.sleep(0.5)


async def history(client: JobClient, subject: str, cls: type[T]) -> list[T]:
    """Every message the events stream kept on ``subject``."""
    sub = await client.bus.js.subscribe(subject, ordered_consumer=True)
    out: list[T] = []
    while True:
        try:
            m = await sub.next_msg(timeout=1.0)
        except TimeoutError:
            await sub.unsubscribe()
            return out
        out.append(decode(cls, m.data))


def ps_flags(stats: list[JobStatistics]) -> dict[str, set[StragglerKind]]:
    out: dict[str, set[StragglerKind]] = {}
    for st in stats:
        for n in st.nodes:
            if n.role == "ps" and n.straggler is not StragglerKind.NONE:
                out.setdefault(n.node, set()).add(n.straggler)
    return out


def jct(rec: JobRecord) -> float:
    return rec.finished_at - rec.started_at


async def test_a_throttled_ps_is_detected_and_migrated_and_antdt_nd_beats_none(
        stack: Stack, client: JobClient, data: Path) -> None:
    await client.submit("psslow-none", spec("psslow-none", data, "none"))
    none = await run_to_end(client, "psslow-none")
    await client.submit("psslow-nd", spec("psslow-nd", data, "antdt-nd"))
    nd = await run_to_end(client, "psslow-nd")
    for rec in (none, nd):
        assert rec.state is JobState.COMPLETED, rec.reason
        assert rec.progress.records_done == ROWS

    # The PS agents reported: CPU and RSS of their PS, and the throttled PS answers slower.
    reports = await history(client, subjects.agent_metrics("psslow-none"), AgentMetrics)
    ps = [m for m in reports if m.role == "ps" and m.steps > 0]
    assert {m.node for m in ps} == {"ps-0", "ps-1"}
    assert all(m.rss_bytes > 0 for m in ps)
    # ps-1's reports from after its throttle began (the PS agents start with the pods).
    lat = {n: sorted(m.bpt_s for m in ps if m.node == n) for n in ("ps-0", "ps-1")}
    median = {n: v[len(v) // 2] for n, v in lat.items()}
    assert median["ps-1"] > 3 * median["ps-0"], median
    cpu1 = sorted(m.cpu_percent for m in ps if m.node == "ps-1")
    assert cpu1[len(cpu1) // 2] <= 100 * PS_CPU * 2, cpu1  # the quota holds (with the probe's own share)

    # The monitor flagged ps-1 (short window, then long) in both jobs, and never ps-0.
    for job in ("psslow-none", "psslow-nd"):
        flags = ps_flags(await history(client, subjects.monitor_statistics(job), JobStatistics))
        assert StragglerKind.PERSISTENT in flags.get("ps-1", set()), (job, flags)
        assert "ps-0" not in flags, (job, flags)

    # antdt-nd KILL_RESTARTed ps-1; the executor migrated it (a new pod, generation 1); none did nothing.
    rounds = await history(client, subjects.controller_decision("psslow-nd"), ControllerDecision)
    restarts = [a for d in rounds for a in d.executed if a.kind is ActionKind.KILL_RESTART]
    assert restarts and restarts[0].node == "ps-1" and "persistent" in restarts[0].reason, [
        (d.reason, [(a.kind.value, a.node) for a in d.executed], [(r.kind, r.reason) for r in d.refused])
        for d in rounds]
    assert all(a.node != "ps-0" for a in restarts)
    created = [e for e in await history(client, subjects.node_event("psslow-nd", "created"), NodeEvent)
               if e.node == "ps-1"]
    assert {e.generation for e in created} >= {0, 1}, created
    assert not [e for e in await history(client, subjects.node_event("psslow-none", "created"), NodeEvent)
                if e.generation > 0]
    assert not [a for d in await history(client, subjects.controller_decision("psslow-none"), ControllerDecision)
                for a in d.executed]
    print(f"JCT none {jct(none):.1f} s, antdt-nd {jct(nd):.1f} s; ps-1 probe latency median {median['ps-1']*1e3:.1f} ms "
          f"vs ps-0 {median['ps-0']*1e3:.2f} ms; ps-1 CPU median {cpu1[len(cpu1) // 2]:.0f} %")
    assert jct(nd) < jct(none), (jct(nd), jct(none))
