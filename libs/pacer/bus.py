"""The bus: one NATS connection with JetStream, request/reply and events.

* ``Bus.connect`` reconnects forever (a restarted nats-server is picked up
  again; nats-py buffers publishes while reconnecting).  Its ``url`` may list
  a cluster's servers comma-separated; credentials, CA and the reply inbox
  prefix of the user come from :func:`pacer.security.connect_options`
  (URL, then ``PACER_NATS_*`` settings, then ``pacer up``'s context file).
* ``ensure_streams`` creates, idempotently, the streams every service relies
  on: the shard log (file storage, no age limit: it is the state) and the
  events stream (bounded by age and size: it is history for dashboards).
* ``request`` sends a message and decodes the typed reply, retrying on
  timeouts, missing responders and *temporary* error replies with capped
  exponential backoff; permanent errors are raised at once.
* ``respond`` / ``respond_error`` always answer within the server's max
  payload: a success reply too large becomes a ``reply_too_large`` error
  reply, and an error reply's message (which may echo the bad input) is cut.
* ``request``, ``publish`` and ``publish_durable`` each run in a span
  (``CLIENT`` / ``PRODUCER``, :mod:`pacer.tracing`) whose W3C ``traceparent``
  travels in the NATS headers, so the receiver's handling is a child span and
  a request and everything it causes are one trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from nats.protocol.parser import AUTHORIZATION_VIOLATION
from opentelemetry.trace import SpanKind

from pacer import subjects, tracing
from pacer.codec import decode, encode
from pacer.contracts.common import decode_reply, encode_error
from pacer.errors import LimitExceeded, PacerError, ReplyTooLarge, StaleRevision, Unavailable
from pacer.security import connect_options

log = logging.getLogger("pacer.bus")
T = TypeVar("T")

DEFAULT_URL = "nats://127.0.0.1:4222"
# A pod's processes (agent, trainer) give up once the bus has refused their credentials this long
# (``Bus.connect(give_up_refused_s=...)``): their job was torn down or their token expired, not an auth
# callout briefly away (its server restarting takes seconds).  $PACER_AGENT_GIVE_UP_REFUSED_S overrides it.
GIVE_UP_REFUSED_ENV = "PACER_AGENT_GIVE_UP_REFUSED_S"
DEFAULT_GIVE_UP_REFUSED_S = 120.0


def give_up_refused_s(env: Mapping[str, str] = os.environ) -> float:
    """A pod process's give-up time: :data:`GIVE_UP_REFUSED_ENV`, else :data:`DEFAULT_GIVE_UP_REFUSED_S`."""
    return float(env.get(GIVE_UP_REFUSED_ENV, DEFAULT_GIVE_UP_REFUSED_S))
