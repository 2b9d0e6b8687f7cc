"""Whole jobs on the embedded stack: job service + pod-executor (local backend) + shard service + monitor.

Every service is its own OS process on a real nats-server (``pacer_services.cli.stack``);
every node is a real TensorFlow PS or worker process with its agent, run by
a pod supervisor with CPU and memory limits.  Sleep-based stragglers slow
the workers down (no CPU cost) so that kills land mid-job.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import psutil
import pytest
from conftest import job_client, read_events, running_stack
from pacer.contracts.executor import ExecutorCommand
from pacer.contracts.jobs import JobRecord, JobState
from pacer.contracts.nodes import NodeEvent
from pacer.data.criteo import generate, heldout_path
from pacer.embedded import free_port
from pacer.errors import ValidationError
from pacer.jobs.client import JobClient
from pacer.subjects import events_of
from pacer_services.cli.stack import Stack
from test_dashboard import Browser, parse_dom, sign_in

# a real stack and TensorFlow jobs: up to 120 s a test on a quiet machine; the timeout is a hang guard
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROWS = 24_000  # 512-record global batches: 47 steps, ~0.1 s each with the injected sleep


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.rec"
    generate(path, ROWS, seed=7)
    generate(heldout_path(path), 4_000, seed=7, stream=1)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "PACER_API_PORT": str(free_port()),
        "PACER_MONITOR_INTERVAL_S": "2",
        "PACER_INJECT_STRAGGLERS": json.dumps({"*": {"kind": "persistent", "sleep_s": 0.25}}),
        "PACER_BATCHES_PER_SHARD": "5",
        "PACER_SHARD_LEASE_S": "20",
    }
    with running_stack(tmp_path_factory.mktemp("stack"), ["shard", "monitor", "jobs", "executor", "api", "brain"],
                       env) as st:
        yield st


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[JobClient]:
    async with job_client(stack.url, "e2e-test") as c:
        yield c


def spec_yaml(name: str, data: Path, extra: str = "", optimizer: str = "default") -> str:
    """Jobs take the default plan unless a test asks for the brain: what one job's OOM taught the
    config DB must not leak into the next test's plan."""
    return (f"name: {name}\nmodel: wide_deep\n"
            f"dataset:\n  path: {data}\n  test_path: {heldout_path(data)}\n"
            f"batch_size: 512\npolicies: {{optimizer: {optimizer}}}\n{extra}")


async def wait_for(client: JobClient, job: str, done: Callable[[JobRecord], bool], timeout: float = 240.0,
                   what: str = "") -> JobRecord:
    deadline = time.monotonic() + timeout
    rec = await client.get(job)
    while not done(rec):
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job}: timed out waiting for {what or 'a condition'}; last record: {rec}")
        await asyncio.sleep(0.5)
        rec = await client.get(job)
    return rec


def terminal(rec: JobRecord) -> bool:
    return rec.state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED) and rec.torn_down


def assert_complete(rec: JobRecord) -> None:
    assert rec.state is JobState.COMPLETED, rec.reason
    p = rec.progress
    assert p.shards_total > 0
    assert p.shards_done == p.shards_total and p.shards_failed == 0
    assert p.records_done == p.records_total == ROWS


def trainer_pid(stack: Stack, job: str, node: str) -> int:
    """The pid of a node's running TensorFlow process (found by its command line)."""
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "pacer.trainer.worker" in cmd and f'"job": "{job}"' in cmd and f'"node": "{node}"' in cmd:
            return int(p.info["pid"])
    raise AssertionError(f"no trainer process for {job}/{node}")


async def node_events(stack: Stack, job: str) -> list[NodeEvent]:
    events: list[NodeEvent] = await read_events(stack.url, events_of("node", job), NodeEvent)
    return events


