"""The HTTP API and the live dashboard: a thin aiohttp client of the bus.

Routes (JSON unless said otherwise; errors are ``{"error": {"code", "message"}}``
with the HTTP status of the :class:`~pacer.errors.PacerError` code, see
:data:`STATUS`).  Every ``/api/`` route wants ``Authorization: Bearer <token>``
(``PACER_API_TOKEN``, or one of ``PACER_API_TOKENS_FILE``'s; 401 otherwise; a token in the URL,
``?access_token=``, is refused with 401 too: URLs end up in logs, proxies and browser history),
and every mutating one ``Content-Type: application/json`` (415 otherwise, so
that no cross-site form can stop a job):

* ``GET  /api/v1/jobs?limit=&state=``     job service ``list`` -> ``{"jobs": [JobRecord]}``
* ``POST /api/v1/jobs``                   body: the spec as a JSON object, or ``{"spec": "<YAML text>"}``
  -> 201 + JobRecord
* ``GET  /api/v1/jobs/{job}``             ``{"job": JobRecord, "nodes": ExecutorStatus | null,
  "statistics": JobStatistics | null, "unavailable": {part: why}}``; the executor and the
  monitor parts are optional (null when that service does not answer)
* ``POST /api/v1/jobs/{job}/stop``        JSON body ``{"reason": ...}`` (or empty) -> JobRecord
* ``GET  /api/v1/jobs/{job}/logs?node=&tail=&container=``  executor ``logs`` -> LogsReply
* ``GET  /api/v1/whoami``                ``{"name", "role", "namespaces"}``: who the token is (the
  dashboard's sign-in page checks a token with it)
* ``GET  /api/v1/events?job=<job>&replay=1`` Server-Sent Events: every ``pacer.events.*.<job>.*``
  event as ``id: <PACER_EVENTS sequence>`` / ``event: <domain>.<kind>`` / ``data: <message as
  JSON>``; on connect, first the job's recent history from ``PACER_EVENTS`` then ``event:
  replayed``, then live events and a ``: keep-alive`` comment every ``keepalive_s``.  A client
  that reconnects with ``Last-Event-ID`` (the dashboard's reader and EventSource do so by
  themselves) gets only what came after that id.  The token goes in the header here too: the
  dashboard reads the stream with ``fetch()``, since ``EventSource`` cannot set headers.
* ``GET  /api/v1/openapi.json``          this list as an OpenAPI 3.1 document (no token needed)

Identities (:mod:`.identity`): each token has a role (viewer, submitter, admin) and the namespaces
(teams) it may act in.  A viewer may not submit or stop (403 ``forbidden``); another team's job
answers 404 ``not_found`` on every route, the event stream included, as a job that does not exist
would; the list shows the caller's namespaces only.  A submission goes to ``?namespace=``, else the
caller's only namespace, else ``default`` (403 outside the caller's).  Every mutating request, refused
or not, is audited: an :class:`~pacer.contracts.jobs.AuditRecord` on ``pacer.events.api.<job>.audit``
and a line in the API's log.
* ``GET  /healthz``                        ``{"status": "ok" | "degraded", ...}`` (503 without NATS)
* ``GET  /`` and ``GET /jobs/{job}``       the dashboard (one page, ``static/``, relative URLs only)

Credentials: what the executor launches carries them (each pod's bus URL holds its job's agent user
and token), and a pod's log, an error text or an event may quote them.  Every string of a response
body, an SSE event and an error message passes :func:`pacer.redact.text` (``nats://agent-j:***@...``),
and the string value of a key named like a password or secret is masked (:func:`jsonable`).

Bodies from strangers (issue 21): a body is at most 1 MiB; JSON nested
deeper than :data:`MAX_JSON_DEPTH` is a 400, not a ``RecursionError``; a
spec's YAML is read by :func:`pacer.jobs.spec.load_spec_document` (no
aliases, 256 KiB at most: an alias bomb is refused without being expanded).
Bodies are parsed in a small pool of parser threads, off the event loop,
and a parse still running after ``parse_timeout_s`` is given up (400; 503
if it never got a thread), so no body holds up the other requests.

Traces: every request but ``/healthz`` and ``/static/`` runs in a ``SERVER``
span named by its method and route (``POST /api/v1/jobs``), continuing the
W3C ``traceparent`` of the HTTP request if it has one, so the bus requests the
handler makes (submit, stop, ...) are its children in the same trace.

Concurrency contract
--------------------
Every request runs on the service's event loop, but for the parsing of
request bodies (parser threads, above).  Each SSE client owns one
JetStream push consumer and one bounded queue; it is removed in
a ``finally`` when the client goes away (noticed within ``poll_s``), when the
write fails, or when the service drains.  A client too slow to keep up loses
live events (counted as ``sse_dropped``) rather than growing memory.

History replay: the last stream sequence at connect splits history (read
with a pull consumer, up to it) from live (a push consumer from the next
one), so nothing falls between the two and nothing is sent twice.  The
replay keeps the newest ``replay_limit`` timeline events and the newest
``replay_series`` periodic ones (monitor statistics, shard progress, controller rounds) so that a
long job's series cannot push its node events out.  Agent heartbeats and
metrics are live only: they are many and the monitor's statistics summarise
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import nats.errors
from aiohttp import web
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry.trace import Status, StatusCode
from pacer import codec, redact, subjects, tracing
from pacer.bus import Bus, RetryPolicy
from pacer.contracts.agent import ActionResult, AgentMetrics, Heartbeat
from pacer.contracts.brain import BrainDecision
from pacer.contracts.executor import ExecutorEvent
from pacer.contracts.jobs import JobEvent, JobRecord, JobState, ResourcePlan
from pacer.contracts.monitor import JobStatistics
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.policy import ControllerDecision
from pacer.contracts.shards import ProgressEvent, ShardEvent
from pacer.errors import DecodeError, Forbidden, PacerError, Unavailable, ValidationError
from pacer.ids import is_namespace, is_token
from pacer.jobs.client import JobClient
from pacer.jobs.spec import MAX_SPEC_DEPTH, load_spec_document, validate_job_spec
from pacer.runtime import RuntimeConfig
from pacer.telemetry import Counters
from pacer_services.api import identity, oidc, openapi
from pacer_services.api.access import (
    AUDIT_JOB,
    AUDIT_NAMESPACE,
    MUTATING,
    Access,
    caller,
    error_body,
    route_label,
    visible,
)

log = logging.getLogger("pacer.api")

T = TypeVar("T")

STATIC_DIR = Path(__file__).parent / "static"

#: HTTP status of each PacerError code (anything else is a 500).
STATUS: dict[str, int] = {
    "invalid": 400,
    "bad_message": 400,
    "not_found": 404,
    "forbidden": 403,
    "conflict": 409,
    "unavailable": 503,
}

#: The prefix of every API route: a breaking change gets ``/api/v2`` beside it.
API = openapi.API

#: The largest request body (aiohttp answers 413 beyond it).
MAX_BODY_BYTES = 1 << 20

#: How deep a request's JSON may nest: a spec's own limit (a stop body is one level).
MAX_JSON_DEPTH = MAX_SPEC_DEPTH

_SUBMIT_HINT = 'send the job spec as a JSON object or {"spec": "<YAML text>"}'
_STOP_HINT = 'send {"reason": "..."} or nothing'

#: The message class of each event, by (domain, kind); ``"*"`` = any kind.
EVENT_TYPES: dict[tuple[str, str], type[Any]] = {
    ("job", subjects.JobEventKind.PLAN): ResourcePlan,
    ("job", "*"): JobEvent,
    ("node", "*"): NodeEvent,
    ("executor", "*"): ExecutorEvent,
    ("monitor", subjects.MonitorEventKind.STATISTICS): JobStatistics,
    ("shard", subjects.ShardEventKind.PROGRESS): ProgressEvent,
    ("shard", "*"): ShardEvent,
    ("agent", subjects.AgentEventKind.METRICS): AgentMetrics,
    ("agent", subjects.AgentEventKind.HEARTBEAT): Heartbeat,
    ("agent", subjects.AgentEventKind.ACTION): ActionResult,
    (subjects.CONTROLLER_SERVICE, "decision"): ControllerDecision,
    (subjects.BRAIN_SERVICE, "decision"): BrainDecision,
}

#: Periodic events: replayed with their own cap (see the module docstring).  The controller
#: decides once per statistics round, acting or not.
SERIES_KINDS = frozenset({"monitor.statistics", "shard.progress", "controller.decision"})

#: The event domains replayed from history (agent actions too; agent heartbeats and metrics are live only).
REPLAY_DOMAINS = ("job", "node", "executor", "monitor", "shard", subjects.CONTROLLER_SERVICE, subjects.BRAIN_SERVICE)



@dataclass
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8750  # 0: any free port (tests); the bound one is ApiService.port
    keepalive_s: float = 15.0  # SSE comment interval: proxies drop silent connections
    poll_s: float = 1.0  # how often an idle SSE handler checks that its client is still there
    replay_limit: int = 2000  # newest timeline events replayed to a new SSE client
    replay_series: int = 500  # newest statistics / progress events replayed
    queue_size: int = 10_000  # live events buffered per SSE client
    rpc_timeout_s: float = 5.0  # job service requests
    part_timeout_s: float = 1.5  # executor / monitor parts of GET /api/jobs/{job} (optional)
    token: str = ""  # the shared bearer token, an admin of every namespace (PACER_API_TOKEN)
    tokens_file: str = ""  # tokens with roles and namespaces (PACER_API_TOKENS_FILE; see .identity)
    oidc: oidc.OidcConfig | None = None  # JWTs of an OIDC issuer (PACER_API_OIDC_*; see .oidc)
    parse_workers: int = 2  # threads reading request bodies: what a flood of bodies can take of the CPU
    parse_timeout_s: float = 10.0  # a body not read by then is given up (a backstop: reads are linear)

    @classmethod
    def from_env(cls) -> ApiConfig:
        """``PACER_API_HOST`` (default 127.0.0.1), ``PACER_API_PORT`` (default 8750), ``PACER_API_TOKEN``,
        ``PACER_API_TOKENS_FILE``.

        A token is required: an API without one would let anything that
        reaches the port stop jobs.  ``pacer up`` generates one; in Kubernetes
        it comes from the ``pacer-api-token`` Secret, the tokens file from a
        Secret mounted as a file.
        """
        env = os.environ
        token = env.get("PACER_API_TOKEN", "").strip()
        tokens_file = env.get("PACER_API_TOKENS_FILE", "").strip()
        try:
            oidc_cfg = oidc.OidcConfig.from_env(env)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        if len(token) < identity.MIN_TOKEN_LEN and not ((tokens_file or oidc_cfg) and not token):
            raise ValidationError(
                f"PACER_API_TOKEN: unset or shorter than {identity.MIN_TOKEN_LEN} characters (or set "
                "PACER_API_TOKENS_FILE or PACER_API_OIDC_ISSUER alone); generate one, e.g. "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
        return cls(host=env.get("PACER_API_HOST", cls.host), port=int(env.get("PACER_API_PORT", str(cls.port))),
                   token=token, tokens_file=tokens_file, oidc=oidc_cfg)


# ------------------------------------------------------------------ pure helpers


def jsonable(obj: Any) -> Any:
    """Plain msgpack data -> data ``json.dumps`` accepts and ``JSON.parse`` reads back.

    Bytes become hex, map keys strings, and non-finite floats ``null`` (JSON
    has no NaN; a trainer's diverged loss must not break the page).  It is
    what users are shown, so credentials are masked (:mod:`pacer.redact`):
    in every string, and the string value of a credential-named key.
    """
    if isinstance(obj, dict):
        return {str(k): redact.MASK if redact.secret_key(str(k)) and isinstance(v, str) and v else jsonable(v)
                for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, str):
        return redact.text(obj)
    if isinstance(obj, int | float | bool) or obj is None:
        return obj
    return redact.text(str(obj))


def to_json(msg: Any) -> Any:
    """A wire message (dataclass) as JSON-able data, enums as their values."""
    return jsonable(codec.to_dict(msg))


def event_name(subject: str) -> tuple[str, str, str] | None:
    """``pacer.events.<domain>.<job>.<kind>`` -> (domain, job, kind); None for anything else."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != subjects.PREFIX or parts[1] != "events":
        return None
    return parts[2], parts[3], parts[4]


def decode_event(domain: str, kind: str, data: bytes) -> Any:
    """The event as JSON-able data: its contract class when known and valid, else generic msgpack.

    Raises :class:`DecodeError` only when the bytes are not msgpack at all.
    """
    cls = EVENT_TYPES.get((domain, kind)) or EVENT_TYPES.get((domain, "*"))
    if cls is not None:
        try:
            return to_json(codec.decode(cls, data))
        except DecodeError:
            pass  # a newer or foreign sender: show what it sent rather than nothing
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types
        raise DecodeError(f"{domain}.{kind}: not valid msgpack") from None
    return jsonable(obj)


def sse_frame(event: str, data: Any, seq: int) -> bytes:
    """One Server-Sent Event; its ``id`` is the PACER_EVENTS sequence, which a reconnecting client sends back."""
    return f"id: {seq}\nevent: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def json_depth(data: Any) -> int:
    """How deep ``data`` (parsed JSON) nests: a scalar is 0, ``[]`` and ``{}`` are 1.  Iterative."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        obj, depth = todo.pop()
        if isinstance(obj, dict | list):
            deepest = max(deepest, depth)
            todo.extend((v, depth + 1) for v in (obj.values() if isinstance(obj, dict) else obj))
    return deepest


def parse_json(raw: bytes, hint: str) -> Any:
    """A request body as JSON data; a ValidationError (ending with ``hint``) when it is not JSON or
    nests deeper than :data:`MAX_JSON_DEPTH`."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:  # the decoder's own bound (~1000 levels), met long before any harm
        raise ValidationError(f"body: nested deeper than {MAX_JSON_DEPTH} levels; {hint}") from None
    except ValueError:  # not UTF-8, not JSON, or an integer of more than 4300 digits
        raise ValidationError(f"body: not JSON; {hint}") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise ValidationError(f"body: nested deeper than {MAX_JSON_DEPTH} levels; {hint}")
    return data


def read_submission(raw: bytes) -> tuple[str, str]:
    """A submit request's body -> (the job's name, the spec text for the job service).

    The body is the spec as a JSON object, or ``{"spec": "<the spec as
    YAML text>"}``.  Pure and linear in the body's size (run in a parser
    thread); a ValidationError names what is wrong.
    """
    if not raw.strip():
        raise ValidationError(f"body: empty; {_SUBMIT_HINT}")
    payload = parse_json(raw, _SUBMIT_HINT)
    if not isinstance(payload, dict):
        raise ValidationError('body: expected a JSON object (the spec, or {"spec": "<YAML text>"})')
    if set(payload) == {"spec"}:
        if not isinstance(payload["spec"], str) or not payload["spec"].strip():
            raise ValidationError("spec: expected the job spec as YAML (or JSON) text")
        text: str = payload["spec"]
        try:
            text.encode("utf-8")  # JSON may carry a lone surrogate ("\ud800"), which no message can
        except UnicodeEncodeError:
            raise ValidationError("spec: not valid Unicode text") from None
    else:
        text = json.dumps(payload)  # YAML is a superset of JSON: one parser, one set of messages
    return spec_name(text), text


def spec_name(text: str) -> str:
    """The ``name`` of a spec document, or a ValidationError naming what is wrong.

    Only the name is needed here (it is the job token of the submit subject);
    the job service validates the whole spec.  When the name cannot be read,
    the spec's checks say why, field by field.  The text is read as the job
    service reads it (:func:`pacer.jobs.spec.load_spec_document`: no aliases,
    bounded size and depth).
    """
    data = load_spec_document(text)  # JobSpecError: too large, not YAML, an alias...
    if isinstance(data, dict) and isinstance(data.get("name"), str) and is_token(data["name"]):
        name: str = data["name"]
        return name
    validate_job_spec(data)  # raises JobSpecError with every problem, the name's included
    raise ValidationError("name: missing or not an id token")


# ------------------------------------------------------------------ the service


class ApiService:
    """The HTTP API + dashboard as a Pacer service (``start`` / ``drain``)."""

    name = "api"

    def __init__(self, bus: Bus, cfg: ApiConfig) -> None:
        self.bus = bus
        self.cfg = cfg
        self.counters = Counters(self.name)
        # ValidationError: no token (and no issuer), or a bad one
        self.access = Access(bus, self.counters, cfg.token, cfg.tokens_file, cfg.oidc)
        self.jobs = JobClient(bus, timeout=self.cfg.rpc_timeout_s, retry=RetryPolicy(attempts=3))
        # Optional parts of the job page: one quick try, the page works without them.
        self.parts = JobClient(bus, timeout=self.cfg.part_timeout_s, retry=RetryPolicy(attempts=1))
        self.port = 0
        self.streams = 0  # SSE clients connected now
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._openapi: str | None = None  # the document, rendered on first request
        self._parser = ThreadPoolExecutor(max_workers=cfg.parse_workers, thread_name_prefix="pacer-api-parse")

    # ================================================================ lifecycle
    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._traced, self.access.audit, self._errors, self.access.auth, self._json_only],
                              client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get(f"{API}/jobs", self.list_jobs)
        r.add_post(f"{API}/jobs", self.submit)
        r.add_get(f"{API}/jobs/{{job}}", self.get_job)
        r.add_post(f"{API}/jobs/{{job}}/stop", self.stop_job)
        r.add_get(f"{API}/jobs/{{job}}/logs", self.logs)
        r.add_get(f"{API}/whoami", self.whoami)
        r.add_get(f"{API}/events", self.events)
        r.add_get(f"{API}/openapi.json", self.openapi)
        r.add_get("/", self.index)
        r.add_get("/jobs/{job}", self.index)
        r.add_static("/static/", STATIC_DIR, follow_symlinks=False)
        return app

    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.bus.ensure_streams()  # the replay reads PACER_EVENTS
        self._runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        addr = self._runner.addresses[0]
        self.port = int(addr[1])
        log.info("api listening", extra={"fields": {"url": f"http://{self.cfg.host}:{self.port}/"}})

    async def drain(self) -> None:
        self._closing.set()  # SSE handlers return at their next wake-up
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._parser.shutdown(wait=False, cancel_futures=True)  # a read still running ends on its own
        await self.access.close()

    # ================================================================ middleware
    @web.middleware
    async def _traced(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The request's ``SERVER`` span (module docstring), with the HTTP semantic-convention attributes."""
        if request.path == "/healthz" or request.path.startswith("/static/"):
            return await handler(request)  # probes and files: no trace worth keeping
        route = route_label(request)
        attrs: dict[str, Any] = {"http.request.method": request.method, "url.path": request.path,
                                 "url.scheme": request.scheme}
        if route:
            attrs["http.route"] = route
        if request.headers.get("User-Agent"):
            attrs["user_agent.original"] = request.headers["User-Agent"]
        with tracing.http_server_span(f"{request.method} {route}".rstrip(), request.headers, **attrs) as span:
            try:
                resp = await handler(request)
            except web.HTTPException as exc:  # a redirect or an error the _errors boundary let through
                span.set_attribute("http.response.status_code", exc.status)
                raise
            span.set_attribute("http.response.status_code", resp.status)
            if resp.status >= 500:  # a server span fails on 5xx only (client errors are the caller's)
                span.set_status(Status(StatusCode.ERROR, f"HTTP {resp.status}"))
            return resp

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The loop boundary of every request: errors become JSON bodies and counts."""
        try:
            return await handler(request)
        except PacerError as exc:
            status = STATUS.get(exc.code, 500)
            self.counters.inc("errors", code=exc.code)
            return web.json_response(error_body(exc.code, exc.message), status=status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            self.counters.inc("errors", code=f"http_{exc.status}")
            code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(exc.status, "invalid")
            return web.json_response(error_body(code, exc.reason), status=exc.status)
        except asyncio.CancelledError:
            raise
        except (ConnectionResetError, nats.errors.ConnectionClosedError):
            raise
        except Exception as exc:
            self.counters.inc("internal_errors")
            log.exception("request failed: %s %s", request.method, request.path)
            return web.json_response(error_body("internal", f"internal error: {type(exc).__name__}"), status=500)

    @web.middleware
    async def _json_only(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A mutating ``/api/`` request must say ``Content-Type: application/json`` (415 otherwise).

        A cross-site form or a bodiless ``fetch`` can only send simple content
        types without a CORS preflight, which this API never grants: so a page
        elsewhere cannot stop a job through a user's port-forward (CSRF), even
        if a token leaked into the browser.
        """
        if request.method in MUTATING and request.path.startswith("/api/") and request.content_type != "application/json":
            self.counters.inc("errors", code="unsupported_media_type")
            given = request.headers.get("Content-Type", "")
            return web.json_response(
                error_body("unsupported_media_type",
                           f"Content-Type {given!r}: {request.method} requests take application/json"),
                status=415)
        return await handler(request)

    # ================================================================ JSON API
    async def healthz(self, request: web.Request) -> web.Response:
        connected = self.bus.nc.is_connected
        body = {"status": "ok" if connected else "degraded", "service": self.name, "nats": connected,
                "streams": self.streams, "counters": self.counters.snapshot()}
        return web.json_response(body, status=200 if connected else 503)

    async def list_jobs(self, request: web.Request) -> web.Response:
        limit = _int_param(request, "limit", 100, 1, 1000)
        jobs = await self.jobs.list(limit, _state_param(request), caller(request).listed())
        self.counters.inc("requests", op="list")
        return web.json_response(to_json(jobs))

    async def submit(self, request: web.Request) -> web.Response:
        """The body is the spec as a JSON object, or ``{"spec": "<YAML text>"}`` (:func:`read_submission`)."""
        who = caller(request)
        namespace = who.submit_namespace(request.query.get("namespace", ""))
        request[AUDIT_NAMESPACE] = namespace
        if not who.may(identity.Role.SUBMITTER):
            raise Forbidden(f"{who.name} is a {who.role.label}: submitting takes the submitter role")
        if not is_namespace(namespace):
            raise ValidationError(f"namespace: {namespace[:70]!r} is not a namespace name (1-63 of [a-z0-9-])")
        if not who.sees(namespace):
            raise Forbidden(f"{who.name} may not act in namespace {namespace!r}")
        raw = await request.read()
        name, text = await self._parse(lambda: read_submission(raw))
        request[AUDIT_JOB] = name
        record = await self.jobs.submit(name, text, namespace)
        self.counters.inc("requests", op="submit")
        return web.json_response(to_json(record), status=201)

    async def whoami(self, request: web.Request) -> web.Response:
        who = caller(request)
        self.counters.inc("requests", op="whoami")
        return web.json_response({"name": who.name, "role": who.role.label, "namespaces": sorted(who.namespaces)})

    async def get_job(self, request: web.Request) -> web.Response:
        job = _job(request)
        record_t = asyncio.ensure_future(self.jobs.get(job))
        nodes_t = asyncio.ensure_future(self.parts.nodes(job))
        stats_t = asyncio.ensure_future(self.parts.statistics(job))
        try:
            record = visible(request, await record_t)
        finally:
            await asyncio.gather(nodes_t, stats_t, return_exceptions=True)
        body: dict[str, Any] = {"job": to_json(record), "nodes": None, "statistics": None, "unavailable": {}}
        for part, task in (("nodes", nodes_t), ("statistics", stats_t)):
            exc = task.exception()
            if exc is None:
                body[part] = to_json(task.result())
            else:
                body["unavailable"][part] = redact.text(exc.message) if isinstance(exc, PacerError) else type(exc).__name__
        self.counters.inc("requests", op="get")
        return web.json_response(body)

    async def stop_job(self, request: web.Request) -> web.Response:
        job = _job(request)
        who = caller(request)
        if not who.may(identity.Role.SUBMITTER):
            raise Forbidden(f"{who.name} is a {who.role.label}: stopping takes the submitter role")
        reason = "stopped by the user"
        if request.can_read_body:
            raw = await request.read()
            payload = await self._parse(lambda: parse_json(raw, _STOP_HINT)) if raw.strip() else {}
            if not isinstance(payload, dict) or not isinstance(payload.get("reason", ""), str):
                raise ValidationError("reason: expected a string")
            reason = payload.get("reason") or reason
        request[AUDIT_NAMESPACE] = (await self._readable(request, job)).namespace
        record: JobRecord = await self.jobs.stop(job, reason)
        self.counters.inc("requests", op="stop")
        return web.json_response(to_json(record))

    async def logs(self, request: web.Request) -> web.Response:
        job = _job(request)
        node = request.query.get("node", "")
        if not is_token(node):
            raise ValidationError(f"node: {node!r} is not a node id (e.g. worker-0)")
        tail = _int_param(request, "tail", 200, 1, 5000)
        container = request.query.get("container", "trainer")
        if container not in ("trainer", "agent"):
            raise ValidationError(f"container: {container!r}; one of trainer, agent")
        await self._readable(request, job)
        reply = await self.jobs.logs(job, node, tail, container)
        self.counters.inc("requests", op="logs")
        return web.json_response(to_json(reply))

    async def _readable(self, request: web.Request, job: str) -> JobRecord:
        """``job``'s record if the caller may see it; else not_found, as for a job that does not exist."""
        record: JobRecord = visible(request, await self.jobs.get(job))
        return record

    async def _parse(self, read: Callable[[], T]) -> T:
        """``read()`` in a parser thread, given up after ``parse_timeout_s`` (module docstring).

        The thread of a read given up runs on until it ends (a thread cannot
        be stopped), but every read here is linear in a body of at most 1 MiB.
        """
        started = threading.Event()

        def run() -> T:
            started.set()
            return read()

        try:
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._parser, run),
                                          self.cfg.parse_timeout_s)
        except TimeoutError:
            self.counters.inc("parse_timeouts")
            if started.is_set():
                raise ValidationError(f"body: not read within {self.cfg.parse_timeout_s:g}s; "
                                      "send a smaller spec") from None
            raise Unavailable("the API is busy reading other requests; retry") from None

    async def openapi(self, request: web.Request) -> web.Response:
        if self._openapi is None:
            self._openapi = json.dumps(openapi.document(), separators=(",", ":"))
        return web.Response(text=self._openapi, content_type="application/json")

    async def index(self, request: web.Request) -> web.Response:
        """The page; at ``/jobs/{job}`` with ``<base href="../">``, so that its relative URLs
        (``static/``, ``api/v1/``) resolve from the dashboard's root, behind any path prefix."""
        html = (STATIC_DIR / "index.html").read_text()
        if "job" in request.match_info:
            html = html.replace("<head>", '<head>\n<base href="../">', 1)
        return web.Response(text=html, content_type="text/html", headers={"Cache-Control": "no-cache"})

    # ================================================================ SSE
    async def events(self, request: web.Request) -> web.StreamResponse:
        job = request.query.get("job", "")
        if not is_token(job):
            raise ValidationError(f"job: {job!r} is not a job id; use {API}/events?job=<job>")
        if caller(request).listed():  # a team's caller: only its own jobs' events (an admin of all: any)
            await self._readable(request, job)
        replay = request.query.get("replay", "1") not in ("0", "false", "no")
        resume = _last_event_id(request)
        queue: asyncio.Queue[Msg] = asyncio.Queue(self.cfg.queue_size)

        async def on_msg(msg: Msg) -> None:
            try:
                queue.put_nowait(msg)
            except asyncio.QueueFull:
                self.counters.inc("sse_dropped")

        # Everything up to ``end`` is history, everything after it live: one stream sequence splits
        # them, so nothing falls between the two and nothing is sent twice.
        info = await self.bus.js.stream_info(subjects.EVENTS_STREAM)
        end = int(info.state.last_seq)
        # A plain push consumer without acks or flow control: nothing for the client to publish back
        # (the API's NATS user may publish only $JS.API/$JS.ACK), and the server drops it once the
        # subscription is gone (inactive_threshold).
        sub = await self.bus.js.subscribe(
            subjects.events_of("*", job), stream=subjects.EVENTS_STREAM, cb=on_msg,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=end + 1,
                                  ack_policy=AckPolicy.NONE, mem_storage=True, inactive_threshold=10.0))
        self.streams += 1
        self.counters.inc("sse_clients")
        try:
            resp = web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            })
            await resp.prepare(request)
            await resp.write(b"retry: 2000\n\n")
            if resume is not None or replay:
                history = await self._history(job, 1 if resume is None else resume + 1, end)
                for seq, subject, data in history:
                    await self._send(resp, seq, subject, data)
                await resp.write(sse_frame("replayed", {"count": len(history), "resumed": resume is not None},
                                           max(end, resume or 0)))
            await self._live(request, resp, queue)
            return resp
        finally:
            self.streams -= 1
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _live(self, request: web.Request, resp: web.StreamResponse, queue: asyncio.Queue[Msg]) -> None:
        last_write = time.monotonic()
        while not self._closing.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                return  # the client went away
            try:
                msg = await asyncio.wait_for(queue.get(), self.cfg.poll_s)
            except TimeoutError:
                if time.monotonic() - last_write >= self.cfg.keepalive_s:
                    await resp.write(b": keep-alive\n\n")
                    last_write = time.monotonic()
                continue
            await self._send(resp, msg.metadata.sequence.stream, msg.subject, msg.data)
            last_write = time.monotonic()

    async def _send(self, resp: web.StreamResponse, seq: int, subject: str, data: bytes) -> None:
        name = event_name(subject)
        if name is None:
            return
        domain, _job, kind = name
        try:
            body = decode_event(domain, kind, data)
        except DecodeError as exc:
            self.counters.inc("bad_events", domain=domain)
            log.debug("undecodable event on %s: %s", subject, exc.message)
            return
        await resp.write(sse_frame(f"{domain}.{kind}", body, seq))
        self.counters.inc("sse_events")

    async def _history(self, job: str, start: int, end: int) -> list[tuple[int, str, bytes]]:
        """The job's stored events with sequences in ``start..end``, oldest first (caps in :class:`ApiConfig`)."""
        if end == 0 or start > end:
            return []
        filters = [subjects.events_of(d, job) for d in REPLAY_DOMAINS]
        filters.append(subjects.events_of(subjects.AGENT_SERVICE, job, subjects.AgentEventKind.ACTION))
        sub = await self.bus.js.pull_subscribe(
            "",
            stream=subjects.EVENTS_STREAM,
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=start,
                filter_subjects=filters,
                inactive_threshold=30.0,  # the server drops it soon if we die mid-replay
                mem_storage=True,
            ),
        )
        timeline: deque[tuple[int, str, bytes]] = deque(maxlen=self.cfg.replay_limit)
        series: deque[tuple[int, str, bytes]] = deque(maxlen=self.cfg.replay_series)
        try:
            done = False
            while not done:
                try:
                    msgs = await sub.fetch(512, timeout=0.5)
                except TimeoutError:
                    break  # nothing (more) stored for this job
                for m in msgs:
                    md = m.metadata
                    if md.sequence.stream > end:
                        done = True  # live from here: the live consumer sends it
                        break
                    name = event_name(m.subject)
                    kind = f"{name[0]}.{name[2]}" if name else ""
                    (series if kind in SERIES_KINDS else timeline).append((md.sequence.stream, m.subject, m.data))
                    if md.sequence.stream >= end or md.num_pending == 0:
                        done = True
                        break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return sorted([*timeline, *series])


def _last_event_id(request: web.Request) -> int | None:
    """Where a reconnecting client left off: ``Last-Event-ID`` (what the dashboard and EventSource send), or
    ``?last_event_id=``."""
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id", "")
    if not raw:
        return None
    if not raw.isdigit():
        raise ValidationError(f"Last-Event-ID: {raw[:40]!r} is not an event id this API sent")
    return int(raw)


def _job(request: web.Request) -> str:
    job = request.match_info["job"]
    if not is_token(job):
        raise ValidationError(f"job: {job!r} is not a job id: use 1-64 of [A-Za-z0-9_-]")
    return job


def _int_param(request: web.Request, key: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError(f"{key}: expected an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ValidationError(f"{key}: {value} is out of range {lo}..{hi}")
    return value


def _state_param(request: web.Request) -> JobState | None:
    raw = request.query.get("state", "")
    if not raw:
        return None
    try:
        return JobState(raw)
    except ValueError:
        raise ValidationError(f"state: must be one of {', '.join(s.value for s in JobState)}, got {raw!r}") from None


async def create(bus: Bus, cfg: RuntimeConfig) -> ApiService:
    """App factory: the only place that builds an ApiService from configuration."""
    return ApiService(bus, ApiConfig.from_env())
