"""The dashboard in a real headless Chromium, fed by real events on a real bus.

The job page keeps its event stream open (a streaming ``fetch``), and Chromium's ``--dump-dom
--virtual-time-budget`` waits for every open request to end, i.e. forever.
So pages are driven over the DevTools protocol instead (:class:`Browser`,
with aiohttp's websocket client): navigate, wait until a JavaScript
condition holds, read the DOM.  Every page first asks for the API token
(its sign-in view): :func:`sign_in` types it in, as a user does.

Reusable helpers (the end-to-end test imports them): :func:`chromium_binary`,
:class:`Browser` / :func:`sign_in` / :func:`render` (-> the DOM as HTML text),
:func:`parse_dom` / :class:`Element` (query the DOM text by id or attribute).
Chromium is required: the test fails, never skips, when it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import api_support
import pytest
from api_support import TOKEN, PeerDouble, statistics
from pacer import subjects
from pacer.bus import Bus
from pacer.contracts.agent import ActionKind, ActionResult
from pacer.contracts.jobs import JobEvent, JobState
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetMode, DatasetStatus, ProgressEvent
from pacer_services.api.app import ApiService

# The API's fixtures, shared with its own tests.
api_service = api_support.api_service
peers = api_support.peers

pytestmark = pytest.mark.timeout(90)

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--mute-audio", "--window-size=1280,1000",
]


def chromium_binary() -> str:
    """Chromium from ``$PACER_CHROMIUM``, ``/usr/bin/chromium`` or PATH; a clear failure if absent."""
    for cand in (os.environ.get("PACER_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if cand and os.access(cand, os.X_OK):
            return cand
    pytest.fail("Chromium is required by the dashboard tests and was not found: install it "
                "(`apt-get install chromium`, which `make install` does) or set PACER_CHROMIUM", pytrace=False)


# ------------------------------------------------------------------ the DevTools driver


class Browser:
    """One headless Chromium with a fresh profile, driven over the DevTools protocol.

    ``async with Browser() as b: await b.goto(url); await b.wait_for("js"); html = await b.dom()``.
    JavaScript exceptions and console errors of the page are kept in ``errors``.
    """

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.profile = Path(tempfile.mkdtemp(prefix="pacer-chromium-"))
        self.errors: list[str] = []
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next = 0

    async def __aenter__(self) -> Browser:
        self.proc = await asyncio.create_subprocess_exec(
            chromium_binary(), *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
            "about:blank", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit code {self.proc.returncode})")
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().splitlines()[0])
        self._session = aiohttp.ClientSession()
        ws_url = ""
        while not ws_url:
            async with self._session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                pages = [t for t in await resp.json() if t.get("type") == "page"]
            if pages:
                ws_url = pages[0]["webSocketDebuggerUrl"]
            elif time.monotonic() > deadline:
                raise RuntimeError("chromium has no page target")
            else:
                await asyncio.sleep(0.05)
        self._ws = await self._session.ws_connect(ws_url, max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.send("Runtime.enable")
        await self.send("Log.enable")
        await self.send("Page.enable")
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._reader:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._ws:
            await self._ws.close()
        if self._session:
            await self._session.close()
        if self.proc and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    async def _read(self) -> None:
        assert self._ws is not None
        async for m in self._ws:
            if m.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(m.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut and not fut.done():
                    fut.set_result(data)
            elif data.get("method") == "Runtime.exceptionThrown":
                d = data["params"]["exceptionDetails"]
                self.errors.append(d.get("exception", {}).get("description") or d.get("text", "?"))
            elif data.get("method") == "Log.entryAdded" and data["params"]["entry"]["level"] == "error":
                self.errors.append(data["params"]["entry"]["text"])
            elif data.get("method") == "Runtime.consoleAPICalled" and data["params"]["type"] == "error":
                self.errors.append(json.dumps(data["params"]["args"])[:500])

    async def send(self, method: str, **params: Any) -> Any:
        assert self._ws is not None
        self._next += 1
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[self._next] = fut
        await self._ws.send_json({"id": self._next, "method": method, "params": params})
        reply = await asyncio.wait_for(fut, 20)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def eval(self, expression: str) -> Any:
        res = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails'].get('text')}")
        return res["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 15.0) -> Any:
        """Until ``expression`` is truthy in the page; its value.  Fails with the page's DOM."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(RuntimeError):
                value = await self.eval(expression)
                if value:
                    return value
            if time.monotonic() > deadline:
                dom = await self.dom()
                raise AssertionError(f"timed out waiting for {expression!r}; page errors {self.errors}; "
                                     f"DOM:\n{dom[:6000]}")
            await asyncio.sleep(0.1)

    async def dom(self) -> str:
        html: str = await self.eval("document.documentElement.outerHTML")
        return html


