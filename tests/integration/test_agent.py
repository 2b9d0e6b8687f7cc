"""Agent sidecars as real processes over a real nats-server, beside fake trainers.

Each node is two OS processes: ``python -m pacer.agent.main`` and a tiny
pure-Python fake trainer (``FAKE_TRAINER`` below) that loops ``sleep;
iteration += 1; record_step; check`` through :class:`TrainerIPC` and logs
every action it applies, with the iteration, to a JSON-lines file.  One
trainer is much slower than the others, so "the same iteration" is a real
claim: the fast ones reach the target long before the slow one does.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from nats.aio.msg import Msg
from otlp_receiver import Receiver, SpanSeen, orphans, otel_env, wait_for
from pacer import subjects
from pacer.bus import Bus, RetryPolicy
from pacer.codec import decode, encode
from pacer.contracts.agent import (
    ActionKind,
    ActionResult,
    AgentMetrics,
    GlobalAction,
    Heartbeat,
    NodeCommand,
    PrimaryRecord,
)
from pacer.embedded import EmbeddedNats
from pacer.errors import ValidationError

pytestmark = pytest.mark.timeout(60)

K = 10
TTL = 1.5  # election TTL (s) used by these tests

FAKE_TRAINER = r"""
import json, sys, time
from pacer.agent.ipc import TrainerIPC
from pacer.contracts.agent import ActionKind

path, node, sleep_s, log_path, max_s = sys.argv[1:6]
slow_s, slow_at = (float(x) for x in sys.argv[6].split("@")) if len(sys.argv) > 6 else (0.0, float("inf"))
sleep_s, max_s = float(sleep_s), float(max_s)
ipc = TrainerIPC(path, role="worker")
bs, it, end = 64, 0, time.monotonic() + max_s
with open(log_path, "a") as log:
    while time.monotonic() < end:
        t0 = time.perf_counter()
        time.sleep(slow_s if it >= slow_at else sleep_s)
        it += 1
        ipc.record_step(it, it, time.perf_counter() - t0, bs, bs)
        while (a := ipc.check(it)) is not None:
            if a.kind is ActionKind.ADJUST_BS:
                bs = int(a.payload["batch_sizes"].get(node, bs))
            log.write(json.dumps({"iteration": it, "seq": a.seq, "kind": a.kind.value,
                                  "target": a.target_iteration, "late": a.late, "payload": a.payload}) + "\n")
            log.flush()
            ipc.ack(a, it)
            if a.kind is ActionKind.KILL_RESTART:
                ipc.mark_exiting()
                sys.exit(0)
"""


class Node:
    """One agent process and one fake trainer process sharing an IPC file."""

    def __init__(self, root: Path, url: str, job: str, name: str, sleep_s: float,
                 env: dict[str, str] | None = None, slow: str = "") -> None:
        self.url, self.job, self.name, self.sleep_s = url, job, name, sleep_s
        self.env = env or {}  # extra environment of the agent
        self.slow = slow  # "<sleep_s>@<step>": the trainer's steps sleep that long from that step on
        self.ipc = root / f"{name}.ipc"
        self.actions_log = root / f"{name}.actions.jsonl"
        self.agent_log = root / f"{name}.agent.log"
        self.trainer_log = root / f"{name}.trainer.log"
        self.agent: subprocess.Popen[bytes] | None = None
        self.trainer: subprocess.Popen[bytes] | None = None

    def start_agent(self) -> None:
        cmd = [
            sys.executable, "-m", "pacer.agent.main", "--job", self.job, "--node", self.name,
            "--role", "worker", "--ipc", str(self.ipc), "--nats", self.url, "--k", str(K),
            "--election-ttl", str(TTL), "--member-ttl", "2",
        ]  # fmt: skip
        with open(self.agent_log, "ab") as log:
            self.agent = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, "PACER_LOG_LEVEL": "INFO", **self.env})

    def start_trainer(self) -> None:
        cmd = [sys.executable, "-c", FAKE_TRAINER, str(self.ipc), self.name, str(self.sleep_s), str(self.actions_log), "50",
               *([self.slow] if self.slow else [])]
        with open(self.trainer_log, "ab") as log:
            self.trainer = subprocess.Popen(cmd, stdout=log, stderr=log)

    def start(self) -> None:
        self.start_trainer()
        self.start_agent()

    def actions(self) -> list[dict[str, Any]]:
        if not self.actions_log.exists():
            return []
        return [json.loads(line) for line in self.actions_log.read_text().splitlines() if line.strip()]

    def kill_agent(self) -> None:
        assert self.agent is not None
        self.agent.send_signal(signal.SIGKILL)
        self.agent.wait()

    def stop(self) -> None:
        for p in (self.agent, self.trainer):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for what, p in (("agent", self.agent), ("trainer", self.trainer)):
            if p is None:
                continue
            t0 = time.monotonic()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if time.monotonic() - t0 > 2:
                print(f"{self.name} {what} took {time.monotonic() - t0:.1f}s to stop")


class Watch:
    """Collects the job's agent events (metrics, heartbeats, action results)."""

    def __init__(self) -> None:
        self.metrics: list[AgentMetrics] = []
        self.heartbeats: list[Heartbeat] = []
        self.results: list[ActionResult] = []

    async def start(self, bus: Bus, job: str) -> None:
        async def on(msg: Msg) -> None:
            kind = msg.subject.rsplit(".", 1)[-1]
            if kind == subjects.AgentEventKind.METRICS:
                self.metrics.append(decode(AgentMetrics, msg.data))
            elif kind == subjects.AgentEventKind.HEARTBEAT:
                self.heartbeats.append(decode(Heartbeat, msg.data))
            elif kind == subjects.AgentEventKind.ACTION:
                self.results.append(decode(ActionResult, msg.data))

        await bus.nc.subscribe(subjects.events_of(subjects.AGENT_SERVICE, job), cb=on)

    def ready_nodes(self, since: float) -> set[str]:
        """Nodes heard with a live trainer since ``since``: a heartbeat that says so, or a metrics window
        (an agent whose windows come faster than its heartbeat is due sends no heartbeat)."""
        return ({h.node for h in self.heartbeats if h.ts >= since and h.trainer_alive}
                | {m.node for m in self.metrics if m.ts >= since and m.steps > 0})

    def primaries(self, since: float) -> set[str]:
        """Agents that said they were primary since ``since`` (heartbeats and metrics both say it)."""
        return {e.node for e in [*self.heartbeats, *self.metrics] if e.ts >= since and e.primary}


