"""Bring your own trainer: the example user script trained end to end with real processes.

``examples/trainers/logreg_ps.py`` (numpy logistic regression with its own
parameter server) runs as 1 PS and 2 worker processes, each worker beside a
real agent sidecar (``pacer.agent.main``), against a real nats-server and
the shard service.  The processes get exactly the environment the executor
gives a ``trainer:`` job (:meth:`pacer.trainer.sdk.TrainerEnv.to_env`, the
same call the launcher makes); the test plays the executor's part in
relaunching a node that exits 75.  Mid-training the job receives real
global actions (ADJUST_BS, ADJUST_LR through the primary agent's two-phase
barrier) and a KILL_RESTART node command.

The second test submits the same program as a ``trainer:`` job to the
embedded stack (job service, pod-executor with the local backend, shard
service): the executor starts it, relaunches the node that asked for it and
keeps the chief's result.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import InProcessService, eventually, job_client, read_events, running_stack
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import Bus, RetryPolicy
from pacer.codec import decode
from pacer.contracts.agent import (
    ActionKind,
    ActionResult,
    AgentMetrics,
    GlobalAction,
    Heartbeat,
    NodeCommand,
)
from pacer.contracts.shards import DatasetSpec
from pacer.data.criteo import generate
from pacer.embedded import EmbeddedNats
from pacer.shards.client import ShardAdmin
from pacer.trainer.cluster import ClusterDesc
from pacer.trainer.sdk import EXIT_RESTART, TrainerEnv

pytestmark = pytest.mark.timeout(240)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trainers" / "logreg_ps.py"
ROWS = 80_000
GLOBAL_BATCH = 256  # 128 per worker
STEP_MS = 50  # ~310 steps of >= 50 ms per worker (~15 s): agents start, elect and act well before the end


def stepping(events: list[Heartbeat | AgentMetrics], since: float = 0.0) -> tuple[set[str], bool]:
    """The nodes whose trainer was seen stepping since ``since``, and whether some agent said it was primary.

    Heartbeats and metrics both count: an agent whose metrics windows come
    faster than its heartbeat is due sends no heartbeat while it steps.
    """
    live = {e.node for e in events if e.ts >= since and (
        (isinstance(e, Heartbeat) and e.trainer_alive and e.iteration > 0)
        or (isinstance(e, AgentMetrics) and e.steps > 0 and e.iteration > 0))}
    return live, any(e.primary for e in events if e.ts >= since)



class Node:
    """One pod: the user's command, and for a worker its agent sidecar (as the executor starts them)."""

    def __init__(self, root: Path, env: TrainerEnv) -> None:
        self.env = env
        self.dir = root / env.node
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trainer: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.exit_lines: list[str] = []  # result lines of incarnations that left for a restart

    def start(self, generation: int = 0) -> None:
        from dataclasses import replace

        self.env = replace(self.env, generation=generation)
        env = {**os.environ, **self.env.to_env(), "PYTHONUNBUFFERED": "1"}
        with open(self.dir / "trainer.log", "ab") as log:
            self.trainer = subprocess.Popen([sys.executable, str(EXAMPLE), "--step-ms", str(STEP_MS)],
                                            env=env, stdout=log, stderr=subprocess.STDOUT)
        if self.env.role == "worker" and self.agent is None:
            with open(self.dir / "agent.log", "ab") as log:
                self.agent = subprocess.Popen(
                    [sys.executable, "-m", "pacer.agent.main", "--job", self.env.job, "--node", self.env.node,
                     "--role", "worker", "--ipc", self.env.agent_ipc, "--nats", self.env.nats_url],
                    env={**os.environ, "PACER_LOG_LEVEL": "INFO"}, stdout=log, stderr=subprocess.STDOUT)

    def result(self) -> dict[str, Any]:
        return dict(json.loads(Path(self.env.result).read_text()))

    def log_tail(self) -> str:
        return "\n".join((self.dir / "trainer.log").read_text().splitlines()[-20:])

    def stop(self) -> None:
        for p in (self.trainer, self.agent):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.fixture
