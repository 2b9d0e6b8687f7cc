"""The HTTP API under attack (issue 21, findings 2 and 9): each probe of the issue, replayed.

The API and the real job service run in-process on a real nats-server
(with the real shard service), the job service's data roots being
``tmp_path/root``; ``tmp_path/outside`` beside it stands for the rest of the
host.  Finding 2: a spec's dataset path must not read the host's files
(absolute, ``..``, a symlink out of the root), must not tell a missing file
from a forbidden one, must not quote a file's bytes, and a path the OS
cannot take is a 400.  Finding 9: a YAML alias bomb (in ``name``, in
``policies.params``) is refused without being expanded, JSON nested 400,000
deep is a 400, a body being read holds up no other request, and a token in
a URL is refused, while the dashboard, which now sends it in a header,
still follows a job and resumes its stream with ``Last-Event-ID``.

No test times anything: a refusal is recognised by its message, "meanwhile"
by holding a body's reading open while other requests are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import api_support
import pytest
from aiohttp import web
from api_support import AUTH, TOKEN, Client, PeerDouble
from conftest import InProcess, InProcessService
from pacer import subjects
from pacer.bus import Bus
from pacer.contracts.jobs import JobEvent, JobState
from pacer.data.criteo import generate
from pacer.embedded import EmbeddedNats
from pacer_services.api import app as api_app
from pacer_services.api.app import ApiService
from pacer_services.job_service.app import JobService, JobServiceConfig
from test_dashboard import Browser, node_event, sign_in

pytestmark = pytest.mark.timeout(120)

# The API double's fixtures, for the dashboard test.
api_service = api_support.api_service
peers = api_support.peers

SECRET = "TOPSECRET-0123456789"
ALIASES = "aliases are not allowed in a job spec"


@dataclass
class Host:
    """The API's URL and a client of it, the data root, and ``outside`` (the rest of the host)."""

    client: Client
    root: Path
    outside: Path
    api: ApiService

    async def submit(self, name: str, path: Any, **spec: Any) -> tuple[int, Any]:
        body = {"name": name, "model": "wide_deep", "dataset": {"path": path},
                "policies": {"optimizer": "none"}, **spec}
        return await self.client.call("POST", "/api/v1/jobs", json=body)

    async def refusal(self, name: str, path: Any) -> str:
        """The message of a refused submission, the path in it replaced by ``<path>``; nothing was stored."""
        status, body = await self.submit(name, path)
        assert status == 400 and body["error"]["code"] == "invalid", (path, status, body)
        status, _ = await self.client.call("GET", f"/api/v1/jobs/{name}")
        assert status == 404, name
        message: str = body["error"]["message"]
        return message.replace(repr(path), "<path>")


@pytest.fixture
async def host(nats_server: EmbeddedNats, shard_service: InProcessService, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Host]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    monkeypatch.setenv("PACER_DATA_ROOTS", str(root))  # as an operator sets it
    cfg = replace(JobServiceConfig.from_env(), data_dir=tmp_path / "jobs", brain_timeout_s=0.5)
    jobs = InProcess(nats_server.url, lambda b: JobService(b, cfg))
    await jobs.start()
    # The real job service converts and registers data: more than the double's 2 s.
    runner = InProcess(nats_server.url, lambda b: ApiService(b, replace(api_support.api_config(), rpc_timeout_s=20.0)))
    api = await runner.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{api.port}", headers=AUTH) as session:
            yield Host(Client(session), root, outside, api)
    finally:
        await runner.stop()
        await jobs.stop()


def record_file(path: Path) -> Path:
    generate(path, 1_000, seed=1)
    return path


# ------------------------------------------------------------------ finding 2: the host's files


@pytest.mark.parametrize("attack", ["absolute", "dotdot", "symlink"])
async def test_a_file_outside_the_roots_is_refused_as_if_it_were_missing(host: Host, attack: str) -> None:
    stolen = record_file(host.outside / "stolen.rec")  # a valid dataset: only where it lies is wrong
    (host.root / "link.rec").symlink_to(stolen)
    path = {"absolute": str(stolen), "dotdot": f"{host.root}/../outside/stolen.rec",
            "symlink": str(host.root / "link.rec")}[attack]
    attacked = await host.refusal(f"via-{attack}", path)
    missing = await host.refusal("missing", str(host.root / "absent.rec"))
    assert missing == "dataset.path: <path> is not a file under the job service's data roots (PACER_DATA_ROOTS)"
    assert attacked == missing
    # The same file inside the root is fine: the refusal was for where it was.
    status, rec = await host.submit("inside", str(record_file(host.root / "train.rec")))
    assert status == 201 and rec["records"] == 1_000, rec