class Cluster:
    def __init__(self, root: Path, bus: Bus, url: str) -> None:
        self.root, self.bus, self.url = root, bus, url
        self.job = f"job{uuid.uuid4().hex[:8]}"
        self.nodes: dict[str, Node] = {}
        self.watch = Watch()

    async def setup(self, speeds: dict[str, float], env: dict[str, str] | None = None) -> None:
        await self.watch.start(self.bus, self.job)
        for name, sleep_s in speeds.items():
            self.nodes[name] = Node(self.root, self.url, self.job, name, sleep_s, env)

    async def wait_ready(self, names: list[str] | None = None, within_s: float = 20.0) -> None:
        """Until every named node heart-beats with a live trainer and some agent is primary."""
        want = set(names or self.nodes)
        t0 = time.time()
        await until(
            lambda: want <= self.watch.ready_nodes(t0) and bool(self.watch.primaries(t0)),
            within_s,
            f"nodes {sorted(want)} ready with a primary",
        )
        await asyncio.sleep(0.2)  # the primary hears the same heartbeats: let it catch up

    async def primary(self) -> PrimaryRecord | None:
        kv = await self.bus.js.key_value(subjects.AGENT_BUCKET)
        try:
            entry = await kv.get(subjects.agent_primary_key(self.job))
        except nats.js.errors.KeyNotFoundError:
            return None
        assert entry.value is not None
        return decode(PrimaryRecord, entry.value)

    async def global_action(self, kind: ActionKind, payload: dict[str, Any], wait_s: float = 10.0) -> ActionResult:
        ga = GlobalAction(self.job, uuid.uuid4().hex, kind, payload, reason="test")
        # No responder while a new primary is being elected: keep asking.
        retry = RetryPolicy(attempts=30, first_delay=0.1, max_delay=0.5)
        return await self.bus.request(subjects.agent_global_action(self.job), ga, ActionResult, wait_s, retry)

    def stop(self) -> None:
        for n in self.nodes.values():
            n.stop()


async def until(pred: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def cluster(tmp_path: Path, bus: Bus, nats_server: EmbeddedNats) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path, bus, nats_server.url)
    try:
        yield c
    finally:
        c.stop()
        for n in c.nodes.values():  # leave the agents' logs in the failure report
            if n.agent_log.exists():
                tail = n.agent_log.read_text().splitlines()[-15:]
                print(f"--- {n.name} agent log tail ---", *tail, sep="\n")


def assert_same_iteration(nodes: list[Node], result: ActionResult, kind: ActionKind) -> None:
    for n in nodes:
        applied = [a for a in n.actions() if a["kind"] == kind.value]
        assert len(applied) == 1, (n.name, n.actions())
        assert applied[0]["iteration"] == result.target_iteration, (n.name, applied, result)
        assert applied[0]["target"] == result.target_iteration and not applied[0]["late"]