async def test_job_completes_and_an_externally_killed_worker_is_relaunched(
        stack: Stack, client: JobClient, data: Path) -> None:
    rec = await client.submit("e2e-basic", spec_yaml("e2e-basic", data, optimizer="brain"))
    # no resources in the spec: the brain plans it (a cold start: its config DB is empty)
    assert rec.state is JobState.PLANNING and rec.plan is not None and rec.plan.source.value == "brain"
    assert "cold start" in rec.plan.reason
    rec = await wait_for(client, "e2e-basic", lambda r: r.state is JobState.RUNNING
                         and 0 < r.progress.shards_done < r.progress.shards_total / 2, what="a running job")
    os.kill(trainer_pid(stack, "e2e-basic", "worker-1"), signal.SIGKILL)
    rec = await wait_for(client, "e2e-basic", terminal, what="the end")
    assert_complete(rec)
    assert rec.node_restarts >= 1 and rec.restarts_by_node.get("worker-1", 0) >= 1
    assert 0.5 < float(rec.result["auc"]) <= 1.0  # the chief evaluated the held-out data
    events = await node_events(stack, "e2e-basic")
    died = [e for e in events if e.kind == "died" and e.node == "worker-1" and e.generation == 0]
    assert died and died[0].reason == "killed" and died[0].relaunch
    assert any(e.kind == "running" and e.node == "worker-1" and e.generation == 1 for e in events)
    assert any(e.kind == "finished" and e.node == "worker-0" and e.result for e in events)
    status = await client.nodes("e2e-basic")
    assert status.state == "torn_down" and all(n.phase.value == "exited" for n in status.nodes)
    # the finished job is in the brain's config DB, as it ran
    from pacer import subjects
    from pacer.bus import NO_RETRY
    from pacer.contracts.brain import HistoryList, HistoryQuery

    for _ in range(40):
        hist = await client.bus.request(subjects.brain_rpc(subjects.ALL_JOBS, subjects.BrainOp.HISTORY),
                                        HistoryQuery(), HistoryList, retry=NO_RETRY)
        if any(e.job == "e2e-basic" for e in hist.jobs):
            break
        await asyncio.sleep(0.25)
    entry = next(e for e in hist.jobs if e.job == "e2e-basic")
    assert entry.succeeded and entry.workers == 2 and entry.throughput > 0


async def test_kill_9_of_each_service_mid_job_loses_nothing(stack: Stack, client: JobClient, data: Path) -> None:
    await client.submit("e2e-kills", spec_yaml("e2e-kills", data))
    await wait_for(client, "e2e-kills", lambda r: r.state is JobState.RUNNING and r.progress.shards_done > 0,
                   what="a running job")
    for name in ("executor", "shard", "monitor", "jobs"):
        before = (await client.get("e2e-kills")).progress.shards_done
        stack.procs[name].kill()
        stack.procs[name].wait()
        await asyncio.sleep(1.0)
        stack.start_service(name)
        # Until it answers its health subject: a loaded machine takes seconds to import a service, longer
        # than a client's retries of a request that finds no responder.
        await asyncio.to_thread(stack.wait_ready, [name])
        def progressed(r: JobRecord, b: int = before) -> bool:
            return r.progress.shards_done > b or terminal(r)

        await wait_for(client, "e2e-kills", progressed, what=f"progress after restarting {name}")
    rec = await wait_for(client, "e2e-kills", terminal, what="the end")
    assert_complete(rec)
    stats = await client.statistics("e2e-kills")  # the restarted monitor rebuilt the job's windows
    assert stats.shards is not None and stats.shards.done == rec.progress.shards_total


async def test_oom_killed_node_is_relaunched_with_more_memory(stack: Stack, client: JobClient, data: Path) -> None:
    extra = "resources:\n  workers: 1\n  worker_memory_mb: 200\n"
    await client.submit("e2e-oom", spec_yaml("e2e-oom", data, extra))
    rec = await wait_for(client, "e2e-oom", terminal, timeout=400, what="the end")
    assert_complete(rec)
    events = await node_events(stack, "e2e-oom")
    ooms = [e for e in events if e.kind == "died" and e.node == "worker-0" and e.reason == "oom"]
    assert ooms and all(e.relaunch for e in ooms)
    created = [e.memory_mb for e in events if e.kind == "created" and e.node == "worker-0"]
    assert created[0] == 200 and created == sorted(created) and created[-1] >= 400
    assert created[1] == 2 * created[0]  # DLRover: an OOM-killed node comes back with twice the memory