async def test_the_hosts_files_are_neither_told_apart_nor_quoted(host: Host) -> None:
    """/etc/passwd answered with its first bytes (``root:x:0``), /proc/self/environ with ``PACER_BR``."""
    missing = await host.refusal("missing", "/etc/no-such-file")
    for n, path in enumerate(("/etc/passwd", "/proc/self/environ", "/etc/hostname", "/dev/zero", "/etc")):
        message = await host.refusal(f"host-{n}", path)
        assert message == missing, path
        head = first_bytes(path)
        assert not head or (head.decode(errors="replace") not in message and repr(head)[2:-1] not in message), path


def first_bytes(path: str) -> bytes:
    """What the old answers quoted of a file (b"" where there is nothing to read)."""
    try:
        with open(path, "rb") as f:
            return f.read(8)
    except OSError:
        return b""


async def test_no_error_quotes_what_a_file_in_the_roots_holds(host: Host) -> None:
    good = "1\t" + "\t".join(["5"] * 13) + "\t" + "\t".join(["68fd1e64"] * 26)
    (host.root / "not.rec").write_text(SECRET * 10)
    (host.root / "label.tsv").write_text(f"{good}\n{SECRET}\t{good[2:]}\n")
    (host.root / "dense.csv").write_text(f"{good}\n{good.replace(chr(9) + '5' + chr(9), chr(9) + SECRET + chr(9), 1)}\n"
                                         .replace("\t", ","))
    (host.root / "fake.tsv.gz").write_text(SECRET)
    for name, why in (("not.rec", "not a Pacer record file"), ("label.tsv", "label.tsv:2: column 'label' is not"),
                      ("dense.csv", "dense.csv:2: column 'I1' is not"), ("fake.tsv.gz", "cannot be read as criteo_tsv")):
        message = await host.refusal(name.replace(".", "-"), str(host.root / name))
        assert why in message and SECRET[:8] not in message, message


async def test_a_path_the_os_cannot_take_is_a_400(host: Host) -> None:
    """5,000 characters were an ``internal error: OSError`` (500)."""
    message = await host.refusal("long", "/" + "x" * 4999)
    assert message == "dataset.path: at most 4096 characters, got 5000"
    assert await host.refusal("long-part", f"{host.root}/{'x' * 300}.rec") == await host.refusal(
        "missing", str(host.root / "absent.rec"))  # a component longer than the OS takes: not there
    assert await host.refusal("nul", f"{host.root}/a\0b.rec") == "dataset.path: must not contain a NUL character"
    assert (await host.refusal("listed", ["/etc/passwd"])).startswith("dataset.path: must be a string, got list")
    status, health = await host.client.call("GET", "/healthz")
    assert status == 200 and host.api.counters.snapshot().get("internal_errors", 0) == 0, health


# ------------------------------------------------------------------ finding 9: blocking the API