# ------------------------------------------------------------------ tests


async def test_metrics_every_k_steps_with_sane_bpt(cluster: Cluster) -> None:
    await cluster.setup({"w0": 0.005, "w1": 0.015})
    for n in cluster.nodes.values():
        n.start()
    await cluster.wait_ready()
    n0, t1 = len(cluster.watch.metrics), time.time()
    await asyncio.sleep(1.5)
    metrics = cluster.watch.metrics[n0:]
    # A heartbeat only after a second in which the agent said nothing else (pacer.agent.reporting.heartbeat_due):
    # its windows, every few tens of ms here, say it is alive.  A fixed 1-s beat would fail this.
    for name in cluster.nodes:
        said = sorted([h.ts for h in cluster.watch.heartbeats if h.node == name]
                      + [m.ts for m in cluster.watch.metrics if m.node == name])
        for h in (h for h in cluster.watch.heartbeats if h.node == name and h.ts >= t1):
            before = max((t for t in said if t < h.ts), default=0.0)
            assert h.ts - before >= 0.9, (name, h, before)
    for name, n in cluster.nodes.items():
        mine = [m for m in metrics if m.node == name]
        assert len(mine) >= 5, (name, len(mine))
        # Exactly one message per k steps, none skipped.
        steps = [m.steps_total for m in mine]
        assert all(b - a == K for a, b in itertools.pairwise(steps)), steps
        assert all(m.steps == K and m.steps_total % K == 0 for m in mine)
        for m in mine:
            assert m.job == cluster.job and m.role == "worker" and m.iteration == m.local_step
            assert n.sleep_s <= m.bpt_s < n.sleep_s + 0.05, (name, m.bpt_s)
            assert 0.3 * 64 / m.bpt_s < m.samples_per_s <= 1.05 * 64 / n.sleep_s, (name, m.samples_per_s)
            assert m.batch_size == 64 and m.samples_total >= 64 * m.steps_total
            assert m.rss_bytes > 1_000_000 and m.cpu_percent >= 0
            assert (m.last_action_seq, m.last_action_iteration) == (0, -1)
    # The slow worker's BPT shows it: its steps sleep 10 ms longer, and both pay the same per-step overhead
    # (a ratio of 2 failed under load, when w0's overhead alone grew past its 5 ms sleep).
    bpt = {name: [m.bpt_s for m in metrics if m.node == name][-1] for name in cluster.nodes}
    assert bpt["w1"] - bpt["w0"] > 0.005, bpt
    # Exactly one primary, in what the agents said over the last two seconds (heartbeats and metrics).
    assert len(cluster.watch.primaries(time.time() - 2.0)) == 1


async def test_slow_steps_are_reported_after_fewer_than_k_steps(cluster: Cluster) -> None:
    # 0.3 s steps: K of them take longer than the 1 s asked for, so windows of 3 steps follow the first.
    await cluster.setup({"w0": 0.3}, env={"PACER_AGENT_WORKER_REPORT_S": "1"})
    for n in cluster.nodes.values():
        n.start()
    await cluster.wait_ready()
    await until(lambda: sum(1 for m in cluster.watch.metrics if m.steps < K) >= 3, 30, "three short windows")
    mine = cluster.watch.metrics
    short = [m for m in mine if m.steps < K]
    assert {m.steps for m in short} == {3}, [(m.steps, round(m.bpt_s, 3)) for m in mine]
    # Windows still tile the steps: each report starts where the one before ended.
    assert all(b.steps_total - a.steps_total == b.steps for a, b in itertools.pairwise(mine)), \
        [(m.steps_total, m.steps) for m in mine]


async def test_a_worker_that_slows_mid_window_says_so_within_worker_report_s(cluster: Cluster) -> None:
    # 0.1 s steps: windows of K steps, 1 s each.  From step 80 a step takes 0.6 s, so the window [80, 90)
    # would take 6 s; it is overdue after max(2 s, 1.5 x 1 s) and closes with the few steps it has
    # (pacer.agent.reporting.window_overdue).  Sized by the last BPT alone, it would carry all K.
    cluster.nodes["w0"] = Node(cluster.root, cluster.url, cluster.job, "w0", 0.1,
                               env={"PACER_AGENT_WORKER_REPORT_S": "2"}, slow="0.6@80")
    await cluster.watch.start(cluster.bus, cluster.job)
    cluster.nodes["w0"].start()
    await until(lambda: any(m.steps_total > 80 for m in cluster.watch.metrics), 40, "a window past step 80")
    mine = cluster.watch.metrics
    before = [m for m in mine if m.steps_total <= 80]
    assert before and before[-1].steps_total == 80, [(m.steps_total, m.steps) for m in mine]  # seen fast
    first_slow = next(m for m in mine if m.steps_total > 80)
    assert first_slow.steps < K and first_slow.steps_total - first_slow.steps == 80, first_slow
    # ... and the windows still tile the steps.
    assert all(b.steps_total - a.steps_total == b.steps for a, b in itertools.pairwise(mine)), \
        [(m.steps_total, m.steps) for m in mine]


