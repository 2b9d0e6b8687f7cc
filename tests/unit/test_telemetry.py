"""Telemetry settings, log lines inside a span, and W3C context through headers (no SDK needed)."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from pacer import metrics, telemetry, tracing

TRACE = 0x0AF7651916CD43DD8448EB211C80319C
SPAN = 0xB7AD6B7169203331
HEADERS = {"traceparent": f"00-{TRACE:032x}-{SPAN:016x}-01"}


@pytest.mark.parametrize(("env", "want"), [
    ({}, ("none", "none")),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp", "otlp")),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none"}, ("otlp", "none")),
    ({"OTEL_TRACES_EXPORTER": "otlp", "PACER_OTEL_EXPORTER": "console"}, ("console", "console")),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, ("none", "none")),
])
def test_exporters_follow_the_standard_variables_and_the_alias(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: tuple[str, str]) -> None:
    for k in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "PACER_OTEL_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert telemetry.exporters() == want


def test_an_unknown_exporter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    monkeypatch.delenv("PACER_OTEL_EXPORTER", raising=False)
    with pytest.raises(RuntimeError, match="jaeger"):
        telemetry.exporters()


def test_a_received_context_is_continued_and_passed_on_and_logged() -> None:
    """Without a tracer provider a handler still continues the sender's trace: its log lines carry
    the trace id, and what it sends carries the sender's traceparent on."""
    fmt = telemetry.JsonFormatter()
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "hello", None, None)
    assert "trace_id" not in json.loads(fmt.format(record))
    with tracing.span("handle x", SpanKind.SERVER, "pacer.rpc.x.j.op", HEADERS):
        line = json.loads(fmt.format(record))
        assert line["trace_id"] == f"{TRACE:032x}"
        out = tracing.inject()
        assert out is not None and f"{TRACE:032x}" in out["traceparent"]
    assert tracing.inject() is None


def test_headers_without_traceparent_start_nothing() -> None:
    assert tracing.extract({"Pacer-Error": "x"}) is None
    assert tracing.extract(None) is None
    ctx = SpanContext(TRACE, SPAN, is_remote=False, trace_flags=TraceFlags(1))
    with trace.use_span(NonRecordingSpan(ctx)):
        assert tracing.current_ids() == (f"{TRACE:032x}", f"{SPAN:016x}")


def test_metrics_port_per_service_wins_over_the_common_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACER_METRICS_PORT", raising=False)
    monkeypatch.delenv("PACER_METRICS_PORT_MONITOR", raising=False)
    assert metrics.port_for("monitor") == 0
    monkeypatch.setenv("PACER_METRICS_PORT", "9464")
    assert metrics.port_for("monitor") == 9464
    monkeypatch.setenv("PACER_METRICS_PORT_MONITOR", "9500")
    assert metrics.port_for("monitor") == 9500 and metrics.port_for("shard") == 9464


def test_without_a_provider_a_span_costs_nothing_yet_passes_an_arrived_context_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_recording", False)
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    assert not tracing.recording()
    # Nothing arrived, nothing current: the invalid span, nothing attached (the fast path).
    with tracing.span("request x", SpanKind.CLIENT, "pacer.rpc.shard.j.lease") as s:
        assert s is trace.INVALID_SPAN and tracing.inject() is None
    # A context arrived in the headers: it is current inside, and passed on to what is sent from there.
    with tracing.span("handle x", SpanKind.SERVER, "pacer.rpc.shard.j.lease", HEADERS):
        assert tracing.current_ids() == (f"{TRACE:032x}", f"{SPAN:016x}")
        sent = tracing.inject()
        assert sent is not None and f"{TRACE:032x}" in sent["traceparent"]
    assert tracing.current_ids() is None