def bomb(levels: int, width: int = 9) -> str:
    lines = ['bomb: &a0 ["lol"]'] + [f"bomb{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]"
                                     for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


async def test_an_alias_bomb_in_the_name_is_refused_and_the_api_answers_the_rest(host: Host) -> None:
    """The issue's 450 bytes blocked the API for 19.9 s (one level deeper, over 60 s)."""
    text = bomb(6) + "model: dcn\ndataset: {path: x.rec}\nname: *a6\n"  # 9^6 strings where a name should be
    submit = host.client.call("POST", "/api/v1/jobs", json={"spec": text})
    (status, body), (hstatus, _), (lstatus, jobs) = await asyncio.gather(
        submit, host.client.call("GET", "/healthz"), host.client.call("GET", "/api/v1/jobs"))
    assert status == 400 and ALIASES in body["error"]["message"], str(body)[:300]
    assert len(body["error"]["message"]) < 300
    assert hstatus == 200 and lstatus == 200 and jobs["jobs"] == []
    status, rec = await host.submit("after-the-bomb", str(record_file(host.root / "train.rec")))
    assert status == 201, rec


async def test_an_alias_bomb_in_policy_params_is_refused(host: Host) -> None:
    """Finding 8: 2,000 aliases of a 1,000-character string passed every check, then got no reply."""
    text = (f"name: params-bomb\nmodel: dcn\ndataset: {{path: {host.root / 'train.rec'}}}\n"
            f"policies:\n  params:\n    big: &s \"{'x' * 1000}\"\n    k: [{', '.join(['*s'] * 2000)}]\n")
    record_file(host.root / "train.rec")
    status, body = await host.client.call("POST", "/api/v1/jobs", json={"spec": text})
    assert status == 400 and ALIASES in body["error"]["message"], str(body)[:300]
    status, _ = await host.client.call("GET", "/api/v1/jobs/params-bomb")
    assert status == 404


async def test_json_nested_400000_deep_is_a_400(host: Host) -> None:
    """It was a 500 (RecursionError)."""
    for path, raw in (("/api/v1/jobs", "[" * 400_000 + "]" * 400_000),
                      ("/api/v1/jobs", json.dumps({"spec": "x"}).replace('"x"', '{"a": ' * 40 + "1" + "}" * 40)),
                      ("/api/v1/jobs/some-job/stop", '{"reason": ' + "[" * 100_000 + "]" * 100_000 + "}")):
        status, body = await host.client.call("POST", path, data=raw.encode(),
                                              headers={"Content-Type": "application/json"})
        assert status == 400 and "nested deeper than 32 levels" in body["error"]["message"], (path, body)
    assert host.api.counters.snapshot().get("internal_errors", 0) == 0


@contextlib.contextmanager
def held_reads(monkeypatch: pytest.MonkeyPatch, marker: bytes) -> Iterator[tuple[threading.Semaphore, threading.Event]]:
    """Submit bodies holding ``marker`` wait in their parser thread until the event is set; the semaphore
    is released once per body that started waiting."""
    entered, release = threading.Semaphore(0), threading.Event()
    read = api_app.read_submission

    def held(raw: bytes) -> tuple[str, str]:
        if marker in raw:
            entered.release()
            release.wait(60)  # bounded: a failing test must not leave the thread behind for ever
        return read(raw)

    monkeypatch.setattr(api_app, "read_submission", held)
    try:
        yield entered, release
    finally:
        release.set()


async def test_a_body_being_read_holds_up_no_other_request(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies are read off the event loop: while one is (held open here), the API answers the others."""
    host.api.cfg.parse_timeout_s = 120.0  # the body is held by the test, not given up
    path = str(record_file(host.root / "train.rec"))
    with held_reads(monkeypatch, b'"held"') as (entered, release):
        submit = asyncio.ensure_future(host.submit("held", path))
        assert await asyncio.to_thread(entered.acquire, True, 30)
        for route in ("/healthz", "/api/v1/jobs", "/api/v1/jobs/held"):
            status, _ = await host.client.call("GET", route)
            assert status in (200, 404), route
        status, body = await host.submit("refused-meanwhile", ["not", "a", "path"])  # the other reader thread
        assert status == 400 and "dataset.path: must be a string" in body["error"]["message"], body
        assert not submit.done()  # all of it while the first body was still being read
        release.set()
        status, rec = await submit
    assert status == 201 and rec["job"] == "held", rec


async def test_a_read_that_takes_too_long_is_given_up(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop: 400 for a body whose reading ran out of time, 503 for one that never got a thread."""
    host.api.cfg.parse_timeout_s = 0.5
    with held_reads(monkeypatch, b'"slow') as (entered, release):
        slow = [asyncio.ensure_future(host.submit(f"slow-{i}", "x.rec")) for i in range(2)]  # both threads
        for _ in slow:
            assert await asyncio.to_thread(entered.acquire, True, 30)
        status, body = await host.submit("queued", "x.rec")
        assert status == 503 and body["error"]["code"] == "unavailable", body
        for task in slow:
            status, body = await task
            assert status == 400 and body["error"]["message"].startswith("body: not read within 0.5s"), body
        assert not release.is_set()  # given up while still being read
    host.api.cfg.parse_timeout_s = 10.0
    status, _ = await host.client.call("GET", "/healthz")
    assert status == 200


async def test_a_token_in_the_url_is_refused(host: Host) -> None:
    """``?access_token=`` was the event stream's way in; a URL's token ends up in logs."""
    async with aiohttp.ClientSession(f"http://127.0.0.1:{host.api.port}") as bare:
        for path, headers in (("/api/v1/events?job=x&replay=0", {}), ("/api/v1/events?job=x&replay=0", AUTH),
                              ("/api/v1/jobs", AUTH), ("/api/v1/openapi.json", {})):
            sep = "&" if "?" in path else "?"
            async with bare.get(f"{path}{sep}access_token={TOKEN}", headers=headers) as resp:
                assert resp.status == 401, (path, headers)
                body = await resp.json()
                assert "access_token" in body["error"]["message"] and TOKEN not in json.dumps(body)
        async with bare.get("/api/v1/events?job=x&replay=0", headers=AUTH) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"


# ------------------------------------------------------------------ the dashboard, with the token in a header


@dataclass
class Recorder:
    """A pass-through proxy in front of the API that records each events request and can end a stream."""

    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # events requests: (path?query, headers)
    ids: list[str] = field(default_factory=list)  # ``id:`` of every event forwarded
    cut: asyncio.Event = field(default_factory=asyncio.Event)  # set: end the open stream
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@contextlib.asynccontextmanager
async def recording_proxy(upstream: str, rec: Recorder) -> AsyncIterator[str]:
    session = aiohttp.ClientSession(upstream)

    async def forward(request: web.Request) -> web.StreamResponse:
        events = request.path.endswith("/api/v1/events")
        if events:
            rec.seen.append((request.path_qs, dict(request.headers)))
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "last-event-id", "accept")}
        async with session.request(request.method, request.path_qs, headers=headers,
                                   data=await request.read()) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() in ("content-type", "cache-control")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                if events:
                    rec.ids += [ln[3:].strip() for ln in chunk.decode().splitlines() if ln.startswith("id:")]
                await resp.write(chunk)
                if events and rec.cut.is_set():
                    rec.cut.clear()
                    rec.ended.set()
                    break  # the stream ends here, as when a proxy or the network drops it
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
        await session.close()


