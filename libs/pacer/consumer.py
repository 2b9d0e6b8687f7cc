"""A durable JetStream consumer loop with Pacer's error rules, for services that live on events.

:class:`DurableConsumer` binds (creating on first use) a durable pull
consumer on ``PACER_EVENTS`` with explicit acks and runs ``handle`` on every
message in stream order:

* success -> ack;
* a :class:`~pacer.errors.PacerError` that is not temporary (the message can
  never be applied: not msgpack, wrong schema, unknown job) -> counted as
  ``bad_events``, dead-lettered on ``pacer.deadletter.<service>`` with the
  reason, and terminated (never redelivered);
* a temporary error (a peer is down) -> ``nak`` with a delay: redelivered;
* any other exception (a bug) -> counted as ``internal_errors``,
  dead-lettered and terminated, so one poisonous message cannot stop the
  service.

The consumer keeps its position across restarts: what was published while
the service was down is delivered when it comes back, and a message whose
handling was cut short by a crash (no ack) is delivered again, so handlers
must be idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry.trace import SpanKind

from pacer import subjects, tracing
from pacer.bus import Bus
from pacer.errors import PacerError
from pacer.telemetry import Counters

# Failures of the bus itself, not of an event: the event is retried.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)

log = logging.getLogger("pacer.consumer")


def jittered(delay_s: float) -> float:
    """A redelivery delay of 0.5-1.5 x ``delay_s``.  Instances sharing one durable consumer that each nak
    what is not theirs, all with the same delay, can livelock: the redelivered messages come back in
    stream order to the pull requests in their same order, and each lands on the wrong instance again
    (seen: a node death bounced 99 times between two shard services for 20 s)."""
    return delay_s * (0.5 + random.random())


async def dead_letter(bus: Bus, service: str, msg: Msg, why: str) -> None:
    """Publish a refused message's bytes on ``pacer.deadletter.<service>`` and say why."""
    await bus.nc.publish(
        subjects.dead_letter(service), msg.data, headers={"Pacer-Error": why[:1024], "Pacer-Subject": msg.subject}
    )


async def bind_durable(js: JetStreamContext, durable: str, filters: list[str], deliver: DeliverPolicy,
                       ack_wait_s: float) -> JetStreamContext.PullSubscription:
    """Bind to (creating on first use) a durable pull consumer on ``PACER_EVENTS``: explicit acks,
    redelivered forever, only ``filters``; ``deliver`` matters only when it is created."""
    return await js.pull_subscribe(
        "",
        durable=durable,
        stream=subjects.EVENTS_STREAM,
        config=ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=deliver,
            ack_wait=ack_wait_s,
            max_deliver=-1,
            filter_subjects=list(filters),
        ),
    )


class DurableConsumer:
    def __init__(
        self,
        bus: Bus,
        service: str,
        durable: str,
        filters: list[str],
        handle: Callable[[Msg], Awaitable[None]],
        counters: Counters,
        *,
        deliver: DeliverPolicy = DeliverPolicy.ALL,
        batch: int = 64,
        fetch_timeout_s: float = 0.5,
        ack_wait_s: float = 30.0,
        retry_delay_s: float = 1.0,
        key: Callable[[Msg], str] | None = None,
    ) -> None:
        self.bus, self.service, self.durable, self.filters = bus, service, durable, filters
        self.handle, self.counters = handle, counters
        self.deliver, self.batch = deliver, batch
        self.fetch_timeout_s, self.ack_wait_s, self.retry_delay_s = fetch_timeout_s, ack_wait_s, retry_delay_s
        # With ``key``, the messages of one fetched batch that share a key are handled in order and
        # different keys concurrently (a service with one worker per job: a slow job holds up the others
        # only until the batch ends); without it, the whole batch in stream order.
        self.key = key
        self.stopping = False
        self.idle = asyncio.Event()
        self.idle.set()

    async def bind(self) -> JetStreamContext.PullSubscription:
        return await bind_durable(self.bus.js, self.durable, self.filters, self.deliver, self.ack_wait_s)

    async def run(self) -> None:
        """Fetch and handle until :meth:`stop`; then park (the runtime cancels the task)."""
        sub = await self.bind()
        try:
            while not self.stopping:
                try:
                    msgs = await sub.fetch(self.batch, timeout=self.fetch_timeout_s)
                except TimeoutError:
                    continue
                except TRANSPORT_ERRORS as exc:
                    # The consumer's leader is being elected or the connection is back in a moment: the
                    # pull subscription stays valid, ask again shortly (the runtime's restart would rebind).
                    self.counters.inc("fetch_unavailable")
                    log.info("fetch failed (%s); retrying", type(exc).__name__,
                             extra={"fields": {"durable": self.durable}})
                    await asyncio.sleep(self.retry_delay_s)
                    continue
                self.idle.clear()
                try:
                    await self._batch(msgs)
                finally:
                    self.idle.set()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await asyncio.Event().wait()

    async def _batch(self, msgs: list[Msg]) -> None:
        if self.key is None:
            for m in msgs:
                await self._one(m)
            return
        groups: dict[str, list[Msg]] = {}
        for m in msgs:
            groups.setdefault(self.key(m), []).append(m)

        async def in_order(group: list[Msg]) -> None:
            for m in group:
                await self._one(m)

        async with asyncio.TaskGroup() as tg:
            for group in groups.values():
                tg.create_task(in_order(group))

    async def _one(self, m: Msg) -> None:
        with tracing.span(f"consume {self.service}", SpanKind.CONSUMER, m.subject, m.headers):
            await self._handle_one(m)

    async def _handle_one(self, m: Msg) -> None:
        try:
            await self.handle(m)
        except PacerError as exc:
            tracing.fail(exc, exc.message)
            if exc.temporary:
                self.counters.inc("events_retried")
                await m.nak(delay=jittered(self.retry_delay_s))
                return
            self.counters.inc("bad_events", code=exc.code)
            log.warning("event refused", extra={"fields": {"subject": m.subject, "error": exc.message}})
            await self._refuse(m, exc.message)
            return
        except TRANSPORT_ERRORS as exc:
            # The bus failed under the handler (a JetStream leader election, a reconnect), not the
            # event: redeliver it later.  Dead-lettering it would drop, e.g., a dataset's `finished`
            # while the KV stream elects a leader, and the job would never complete (found by chaos).
            tracing.fail(exc)
            self.counters.inc("events_retried")
            log.warning("event retried", extra={"fields": {"subject": m.subject, "error": type(exc).__name__}})
            with contextlib.suppress(Exception):
                await m.nak(delay=jittered(self.retry_delay_s))
            return
        except Exception as exc:  # loop boundary: a bug must not stop the service
            tracing.fail(exc)
            self.counters.inc("internal_errors", op="event")
            log.exception("event failed", extra={"fields": {"subject": m.subject}})
            await self._refuse(m, f"internal error: {type(exc).__name__}: {exc}")
            return
        await m.ack()

    async def _refuse(self, m: Msg, why: str) -> None:
        await dead_letter(self.bus, self.service, m, why)
        await m.term()

    async def stop(self) -> None:
        """Finish the batch in hand; fetch no more."""
        self.stopping = True
        await self.idle.wait()
