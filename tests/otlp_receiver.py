"""An OTLP/HTTP trace receiver for tests: what the services' real exporters send, decoded.

Services run with :func:`otel_env` export spans (protobuf over HTTP, the
OpenTelemetry SDK's own exporter) to a :class:`Receiver` on an ephemeral
loopback port; tests read back :class:`SpanSeen` records.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


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


def otel_env(endpoint: str) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}




def orphans(spans: list[SpanSeen], root_ids: set[str]) -> list[SpanSeen]:
    """Spans whose parent is not (yet: a parent is exported when it ends) among ``spans`` or ``root_ids``."""
    ids = {s.span_id for s in spans} | root_ids
    return [s for s in spans if s.span_id not in root_ids and s.parent_id not in ids]


async def wait_for(receiver: Receiver, done: Callable[[list[SpanSeen]], bool],
                   timeout_s: float = 60.0) -> list[SpanSeen]:
    """The spans received once ``done`` says so (or at the timeout: the caller's asserts say what is missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.snapshot()
        if done(spans) or time.monotonic() > deadline:
            return spans
        await asyncio.sleep(0.1)
