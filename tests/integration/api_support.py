"""What the HTTP API tests share: a double of the API's peer services, the API service, a client, SSE.

The HTTP API runs over a real nats-server, against a double of its peer services.
The API runs in-process through the real runtime on a free port.  The job
service, the executor and the monitor are played by :class:`PeerDouble`: a
responder on the real bus that answers their rpc subjects with real contract
messages and real error replies (through ``runtime.dispatch_rpc``) and
validates specs with the real ``parse_job_spec``, so error messages are the
ones users get.  Events are published as the real services publish them.

``PeerDouble``, ``api_service`` and ``read_sse`` are imported by the
dashboard tests too (and by the API's hostile and redaction tests).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import InProcess
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pacer import codec, subjects
from pacer.bus import Bus
from pacer.contracts.agent import ActionKind
from pacer.contracts.brain import BrainDecision, BrainRule, BrainStage
from pacer.contracts.executor import ExecutorStatus, LogsQuery, LogsReply, NodeInfo, PodPhase
from pacer.contracts.executor import JobQuery as ExecutorQuery
from pacer.contracts.jobs import (
    JobList,
    JobQuery,
    JobRecord,
    JobState,
    ListRequest,
    StopRequest,
    SubmitRequest,
)
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, StatsQuery
from pacer.contracts.policy import ControllerDecision, PolicyAction, RefusedAction
from pacer.embedded import EmbeddedNats
from pacer.errors import Conflict, NotFound, ValidationError
from pacer.jobs.spec import default_plan, parse_job_spec
from pacer.runtime import dispatch_rpc
from pacer.telemetry import Counters
from pacer_services.api import identity
from pacer_services.api.app import ApiConfig, ApiService

SPEC_YAML = """\
name: {name}
model: wide_deep
dataset:
  path: data/train.tsv