async def job(tmp_path: Path, nats_server: EmbeddedNats, shard_service: InProcessService) -> AsyncIterator[dict[str, Node]]:
    name = f"byo{uuid.uuid4().hex[:6]}"
    generate(tmp_path / "train.rec", ROWS, seed=7)
    generate(tmp_path / "test.rec", 10_000, seed=7, stream=1)
    bus = await Bus.connect(nats_server.url, name="test-launcher")
    try:
        # What the job service does for every job: register its dataset with the shard service.
        await ShardAdmin(bus, retry=RetryPolicy(attempts=50)).register(DatasetSpec(
            job=name, dataset="train", records=ROWS, batch_size=GLOBAL_BATCH, batches_per_shard=10, lease_s=10.0))
    finally:
        await bus.close()
    cluster = ClusterDesc.local(1, 2)
    nodes: dict[str, Node] = {}
    for role, count in (("ps", 1), ("worker", 2)):
        for i in range(count):
            node = f"{role}-{i}"
            pod = tmp_path / "pods" / node
            nodes[node] = Node(tmp_path / "pods", TrainerEnv(
                job=name, node=node, role=role, index=i, ps=cluster.ps, workers=cluster.workers,
                nats_url=nats_server.url, data=str(tmp_path / "train.rec"),
                eval_data=str(tmp_path / "test.rec") if (role, i) == ("worker", 0) else "",
                num_workers=2, batch_size=GLOBAL_BATCH // 2, global_batch=GLOBAL_BATCH, learning_rate=0.05,
                agent_ipc=str(pod / "trainer.ipc") if role == "worker" else "", result=str(pod / "result.json")))
    try:
        yield nodes
    finally:
        for n in nodes.values():
            n.stop()
        for n in nodes.values():
            if (n.dir / "trainer.log").exists():
                print(f"--- {n.env.node} trainer log tail ---\n{n.log_tail()}")


