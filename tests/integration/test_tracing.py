"""One ``pacer submit`` is one trace across processes.

The embedded stack (every service its own OS process) and the ``pacer``
CLI export spans with the real OTLP/HTTP exporter (``OTEL_TRACES_EXPORTER=otlp``)
to a receiver this test runs, which decodes the protobuf requests.  The CLI's
root span's trace id must show up in the job service (handling the submit),
the shard service (the dataset registration the job service asks for) and the
executor (consuming the plan event the job service publishes): context was
injected into NATS headers and extracted on receive at every hop.  A
``POST /api/v1/jobs`` carrying a W3C ``traceparent`` continues that trace
through the HTTP API into the job service.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from conftest import running_stack
from otlp_receiver import Receiver, SpanSeen, orphans, otel_env, wait_for
from pacer.data.criteo import generate, heldout_path

pytestmark = pytest.mark.slow


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    yield r
    r.server.shutdown()


async def test_one_submit_is_one_trace_across_services(receiver: Receiver, tmp_path: Path) -> None:
    data = tmp_path / "train.rec"
    generate(data, 4_000, seed=3)
    generate(heldout_path(data), 1_000, seed=3, stream=1)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: traced\nmodel: wide_deep\ndataset:\n  path: {data}\n  test_path: {heldout_path(data)}\n"
                    "batch_size: 256\nresources:\n  workers: 1\n")
    env = otel_env(receiver.endpoint)
    with running_stack(tmp_path / "stack", ["shard", "jobs", "executor"], env) as st:
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "pacer_services.cli.main", "submit", str(spec), "--nats", st.url],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        roots = []
        for _ in range(200):  # the CLI flushes its spans at exit
            roots = [s for s in receiver.snapshot() if s.service == "cli" and s.name == "pacer submit"]
            if roots:
                break
            await asyncio.sleep(0.1)
        assert len(roots) == 1, receiver.snapshot()
        trace_id = roots[0].trace_id
        want = {"cli", "jobs", "shard", "executor"}
        root = {roots[0].span_id}

        def complete(seen: list[SpanSeen]) -> bool:
            mine = [s for s in seen if s.trace_id == trace_id]
            return want <= {s.service for s in mine} and not orphans(mine, root)

        spans = [s for s in await wait_for(receiver, complete) if s.trace_id == trace_id]
        assert want <= {s.service for s in spans}, sorted({(s.service, s.name) for s in spans})
    # every span of the trace but the root has its parent in the trace: the context was passed on, not restarted
    assert not orphans(spans, root), orphans(spans, root)
    by_id = {s.span_id: s for s in spans}
    handled = {(s.service, s.name) for s in spans}
    assert ("jobs", "handle jobs.submit") in handled
    assert any(svc == "shard" and name.startswith("handle shard.") for svc, name in handled)
    assert ("executor", "consume executor") in handled
    # the job service's handling of the submit is a child of the CLI's request span
    submit = next(s for s in spans if s.name == "handle jobs.submit")
    assert by_id[submit.parent_id].service == "cli"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_api_submit_with_a_traceparent_continues_the_callers_trace(receiver: Receiver, tmp_path: Path) -> None:
    data = tmp_path / "train.rec"
    generate(data, 1_000, seed=5)
    port = free_port()
    env = {**otel_env(receiver.endpoint), "PACER_API_PORT": str(port)}
    # The caller's own span (a gateway, a script): the API must not start a trace of its own.
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    with running_stack(tmp_path / "stack", ["shard", "jobs", "api"], env) as st:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(
                f"http://127.0.0.1:{port}/api/v1/jobs",
                data=json.dumps({"name": "via-api", "model": "wide_deep", "dataset": str(data), "batch_size": 64}),
                headers={"Authorization": f"Bearer {st.api_token}", "Content-Type": "application/json",
                         "traceparent": f"00-{trace_id}-{caller_span}-01"})
            assert resp.status == 201, await resp.text()

        def complete(spans: list[SpanSeen]) -> bool:
            mine = [s for s in spans if s.trace_id == trace_id]
            return ({("api", "POST /api/v1/jobs"), ("jobs", "handle jobs.submit")} <= {(s.service, s.name) for s in mine}
                    and not orphans(mine, {caller_span}))

        spans = [s for s in await wait_for(receiver, complete) if s.trace_id == trace_id]
    handled = {(s.service, s.name) for s in spans}
    assert ("api", "POST /api/v1/jobs") in handled, sorted(handled)
    assert ("jobs", "handle jobs.submit") in handled, sorted(handled)
    assert not orphans(spans, {caller_span}), orphans(spans, {caller_span})
    by_id = {s.span_id: s for s in spans}
    http_span = next(s for s in spans if s.name == "POST /api/v1/jobs")
    assert http_span.parent_id == caller_span and http_span.kind == 2  # SPAN_KIND_SERVER
    # the job service's handling descends from the API's HTTP span (through the API's bus request)
    submit = next(s for s in spans if s.name == "handle jobs.submit")
    ancestors = []
    node = submit
    while node.parent_id in by_id:
        node = by_id[node.parent_id]
        ancestors.append(node.span_id)
    assert http_span.span_id in ancestors