#: JetStream's "no suitable peers for placement": a cluster that cannot place the replicas now (a peer offline).
NO_PEERS_FOR_PLACEMENT = 10005


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How ``Bus.request`` retries: attempts, first delay, cap (seconds)."""

    attempts: int = 5
    first_delay: float = 0.05
    max_delay: float = 2.0

    def delays(self) -> list[float]:
        out, d = [], self.first_delay
        for _ in range(self.attempts - 1):
            out.append(d * (0.5 + random.random()))  # jitter: clients restarting together spread out
            d = min(d * 2, self.max_delay)
        return out


NO_RETRY = RetryPolicy(attempts=1)
DEFAULT_RETRY = RetryPolicy()


class _Client(Client):
    """nats-py's client, except that an authorization refusal after the first connect is a lost connection.

    nats-py closes a connection for good when a server answers
    ``-ERR 'Authorization Violation'``.  A client that connected once and is
    refused while it reconnects was not given wrong credentials: the
    server it reconnected to could not ask the auth callout in time
    (the callout service's own server had just died, found by chaos: a
    worker's connection closed for ever and the job failed).  Treated as a
    lost connection, the client reconnects again, as it would after a
    server crash; a credential that stays refused is retried and reported
    on every attempt.  (nats-py retries a refused first connect the same way,
    with ``max_reconnect_attempts=-1``.)

    ``refused_since`` is when the present run of refusals began (monotonic
    seconds; None while connected): how :meth:`Bus.connect`'s ``give_up_refused_s``
    tells a refusal for good (a torn-down job's pod, an expired token) from
    a callout that is briefly away.
    """

    connected_once = False
    refused_since: float | None = None

    async def _process_err(self, err_msg: str) -> None:
        if self.connected_once and AUTHORIZATION_VIOLATION in err_msg.lower() and not self.is_closed:
            err = nats.errors.AuthorizationError()
            await self._error_cb(err)
            await self._process_op_err(err)
            return
        await super()._process_err(err_msg)


def trace_headers() -> dict[str, str] | None:
    """W3C trace headers of the current span, or None when nothing is traced."""
    return tracing.inject()


class Bus:
    """A connected NATS client with JetStream; one per process."""

    def __init__(self, nc: Client, js: JetStreamContext, replicas: int = 1) -> None:
        self.nc = nc
        self.js = js
        self.replicas = replicas

    @classmethod
    async def connect(
        cls, url: str = DEFAULT_URL, name: str = "pacer", replicas: int = 1, connect_timeout: float = 5.0, *,
        give_up_refused_s: float = 0.0, on_give_up: Callable[[], object] | None = None,
    ) -> Bus:
        """Connect to ``url``.  A lost connection is retried for ever, an authorization refusal too, when
        connecting as when reconnecting (:class:`_Client`), unless ``give_up_refused_s`` > 0: when every
        attempt for that long was refused, the client closes for good and ``on_give_up`` is called (once),
        or, before it ever connected, this raises :class:`nats.errors.AuthorizationError`."""
        nc = _Client()
        giving_up: list[asyncio.Task[None]] = []
        refused_first = asyncio.Event()

        async def give_up() -> None:
            if not nc.connected_once:
                refused_first.set()  # connect below stops waiting, cancels nats-py's loop and raises
                return
            if on_give_up is not None:  # first: it may end the process, and a close can take a while
                on_give_up()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5.0)

        async def on_error(exc: Exception) -> None:
            log.warning("nats error: %s", exc)
            if not (isinstance(exc, nats.errors.AuthorizationError) or AUTHORIZATION_VIOLATION in str(exc).lower()):
                return
            now = time.monotonic()
            if nc.refused_since is None:
                nc.refused_since = now
            if 0 < give_up_refused_s <= now - nc.refused_since and not giving_up:
                log.error("nats refused this client's credentials for %.0f s: giving up", now - nc.refused_since)
                # Its own task: this callback runs inside nats-py's reconnect task, which close() cancels.
                giving_up.append(asyncio.get_running_loop().create_task(give_up()))

        async def on_disconnect() -> None:
            # nats-py also calls this on an intentional close: only a real loss is worth a warning.
            if nc.connected_once and not (nc.is_closed or nc.is_draining):
                log.warning("nats disconnected")

        async def on_reconnect() -> None:
            nc.refused_since = None
            log.info("nats reconnected")

        connecting = asyncio.ensure_future(nc.connect(
            name=name,
            connect_timeout=connect_timeout,  # type: ignore[arg-type]  # typed int, used as seconds (float)
            reconnect_time_wait=0.2,  # type: ignore[arg-type]
            max_reconnect_attempts=-1,
            allow_reconnect=True,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            pending_size=64 * 1024 * 1024,
            # servers (url may list several: nats://a:1,nats://b:2), credentials, CA and the user's inbox prefix
            **connect_options(url, os.environ),  # type: ignore[arg-type]
        ))
        refused = asyncio.ensure_future(refused_first.wait())
        try:
            await asyncio.wait({connecting, refused}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            refused.cancel()
            if not connecting.done():
                connecting.cancel()
        if not connecting.done() or connecting.cancelled():
            with contextlib.suppress(nats.errors.Error):
                await nc.close()
            raise nats.errors.AuthorizationError()
        connecting.result()  # its error, if it failed
        nc.refused_since = None
        nc.connected_once = True
        return cls(nc, nc.jetstream(timeout=5.0), replicas)

    async def close(self) -> None:
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), 5.0)
            except (TimeoutError, nats.errors.Error):
                await self.nc.close()

    # ------------------------------------------------------------ streams
    async def ensure_streams(self) -> None:
        await self._ensure(
            StreamConfig(
                name=subjects.SHARD_LOG_STREAM,
                subjects=[subjects.SHARD_LOG_SUBJECTS],
                storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS,
                num_replicas=self.replicas,
                allow_direct=True,
                description="Pacer shard logs: one subject per job, the source of truth of shard state",
            )
        )
        await self._ensure(
            StreamConfig(
                name=subjects.EVENTS_STREAM,
                subjects=subjects.stored_events(),
                storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS,
                discard=DiscardPolicy.OLD,
                max_age=7 * 24 * 3600.0,
                max_bytes=1 << 30,
                num_replicas=self.replicas,
                description="Pacer events for dashboards and services",
            )
        )

    async def _ensure(self, cfg: StreamConfig, wait_s: float = 30.0) -> None:
        """Create the stream, or update it in place if it exists with another config (e.g. replicas changed).

        On a cluster that has just started, or with a server down, the meta
        leader may see too few peers to place the replicas (error 10005) or
        not answer yet: retried for ``wait_s``.
        """
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                try:
                    await self.js.add_stream(cfg)
                except nats.js.errors.BadRequestError as exc:
                    if exc.err_code == NO_PEERS_FOR_PLACEMENT:
                        raise
                    await self.js.update_stream(cfg)
                return
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.ServiceUnavailableError, nats.js.errors.BadRequestError) as exc:
                unplaced = not isinstance(exc, nats.js.errors.BadRequestError) or \
                    exc.err_code == NO_PEERS_FOR_PLACEMENT
                if not unplaced or asyncio.get_running_loop().time() >= deadline:
                    raise
                log.info("stream %s not placed yet (%s); retrying", cfg.name, exc)
                await asyncio.sleep(0.5)

    async def kv(self, bucket: str, description: str = "", wait_s: float = 30.0) -> KeyValue:
        """The JetStream KV bucket ``bucket`` (file storage, history 1), created on first use.

        On a cluster a replicated bucket has no leader for a few seconds after it
        is created or its leader died (about 5 s measured here, docs/ha.md): the
        lookup times out or finds no responder.  That is retried for ``wait_s``
        instead of failing a service's start.  So is "stream not found"
        (10059) right after the bucket was created or found: seen in CI when
        two controllers started at once on the 3-server cluster and one's
        leader check asked before the bucket was assigned.
        """
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                kv = await self._kv_once(bucket, description)
                if await self._has_leader(f"KV_{bucket}"):
                    return kv
                reason = "no leader"
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.ServiceUnavailableError, nats.js.errors.NotFoundError, Unavailable) as exc:
                reason = type(exc).__name__
            if asyncio.get_running_loop().time() >= deadline:
                raise Unavailable(f"KV {bucket}: not available after {wait_s:.0f} s ({reason})")
            log.info("KV %s not available yet (%s); retrying", bucket, reason)
            await asyncio.sleep(0.5)

    async def _has_leader(self, stream: str) -> bool:
        """Whether the stream has a leader now (a freshly made replicated bucket accepts no write before)."""
        if self.replicas <= 1:
            return True
        info = await self.js.stream_info(stream)
        return info.cluster is None or bool(info.cluster.leader)

    async def _kv_once(self, bucket: str, description: str) -> KeyValue:
        try:
            return await self.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            pass
        try:
            return await self.js.create_key_value(
                KeyValueConfig(bucket=bucket, history=1, replicas=self.replicas, description=description,
                               storage=StorageType.FILE))
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code == NO_PEERS_FOR_PLACEMENT:
                raise Unavailable(f"KV {bucket}: no peers to place it on yet") from exc
            return await self.js.key_value(bucket)  # created concurrently by another instance

    @staticmethod
    async def kv_get(kv: KeyValue, key: str, cls: type[T]) -> T | None:
        """The value of ``key`` decoded as ``cls``; ``None`` when the key is absent or deleted."""
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return decode(cls, entry.value) if entry.value else None

    @staticmethod
    async def kv_update(kv: KeyValue, key: str, value: bytes, revision: int | None) -> int:
        """Write ``key`` only if it is still at ``revision`` (compare-and-set); returns the new revision.

        ``revision=None`` creates the key and fails if it exists.  A write that
        lost (the key changed since the caller read ``revision``) raises
        :class:`~pacer.errors.StaleRevision`: the caller re-reads the key and
        re-applies its change, or fails loudly -- shared state is never
        written with a blind put (STYLE.md, Errors).
        """
        try:
            if revision is None:
                return await kv.create(key, value)
            return await kv.update(key, value, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            expected = "absent" if revision is None else f"at revision {revision}"
            raise StaleRevision(f"{key}: expected {expected}, but it was written since") from exc

    async def kv_items(self, bucket: str, batch: int = 256, wait_s: float = 30.0) -> dict[str, bytes]:
        """Every live key of a KV bucket with its value, read straight from the bucket's stream.

        ``KeyValue.keys()`` of nats-py decides "no more keys" from a
        consumer's pending count read at creation, which races under load
        and can report an empty bucket; a service rebuilding its state on
        start must not believe that.  This reads the last message of every
        subject (DeliverPolicy.LAST_PER_SUBJECT) until nothing is pending.

        On a cluster the read's consumer may not serve yet (a 503 status on
        the pull, seen when a service starts right after another instance
        died) or the stream may be between leaders: the read is idempotent, so
        it starts over with a new consumer for ``wait_s``.
        """
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                return await self._kv_items_once(bucket, batch)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.ServiceUnavailableError) as exc:
                if asyncio.get_running_loop().time() >= deadline:
                    raise Unavailable(f"KV {bucket}: not readable after {wait_s:.0f} s ({type(exc).__name__})") \
                        from exc
                log.info("KV %s not readable yet (%s); retrying", bucket, type(exc).__name__)
                await asyncio.sleep(0.5)

    async def _kv_items_once(self, bucket: str, batch: int) -> dict[str, bytes]:
        stream = f"KV_{bucket}"
        info = await self.js.stream_info(stream)
        if info.state.messages == 0:
            return {}
        prefix = f"$KV.{bucket}."
        sub = await self.js.pull_subscribe(
            f"{prefix}>", stream=stream,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                                  inactive_threshold=30.0, mem_storage=True))
        out: dict[str, bytes] = {}
        try:
            while True:
                msgs = await sub.fetch(batch, timeout=5.0)
                for m in msgs:
                    op = (m.headers or {}).get("KV-Operation", "")
                    key = m.subject[len(prefix):]
                    if op in ("DEL", "PURGE"):
                        out.pop(key, None)
                    else:
                        out[key] = m.data
                if msgs[-1].metadata.num_pending == 0:
                    return out
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def replay(self, subject: str, batch: int = 512, within_s: float = 60.0) -> list[Msg]:
        """Every message a stream keeps on ``subject`` (wildcards allowed), oldest first.

        A pull consumer reads until the server says nothing is pending, never
        "until a second of quiet": on a loaded machine a quiet second comes
        in the middle of a history and would cut it short.  Raises
        ``TimeoutError`` when the server does not deliver what it counted
        within ``within_s``.
        """
        sub = await self.js.pull_subscribe(
            subject, config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                                           inactive_threshold=30.0, mem_storage=True))
        out: list[Msg] = []
        try:
            if (await sub.consumer_info()).num_pending == 0:
                return out
            deadline = asyncio.get_running_loop().time() + within_s
            while True:
                try:
                    msgs = await sub.fetch(batch, timeout=2.0)
                except (TimeoutError, nats.js.errors.ServiceUnavailableError):
                    # a 503 on the pull: the consumer does not serve yet (a cluster between leaders)
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.2)
                    continue
                out.extend(msgs)
                if msgs[-1].metadata.num_pending == 0:
                    return out
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # ------------------------------------------------------------ request/reply
    async def request(
        self,
        subject: str,
        msg: Any,
        reply_cls: type[T],
        timeout: float = 5.0,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> T:
        """Send ``msg`` and return the decoded reply, retrying what may succeed later."""
        with tracing.span(f"request {_op(subject)}", SpanKind.CLIENT, subject):
            return await self._request(subject, msg, reply_cls, timeout, retry)

    async def _request(self, subject: str, msg: Any, reply_cls: type[T], timeout: float, retry: RetryPolicy) -> T:
        payload = b"" if msg is None else encode(msg)
        if len(payload) > self.nc.max_payload:  # nats-py would raise a bare MaxPayloadError
            raise LimitExceeded(f"{subject}: the request ({len(payload)} bytes) exceeds the bus's max payload "
                                f"({self.nc.max_payload} bytes)")
        last: Exception | None = None
        delays = retry.delays()
        for attempt in range(retry.attempts):
            try:
                resp = await self.nc.request(subject, payload, timeout=timeout, headers=trace_headers())
                return decode_reply(reply_cls, resp.data)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError) as exc:
                last = Unavailable(f"{subject}: {type(exc).__name__}")
            except PacerError as exc:
                if not exc.temporary:
                    raise
                last = exc
            if attempt < len(delays):
                await asyncio.sleep(delays[attempt])
        assert last is not None
        raise last

    async def respond(self, msg: Msg, reply: Any) -> bool:
        """Send ``reply`` to the requester; False when it did not fit the server's max payload and a
        ``reply_too_large`` error reply went instead (the requester hears either way, never silence)."""
        if not msg.reply:
            return True
        data = encode(reply)
        if len(data) > self.nc.max_payload:
            log.warning("reply to %s too large (%d bytes); sent an error instead", msg.subject, len(data))
            await self.respond_error(msg, ReplyTooLarge(
                f"the reply ({type(reply).__name__}, {len(data)} bytes) exceeds the bus's max payload "
                f"({self.nc.max_payload} bytes); the request was handled, ask for less at once"))
            return False
        await self.nc.publish(msg.reply, data)
        return True

    async def respond_error(self, msg: Msg, exc: PacerError) -> None:
        """Send an error reply; its message is cut so that it always fits the max payload
        (:func:`~pacer.contracts.common.encode_error`)."""
        if msg.reply:
            await self.nc.publish(msg.reply, encode_error(exc, self.nc.max_payload))

    # ------------------------------------------------------------ events
    async def publish(self, subject: str, msg: Any) -> None:
        """Fire-and-forget publish (events land in PACER_EVENTS without an ack wait)."""
        with tracing.child_span(f"publish {_op(subject)}", SpanKind.PRODUCER, subject):
            await self.nc.publish(subject, encode(msg), headers=trace_headers())

    async def publish_durable(self, subject: str, msg: Any, timeout: float = 5.0, msg_id: str = "") -> int:
        """Publish to JetStream and wait until it is stored; returns the stream sequence.

        ``msg_id`` (``Nats-Msg-Id``): the stream stores a message of that id
        once within its duplicate window (2 min), answering a repeat with
        the first copy's sequence, so a publish retried after a crash is not
        a second event.
        """
        return await self.publish_encoded(subject, encode(msg), timeout, msg_id)

    async def publish_encoded(self, subject: str, data: bytes, timeout: float = 5.0, msg_id: str = "") -> int:
        """:meth:`publish_durable` of an already encoded message."""
        with tracing.child_span(f"publish {_op(subject)}", SpanKind.PRODUCER, subject):
            headers = trace_headers()
            if msg_id:
                headers = {**(headers or {}), "Nats-Msg-Id": msg_id}
            ack = await self.js.publish(subject, data, timeout=timeout, headers=headers)
            return int(ack.seq)


def _op(subject: str) -> str:
    """A low-cardinality span name for ``subject``: the job id (3rd token) replaced by ``*``."""
    parts = subject.split(".")
    if len(parts) > 3 and parts[1] in ("rpc", "events"):
        parts[3] = "*"
    return ".".join(parts)
