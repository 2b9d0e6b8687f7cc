"""Simulated nodes for ``bench/bench_scale.py``: many agents and workers in one asyncio process, no TensorFlow.

A simulated node does what a pod's agent and trainer do on the bus, with
the real code for everything that leaves the node:

* the agent's heartbeat (:class:`~pacer.contracts.agent.Heartbeat`) when the
  node has sent nothing else for ``heartbeat_s`` (1 s, the agent's default),
  by the agent's own rule (:func:`pacer.agent.reporting.heartbeat_due`);
* the agent's metrics window: a worker publishes an
  :class:`~pacer.contracts.agent.AgentMetrics` at the end of every window,
  whose length in steps is the agent's own
  :func:`pacer.agent.reporting.window_steps` (k = 10 steps, or fewer when
  they take longer than 4 s at the last BPT; a window open 4 s closes with
  the steps it has, :func:`~pacer.agent.reporting.window_overdue`); a PS every ``report_every_s`` (2 s) with its
  probe latency as ``bpt_s``;
* the trainer's shard reader: the real :class:`~pacer.shards.client.ShardClient`
  (prefetch, lease renewal, reports), one shard of ``batches_per_shard``
  steps at a time;
* the primary agent of each job: it answers ``pacer.rpc.agent.<job>.global_action``
  with an applied :class:`~pacer.contracts.agent.ActionResult` (the two-phase
  barrier among the job's agents is the agents' own business, measured by
  ``tests/integration/test_agent*``) and notes when each action arrived.

Each job connects once per simulating process, as its own agent user
(``agent-<job>``, the password the executor would give its pods), so the bus's
permissions are those of a deployment.  Real agents hold one connection
each; a process holding thousands of TLS connections would measure itself,
not the control plane.

Steps are not simulated one by one: a node's step count is a function of
time (``1 / bpt`` steps per second), and it wakes only when a message is due.
A straggler's BPT becomes ``slow_factor`` times its peers' at ``onset``
(seconds into the run).

Everything a measurement needs is written to the result queue: per worker
report (job, node, samples_total, publish time), each job's straggler onset
and the arrival of its first global action after it, the shard clients'
request timings, and the counts of what was published.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from pacer import security, subjects
from pacer.agent.agent import AgentConfig
from pacer.agent.reporting import heartbeat_due, window_deadline, window_steps
from pacer.authjwt import agent_token, incarnation, token_expiry
from pacer.bus import Bus
from pacer.codec import decode
from pacer.contracts.agent import ActionResult, AgentMetrics, GlobalAction, Heartbeat
from pacer.shards.client import ShardClient

AGENT = AgentConfig(job="sim", node="worker-0", ipc_path=Path("unused"))  # a real agent's defaults
K = AGENT.k
WORKER_REPORT_S = AGENT.worker_report_s
HEARTBEAT_S = AGENT.heartbeat_s
PS_REPORT_S = AGENT.report_every_s


@dataclass
class SimJob:
    """One job as the simulating process runs it."""

    job: str
    workers: int
    ps: int
    batch_size: int
    bpt_s: float
    batches_per_shard: int
    straggler: str = ""  # the worker that turns slow ("": none)
    onset: float = 0.0  # seconds after the run's start
    slow_factor: float = 4.0
    submitted_at: float = 0.0  # its record's submission time: the incarnation its agents' tokens name


@dataclass
class Plan:
    """What one simulating process runs, and for how long."""

    url: str  # the server, without credentials
    agent_secret: str  # the executor's secret of the agents' passwords
    ca: str
    jobs: list[SimJob]
    start_at: float  # wall clock: every process starts its nodes then
    stop_at: float  # ... and stops them then
    seed: int = 0
    stop_file: str = ""  # given: the nodes run on past stop_at until this file exists

    def over(self, t: float) -> bool:
        """Whether the run is over at wall time ``t``."""
        return t >= self.stop_at and (not self.stop_file or os.path.exists(self.stop_file))


class Stamped(list):  # type: ignore[type-arg]
    """``ShardClient.timings``, each entry with the wall time it was taken: (seconds, reported, granted, at)."""

    def append(self, item: Any) -> None:
        super().append((*item, time.time()))


@dataclass
class Out:
    reports: list[tuple[str, str, int, float]] = field(default_factory=list)  # job, node, samples_total, ts
    onsets: dict[str, float] = field(default_factory=dict)  # job -> wall time its straggler turned slow
    actions: list[tuple[str, float, str]] = field(default_factory=list)  # job, arrival wall time, kind
    lease_timings: list[tuple[float, int, int, float]] = field(default_factory=Stamped)
    published: dict[str, int] = field(default_factory=lambda: {"heartbeats": 0, "metrics": 0})
    errors: list[str] = field(default_factory=list)


class Node:
    """One simulated worker or PS: the time-driven step count and what its agent publishes."""

    def __init__(self, sj: SimJob, role: str, index: int, t0: float, rng: random.Random) -> None:
        self.sj, self.role, self.name = sj, role, f"{role}-{index}"
        self.t0 = t0  # wall time the node starts stepping
        self.base = sj.bpt_s * rng.uniform(0.9, 1.1) if role == "worker" else 0.004 * rng.uniform(0.8, 1.2)
        self.slow_at = t0 + sj.onset if sj.straggler == self.name else float("inf")
        self.incarnation = 1
        self.sent_at = float("-inf")  # wall time of its agent's last heartbeat or metrics

    def bpt(self, t: float) -> float:
        return self.base * (self.sj.slow_factor if t >= self.slow_at else 1.0)

    def steps(self, t: float) -> float:
        """Steps done by wall time ``t``: BPT base until the onset, slow after."""
        if t <= self.t0:
            return 0.0
        fast_end = min(t, self.slow_at)
        n = (fast_end - self.t0) / self.base
        if t > self.slow_at:
            n += (t - self.slow_at) / self.bpt(t)
        return n

    def time_of(self, steps: float) -> float:
        """Wall time the node reaches ``steps`` (inverse of :meth:`steps`)."""
        at_onset = (self.slow_at - self.t0) / self.base if self.slow_at != float("inf") else float("inf")
        if steps <= at_onset:
            return self.t0 + steps * self.base
        return self.slow_at + (steps - at_onset) * self.base * self.sj.slow_factor

    def heartbeat(self, now: float) -> Heartbeat:
        it = int(self.steps(now)) if self.role == "worker" else -1
        return Heartbeat(job=self.sj.job, node=self.name, role=self.role, ts=now, instance=f"sim-{self.name}",
                         primary=self.name == "worker-0", trainer_alive=True, iteration=it,
                         bpt_s=self.bpt(now), trainer_pid=1)

    def metrics(self, now: float, first: int, last: int, local_step: int = -1) -> AgentMetrics:
        """The window of steps [first, last) ending now (a PS: ``last - first`` probes)."""
        w = last - first
        bpt = (self.time_of(last) - self.time_of(first)) / w if self.role == "worker" and w else self.bpt(now)
        worker = self.role == "worker"
        return AgentMetrics(
            job=self.sj.job, node=self.name, role=self.role, ts=now,
            local_step=last if worker else local_step, iteration=last if worker else -1, bpt_s=bpt,
            batch_size=self.sj.batch_size if worker else 0,
            samples_per_s=self.sj.batch_size / bpt if worker and bpt > 0 else 0.0,
            samples_total=last * self.sj.batch_size if worker else 0,
            cpu_percent=95.0, rss_bytes=600 << 20, last_action_seq=0, last_action_iteration=-1,
            primary=self.name == "worker-0", steps=w, steps_total=last, incarnation=self.incarnation)


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.time()))


async def _heartbeats(bus: Bus, node: Node, plan: Plan, out: Out, rng: random.Random) -> None:
    subject = subjects.agent_heartbeat(node.sj.job)
    t = node.t0 + rng.uniform(0, HEARTBEAT_S)
    while not plan.over(t):
        await _sleep_until(t)
        now = time.time()
        if heartbeat_due(now - node.sent_at, HEARTBEAT_S, changed=False):  # nothing else changes here
            await bus.publish(subject, node.heartbeat(now))
            node.sent_at = now
            out.published["heartbeats"] += 1
        t = node.sent_at + HEARTBEAT_S


async def _worker_metrics(bus: Bus, node: Node, plan: Plan, out: Out) -> None:
    """The agent's windows: k steps, or as many as take worker_report_s at the last BPT, or what a window
    open worker_report_s has (the real rules)."""
    subject = subjects.agent_metrics(node.sj.job)
    first, w, opened, planned = 0, K, node.t0, float("inf")
    while True:
        end = node.time_of(first + w)
        cut = opened + window_deadline(planned, WORKER_REPORT_S)
        if end > cut:  # overdue (window_overdue): it closes at the cut with the steps it has, or at its first
            done = max(first + 1, int(node.steps(cut)))
            end, w = max(cut, node.time_of(done)), done - first
        if plan.over(end):
            return
        await _sleep_until(end)
        now = time.time()
        m = node.metrics(now, first, first + w)
        await bus.publish(subject, m)
        node.sent_at = now
        out.published["metrics"] += 1
        out.reports.append((node.sj.job, node.name, m.samples_total, now))
        first, opened = first + w, now
        w = window_steps(K, m.bpt_s, WORKER_REPORT_S)
        planned = w * m.bpt_s


async def _ps_metrics(bus: Bus, node: Node, plan: Plan, out: Out, rng: random.Random) -> None:
    subject = subjects.agent_metrics(node.sj.job)
    t, probes = node.t0 + rng.uniform(0, PS_REPORT_S), 0
    while not plan.over(t):
        await _sleep_until(t)
        n = int(PS_REPORT_S / AGENT.probe_every_s)
        node.sent_at = time.time()
        await bus.publish(subject, node.metrics(node.sent_at, probes, probes + n, local_step=probes + n))
        out.published["metrics"] += 1
        probes += n
        t += PS_REPORT_S


async def _shards(bus: Bus, node: Node, plan: Plan, out: Out) -> None:
    """The trainer's reader: a shard of batches_per_shard steps, then the next (the real ShardClient)."""
    c = ShardClient(bus, node.sj.job, "d", node.name)
    c.timings = out.lease_timings
    await c.start()
    try:
        await _sleep_until(node.t0)
        steps = 0.0
        while (shard := await c.next()) is not None:
            steps += node.sj.batches_per_shard
            end = node.time_of(steps)
            if plan.over(end):
                break
            await _sleep_until(end)
            c.done(shard)
    finally:  # its last report, bounded: thousands of them at once must not outlast the run by minutes
        with contextlib.suppress(Exception):
            await asyncio.wait_for(c.close(release=False), 5.0)