async def test_invalid_spec_is_rejected_naming_the_field(stack: Stack, client: JobClient, data: Path) -> None:
    bad = f"name: e2e-bad\nmodel: resnet\ndataset:\n  path: {data}\nbatch_size: -3\n"
    with pytest.raises(ValidationError) as err:
        await client.submit("e2e-bad", bad)
    assert "model" in str(err.value) and "batch_size" in str(err.value)
    with pytest.raises(ValidationError, match=r"dataset\.path"):
        await client.submit("e2e-bad2", "name: e2e-bad2\nmodel: dcn\ndataset:\n  path: /nonexistent.rec\n")
    jobs = await client.list()
    assert not any(r.job.startswith("e2e-bad") for r in jobs.jobs)  # nothing was stored


async def test_dashboard_shows_the_running_job_and_stop_works(stack: Stack, client: JobClient, data: Path) -> None:
    """Real stack, real TensorFlow job, real headless Chromium: the job page follows the job live."""
    await client.submit("e2e-dash", spec_yaml("e2e-dash", data))
    await wait_for(client, "e2e-dash", lambda r: r.state is JobState.RUNNING and r.progress.shards_done > 0,
                   what="a running job")
    async with Browser() as b:
        await b.goto(stack.dashboard_url(stack.env["PACER_API_PORT"], "#/jobs/e2e-dash"))
        await sign_in(b, stack.api_token_file.read_text().strip())  # the token of the file `pacer up` names
        await b.wait_for("document.querySelector('#job-state')?.dataset.state === 'running'"
                         " && document.querySelectorAll('#nodes-body tr[data-node]').length === 4"
                         " && Number(document.querySelector('#throughput')?.dataset.value) > 0"
                         " && Number(document.querySelector('#shards-done')?.textContent) > 0"
                         # the timeline fills from the event replay, a request of its own that may come later
                         " && document.querySelector('#timeline li[data-kind=\"job.running\"]') !== null"
                         " && document.querySelectorAll('#timeline li[data-kind=\"node.running\"]').length >= 4",
                         timeout=60.0)
        page = parse_dom(await b.dom())
        for node in ("ps-0", "ps-1", "worker-0", "worker-1"):
            assert page.find(tag="tr", data_node=node).find(data_field="state").text == "running", node
        kinds = [li.attrs["data-kind"] for li in page.find(id="timeline").find_all(tag="li")]
        assert "job.running" in kinds and kinds.count("node.running") >= 4
        await b.eval("window.confirm = () => true; document.querySelector('#stop-btn').click(); true")
        await b.wait_for("document.querySelector('#job-state').dataset.state === 'stopped'", timeout=30.0)
        assert b.errors == []
    rec = await wait_for(client, "e2e-dash", terminal, what="teardown after stop")
    assert rec.state is JobState.STOPPED and rec.torn_down


async def ps_command_to_the_end(client: JobClient, data: Path, cmd: ExecutorCommand) -> str:
    """Submit job ``cmd.job``, send it the executor command ``cmd`` once it trains, and check that it completes
    with every record and a sane AUC; returns the command's answer (its ``detail``)."""
    from pacer import subjects
    from pacer.contracts.executor import CommandResult

    await client.submit(cmd.job, spec_yaml(cmd.job, data))
    await wait_for(client, cmd.job, lambda r: r.state is JobState.RUNNING and r.progress.shards_done >= 2,
                   what="a running job")
    res = await client.bus.request(subjects.executor_rpc(cmd.job, subjects.ExecutorOp.COMMAND), cmd,
                                   CommandResult, timeout=20.0)
    assert res.done, res.detail
    rec = await wait_for(client, cmd.job, terminal, what="the end")
    assert_complete(rec)
    assert 0.5 < float(rec.result["auc"]) <= 1.0
    return res.detail