epochs: 2
batch_size: 256
"""

TERMINAL = {JobState.COMPLETED, JobState.FAILED, JobState.STOPPED}


# ------------------------------------------------------------------ the peer double


@dataclass
class PeerDouble:
    """Answers ``pacer.rpc.jobs.*``, ``pacer.rpc.executor.*`` and ``pacer.rpc.monitor.*``.

    ``records`` is the job service's state; ``executor`` and ``stats`` hold what
    the executor and the monitor answer (absent job: ``not_found``);
    ``calls`` lists every (subject, op) received, in order.
    """

    bus: Bus
    records: dict[str, JobRecord] = field(default_factory=dict)
    executor: dict[str, ExecutorStatus] = field(default_factory=dict)
    stats: dict[str, JobStatistics] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    subs: list[Subscription] = field(default_factory=list)

    async def start(self) -> PeerDouble:
        counters = Counters("double")
        handlers = {
            "jobs": {"submit": self._submit, "get": self._get, "list": self._list, "stop": self._stop},
            "executor": {"status": self._status, "logs": self._logs},
            "monitor": {"stats": self._stats},
        }
        for service, table in handlers.items():

            async def on_msg(msg: Msg, table: Any = table) -> None:
                self.calls.append((msg.subject, msg.subject.rsplit(".", 1)[-1]))
                await dispatch_rpc(self.bus, counters, table, msg)

            self.subs.append(await self.bus.nc.subscribe(subjects.rpc_wildcard(service), cb=on_msg))
        await self.bus.nc.flush()
        return self

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()

    def add_running(self, name: str, now: float | None = None, namespace: str = "default") -> JobRecord:
        """A running job with the default plan (what the job service holds once started)."""
        now = now or time.time()
        spec = parse_job_spec(SPEC_YAML.format(name=name))
        rec = JobRecord(job=name, spec=spec, state=JobState.RUNNING, submitted_at=now - 60, updated_at=now - 30,
                        started_at=now - 30, plan=default_plan(spec), namespace=namespace)
        self.records[name] = rec
        return rec

    async def _submit(self, job: str, msg: Msg) -> None:
        req = codec.decode(SubmitRequest, msg.data)
        spec = parse_job_spec(req.spec)  # the real validation: JobSpecError names each bad field
        if spec.name != job:
            raise ValidationError(f"name: {spec.name!r} differs from the subject's job {job!r}")
        if job in self.records:
            raise Conflict(f"job {job!r} exists")
        now = time.time()
        self.records[job] = JobRecord(job=job, spec=spec, state=JobState.SUBMITTED, submitted_at=now, updated_at=now,
                                      namespace=req.namespace)
        await self.bus.respond(msg, self.records[job])

    async def _get(self, job: str, msg: Msg) -> None:
        codec.decode(JobQuery, msg.data)
        await self.bus.respond(msg, self._record(job))

    async def _list(self, job: str, msg: Msg) -> None:
        req = codec.decode(ListRequest, msg.data)
        jobs = [r for r in self.records.values() if (not req.state or r.state.value == req.state)
                and (not req.namespaces or r.namespace in req.namespaces)]
        jobs.sort(key=lambda r: -r.submitted_at)
        await self.bus.respond(msg, JobList(jobs[: req.limit]))

    async def _stop(self, job: str, msg: Msg) -> None:
        req = codec.decode(StopRequest, msg.data)
        rec = self._record(job)
        if rec.state in TERMINAL:
            raise Conflict(f"job {job!r} is {rec.state.value}: nothing to stop")
        rec = self.records[job] = replace(rec, state=JobState.STOPPED, reason=req.reason, finished_at=time.time())
        await self.bus.respond(msg, rec)

    async def _status(self, job: str, msg: Msg) -> None:
        codec.decode(ExecutorQuery, msg.data)
        if job not in self.executor:
            raise NotFound(f"executor knows no job {job!r}")
        await self.bus.respond(msg, self.executor[job])

    async def _logs(self, job: str, msg: Msg) -> None:
        q = codec.decode(LogsQuery, msg.data)
        if job not in self.executor:
            raise NotFound(f"executor knows no job {job!r}")
        lines = [f"{q.container} line {i}" for i in range(q.tail)]
        await self.bus.respond(msg, LogsReply(job, q.node, f"{job}-{q.node}-g0", "\n".join(lines)))

    async def _stats(self, job: str, msg: Msg) -> None:
        codec.decode(StatsQuery, msg.data)
        if job not in self.stats:
            raise NotFound(f"monitor knows no job {job!r}")
        await self.bus.respond(msg, self.stats[job])

    def _record(self, job: str) -> JobRecord:
        if job not in self.records:
            raise NotFound(f"no job named {job!r}")
        return self.records[job]


def statistics(job: str, throughput: float, ts: float | None = None) -> JobStatistics:
    """Statistics as the monitor publishes them: two workers (one slow) and a PS."""
    ts = ts or time.time()

    def node(name: str, role: str, bpt: float, speed: float) -> NodeStats:
        return NodeStats(node=name, role=role, bpt_short_s=bpt, bpt_long_s=bpt, speed_samples_per_s=speed,
                         samples_total=1000, cpu_percent=90.0, rss_bytes=1 << 28, last_seen=ts,
                         state=Liveness.RUNNING, pending_s=1.0, restarts=0, slowdown_short=1.0, slowdown_long=1.0)

    return JobStatistics(job=job, ts=ts, window_short_s=3.0, window_long_s=30.0,
                         throughput_samples_per_s=throughput,
                         nodes=[node("ps-0", "ps", 0.0, 0.0), node("worker-0", "worker", 0.05, throughput * 0.6),
                                node("worker-1", "worker", 0.08, throughput * 0.4)])


def executor_status(job: str) -> ExecutorStatus:
    def info(name: str, role: str) -> NodeInfo:
        return NodeInfo(node=name, role=role, pod=f"{job}-{name}-g0", phase=PodPhase.RUNNING, cpu=1.0,
                        memory_mb=1024, restarts=0, requested_restarts=0, generation=0)

    return ExecutorStatus(job=job, state="running", plan=None,
                          nodes=[info("ps-0", "ps"), info("worker-0", "worker"), info("worker-1", "worker")],
                          backend="local")


# ------------------------------------------------------------------ fixtures and helpers


TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


def api_config() -> ApiConfig:
    return ApiConfig(host="127.0.0.1", port=0, keepalive_s=0.5, poll_s=0.1, rpc_timeout_s=5.0, part_timeout_s=5.0,
                     token=TOKEN)


# Three callers of a tokens file: a viewer and a submitter of team-a, a submitter of team-b.
VIEWER_A = "viewer-a-token-0123456789abcdef"
SUBMIT_A = "submitter-a-token-0123456789abcdef"
SUBMIT_B = "submitter-b-token-0123456789abcdef"


def teams_config(tmp_path: Path) -> ApiConfig:
    """:func:`api_config` with a tokens file (in ``tmp_path``) of the three team callers above."""
    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": [
        identity.entry("vera", "viewer", ["team-a"], VIEWER_A),
        identity.entry("sam", "submitter", ["team-a"], SUBMIT_A),
        identity.entry("bo", "submitter", ["team-b"], SUBMIT_B),
    ]}))
    assert VIEWER_A not in path.read_text()  # the file holds hashes, not tokens
    cfg = api_config()
    cfg.tokens_file = str(path)
    return cfg


@pytest.fixture
async def peers(bus: Bus) -> AsyncIterator[PeerDouble]:
    double = await PeerDouble(bus).start()
    yield double
    await double.stop()


@pytest.fixture
async def api_service(nats_server: EmbeddedNats) -> AsyncIterator[ApiService]:
    runner = InProcess(nats_server.url, lambda b: ApiService(b, api_config()))
    svc = await runner.start()
    yield svc
    await runner.stop()


@pytest.fixture
async def http(api_service: ApiService) -> AsyncIterator[Client]:
    async with aiohttp.ClientSession(f"http://127.0.0.1:{api_service.port}", headers=AUTH) as session:
        yield Client(session)


@dataclass
class Client:
    session: aiohttp.ClientSession

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        async with self.session.request(method, path, **kw) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except json.JSONDecodeError:
                return resp.status, text


async def read_sse(resp: aiohttp.ClientResponse, until: str, timeout: float = 10.0,
                   out: list[tuple[str, Any]] | None = None, ids: list[str | None] | None = None,
                   ) -> list[tuple[str, Any]]:
    """Read Server-Sent Events until one named ``until`` (included); returns (event, data) pairs.

    Comment lines are collected as ``(":", text)``; ``ids``, if given, gets each event's ``id:``.
    """
    events = out if out is not None else []
    name, data, eid = "message", "", None

    async def loop() -> None:
        nonlocal name, data, eid
        while True:
            raw = await resp.content.readline()
            if not raw:
                raise AssertionError(f"stream ended before {until!r}: {events}")
            line = raw.decode().rstrip("\n")
            if line.startswith(":"):
                events.append((":", line[1:].strip()))
                if until == ":":
                    return
            elif line.startswith("id:"):
                eid = line[3:].strip()
            elif line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()
            elif line == "":
                if data:
                    events.append((name, json.loads(data)))
                    if ids is not None:
                        ids.append(eid)
                    if name == until:
                        name, data, eid = "message", "", None
                        return
                name, data, eid = "message", "", None

    await asyncio.wait_for(loop(), timeout)
    return events


def decisions(job: str, ts: float) -> tuple[ControllerDecision, ControllerDecision, BrainDecision]:
    """An idle controller round, one that restarted a straggler, and a brain re-plan (as the services publish them)."""
    spec = parse_job_spec(SPEC_YAML.format(name=job))
    before = default_plan(spec)
    after = replace(before, workers=before.workers + 2)
    idle = ControllerDecision(job=job, ts=ts, policy="none")
    acted = ControllerDecision(job=job, ts=ts + 1, policy="straggler",
                               executed=[PolicyAction(ActionKind.KILL_RESTART, "worker-1", reason="3x slower")],
                               refused=[RefusedAction("ADJUST_LR", "", "cooldown")])
    brain = BrainDecision(job=job, ts=ts + 2, stage=BrainStage.ADJUST, rule=BrainRule.OPTIMIZE, plan=after,
                          previous=before, measured_throughput=900.0, predicted_throughput=1400.0)
    return idle, acted, brain