async def _primary(bus: Bus, sj: SimJob, out: Out) -> Any:
    """The job's primary agent, as far as the controller can tell: global actions arrive and are applied."""

    async def on_action(msg: Msg) -> None:
        now = time.time()
        try:
            ga = decode(GlobalAction, msg.data)
        except Exception as exc:
            out.errors.append(f"{sj.job}: undecodable global action: {exc}")
            return
        out.actions.append((sj.job, now, ga.kind.value))
        await bus.respond(msg, ActionResult(action_id=ga.action_id or "sim", applied=True, target_iteration=0,
                                            nodes=[f"worker-{i}" for i in range(sj.workers)], job=sj.job,
                                            kind=ga.kind, attempts=1, ts=now))

    return await bus.nc.subscribe(subjects.agent_global_action(sj.job), cb=on_action)


async def _membership(bus: Bus, sj: SimJob) -> Any:
    """What the primary listens to: its job's heartbeats and metrics (counted, not used)."""
    subs = []
    for subject in (subjects.agent_heartbeat(sj.job), subjects.agent_metrics(sj.job)):
        subs.append(await bus.nc.subscribe(subject, cb=_ignore))
    return subs


async def _ignore(msg: Msg) -> None:
    return None


async def run(plan: Plan) -> Out:
    out = Out()
    rng = random.Random(plan.seed)
    buses: list[Bus] = []
    tasks: list[asyncio.Task[Any]] = []
    try:
        for sj in plan.jobs:
            token = agent_token(plan.agent_secret, sj.job, incarnation=incarnation(sj.submitted_at),
                                expires=token_expiry(time.time(), 24 * 3600.0))  # as the executor mints them
            url = security.with_credentials(plan.url, f"agent-{sj.job}", token)
            bus = await Bus.connect(url, name=f"sim-{sj.job}")
            buses.append(bus)
            await _primary(bus, sj, out)
            await _membership(bus, sj)
        for bus, sj in zip(buses, plan.jobs, strict=True):
            if sj.straggler:
                out.onsets[sj.job] = plan.start_at + sj.onset
            for role, count in (("ps", sj.ps), ("worker", sj.workers)):
                for i in range(count):
                    node = Node(sj, role, i, plan.start_at + rng.uniform(0, 1.0), rng)
                    tasks.append(asyncio.create_task(_heartbeats(bus, node, plan, out, rng)))
                    if role == "worker":
                        tasks.append(asyncio.create_task(_worker_metrics(bus, node, plan, out)))
                        tasks.append(asyncio.create_task(_shards(bus, node, plan, out)))
                    else:
                        tasks.append(asyncio.create_task(_ps_metrics(bus, node, plan, out, rng)))
        while not plan.over(time.time()):
            await asyncio.sleep(0.2)
        # A request still waiting on a service at the end is the service's latency, reported.  The
        # correctness test (a stop file) gives it 60 s: beside a CPU burner and TensorFlow tests, 21 of
        # 1,500 node tasks were still waiting after 15 s, a starved machine, not a lost request.
        late_s = 60.0 if plan.stop_file else 15.0
        _, late = await asyncio.wait(tasks, timeout=late_s)
        for t in late:
            t.cancel()
        if late:
            out.errors.append(f"{len(late)} node task(s) still waiting {late_s:g} s after the end (cancelled)")
            await asyncio.wait(late)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                out.errors.append(f"{type(t.exception()).__name__}: {t.exception()}")
    finally:  # every job's connection at once: one by one, their drains took minutes at 10,000 nodes
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(b.close() for b in buses), return_exceptions=True), 30.0)
    return out


def main(plan: Plan, q: Any) -> None:
    """Process entry point (multiprocessing spawn): run the plan, put the result on ``q``."""
    if plan.ca:
        os.environ["PACER_NATS_CA"] = plan.ca
    try:
        import uvloop

        out = uvloop.run(run(plan))
    except ImportError:  # pragma: no cover
        out = asyncio.run(run(plan))
    q.put(encode_out(out))


def encode_out(out: Out) -> dict[str, Any]:
    return {"reports": out.reports, "onsets": out.onsets, "actions": out.actions,
            "lease_timings": list(out.lease_timings), "published": out.published, "errors": out.errors[:20]}


__all__ = ["Node", "Out", "Plan", "SimJob", "main", "run"]
