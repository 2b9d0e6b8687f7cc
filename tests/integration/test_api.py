"""The HTTP API over a real nats-server, against a double of its peer services.

The API runs in-process through the real runtime on a free port.  The job
service, the executor and the monitor are played by :class:`PeerDouble`: a
responder on the real bus that answers their rpc subjects with real contract
messages and real error replies (through ``runtime.dispatch_rpc``) and
validates specs with the real ``parse_job_spec``, so error messages are the
ones users get.  Events are published as the real services publish them.

``PeerDouble``, ``api_service`` and ``read_sse`` are imported by the
dashboard tests.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import msgpack
import pytest
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
    JobEvent,
    JobList,
    JobQuery,
    JobRecord,
    JobState,
    ListRequest,
    StopRequest,
    SubmitRequest,
)
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, StatsQuery
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.policy import ControllerDecision, PolicyAction, RefusedAction
from pacer.embedded import EmbeddedNats
from pacer.errors import Conflict, NotFound, ValidationError
from pacer.jobs.spec import default_plan, parse_job_spec, spec_to_json
from pacer.runtime import dispatch_rpc
from pacer.telemetry import Counters
from pacer_services.api.app import ApiConfig, ApiService

pytestmark = pytest.mark.timeout(60)

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

    def add_running(self, name: str, now: float | None = None) -> JobRecord:
        """A running job with the default plan (what the job service holds once started)."""
        now = now or time.time()
        spec = parse_job_spec(SPEC_YAML.format(name=name))
        rec = JobRecord(job=name, spec=spec, state=JobState.RUNNING, submitted_at=now - 60, updated_at=now - 30,
                        started_at=now - 30, plan=default_plan(spec))
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
        self.records[job] = JobRecord(job=job, spec=spec, state=JobState.SUBMITTED, submitted_at=now, updated_at=now)
        await self.bus.respond(msg, self.records[job])

    async def _get(self, job: str, msg: Msg) -> None:
        codec.decode(JobQuery, msg.data)
        await self.bus.respond(msg, self._record(job))

    async def _list(self, job: str, msg: Msg) -> None:
        req = codec.decode(ListRequest, msg.data)
        jobs = [r for r in self.records.values() if not req.state or r.state.value == req.state]
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
    return ApiConfig(host="127.0.0.1", port=0, keepalive_s=0.5, poll_s=0.1, rpc_timeout_s=2.0, part_timeout_s=0.5,
                     token=TOKEN)


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


async def eventually(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ job routes


async def test_submit_list_get_stop_map_to_the_job_service(http: Client, peers: PeerDouble) -> None:
    status, rec = await http.call("POST", "/api/v1/jobs", json={"spec": SPEC_YAML.format(name="yaml-job")})
    assert status == 201, rec
    assert rec["job"] == "yaml-job" and rec["state"] == "submitted"
    assert rec["spec"]["model"]["name"] == "wide_deep"  # enums as their values
    assert ("pacer.rpc.jobs.yaml-job.submit", "submit") in peers.calls

    spec_json = json.dumps({"name": "json-job", "model": "dcn", "dataset": {"path": "data/train.tsv"}})
    status, rec = await http.call("POST", "/api/v1/jobs", data=spec_json, headers={"Content-Type": "application/json"})
    assert status == 201 and rec["spec"]["model"]["name"] == "dcn"

    status, listed = await http.call("GET", "/api/v1/jobs")
    assert status == 200
    assert sorted(j["job"] for j in listed["jobs"]) == ["json-job", "yaml-job"]
    assert ("pacer.rpc.jobs._all.list", "list") in peers.calls
    status, listed = await http.call("GET", "/api/v1/jobs?state=running")
    assert status == 200 and listed["jobs"] == []

    status, body = await http.call("GET", "/api/v1/jobs/yaml-job")
    assert status == 200
    assert body["job"]["state"] == "submitted"
    assert body["nodes"] is None and body["statistics"] is None  # neither peer knows the job
    assert set(body["unavailable"]) == {"nodes", "statistics"}

    status, rec = await http.call("POST", "/api/v1/jobs/yaml-job/stop", json={"reason": "enough"})
    assert status == 200 and rec["state"] == "stopped" and rec["reason"] == "enough"
    assert ("pacer.rpc.jobs.yaml-job.stop", "stop") in peers.calls
    status, err = await http.call("POST", "/api/v1/jobs/yaml-job/stop", headers=JSON)  # no body: the default reason
    assert status == 409 and err["error"]["code"] == "conflict"

    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": SPEC_YAML.format(name="yaml-job")})
    assert status == 409, err


async def test_get_joins_executor_and_monitor_when_they_answer(http: Client, peers: PeerDouble) -> None:
    peers.add_running("run1")
    peers.executor["run1"] = executor_status("run1")
    peers.stats["run1"] = statistics("run1", 1234.5)
    status, body = await http.call("GET", "/api/v1/jobs/run1")
    assert status == 200, body
    assert body["job"]["state"] == "running" and body["job"]["plan"]["workers"] == 2
    assert [n["node"] for n in body["nodes"]["nodes"]] == ["ps-0", "worker-0", "worker-1"]
    assert body["nodes"]["nodes"][0]["phase"] == "running"
    assert body["statistics"]["throughput_samples_per_s"] == 1234.5
    assert body["statistics"]["nodes"][1]["state"] == "running"
    assert body["unavailable"] == {}

    status, logs = await http.call("GET", "/api/v1/jobs/run1/logs?node=worker-0&tail=3&container=agent")
    assert status == 200 and logs["text"].splitlines() == ["agent line 0", "agent line 1", "agent line 2"]
    assert logs["pod"] == "run1-worker-0-g0"


async def test_invalid_specs_are_400_naming_the_field(http: Client, peers: PeerDouble) -> None:
    bad = SPEC_YAML.format(name="bad1").replace("epochs: 2", "epochs: 0")
    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": bad})
    assert status == 400 and err["error"]["code"] == "invalid"
    assert "epochs" in err["error"]["message"]  # the job service's own message
    assert ("pacer.rpc.jobs.bad1.submit", "submit") in peers.calls

    bad = SPEC_YAML.format(name="bad2").replace("wide_deep", "resnet")
    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": bad})
    assert status == 400 and "model" in err["error"]["message"]

    # No usable name: the API cannot build the subject, and says why field by field.
    no_name = "model: wide_deep\ndataset:\n  path: data/train.tsv\n"
    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": no_name})
    assert status == 400 and "name" in err["error"]["message"]
    status, err = await http.call("POST", "/api/v1/jobs", json={"model": "dcn", "dataset": {"path": "x"}})
    assert status == 400 and "name" in err["error"]["message"]
    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": SPEC_YAML.format(name="a.b*c")})
    assert status == 400 and "name" in err["error"]["message"]


async def test_malformed_input_is_400_and_unknown_is_404(http: Client, peers: PeerDouble,
                                                        api_service: ApiService) -> None:
    cases: list[tuple[str, str, dict[str, Any], int]] = [
        ("POST", "/api/v1/jobs", {"json": {"spec": "{{{ not: yaml"}}, 400),
        ("POST", "/api/v1/jobs", {"data": "", "headers": JSON}, 400),
        ("POST", "/api/v1/jobs", {"data": "{not json", "headers": JSON}, 400),
        ("POST", "/api/v1/jobs", {"data": b"\xff\xfe\x00garbage", "headers": JSON}, 400),
        ("POST", "/api/v1/jobs", {"data": "[1, 2, 3]", "headers": JSON}, 400),
        ("POST", "/api/v1/jobs", {"json": {"spec": 42}}, 400),
        ("POST", "/api/v1/jobs", {"json": {"spec": "  "}}, 400),
        ("POST", "/api/v1/jobs/x/stop", {"data": "{not json", "headers": {"Content-Type": "application/json"}}, 400),
        ("POST", "/api/v1/jobs/x/stop", {"json": {"reason": 42}}, 400),
        ("GET", "/api/v1/jobs?limit=lots", {}, 400),
        ("GET", "/api/v1/jobs?limit=0", {}, 400),
        ("GET", "/api/v1/jobs?state=sleeping", {}, 400),
        ("GET", "/api/v1/jobs/bad.id", {}, 400),
        ("GET", "/api/v1/jobs/x/logs", {}, 400),  # no node
        ("GET", "/api/v1/jobs/x/logs?node=worker-0&tail=-1", {}, 400),
        ("GET", "/api/v1/jobs/x/logs?node=worker-0&container=sidecar", {}, 400),
        ("GET", "/api/v1/events", {}, 400),  # no job
        ("GET", "/api/v1/events?job=a.>", {}, 400),
        ("GET", "/api/v1/jobs/nope", {}, 404),
        ("POST", "/api/v1/jobs/nope/stop", {"headers": JSON}, 404),
        ("GET", "/api/v1/nothing-here", {}, 404),
        ("GET", "/api/jobs", {}, 404),  # unversioned paths are gone
        ("DELETE", "/api/v1/jobs", {"headers": JSON}, 405),
    ]
    for method, path, kw, want in cases:
        status, body = await http.call(method, path, **kw)
        assert status == want, (method, path, status, body)
        assert isinstance(body, dict) and set(body["error"]) == {"code", "message"}, body
        assert body["error"]["message"]
    status, body = await http.call("GET", "/api/v1/jobs/nope")
    assert body["error"]["code"] == "not_found" and "nope" in body["error"]["message"]
    status, body = await http.call("GET", "/api/v1/jobs?state=sleeping")
    assert body["error"]["code"] == "invalid" and body["error"]["message"].startswith("state: must be one of")
    assert api_service.counters.snapshot().get("errors", 0) >= len(cases)
    status, health = await http.call("GET", "/healthz")
    assert status == 200 and health["status"] == "ok"  # nothing above hurt the service


async def test_every_api_request_needs_the_bearer_token(api_service: ApiService, peers: PeerDouble) -> None:
    peers.add_running("tok1")
    paths = [("GET", "/api/v1/jobs"), ("GET", "/api/v1/jobs/tok1"), ("POST", "/api/v1/jobs/tok1/stop"),
             ("POST", "/api/v1/jobs"),
             ("GET", "/api/v1/jobs/tok1/logs?node=worker-0"), ("GET", "/api/v1/events?job=tok1"),
             ("GET", "/api/v1/nothing-here")]
    wrong = [{}, {"Authorization": "Bearer wrong-token-0123456789abcdef"}, {"Authorization": f"Basic {TOKEN}"},
             {"Authorization": "Bearer "}, {"Authorization": f"Bearer {TOKEN}x"}]
    async with aiohttp.ClientSession(f"http://127.0.0.1:{api_service.port}") as session:
        http = Client(session)
        for method, path in paths:
            for headers in wrong:
                status, body = await http.call(method, path, headers=headers)
                assert status == 401, (method, path, headers, status, body)
                assert body["error"]["code"] == "unauthorized", body
        # A token in the URL is refused everywhere, the event stream included, even beside the header
        # (tests/integration/test_api_hostile.py has the whole story).
        for path in ("/api/v1/jobs", "/api/v1/events?job=tok1&replay=0"):
            sep = "&" if "?" in path else "?"
            status, body = await http.call("GET", f"{path}{sep}access_token={TOKEN}")
            assert status == 401 and "access_token" in body["error"]["message"], (path, body)
        async with session.get("/api/v1/events?job=tok1&replay=0", headers=AUTH) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
        status, body = await http.call("GET", "/api/v1/jobs", headers=AUTH)
        assert status == 200 and [r["job"] for r in body["jobs"]] == ["tok1"]
        status, body = await http.call("GET", "/api/v1/jobs", headers={"Authorization": f"bearer {TOKEN}"})
        assert status == 200  # the scheme is case-insensitive (RFC 7235)
        # Open: the readiness probe and the dashboard's files (they hold no data).
        for path in ("/healthz", "/", "/static/app.js"):
            async with session.get(path) as resp:
                assert resp.status == 200, path
    assert peers.records["tok1"].state is JobState.RUNNING  # no unauthenticated stop got through
    assert api_service.counters.snapshot()["errors"] >= len(paths) * len(wrong)


async def test_mutating_requests_must_be_json(http: Client, peers: PeerDouble, api_service: ApiService) -> None:
    """A cross-site form posts text/plain, form-urlencoded or multipart, or nothing: all 415, nothing stopped."""
    peers.add_running("csrf1")
    spec = SPEC_YAML.format(name="csrf2")
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "text/yaml", "application/jsonx"):
        headers = {} if ctype is None else {"Content-Type": ctype}
        for path, body in (("/api/v1/jobs/csrf1/stop", b""), ("/api/v1/jobs/csrf1/stop", b'{"reason": "x"}'),
                           ("/api/v1/jobs", spec.encode())):
            status, err = await http.call("POST", path, data=body, headers=headers)
            assert status == 415, (ctype, path, status, err)
            assert err["error"]["code"] == "unsupported_media_type" and "application/json" in err["error"]["message"]
    assert peers.records["csrf1"].state is JobState.RUNNING and "csrf2" not in peers.records
    assert not [c for c in peers.calls if c[1] in ("stop", "submit")]  # none reached the job service
    status, rec = await http.call("POST", "/api/v1/jobs/csrf1/stop", headers={"Content-Type": "application/json; charset=utf-8"})
    assert status == 200 and rec["state"] == "stopped" and rec["reason"] == "stopped by the user"


def test_the_api_refuses_to_start_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACER_API_TOKEN", raising=False)
    with pytest.raises(ValidationError, match="PACER_API_TOKEN"):
        ApiConfig.from_env()
    monkeypatch.setenv("PACER_API_TOKEN", "short")
    with pytest.raises(ValidationError, match="PACER_API_TOKEN"):
        ApiConfig.from_env()
    monkeypatch.setenv("PACER_API_TOKEN", TOKEN)
    assert ApiConfig.from_env().token == TOKEN


async def test_openapi_document_validates_and_describes_what_is_served(
        api_service: ApiService, peers: PeerDouble) -> None:
    import jsonschema
    from openapi_spec_validator import validate

    async with aiohttp.ClientSession(f"http://127.0.0.1:{api_service.port}") as session:
        http = Client(session)
        status, doc = await http.call("GET", "/api/v1/openapi.json")  # no token: it holds no job data
        assert status == 200
        validate(doc)  # OpenAPI 3.1, every $ref resolved, every path parameter declared
        # Every route the app serves is in the document, and nothing else.
        served = {(r.method.lower(), r.resource.canonical) for r in api_service_routes(api_service)
                  if r.resource is not None and r.method != "HEAD"
                  and r.resource.canonical.startswith(("/api/", "/healthz"))}
        documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
        assert served == documented, served ^ documented

        # Real answers validate against their documented schemas.
        def check(schema: str, body: Any) -> None:
            jsonschema.Draft202012Validator(
                {"$ref": f"#/components/schemas/{schema}", "components": doc["components"]}).validate(body)

        peers.add_running("doc1")
        peers.executor["doc1"] = executor_status("doc1")
        peers.stats["doc1"] = statistics("doc1", 10.0)
        http.session.headers.update(AUTH)
        for path, schema in (("/api/v1/jobs", "job.JobList"), ("/api/v1/jobs/doc1", "JobPage"),
                             ("/api/v1/jobs/doc1/logs?node=worker-0&tail=2", "executor.LogsReply"),
                             ("/api/v1/jobs/nope", "Error")):
            status, body = await http.call("GET", path)
            check(schema, body)
        status, body = await http.call("POST", "/api/v1/jobs", json={"spec": SPEC_YAML.format(name="doc2")})
        assert status == 201
        check("job.JobRecord", body)
        with pytest.raises(jsonschema.ValidationError):
            check("job.JobRecord", {**body, "state": "sleeping"})  # the check can fail
        # The submit body is typed: a spec in its full form (as a record holds it) validates, and the
        # API takes it; a spec with a wrongly typed field does not validate.
        full = spec_to_json(parse_job_spec(SPEC_YAML.format(name="doc3")))
        check("SubmitBody", json.loads(full))
        status, _ = await http.call("POST", "/api/v1/jobs", json=json.loads(full))
        assert status == 201
        with pytest.raises(jsonschema.ValidationError):
            check("SubmitBody", {**json.loads(full), "epochs": "two"})


def api_service_routes(svc: ApiService) -> list[Any]:
    return list(svc.make_app().router.routes())


async def test_job_service_down_is_503(http: Client) -> None:
    status, body = await http.call("GET", "/api/v1/jobs")
    assert status == 503 and body["error"]["code"] == "unavailable"
    status, body = await http.call("GET", "/api/v1/jobs/x")
    assert status == 503


async def test_dashboard_is_served(http: Client) -> None:
    for path, base in (("/", None), ("/jobs/some-job", "../")):
        async with http.session.get(path) as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
            html = await resp.text()
            assert '<script src="static/app.js">' in html and 'id="app"' in html
            assert "http://" not in html and "https://" not in html  # nothing from outside
            # Relative URLs only, so that the page works behind a path prefix (an Ingress at /pacer/);
            # the job page's base is the dashboard's root, one level up.
            assert re.findall(r'<base href="([^"]*)">', html) == ([] if base is None else [base])
            assert not re.search(r'(?:src|href)="/', html), html
    async with http.session.get("/static/app.js") as resp:
        js = await resp.text()
    assert "api/v1/jobs" in js and "api/v1/events" in js
    assert not re.search(r'["`\'](?:/api|/static)', js)  # no absolute path to the API or the files
    for path, ctype in (("/static/app.js", "application/javascript"), ("/static/style.css", "text/css")):
        async with http.session.get(path) as resp:
            assert resp.status == 200 and resp.content_type in (ctype, "text/javascript"), resp.content_type
    async with http.session.get("/static/../app.py") as resp:
        assert resp.status in (403, 404)


# ------------------------------------------------------------------ events (SSE)


async def test_sse_replays_history_then_streams_live(http: Client, bus: Bus, api_service: ApiService) -> None:
    now = time.time()
    job = "sse1"
    # History, stored before any client connects (another job's events must not leak in).
    await bus.publish_durable(subjects.job_event(job, "running"),
                              JobEvent(job, JobState.RUNNING, now - 5, "plan applied", JobState.PLANNING))
    await bus.publish_durable(subjects.node_event(job, "created"),
                              NodeEvent(job=job, node="worker-0", kind="created", ts=now - 4, role="worker"))
    await bus.publish_durable(subjects.node_event("other", "created"),
                              NodeEvent(job="other", node="worker-9", kind="created", ts=now - 4))
    await bus.publish_durable(subjects.monitor_statistics(job), statistics(job, 500.0, now - 3))

    async with http.session.get(f"/api/v1/events?job={job}") as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        events = await read_sse(resp, "replayed")
        named = [e for e in events if e[0] != ":"]
        assert [n for n, _ in named] == ["job.running", "node.created", "monitor.statistics", "replayed"]
        assert named[0][1]["state"] == "running" and named[0][1]["previous"] == "planning"
        assert named[1][1]["node"] == "worker-0"
        assert named[2][1]["throughput_samples_per_s"] == 500.0
        assert named[3][1] == {"count": 3, "resumed": False}
        await eventually(lambda: api_service.streams == 1)

        # Live: a node event as the executor publishes it.
        await bus.publish(subjects.node_event(job, "running"),
                          NodeEvent(job=job, node="worker-0", kind="running", ts=time.time(), pending_s=1.5))
        events = await read_sse(resp, "node.running")
        assert events[-1][1]["node"] == "worker-0" and events[-1][1]["pending_s"] == 1.5

        # Garbage on an event subject is counted and skipped; the stream goes on.
        await bus.nc.publish(subjects.node_event(job, "died"), b"\xc1\xc1 not msgpack")
        # A message that is msgpack but not the contract is shown generically.
        await bus.nc.publish(subjects.node_event(job, "died"), msgpack.packb({"foo": b"\x01", "nan": float("nan")}))
        await bus.publish(subjects.job_event(job, "completed"),
                          JobEvent(job, JobState.COMPLETED, time.time(), previous=JobState.RUNNING))
        events = await read_sse(resp, "job.completed")
        tail = [e for e in events if e[0] not in (":",)]
        assert ("node.died", {"foo": "01", "nan": None}) in tail
        assert tail[-1][1]["state"] == "completed"
        assert api_service.counters.snapshot()["bad_events"] == 1

        # Keep-alive comments while nothing happens.
        await read_sse(resp, ":", timeout=3.0)

    # The client went away: its subscription is gone.
    await eventually(lambda: api_service.streams == 0, timeout=5.0)


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


async def test_sse_replays_controller_and_brain_decisions(http: Client, bus: Bus) -> None:
    job = "dec1"
    idle, acted, brain = decisions(job, time.time() - 10)
    await bus.publish_durable(subjects.node_event(job, "created"),
                              NodeEvent(job=job, node="worker-0", kind="created", ts=idle.ts - 1))
    for d in (idle, acted):
        await bus.publish_durable(subjects.controller_decision(job), d)
    await bus.publish_durable(subjects.brain_decision(job), brain)
    async with http.session.get(f"/api/v1/events?job={job}") as resp:
        events = [e for e in await read_sse(resp, "replayed") if e[0] != ":"]
        assert [n for n, _ in events] == ["node.created", "controller.decision", "controller.decision",
                                          "brain.decision", "replayed"]
        ctl = events[2][1]
        assert ctl["policy"] == "straggler" and ctl["executed"][0]["kind"] == "KILL_RESTART"
        assert ctl["executed"][0]["node"] == "worker-1" and ctl["refused"][0]["reason"] == "cooldown"
        b = events[3][1]
        assert (b["rule"], b["stage"], b["plan"]["workers"], b["previous"]["workers"]) == (
            "optimize", "adjust", brain.plan.workers, brain.previous.workers if brain.previous else -1)
        # Live, decoded by their contracts too.
        await bus.publish_durable(subjects.brain_decision(job), replace(brain, ts=time.time(), rule=BrainRule.OOM))
        events = await read_sse(resp, "brain.decision")
        assert events[-1][1]["rule"] == "oom" and events[-1][1]["predicted_throughput"] == 1400.0


async def test_sse_ids_let_a_client_resume_where_it_left_off(http: Client, bus: Bus) -> None:
    job = "resume1"
    for i in range(3):
        await bus.publish_durable(subjects.node_event(job, "created"),
                                  NodeEvent(job=job, node=f"worker-{i}", kind="created", ts=time.time()))
    ids: list[str | None] = []
    async with http.session.get(f"/api/v1/events?job={job}") as resp:
        events = [e for e in await read_sse(resp, "replayed", ids=ids) if e[0] != ":"]
        assert [d.get("node") for _n, d in events[:3]] == ["worker-0", "worker-1", "worker-2"]
        assert all(i is not None and i.isdigit() for i in ids), ids  # an id on every event, the marker's too
        seqs = [int(i) for i in ids if i is not None]
        assert seqs[:3] == sorted(set(seqs[:3])) and seqs[3] >= seqs[2]
        assert events[3] == ("replayed", {"count": 3, "resumed": False})
        await bus.publish(subjects.node_event(job, "running"),
                          NodeEvent(job=job, node="worker-0", kind="running", ts=time.time()))
        await read_sse(resp, "node.running", ids=ids)
        live_id = int(ids[-1] or 0)
        assert live_id > seqs[2]
    # The connection dropped after worker-1; the browser reconnects with Last-Event-ID.
    ids = []
    async with http.session.get(f"/api/v1/events?job={job}", headers={"Last-Event-ID": str(seqs[1])}) as resp:
        events = [e for e in await read_sse(resp, "replayed", ids=ids) if e[0] != ":"]
    assert [(n, d.get("node")) for n, d in events[:-1]] == [("node.created", "worker-2"), ("node.running", "worker-0")]
    assert events[-1] == ("replayed", {"count": 2, "resumed": True})
    assert [int(i or 0) for i in ids[:2]] == [seqs[2], live_id]
    # Up to date: nothing to replay, live follows.
    async with http.session.get(f"/api/v1/events?job={job}&last_event_id={live_id}") as resp:
        events = [e for e in await read_sse(resp, "replayed") if e[0] != ":"]
        assert events == [("replayed", {"count": 0, "resumed": True})]
        await bus.publish(subjects.node_event(job, "died"),
                          NodeEvent(job=job, node="worker-1", kind="died", ts=time.time()))
        events = await read_sse(resp, "node.died")
        assert events[-1][1]["node"] == "worker-1"
    status, err = await http.call("GET", f"/api/v1/events?job={job}", headers={"Last-Event-ID": "abc"})
    assert status == 400 and "Last-Event-ID" in err["error"]["message"]


async def test_sse_without_replay_and_many_clients_leave_nothing_behind(
    http: Client, bus: Bus, api_service: ApiService
) -> None:
    job = "sse2"
    await bus.publish_durable(subjects.node_event(job, "created"),
                              NodeEvent(job=job, node="worker-0", kind="created", ts=time.time()))
    base = len(bus.nc._subs)  # the API shares the server, not this connection: count the API's own
    api_subs = len(api_service.bus.nc._subs)
    responses = [await http.session.get(f"/api/v1/events?job={job}&replay=0") for _ in range(5)]
    await eventually(lambda: api_service.streams == 5)
    assert len(api_service.bus.nc._subs) == api_subs + 5
    await bus.publish(subjects.node_event(job, "running"),
                      NodeEvent(job=job, node="worker-0", kind="running", ts=time.time()))
    for resp in responses:
        events = await read_sse(resp, "node.running")
        assert [e[0] for e in events if e[0] != ":"] == ["node.running"]  # no history asked for
        resp.close()
    await eventually(lambda: api_service.streams == 0)
    await eventually(lambda: len(api_service.bus.nc._subs) == api_subs)
    assert len(bus.nc._subs) == base


async def test_sse_history_is_capped_at_the_newest(nats_server: EmbeddedNats, bus: Bus) -> None:
    cfg = replace(api_config(), replay_limit=5, replay_series=2)
    runner = InProcess(nats_server.url, lambda b: ApiService(b, cfg))
    svc = await runner.start()
    try:
        job = "cap1"
        for i in range(20):
            await bus.publish_durable(subjects.node_event(job, "created"),
                                      NodeEvent(job=job, node=f"worker-{i}", kind="created", ts=float(i)))
            await bus.publish_durable(subjects.monitor_statistics(job), statistics(job, float(i), float(i)))
        async with aiohttp.ClientSession(f"http://127.0.0.1:{svc.port}", headers=AUTH) as session:
            async with session.get(f"/api/v1/events?job={job}") as resp:
                events = [e for e in await read_sse(resp, "replayed") if e[0] != ":"]
        nodes = [d["node"] for n, d in events if n == "node.created"]
        stats = [d["throughput_samples_per_s"] for n, d in events if n == "monitor.statistics"]
        assert nodes == [f"worker-{i}" for i in range(15, 20)]
        assert stats == [18.0, 19.0]
        assert events[-1] == ("replayed", {"count": 7, "resumed": False})
    finally:
        await runner.stop()


async def test_service_survives_garbage_on_every_event_subject(http: Client, bus: Bus, api_service: ApiService) -> None:
    job = "junk"
    garbage = [b"", b"\xc1", b"\x93\x01\x02", msgpack.packb([1, 2, 3]), b"\xff" * 100]
    for domain, kind in (("job", "running"), ("job", "plan"), ("node", "died"), ("monitor", "statistics"),
                         ("shard", "progress"), ("agent", "metrics"), ("agent", "action"), ("executor", "failed")):
        for data in garbage:
            await bus.js.publish(subjects.event(domain, job, kind), data)
    async with http.session.get(f"/api/v1/events?job={job}") as resp:
        events = [e for e in await read_sse(resp, "replayed") if e[0] != ":"]
        # Only valid msgpack gets through (generically); nothing crashed.
        assert all(isinstance(d, list | int | dict) for n, d in events if n != "replayed")
    status, health = await http.call("GET", "/healthz")
    assert status == 200 and health["counters"]["bad_events"] > 0