async def test_global_action_is_applied_by_all_trainers_at_the_same_iteration(cluster: Cluster) -> None:
    await cluster.setup({"w0": 0.005, "w1": 0.008, "w2": 0.02})
    for n in cluster.nodes.values():
        n.start()
    await cluster.wait_ready()
    sizes = {"w0": 128, "w1": 96, "w2": 32}
    result = await cluster.global_action(ActionKind.ADJUST_BS, {"batch_sizes": sizes})
    assert result.applied, result
    assert result.nodes == ["w0", "w1", "w2"] and result.kind is ActionKind.ADJUST_BS
    assert result.target_iteration > 0 and result.detail == ""
    nodes = list(cluster.nodes.values())
    # The slow worker reaches T last; everyone applies it exactly at T.
    await until(lambda: all(n.actions() for n in nodes), 30, "every trainer applied the action")
    assert_same_iteration(nodes, result, ActionKind.ADJUST_BS)
    # The agents report it too: last_action_iteration == T, and the new batch sizes.
    def reported() -> bool:
        last = {m.node: m for m in cluster.watch.metrics}
        return all(
            n in last and last[n].last_action_iteration == result.target_iteration and last[n].batch_size == sizes[n]
            for n in sizes
        )

    await until(reported, 10, "metrics with last_action_iteration == T")
    last = {m.node: m for m in cluster.watch.metrics}
    assert len({m.last_action_seq for m in last.values()}) >= 1
    assert all(m.last_action_id == result.action_id for m in last.values())
    # The result is also an event.
    await until(lambda: any(r.action_id == result.action_id for r in cluster.watch.results), 5, "ActionResult event")
    # Sending the same action again returns the first result and applies nothing twice.
    again = await cluster.bus.request(
        subjects.agent_global_action(cluster.job),
        GlobalAction(cluster.job, result.action_id, ActionKind.ADJUST_BS, {"batch_sizes": sizes}),
        ActionResult,
    )
    assert again == result
    await asyncio.sleep(0.3)
    assert all(len(n.actions()) == 1 for n in nodes)


async def test_primary_killed_another_takes_over_and_actions_still_synchronise(cluster: Cluster) -> None:
    await cluster.setup({"slow": 0.02, "w0": 0.005, "w1": 0.008})
    slow = cluster.nodes["slow"]
    slow.start()  # alone first: it becomes primary, so killing it leaves the fast ones
    await until(lambda: any(h.primary and h.node == "slow" for h in cluster.watch.heartbeats), 20, "slow primary")
    for name in ("w0", "w1"):
        cluster.nodes[name].start()
    await cluster.wait_ready()
    rec = await cluster.primary()
    assert rec is not None and rec.node == "slow"

    slow.kill_agent()  # kill -9; its trainer goes on, without an agent
    t_kill = time.monotonic()
    new: list[PrimaryRecord] = []

    async def elected() -> None:
        while not new:
            rec = await cluster.primary()
            if rec is not None and rec.node != "slow":
                new.append(rec)
            await asyncio.sleep(0.05)

    await asyncio.wait_for(elected(), 2 * TTL + 2)
    took = time.monotonic() - t_kill
    print(f"re-elected {new[0].node} {took:.2f}s after kill -9 (TTL {TTL}s)")
    assert new[0].node in ("w0", "w1")

    result = await cluster.global_action(ActionKind.ADJUST_LR, {"scale": 0.5}, wait_s=15)
    assert result.applied, result
    assert result.nodes == ["w0", "w1"]
    remaining = [cluster.nodes["w0"], cluster.nodes["w1"]]
    await until(lambda: all(n.actions() for n in remaining), 20, "remaining trainers applied the action")
    assert_same_iteration(remaining, result, ActionKind.ADJUST_LR)
    assert slow.actions() == []  # its agent is dead: it was not part of the action