async def test_the_dashboard_sends_the_token_in_a_header_and_resumes_its_stream(
        api_service: ApiService, bus: Bus, peers: PeerDouble) -> None:
    job = "resume"
    peers.add_running(job)
    await bus.publish_durable(subjects.job_event(job, "running"),
                              JobEvent(job, JobState.RUNNING, time.time(), "plan applied", JobState.PLANNING))
    await bus.publish_durable(subjects.node_event(job, "created"), node_event(job, "worker-0", "created"))
    rec = Recorder()

    def count(kind: str) -> str:
        return f"document.querySelectorAll('#timeline li[data-kind=\"{kind}\"]').length"

    async with recording_proxy(f"http://127.0.0.1:{api_service.port}", rec) as root, Browser() as b:
        await b.goto(f"{root}/#/jobs/{job}")
        await sign_in(b)
        await b.wait_for(f"document.querySelector('#conn')?.dataset.state === 'live' && {count('node.created')} === 1")
        (url, headers), = rec.seen
        assert "access_token" not in url and TOKEN not in url, url
        assert headers.get("Authorization") == f"Bearer {TOKEN}" and "Last-Event-ID" not in headers

        # The stream drops; an event comes meanwhile; the page reconnects from where it left off.
        rec.cut.set()
        await asyncio.wait_for(rec.ended.wait(), 30)
        last = rec.ids[-1]
        await bus.publish_durable(subjects.node_event(job, "running"), node_event(job, "worker-0", "running"))
        await b.wait_for(f"{count('node.running')} === 1 && document.querySelector('#conn').dataset.state === 'live'")
        assert len(rec.seen) == 2, rec.seen
        url, headers = rec.seen[1]
        assert "access_token" not in url and headers.get("Authorization") == f"Bearer {TOKEN}"
        assert headers.get("Last-Event-ID") == last  # resumed after the last event it got
        assert await b.eval(count("node.created")) == 1  # nothing it had was sent again
        assert await b.eval(count("job.running")) == 1
        assert b.errors == [], b.errors
