"""Logs, traces and metrics, set up once per process.

* Logs: one JSON object per line on stderr (``PACER_LOG_LEVEL``, default INFO).
  A line logged inside a span carries its ``trace_id`` and ``span_id``.
* Traces and metrics: OpenTelemetry, exporter chosen by the standard
  ``OTEL_TRACES_EXPORTER`` (and ``OTEL_METRICS_EXPORTER``, default: the
  traces one) or its older alias ``PACER_OTEL_EXPORTER``, which wins when both
  are set: ``none`` (default: spans only pass on a received context),
  ``console`` (JSON on stdout) or ``otlp`` (OTLP over HTTP/protobuf, the
  ``opentelemetry-exporter-otlp-proto-http`` dependency; endpoint from the
  standard ``OTEL_EXPORTER_OTLP_ENDPOINT``, e.g. ``http://collector:4318``).
  ``OTEL_SDK_DISABLED=true`` turns both off.  The service name is
  ``OTEL_SERVICE_NAME`` if set, else ``pacer-<service>``; other standard
  variables (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*``,
  ``OTEL_EXPORTER_OTLP_HEADERS``...) are read by the SDK itself.
* Prometheus metrics: :mod:`pacer.metrics`.
* :class:`Counters` counts locally *and* in OpenTelemetry, so a health reply
  and a test can read what a dashboard would see.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import Counter
from typing import Any

from opentelemetry import metrics, trace

from pacer import tracing

_configured = False


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ids = tracing.current_ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _SslEofNoise(logging.Filter):
    """Drops asyncio's "returning true from eof_received() has no effect when using ssl" warning.

    Python 3.11's SSL transport logs it each time a TLS peer (nats-server, with TLS on by
    default) closes a connection that nats-py's protocol keeps half-open; it says nothing
    an operator can act on and would otherwise fill every service log and the CLI's output.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received()" not in record.getMessage()


def quiet_asyncio_ssl() -> None:
    """Install :class:`_SslEofNoise` on asyncio's logger (idempotent); the CLI calls it too."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _SslEofNoise) for f in logger.filters):
        logger.addFilter(_SslEofNoise())


def setup(service: str, exporter: str | None = None) -> None:
    """Configure logging and OpenTelemetry for this process (idempotent)."""
    global _configured
    if _configured:
        return
    _configured = True
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("PACER_LOG_LEVEL", "INFO").upper())
    logging.getLogger("nats").setLevel(logging.WARNING)
    quiet_asyncio_ssl()
    setup_otel(service, exporter)


def exporters(exporter: str | None = None) -> tuple[str, str]:
    """(traces exporter, metrics exporter) from the argument or the environment (see the module doc)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return "none", "none"
    traces = exporter or env.get("PACER_OTEL_EXPORTER") or env.get("OTEL_TRACES_EXPORTER") or "none"
    metrics_ = exporter or env.get("PACER_OTEL_EXPORTER") or env.get("OTEL_METRICS_EXPORTER") or traces
    for what, value in (("traces", traces), ("metrics", metrics_)):
        if value not in ("none", "console", "otlp"):
            raise RuntimeError(f"OTEL_{what.upper()}_EXPORTER / PACER_OTEL_EXPORTER: unknown exporter {value!r} "
                               "(none|console|otlp)")
    return traces, metrics_


_otel_configured = False


def setup_otel(service: str, exporter: str | None = None) -> None:
    """Configure only OpenTelemetry (what a CLI command does: its logging stays as it is); idempotent."""
    global _otel_configured
    if _otel_configured:
        return
    _otel_configured = True
    traces, metrics_ = exporters(exporter)
    if traces == "none" and metrics_ == "none":
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or f"pacer-{service}"
    resource = Resource.create({"service.name": name, "pacer.service": service})
    if traces != "none":
        tp = TracerProvider(resource=resource)
        tp.add_span_processor(BatchSpanProcessor(_span_exporter(traces)))
        trace.set_tracer_provider(tp)
    if metrics_ != "none":
        metrics.set_meter_provider(
            MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(_metric_exporter(metrics_))])
        )


def _span_exporter(kind: str) -> Any:
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _metric_exporter(kind: str) -> Any:
    if kind == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter()


class Counters:
    """Named monotonic counters, kept locally and exported as OpenTelemetry counters."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._meter = metrics.get_meter(f"pacer.{service}")
        self._otel: dict[str, Any] = {}
        self.values: Counter[str] = Counter()

    def inc(self, name: str, n: int = 1, **attrs: str) -> None:
        self.values[name] += n
        c = self._otel.get(name)
        if c is None:
            c = self._otel[name] = self._meter.create_counter(f"pacer.{name}")
        c.add(n, attrs or None)

    def snapshot(self) -> dict[str, int]:
        return dict(self.values)


class Stopwatch:
    """Monotonic elapsed time, for uptime and latency."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0