async def test_user_script_trains_every_shard_and_applies_global_actions(
    job: dict[str, Node], nats_server: EmbeddedNats
) -> None:
    ps, w0, w1 = job["ps-0"], job["worker-0"], job["worker-1"]
    name = w0.env.job
    bus = await Bus.connect(nats_server.url, name="test")
    metrics: list[AgentMetrics] = []
    said: list[Heartbeat | AgentMetrics] = []

    async def on_event(msg: Msg) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        if kind == subjects.AgentEventKind.HEARTBEAT:
            said.append(decode(Heartbeat, msg.data))
        elif kind == subjects.AgentEventKind.METRICS:
            metrics.append(decode(AgentMetrics, msg.data))
            said.append(metrics[-1])

    await bus.nc.subscribe(subjects.events_of(subjects.AGENT_SERVICE, name), cb=on_event)
    try:
        for n in (ps, w0, w1):
            n.start()
        t0 = time.time()

        def ready() -> bool:
            live, primary = stepping(said, t0)
            return live >= {"worker-0", "worker-1"} and primary

        await eventually(ready, 60, lambda: f"agents ready; worker logs:\n{w0.log_tail()}\n{w1.log_tail()}")
        await asyncio.sleep(0.3)  # the primary hears the same messages

        # Global actions through the primary agent, as the controller sends them.
        retry = RetryPolicy(attempts=30, first_delay=0.1, max_delay=0.5)
        bs = await bus.request(subjects.agent_global_action(name), GlobalAction(
            name, uuid.uuid4().hex, ActionKind.ADJUST_BS, {"batch_sizes": {"worker-0": 160, "worker-1": 96}},
            reason="test"), ActionResult, 15, retry)
        assert bs.applied and sorted(bs.nodes) == ["worker-0", "worker-1"], bs
        lr = await bus.request(subjects.agent_global_action(name), GlobalAction(
            name, uuid.uuid4().hex, ActionKind.ADJUST_LR, {"scale": 0.5}, reason="test"), ActionResult, 15, retry)
        assert lr.applied and lr.target_iteration >= bs.target_iteration, lr  # both may land at one T

        # The agents report what the SDK recorded: each worker's steps now run its new batch size,
        # after the last action it acknowledged (ADJUST_LR, at its target iteration).
        def adjusted(node: str, size: int) -> bool:
            return any(m.node == node and m.batch_size == size and m.last_action_iteration == lr.target_iteration
                       for m in metrics)

        await eventually(lambda: adjusted("worker-0", 160) and adjusted("worker-1", 96), 30,
                         lambda: f"metrics after the actions: {metrics[-4:]}")

        # KILL_RESTART: worker-1 leaves with 75 and is relaunched in its slot (the executor's part).
        kr = await bus.request(subjects.agent_command(name, "worker-1"),
                               NodeCommand(name, "worker-1", ActionKind.KILL_RESTART, reason="test"), ActionResult, 10)
        assert kr.applied, kr
        assert w1.trainer is not None
        first = w1.trainer
        await eventually(lambda: first.poll() is not None, 30, "worker-1 exits after KILL_RESTART")
        assert first.returncode == EXIT_RESTART, w1.log_tail()
        w1.exit_lines = [ln for ln in w1.log_tail().splitlines() if ln.startswith('{"node"')]
        assert not os.path.exists(w1.env.result)  # it left mid-training: no result  # noqa: ASYNC240
        w1.start(generation=1)

        for n in (w0, w1):
            proc = n.trainer
            assert proc is not None
            await eventually(lambda p=proc: p.poll() is not None, 180, f"{n.env.node} finishes")  # type: ignore[misc]
            assert proc.returncode == 0, n.log_tail()
        status = await ShardAdmin(bus).status(name, "train")
    finally:
        await bus.close()

    # Every shard was trained and reported done; nothing failed.
    assert status.finished and status.failed == 0 and status.records_done == ROWS, status
    r0, r1 = w0.result(), w1.result()
    # worker-0 ran throughout: it applied both global actions at their target iterations.
    applied = {a["kind"]: a for a in r0["actions"]}
    assert applied["ADJUST_BS"]["iteration"] == bs.target_iteration and not applied["ADJUST_BS"]["late"]
    assert applied["ADJUST_LR"]["iteration"] == lr.target_iteration and not applied["ADJUST_LR"]["late"]
    assert r0["batch_size"] == 160 and r0["learning_rate"] == pytest.approx(0.025)
    # The relaunched worker-1 starts from the job's settings (as the built-in worker does) and is
    # not given the actions its previous incarnation already took.
    assert r1["generation"] == 1 and r1["batch_size"] == 128 and r1["actions"] == [], r1
    # Each record was trained exactly once: the relaunched worker-1 got its shard back from the
    # last progress report (made after every step), and the example resumes right there.
    left = json.loads(w1.exit_lines[0])
    assert left["exit"] == EXIT_RESTART and left["samples"] > 0, left
    assert r0["samples"] + left["samples"] + r1["samples"] == ROWS, (r0["samples"], left, r1["samples"])
    # The model learnt the planted signal (a broken step or shard reader stays near 0.5).
    assert r0["auc"] > 0.65, r0


# ------------------------------------------------------- through the job service and the executor


def _wired() -> bool:
    """The spec parser and the executor's launcher know ``trainer:`` (requests-h8-sdk.md)."""
    from pacer.jobs.spec import TOP_LEVEL
    from pacer_services.pod_executor import launch

    return "trainer" in TOP_LEVEL and hasattr(launch, "trainer_env")


