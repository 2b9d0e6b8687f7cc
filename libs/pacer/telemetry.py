"""Logs, traces and metrics, set up once per process.

* Logs: one JSON object per line on stderr (``PACER_LOG_LEVEL``, default INFO).
* Traces and metrics: OpenTelemetry, exporter chosen by ``PACER_OTEL_EXPORTER``:
  ``none`` (default: API calls are no-ops), ``console``, or ``otlp`` (needs the
  ``opentelemetry-exporter-otlp`` package; endpoint from the standard
  ``OTEL_EXPORTER_OTLP_ENDPOINT``).
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

_configured = False


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


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

    exporter = exporter or os.environ.get("PACER_OTEL_EXPORTER", "none")
    if exporter == "none":
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": f"pacer-{service}"})
    if exporter == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        span_exp: Any = ConsoleSpanExporter()
        metric_exp: Any = ConsoleMetricExporter()
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError("PACER_OTEL_EXPORTER=otlp needs opentelemetry-exporter-otlp") from exc
        span_exp, metric_exp = OTLPSpanExporter(), OTLPMetricExporter()
    else:
        raise RuntimeError(f"PACER_OTEL_EXPORTER: unknown exporter {exporter!r} (none|console|otlp)")
    tp = TracerProvider(resource=resource)
    tp.add_span_processor(BatchSpanProcessor(span_exp))
    trace.set_tracer_provider(tp)
    metrics.set_meter_provider(
        MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(metric_exp)])
    )


class Counters:
    """Named monotonic counters, kept locally and exported as OpenTelemetry counters."""

    def __init__(self, service: str) -> None:
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
