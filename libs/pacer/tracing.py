"""Spans around the bus: W3C trace context carried in NATS headers.

Every message a :class:`~pacer.bus.Bus` sends carries the ``traceparent``
(and ``tracestate``) of the span that sent it; every place a message is
handled (:func:`pacer.runtime.dispatch_rpc`, :class:`pacer.consumer.DurableConsumer`,
subscriptions wrapped with :func:`traced`) starts its span from the
context extracted from those headers.  So one ``pacer submit`` is one trace:
the client's request, the job service's handling, its request to the shard
service, the plan event it publishes and the executor consuming that event.

Span kinds follow the OpenTelemetry messaging conventions: ``CLIENT`` for a
request, ``PRODUCER`` for a publish, ``SERVER`` for handling a request,
``CONSUMER`` for handling an event.  With no tracer provider configured
(``PACER_OTEL_EXPORTER=none``) all of this is a no-op apart from passing on a
context that arrived.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import context, propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

_tracer = trace.get_tracer("pacer")  # a proxy: uses the provider that telemetry.setup installs later
_recording = False  # a tracer provider is installed (it stays once set)


def recording() -> bool:
    """Whether spans go anywhere: a tracer provider was installed (telemetry.setup, a test's own)."""
    global _recording
    if not _recording:
        _recording = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return _recording


def inject() -> dict[str, str] | None:
    """W3C trace headers of the current span, or None when nothing is traced."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


def extract(headers: Mapping[str, str] | None) -> context.Context | None:
    """The context a message's headers carry (None when they carry none)."""
    if not headers or "traceparent" not in headers:
        return None
    return propagate.extract(dict(headers))


@contextmanager
def span(name: str, kind: SpanKind, subject: str, headers: Mapping[str, str] | None = None,
         **attrs: Any) -> Iterator[Span]:
    """A span named ``name``, child of the context in ``headers`` if any, else of the current span.

    With no tracer provider and no context to pass on (none arrived, none is current) it yields
    the invalid span at once: 20 us of span bookkeeping saved per request handled or sent.
    """
    parent = extract(headers)
    if parent is None and not recording() and not trace.get_current_span().get_span_context().is_valid:
        yield trace.INVALID_SPAN
        return
    attributes = {"messaging.system": "nats", "messaging.destination.name": subject, **attrs}
    with _tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes) as s:
        yield s


@contextmanager
def child_span(name: str, kind: SpanKind, subject: str, **attrs: Any) -> Iterator[Span | None]:
    """:func:`span`, but only inside a trace: outside any span it yields None and records nothing.

    For publishes: a periodic event sent outside any span (an agent's heartbeat
    every second, its metrics, the monitor's statistics) would otherwise start
    a one-span trace of its own each time.
    """
    if not trace.get_current_span().get_span_context().is_valid:
        yield None
        return
    with span(name, kind, subject, **attrs) as s:
        yield s


@contextmanager
def http_server_span(name: str, headers: Mapping[str, str], **attrs: Any) -> Iterator[Span]:
    """A ``SERVER`` span for one HTTP request, child of the W3C context in its ``headers`` if any.

    ``headers`` may be case-insensitive (aiohttp's): only ``traceparent`` and
    ``tracestate`` are read from it.
    """
    carrier = {k: v for k in ("traceparent", "tracestate") if (v := headers.get(k))}
    with _tracer.start_as_current_span(name, context=extract(carrier), kind=SpanKind.SERVER,
                                       attributes=attrs) as s:
        yield s


def fail(exc: BaseException, message: str = "") -> None:
    """Mark the current span failed by ``exc`` (the handler caught it and answered an error)."""
    s = trace.get_current_span()
    s.record_exception(exc)
    s.set_status(Status(StatusCode.ERROR, message or type(exc).__name__))


def traced(name: str, cb: Callable[[Msg], Awaitable[None]],
           kind: SpanKind = SpanKind.CONSUMER) -> Callable[[Msg], Awaitable[None]]:
    """Wrap a plain subscription callback so that it runs in a span continuing the sender's trace.

    ``kind``: ``CONSUMER`` for an event, ``SERVER`` for a callback that replies to a request.
    """

    async def run(msg: Msg) -> None:
        with span(name, kind, msg.subject, msg.headers):
            await cb(msg)

    return run


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span in hex, or None outside any trace."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