async def test_ps_migration_moves_a_ps_to_more_memory_without_losing_data(
        stack: Stack, client: JobClient, data: Path) -> None:
    """DLRover-RM §5.2: the new PS starts while training goes on; then checkpoint, move, restore."""
    from pacer.contracts.executor import CommandKind

    cmd = ExecutorCommand("e2e-migrate", "ps-1", CommandKind.MIGRATE, "hot PS", command_id="m1", memory_mb=3072)
    assert await ps_command_to_the_end(client, data, cmd) == "migration started"
    events = await node_events(stack, "e2e-migrate")
    new_ps = [e for e in events if e.node == "ps-1" and e.generation == 1]
    assert [e.kind for e in new_ps][:2] == ["created", "running"] and new_ps[0].memory_mb == 3072
    moved = [e for e in events if e.kind == "died" and e.reason == "migrating"]
    assert {e.node for e in moved} == {"worker-0", "worker-1"}
    # seamless: the old workers kept training until the new PS ran; they moved after it
    assert min(e.ts for e in moved) >= new_ps[1].ts
    restarted = [e for e in events if e.kind == "created" and e.node == "worker-0" and e.generation == 1]
    assert restarted and restarted[0].ts >= max(e.ts for e in moved)
    chief = [e for e in events if e.kind == "finished" and e.node == "worker-0"]
    assert chief and str(chief[-1].result.get("restored_from", "")).startswith("flash")
    old_ps = [e for e in events if e.node == "ps-1" and e.generation == 0 and e.kind == "died"]
    assert old_ps and not old_ps[0].relaunch  # the old PS was stopped, not relaunched


async def test_a_ps_stop_and_restart_stops_training_first_and_loses_no_data(
        stack: Stack, client: JobClient, data: Path) -> None:
    """AntDT §V-E2's stop-and-restart of a PS (a policy's ``migration: restart``): checkpoint, stop, new PS, restore."""
    from pacer.contracts.executor import CommandKind

    cmd = ExecutorCommand("e2e-psrestart", "ps-1", CommandKind.RESTART, "slow PS", command_id="r1")
    assert await ps_command_to_the_end(client, data, cmd) == "stop-and-restart started"
    events = await node_events(stack, "e2e-psrestart")
    moved = [e for e in events if e.kind == "died" and e.reason == "migrating"]
    assert {e.node for e in moved} == {"worker-0", "worker-1"}
    old_ps = [e for e in events if e.node == "ps-1" and e.generation == 0 and e.kind == "died"]
    assert old_ps and not old_ps[0].relaunch
    restarted = [e for e in events if e.kind == "created" and e.node.startswith("worker-") and e.generation == 1]
    assert len(restarted) == 2 and min(e.ts for e in restarted) >= max(e.ts for e in moved)
    # (that the drain does not wait for the new PS is the pure core's test: here the new PS may run first)
    chief = [e for e in events if e.kind == "finished" and e.node == "worker-0"]
    assert chief and str(chief[-1].result.get("restored_from", "")).startswith("flash")


async def test_a_plan_with_more_ps_migrates_the_job_to_three_ps(stack: Stack, client: JobClient, data: Path) -> None:
    """A new plan with 3 PS: the embedding parts are re-cut for 3 PS when the chief restores."""
    from dataclasses import replace

    from pacer import subjects

    rec = await client.submit("e2e-3ps", spec_yaml("e2e-3ps", data))
    await wait_for(client, "e2e-3ps", lambda r: r.state is JobState.RUNNING and r.progress.shards_done >= 2,
                   what="a running job")
    assert rec.plan is not None and rec.plan.ps == 2
    await client.bus.publish_durable(subjects.job_event("e2e-3ps", subjects.JobEventKind.PLAN),
                                     replace(rec.plan, ps=3, reason="test: one more PS"))
    rec = await wait_for(client, "e2e-3ps", terminal, what="the end")
    assert_complete(rec)
    events = await node_events(stack, "e2e-3ps")
    assert any(e.kind == "running" and e.node == "ps-2" for e in events)
    chief = [e for e in events if e.kind == "finished" and e.node == "worker-0"]
    assert chief and str(chief[-1].result.get("restored_from", "")).startswith("flash")
    assert 0.5 < float(rec.result["auc"]) <= 1.0