@pytest.mark.slow
@pytest.mark.skipif(not _wired(), reason="trainer: jobs not wired into pacer.jobs.spec / the executor yet")
async def test_a_trainer_job_runs_on_the_local_backend_and_takes_actions(tmp_path: Path) -> None:
    from pacer.contracts.jobs import JobState
    from pacer.contracts.nodes import NodeEvent
    from pacer.data.criteo import heldout_path

    data = tmp_path / "train.rec"
    generate(data, 60_000, seed=7)
    generate(heldout_path(data), 10_000, seed=7, stream=1)
    name = "byo-e2e"
    spec = (f"name: {name}\ndataset: {{path: {data}, test_path: {heldout_path(data)}}}\nbatch_size: 256\n"
            "policies: {optimizer: default}\n"
            "resources: {workers: 2, ps: 1, worker_cpu: 0.5, ps_cpu: 0.5, worker_memory_mb: 768, ps_memory_mb: 768}\n"
            f"trainer:\n  command: [python, {EXAMPLE}, --step-ms, '{STEP_MS}']\n  ps_command: [python, {EXAMPLE}]\n")
    env = {"PACER_BATCHES_PER_SHARD": "10", "PACER_SHARD_LEASE_S": "20"}
    with running_stack(tmp_path / "stack", ["shard", "jobs", "executor"], env) as st:
        async with job_client(st.url, "byo-test") as client:
            bus = client.bus
            said: list[Heartbeat | AgentMetrics] = []

            async def on_said(msg: Msg) -> None:
                kind = msg.subject.rsplit(".", 1)[-1]
                if kind in (subjects.AgentEventKind.HEARTBEAT, subjects.AgentEventKind.METRICS):
                    said.append(decode(Heartbeat if kind == subjects.AgentEventKind.HEARTBEAT else AgentMetrics,
                                       msg.data))

            await bus.nc.subscribe(subjects.events_of(subjects.AGENT_SERVICE, name), cb=on_said)
            rec = await client.submit(name, spec)
            assert rec.spec.trainer is not None and rec.spec.trainer.command[0] == "python"

            def ready() -> bool:
                live, primary = stepping(said)
                return live >= {"worker-0", "worker-1"} and primary

            await eventually(ready, 120, "both workers step beside their agents")
            await asyncio.sleep(0.3)
            retry = RetryPolicy(attempts=30, first_delay=0.1, max_delay=0.5)
            lr = await bus.request(subjects.agent_global_action(name), GlobalAction(
                name, uuid.uuid4().hex, ActionKind.ADJUST_LR, {"scale": 0.5}, reason="test"), ActionResult, 15, retry)
            assert lr.applied and sorted(lr.nodes) == ["worker-0", "worker-1"], lr
            kr = await bus.request(subjects.agent_command(name, "worker-1"),
                                   NodeCommand(name, "worker-1", ActionKind.KILL_RESTART, reason="test"),
                                   ActionResult, 10)
            assert kr.applied, kr
            deadline = time.monotonic() + 180
            while not ((rec := await client.get(name)).state in (JobState.COMPLETED, JobState.FAILED) and rec.torn_down):
                assert time.monotonic() < deadline, rec
                await asyncio.sleep(0.5)
            events: list[NodeEvent] = await read_events(st.url, subjects.events_of("node", name), NodeEvent)
    assert rec.state is JobState.COMPLETED, rec.reason
    assert rec.progress.records_done == rec.progress.records_total == 60_000 and rec.progress.shards_failed == 0
    # The executor relaunched worker-1 for its KILL_RESTART (exit 75) with the user's command again.
    died = [e for e in events if e.kind == "died" and e.node == "worker-1" and e.generation == 0]
    assert died and died[0].relaunch and died[0].exit_code == EXIT_RESTART, died
    assert any(e.kind == "running" and e.node == "worker-1" and e.generation == 1 for e in events)
    # The chief's result line became the job's result: the action at its iteration, the held-out AUC.
    applied = [a for a in rec.result["actions"] if a["kind"] == "ADJUST_LR"]
    assert [a["iteration"] for a in applied] == [lr.target_iteration], rec.result
    assert rec.result["learning_rate"] == pytest.approx(0.025) and rec.result["auc"] > 0.65, rec.result
