"""One ``pacer submit`` is one trace across processes.

The embedded stack (every service its own OS process) and the ``pacer``
CLI export spans with the real OTLP/HTTP exporter (``OTEL_TRACES_EXPORTER=otlp``)
to a receiver this test runs, which decodes the protobuf requests.  The CLI's
root span's trace id must show up in the job service (handling the submit),
the shard service (the dataset registration the job service asks for) and the
executor (consuming the plan event the job service publishes): context was
injected into NATS headers and extracted on receive at every hop.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import running_stack
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from pacer.data.criteo import generate, heldout_path

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class SpanSeen:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int


class Receiver:
    """An OTLP/HTTP trace receiver on an ephemeral port, in a thread (the stack's start blocks the test's loop)."""

    def __init__(self) -> None:
        self.spans: list[SpanSeen] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    req = ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    receiver.add(req)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, req: ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in req.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(SpanSeen(attrs.get("pacer.service", "?"), s.name, s.trace_id.hex(),
                                                   s.span_id.hex(), s.parent_span_id.hex(), s.kind))

    def snapshot(self) -> list[SpanSeen]:
        with self.lock:
            return list(self.spans)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    yield r
    r.server.shutdown()


def otel_env(endpoint: str) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}


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

        def orphans(spans: list[SpanSeen]) -> list[SpanSeen]:
            """Spans whose parent is not (yet: a parent is exported when it ends) in the trace."""
            ids = {s.span_id for s in spans}
            return [s for s in spans if s is not roots[0] and s.parent_id not in ids]

        for _ in range(600):
            spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
            if want <= {s.service for s in spans} and not orphans(spans):
                break
            await asyncio.sleep(0.1)
        assert want <= {s.service for s in spans}, sorted({(s.service, s.name) for s in spans})
    # every span of the trace but the root has its parent in the trace: the context was passed on, not restarted
    assert not orphans(spans), orphans(spans)
    by_id = {s.span_id: s for s in spans}
    handled = {(s.service, s.name) for s in spans}
    assert ("jobs", "handle jobs.submit") in handled
    assert any(svc == "shard" and name.startswith("handle shard.") for svc, name in handled)
    assert ("executor", "consume executor") in handled
    # the job service's handling of the submit is a child of the CLI's request span
    submit = next(s for s in spans if s.name == "handle jobs.submit")
    assert by_id[submit.parent_id].service == "cli"