async def sign_in(b: Browser, token: str = TOKEN) -> None:
    """Type ``token`` into the dashboard's sign-in page and send it, as a user does."""
    await b.wait_for("document.querySelector('#login-form') !== null")
    await b.eval(f"document.querySelector('#login-token').value = {json.dumps(token)};"
                 " document.querySelector('#login-form').requestSubmit(); true")


async def render(url: str, until: str = "document.readyState === 'complete'", timeout: float = 15.0) -> str:
    """The DOM (HTML text) of ``url``, signed in on its sign-in page, once the JavaScript condition ``until``
    holds."""
    async with Browser() as b:
        await b.goto(url)
        await sign_in(b)
        await b.wait_for(until, timeout)
        return await b.dom()


# ------------------------------------------------------------------ reading DOM text


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element] = field(default_factory=list)
    parts: list[str | Element] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)

    def walk(self) -> Iterator[Element]:
        yield self
        for c in self.children:
            yield from c.walk()

    def find_all(self, **attrs: str) -> list[Element]:
        """Elements whose attributes match (``data_node="worker-0"`` means ``data-node``; ``tag=`` the tag)."""
        want = {k.replace("_", "-"): v for k, v in attrs.items() if k != "tag"}
        tag = attrs.get("tag")
        return [e for e in self.walk() if (tag is None or e.tag == tag)
                and all(e.attrs.get(k) == v for k, v in want.items())]

    def find(self, **attrs: str) -> Element:
        found = self.find_all(**attrs)
        if not found:
            raise AssertionError(f"no element with {attrs}")
        return found[0]


_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        e = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(e)
        self.stack[-1].parts.append(e)
        if tag not in _VOID:
            self.stack.append(e)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].parts.append(data)


def parse_dom(html: str) -> Element:
    b = _TreeBuilder()
    b.feed(html)
    b.close()
    return b.root


# ------------------------------------------------------------------ events as the services publish them


def progress(job: str, todo: int, doing: int, done: int, failed: int = 0) -> ProgressEvent:
    total = todo + doing + done + failed
    return ProgressEvent(ts=time.time(), status=DatasetStatus(
        job=job, dataset="train", mode=DatasetMode.FINITE, epoch=0, epochs=1, todo=todo, doing=doing, done=done,
        failed=failed, records_total=total * 1000, records_done=done * 1000, records_duplicated=0, finished=False,
        closed=True))


def node_event(job: str, node: str, kind: str, **kw: Any) -> NodeEvent:
    role = "ps" if node.startswith("ps") else "worker"
    return NodeEvent(job=job, node=node, kind=kind, ts=time.time(), role=role, pod=f"{job}-{node}-g0", **kw)


@pytest.fixture
async def base_url(api_service: ApiService) -> AsyncIterator[str]:
    yield f"http://127.0.0.1:{api_service.port}"


# ------------------------------------------------------------------ tests