async def test_node_command_reaches_only_its_node(cluster: Cluster) -> None:
    await cluster.setup({"w0": 0.005, "w1": 0.005, "w2": 0.01})
    for n in cluster.nodes.values():
        n.start()
    await cluster.wait_ready()
    cmd = NodeCommand(cluster.job, "w1", ActionKind.KILL_RESTART, reason="persistent straggler")
    result = await cluster.bus.request(subjects.agent_command(cluster.job, "w1"), cmd, ActionResult)
    assert result.applied and result.nodes == ["w1"] and result.kind is ActionKind.KILL_RESTART
    w1 = cluster.nodes["w1"]
    assert w1.trainer is not None
    await until(lambda: w1.trainer is not None and w1.trainer.poll() is not None, 10, "w1's trainer exits")
    assert w1.trainer.returncode == 0
    (applied,) = w1.actions()
    # A node command has no barrier: it is taken at the first check at or after
    # its target. The trainer may pass the target while the agent writes the
    # command (a loaded host), and then says so with ``late``.
    assert applied["kind"] == "KILL_RESTART" and applied["iteration"] >= result.target_iteration
    assert applied["late"] == (applied["iteration"] > result.target_iteration), applied
    # Its agent now reports the trainer as gone; the others got nothing.
    t0 = time.time()
    await until(
        lambda: any(h.node == "w1" and h.ts > t0 and not h.trainer_alive for h in cluster.watch.heartbeats),
        5,
        "w1 heartbeat without a live trainer",
    )
    assert cluster.nodes["w0"].actions() == [] and cluster.nodes["w2"].actions() == []
    # A command whose body names another node is refused by the agent it reached.
    with pytest.raises(ValidationError):
        await cluster.bus.request(
            subjects.agent_command(cluster.job, "w0"),
            NodeCommand(cluster.job, "w2", ActionKind.KILL_RESTART),
            ActionResult,
        )
    assert cluster.nodes["w2"].actions() == []


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    yield r
    r.server.shutdown()


async def test_actions_are_traced_through_the_agents(receiver: Receiver, cluster: Cluster) -> None:
    """A global action and a node command sent with a W3C trace context: the agents' spans join that trace.

    The receiver is requested before the cluster so that it outlives the agents, which flush their last spans as
    they stop.
    """
    await cluster.setup({"w0": 0.005, "w1": 0.008}, env=otel_env(receiver.endpoint))
    for n in cluster.nodes.values():
        n.start()
    await cluster.wait_ready()
    nc = cluster.bus.nc

    async def send(subject: str, msg: Any, trace_id: str, span_id: str) -> ActionResult:
        reply = await nc.request(subject, encode(msg), timeout=15,
                                 headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
        return decode(ActionResult, reply.data)

    ga_trace, ga_span = secrets.token_hex(16), secrets.token_hex(8)
    ga = GlobalAction(cluster.job, uuid.uuid4().hex, ActionKind.ADJUST_LR, {"scale": 0.5}, reason="test")
    assert (await send(subjects.agent_global_action(cluster.job), ga, ga_trace, ga_span)).applied
    cmd_trace, cmd_span = secrets.token_hex(16), secrets.token_hex(8)
    cmd = NodeCommand(cluster.job, "w1", ActionKind.ADJUST_LR, reason="test", payload={"scale": 2.0})
    assert (await send(subjects.agent_command(cluster.job, "w1"), cmd, cmd_trace, cmd_span)).applied

    def names(spans: list[SpanSeen], trace_id: str) -> collections.Counter[str]:
        return collections.Counter(s.name for s in spans if s.trace_id == trace_id and s.service == "agent")

    def complete(seen: list[SpanSeen]) -> bool:
        ga_names = names(seen, ga_trace)
        # one handling by the primary; a prepare and a commit by each of the two agents (more after an abort)
        return (ga_names["handle agent.global_action"] == 1 and ga_names["handle agent.prepare"] >= 2
                and ga_names["handle agent.commit"] >= 2 and names(seen, cmd_trace)["handle agent.command"] == 1)

    spans = await wait_for(receiver, complete, timeout_s=20)
    assert complete(spans), (names(spans, ga_trace), names(spans, cmd_trace))
    # The primary handled the action in the caller's trace, and every agent's prepare and commit joined it.
    (handled,) = [s for s in spans if s.trace_id == ga_trace and s.name == "handle agent.global_action"]
    assert handled.parent_id == ga_span and handled.kind == 2  # SPAN_KIND_SERVER
    assert not orphans([s for s in spans if s.trace_id == ga_trace], {ga_span})
    (command,) = [s for s in spans if s.trace_id == cmd_trace and s.name == "handle agent.command"]
    assert command.parent_id == cmd_span
    assert not orphans([s for s in spans if s.trace_id == cmd_trace], {cmd_span})  # its result event too
