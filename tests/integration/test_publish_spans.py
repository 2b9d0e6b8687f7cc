"""A publish is a span only inside a trace: periodic events outside any span start no trace of their own.

Agents send a heartbeat every second and metrics every few steps, the
monitor its statistics every window; if each publish opened a root span,
every one of them would be a one-span trace in the operator's backend.
Real bus (nats-server), an in-memory span exporter on a private provider.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pacer import tracing
from pacer.bus import Bus
from pacer.contracts.agent import Heartbeat
from pacer.embedded import EmbeddedNats


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


async def test_publish_outside_a_trace_records_nothing_and_sends_no_context(
        nats_server: EmbeddedNats, spans: InMemorySpanExporter) -> None:
    bus = await Bus.connect(nats_server.url)
    try:
        got: list[Msg] = []

        async def on(msg: Msg) -> None:
            got.append(msg)

        sub = await bus.nc.subscribe("pacer.events.agent.j1.heartbeat", cb=on)
        await bus.publish("pacer.events.agent.j1.heartbeat", _beat(1))
        await bus.nc.flush()
        await _until(lambda: got)
        assert spans.get_finished_spans() == ()
        assert not (got[0].headers or {}).get("traceparent")

        with trace.use_span(tracing._tracer.start_span("round"), end_on_exit=True) as parent:
            await bus.publish("pacer.events.agent.j1.heartbeat", _beat(2))
        await _until(lambda: len(got) == 2)
        await sub.unsubscribe()
    finally:
        await bus.close()
    (publish,) = [s for s in spans.get_finished_spans() if s.name.startswith("publish")]
    assert publish.parent is not None and publish.parent.span_id == parent.get_span_context().span_id
    assert publish.kind is trace.SpanKind.PRODUCER
    assert got[1].headers and got[1].headers["traceparent"].split("-")[1] == format(
        parent.get_span_context().trace_id, "032x")


def _beat(n: int) -> Heartbeat:
    return Heartbeat(job="j1", node="worker-0", role="worker", ts=float(n), instance="h-1", primary=False,
                     trainer_alive=True, iteration=n)


async def _until(cond: object, timeout: float = 10.0) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():  # type: ignore[operator]
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)