async def test_job_page_shows_a_running_job_live(base_url: str, bus: Bus, peers: PeerDouble) -> None:
    job = "demo"
    rec = peers.add_running(job)
    # What the services published before anyone opened the page (replayed from PACER_EVENTS).
    await bus.publish_durable(subjects.job_event(job, "running"),
                              JobEvent(job, JobState.RUNNING, rec.started_at, "plan applied", JobState.PLANNING))
    for node in ("ps-0", "worker-0", "worker-1"):
        await bus.publish_durable(subjects.node_event(job, "created"), node_event(job, node, "created"))
        await bus.publish_durable(subjects.node_event(job, "running"), node_event(job, node, "running", pending_s=2.0))
    await bus.publish_durable(subjects.monitor_statistics(job), statistics(job, 1500.0))
    await bus.publish_durable(subjects.event("shard", job, "progress"), progress(job, todo=6, doing=2, done=2))

    async with Browser() as b:
        await b.goto(f"{base_url}/#/jobs/{job}")
        await sign_in(b)  # then the page asked for
        await b.wait_for("document.querySelector('#conn')?.dataset.state === 'live'"
                         " && document.querySelector('#throughput')?.dataset.value === '1500'"
                         " && document.querySelectorAll('#nodes-body tr[data-node]').length === 3"
                         " && document.querySelector('#shards-done')?.textContent === '2'")
        page = parse_dom(await b.dom())
        assert page.find(id="job-state").text == "running"
        assert page.find(id="job-reason").text == "plan applied"
        assert page.find(id="job-plan").attrs["data-workers"] == "2"
        assert page.find(id="throughput").text == "1,500"
        for node in ("ps-0", "worker-0", "worker-1"):
            row = page.find(tag="tr", data_node=node)
            assert row.find(data_field="state").text == "running", node
        w1 = page.find(tag="tr", data_node="worker-1")
        assert w1.find(data_field="bpt_short").text == "80.0 ms"
        assert page.find(id="shards-todo").text == "6" and page.find(id="shards-doing").text == "2"
        kinds = [li.attrs["data-kind"] for li in page.find(id="timeline").find_all(tag="li")]
        assert kinds.count("node.running") == 3 and "job.running" in kinds
        assert int(page.find(id="throughput-chart").find(tag="svg").attrs["data-points"]) >= 1

        # Live, after the page is open: the job speeds up, a worker dies, an action is applied.
        await bus.publish(subjects.monitor_statistics(job), statistics(job, 2500.0))
        await bus.publish(subjects.node_event(job, "died"),
                          node_event(job, "worker-1", "died", reason="oom", relaunch=True, exit_code=137))
        await bus.publish(subjects.agent_action(job), ActionResult(
            action_id="a1", applied=True, target_iteration=420, nodes=["worker-0", "worker-1"], job=job,
            kind=ActionKind.ADJUST_BS, ts=time.time()))
        await bus.publish(subjects.event("shard", job, "progress"), progress(job, todo=3, doing=2, done=5))
        await b.wait_for("document.querySelector('#throughput').dataset.value === '2500'"
                         " && document.querySelector('[data-node=\"worker-1\"]').dataset.state === 'dead'"
                         " && document.querySelector('#timeline li[data-kind=\"agent.action\"]') !== null"
                         " && document.querySelector('#shards-done').textContent === '5'")
        page = parse_dom(await b.dom())
        died = page.find(tag="li", data_kind="node.died")
        assert "worker-1" in died.text and "oom" in died.text and "relaunching" in died.text
        action = page.find(tag="li", data_kind="agent.action")
        assert "ADJUST_BS applied at iteration 420" in action.text
        assert page.find(tag="tr", data_node="worker-0").find(data_field="state").text == "running"
        assert int(page.find(id="throughput-chart").find(tag="svg").attrs["data-points"]) >= 2

        # The job completes: the page follows without a reload.
        await bus.publish(subjects.job_event(job, "completed"),
                          JobEvent(job, JobState.COMPLETED, time.time(), "every dataset finished", JobState.RUNNING))
        await b.wait_for("document.querySelector('#job-state').dataset.state === 'completed'")
        assert await b.eval("document.querySelector('#stop-btn').disabled") is True
        assert b.errors == []


async def test_render_opened_mid_job_and_unknown_job(base_url: str, bus: Bus, peers: PeerDouble) -> None:
    job = "mid"
    peers.add_running(job)
    await bus.publish_durable(subjects.node_event(job, "running"), node_event(job, "worker-0", "running"))
    await bus.publish_durable(subjects.monitor_statistics(job), statistics(job, 42.0))
    idle, acted, brain = api_support.decisions(job, time.time() - 5)
    for d in (idle, acted):
        await bus.publish_durable(subjects.controller_decision(job), d)
    await bus.publish_durable(subjects.brain_decision(job), brain)
    html = await render(f"{base_url}/jobs/{job}",  # the path form of the job page
                        until="document.querySelector('#throughput')?.dataset.value === '42'"
                              " && document.querySelector('#timeline li[data-kind=\"brain.decision\"]') !== null")
    page = parse_dom(html)
    # The controller's round that acted and the brain's re-plan are on the timeline; the idle round is not.
    decided = [li.text for li in page.find(id="timeline").find_all(tag="li")
               if li.attrs.get("data-kind") in ("controller.decision", "brain.decision")]
    assert len(decided) == 2, decided
    assert any("KILL_RESTART worker-1" in t and "3x slower" in t for t in decided), decided
    assert any(f"brain optimize: {brain.plan.workers} workers" in t for t in decided), decided
    assert page.find(id="job-state").text == "running"
    assert page.find(tag="tr", data_node="worker-0").find(data_field="state").text == "running"

    html = await render(f"{base_url}/#/jobs/ghost",
                        until="document.querySelector('#job-error')?.hidden === false")
    assert "No job named ghost" in parse_dom(html).find(id="job-error").text


async def test_jobs_list_page(base_url: str, peers: PeerDouble) -> None:
    peers.add_running("alpha")
    peers.add_running("beta", now=time.time() - 100)
    html = await render(f"{base_url}/", until="document.querySelectorAll('#jobs-body tr[data-job]').length === 2")
    page = parse_dom(html)
    rows = page.find(id="jobs-body").find_all(tag="tr")
    assert [r.attrs["data-job"] for r in rows] == ["alpha", "beta"]  # newest first, as listed
    alpha = rows[0]
    assert alpha.find(data_field="state").text == "running"
    assert alpha.find(data_field="model").text == "wide_deep"
    assert alpha.find(data_field="name").find(tag="a").attrs["href"] == "#/jobs/alpha"
    assert alpha.find(data_field="progress").text.strip() == "0%"


# ------------------------------------------------------------------ signing in


async def test_sign_in_checks_the_token_keeps_it_out_of_the_url_and_sign_out_forgets_it(
        base_url: str, peers: PeerDouble) -> None:
    peers.add_running("alpha")
    async with Browser() as b:
        await b.goto(f"{base_url}/#/jobs/alpha")
        await sign_in(b, "not-a-known-token-0123456789abcdef")
        await b.wait_for("document.querySelector('#login-error')?.hidden === false")
        assert "Not signed in" in await b.eval("document.querySelector('#login-error').textContent")
        assert await b.eval("sessionStorage.getItem('pacer.token')") is None  # a refused token is not kept
        await sign_in(b)
        await b.wait_for("document.querySelector('#job-state')?.textContent === 'running'")  # the page asked for
        assert await b.eval("document.querySelector('#who-name').textContent") == "api-token (admin; every namespace)"
        assert TOKEN not in await b.eval("location.href")
        # A reload keeps this tab's sign-in.
        await b.goto(f"{base_url}/")
        await b.wait_for("document.querySelectorAll('#jobs-body tr[data-job]').length === 1"
                         " && document.querySelector('#who-name') !== null")
        await b.eval("document.querySelector('#logout').click(); true")
        await b.wait_for("document.querySelector('#login-form') !== null")
        assert await b.eval("sessionStorage.getItem('pacer.token')") is None
        # A token the API no longer takes (revoked, rotated): back to the sign-in page, saying why.
        await b.eval("sessionStorage.setItem('pacer.token', 'revoked-token-0123456789abcdef'); true")
        await b.goto(f"{base_url}/")
        await b.wait_for("document.querySelector('#login-note')?.textContent.includes('refused the token')")
        assert await b.eval("sessionStorage.getItem('pacer.token')") is None
        assert all("401" in e for e in b.errors), b.errors


# ------------------------------------------------------------------ behind a path prefix


@contextlib.asynccontextmanager
async def prefix_proxy(upstream: str, prefix: str) -> AsyncIterator[str]:
    """A reverse proxy serving ``upstream`` under ``prefix`` (as an Ingress at /pacer/ does); its base URL.

    Streams responses (the event stream included) and forwards the headers the API reads.
    """
    from aiohttp import web

    session = aiohttp.ClientSession(upstream)
    seen: list[str] = []

    async def forward(request: web.Request) -> web.StreamResponse:
        seen.append(request.path_qs)
        if not request.path.startswith(prefix):
            return web.Response(status=404, text=f"outside {prefix}")
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "last-event-id", "accept")}
        async with session.request(request.method, "/" + request.path_qs[len(prefix):], headers=headers,
                                   data=await request.read()) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() in ("content-type", "cache-control")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}{prefix}"
    finally:
        await runner.cleanup()
        await session.close()
        assert not [p for p in seen if not p.startswith(prefix)], seen  # the page never left the prefix


async def test_dashboard_behind_a_path_prefix_submits_and_follows_a_job(
        base_url: str, bus: Bus, peers: PeerDouble) -> None:
    job = "pfx"
    async with prefix_proxy(base_url, "/pacer/") as root, Browser() as b:
        # Without a token: the sign-in page, inside the prefix.
        await b.goto(root)
        await b.wait_for("document.querySelector('#login-form') !== null")
        # A token in the address (what older `pacer up` printed) leaves it and is not used.
        await b.goto(f"{root}#token={TOKEN}")
        await b.wait_for("!location.hash.includes('token')"
                         " && document.querySelector('#login-note')?.textContent.includes('not used')")
        assert await b.eval("sessionStorage.getItem('pacer.token')") is None
        await sign_in(b)
        await b.wait_for("document.querySelector('#jobs-body') !== null")
        await b.eval(f"document.querySelector('#submit-spec').value = {json.dumps(api_support.SPEC_YAML.format(name=job))};"
                     " document.querySelector('#submit-spec').form.requestSubmit(); true")
        await b.wait_for(f"location.hash === '#/jobs/{job}' && document.querySelector('#job-state')?.textContent"
                         " === 'submitted'")
        assert job in peers.records
        # Live events reach the page through the prefix (the event stream with its token).
        await bus.publish(subjects.job_event(job, "running"),
                          JobEvent(job, JobState.RUNNING, time.time(), "plan applied", JobState.SUBMITTED))
        await b.wait_for("document.querySelector('#job-state')?.dataset.state === 'running'")
        # The path form of the job page, under the prefix: <base href="../"> keeps the URLs inside it.
        await b.goto(f"{root}jobs/{job}")
        await b.wait_for("document.querySelector('#conn')?.dataset.state === 'live'"
                         " && document.querySelector('#job-state')?.dataset.state === 'running'")
        assert b.errors == [] or all("401" in e for e in b.errors), b.errors
