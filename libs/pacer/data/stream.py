"""Streaming datasets (online learning): samples read from a JetStream stream.

Sample format
-------------
One JetStream message per sample, in a stream that holds nothing else (every
sequence number is a sample).  Its payload is a msgpack map ``{column: value}``
whose values are an int, a float, a str, or a list of those (``None`` counts as
missing).  Record index ``i`` of the dataset is stream sequence
``first_seq + i``: the shard service hands out record ranges, a worker reads
exactly those sequences.  Columns have the kinds of :mod:`pacer.data.schema`
(``float`` -> float32, ``int`` -> int64, ``string`` -> object array of str,
``list<...>`` -> object array of 1-D arrays); given by the caller or inferred
from the first messages (an int column that also holds floats is ``float``).
A sample that lacks a column gets NaN / 0 / "" / an empty list.  A payload
that is not a msgpack map is an error naming its sequence (never skipped: the
shard service counts records by position).  One message holding an Arrow IPC
stream batch of many samples is future work.

Bridging Kafka
--------------
A small consumer process reads the topic (one consumer group, manual commits)
and, for each record, publishes its value re-encoded as the msgpack map above
to ``<STREAM>.samples`` with a JetStream publish (waiting for the ack), with
``Nats-Msg-Id = <topic>/<partition>/<offset>`` so that a replay after a crash
is deduplicated by the stream's duplicate window.  It commits the Kafka offset
only after the JetStream ack.  Several partitions interleave into one
sequence order, which is fine: the dataset's order is the stream's.

URIs and placement
------------------
A dataset URI ``jetstream://<STREAM>`` (:func:`stream_uri`) names a stream on
the job's own NATS.  :class:`StreamSource` is the worker's reader (the
:class:`pacer.data.sources.Source` interface, synchronous, on a private event
loop thread); :class:`StreamFollower` (async) tells the shard service how
many records exist: ``ShardAdmin.append(job, dataset, n)`` takes a *delta*,
records ``[known, known + n)`` become new TODO shards, so it must never be
sent twice for the same records (see :class:`StreamFollower`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import msgpack
import nats.errors
import nats.js.errors
import numpy as np
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.nuid import NUID

from pacer.bus import NO_RETRY, Bus
from pacer.data.criteo import DataError
from pacer.shards.client import ShardAdmin

log = logging.getLogger("pacer.data.stream")
T = TypeVar("T")

SCHEME = "jetstream://"
#: Messages per pull request of a read.
FETCH_BATCH = 2048
#: Messages looked at to infer column kinds.
INFER_SAMPLES = 64
KINDS = ("float", "int", "string", "list<float>", "list<int>", "list<string>")


class StreamError(DataError):
    """A stream cannot be read as a dataset: missing sequences, a payload that is not a sample, no stream."""

    code = "bad_stream"


class Column(NamedTuple):
    """A column and its kind (as :class:`pacer.data.sources.Column`)."""

    name: str
    kind: str


def stream_uri(stream: str) -> str:
    """The dataset URI of a JetStream stream of the job's NATS: ``jetstream://<STREAM>``."""
    _check_name(stream)
    return SCHEME + stream


def parse_stream_uri(uri: str) -> str:
    """The stream name of a ``jetstream://<STREAM>`` URI."""
    if not uri.startswith(SCHEME):
        raise StreamError(f"not a stream URI (expected {SCHEME}<STREAM>): {uri!r}")
    name = uri[len(SCHEME):].rstrip("/")
    _check_name(name)
    return name


def _check_name(name: str) -> None:
    if not name or any(c in name for c in " .*>/\\\t\r\n"):
        raise StreamError(f"invalid JetStream stream name: {name!r}")


# ------------------------------------------------------------------ decoding


def _kind_of(value: Any) -> str | None:
    """The kind of one value, None when it tells nothing (None, an empty list)."""
    if isinstance(value, bool | int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str | bytes):
        return "string"
    if isinstance(value, list | tuple):
        inner = {_kind_of(v) for v in value} - {None}
        if not inner:
            return None
        if inner <= {"int", "float"}:
            return "list<float>" if "float" in inner else "list<int>"
        if len(inner) == 1 and inner <= {"string"}:
            return "list<string>"
    raise TypeError(f"unsupported value of type {type(value).__name__}")


def _merge(a: str | None, b: str | None) -> str | None:
    if a is None or a == b:
        return b if a is None else a
    if b is None:
        return a
    if {a, b} == {"int", "float"}:
        return "float"
    if {a, b} == {"list<int>", "list<float>"}:
        return "list<float>"
    raise TypeError(f"holds both {a} and {b} values")


def infer_kinds(samples: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Column kinds from decoded samples, in order of first appearance; a column that is only ever
    missing or an empty list is ``list<string>`` if it was a list, else ``float``."""
    kinds: dict[str, str | None] = {}
    was_list: set[str] = set()
    for s in samples:
        for k, v in s.items():
            try:
                kinds[k] = _merge(kinds.get(k), _kind_of(v))
            except TypeError as exc:
                raise StreamError(f"column {k!r}: {exc}") from None
            if isinstance(v, list | tuple):
                was_list.add(k)
    return {k: v or ("list<string>" if k in was_list else "float") for k, v in kinds.items()}


def _unpack(data: bytes, seq: int, stream: str) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise StreamError(f"stream {stream} sequence {seq}: payload is not msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise StreamError(f"stream {stream} sequence {seq}: payload is a msgpack {type(obj).__name__}, not a map")
    return obj


def _decode(samples: Sequence[Mapping[str, Any]], seqs: Sequence[int], kinds: Mapping[str, str],
            columns: Sequence[str], stream: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    n = len(samples)
    for name in columns:
        kind = kinds[name]
        vals = [s.get(name) for s in samples]
        try:
            if kind == "float":
                out[name] = np.array([math.nan if v is None else v for v in vals], dtype=np.float32)
            elif kind == "int":
                out[name] = np.array([0 if v is None else v for v in vals], dtype=np.int64)
            elif kind == "string":
                col = np.empty(n, dtype=object)
                col[:] = ["" if v is None else v.decode() if isinstance(v, bytes) else str(v) for v in vals]
                out[name] = col
            else:
                inner = {"list<float>": np.float32, "list<int>": np.int64, "list<string>": object}[kind]
                col = np.empty(n, dtype=object)
                for i, v in enumerate(vals):
                    col[i] = np.array(v if v is not None else [], dtype=inner)
                out[name] = col
        except (TypeError, ValueError, OverflowError):
            bad = next((seqs[i] for i, v in enumerate(vals) if not _fits(v, kind)), seqs[0] if seqs else -1)
            raise StreamError(f"stream {stream} sequence {bad}: column {name!r} is not a {kind}") from None
    return out


def _fits(v: Any, kind: str) -> bool:
    """Whether one value can be a ``kind`` (to name the sequence of a bad one)."""
    if v is None:
        return True
    if kind == "string":
        return isinstance(v, str | bytes | int | float)
    if kind in ("float", "int"):
        return isinstance(v, int | float)
    return isinstance(v, list | tuple) and all(x is not None and _fits(x, kind[5:-1]) for x in v)


# ------------------------------------------------------------------ reading


class StreamReader:
    """The async reader under :class:`StreamSource` (usable on its own from async code)."""

    def __init__(self, nc: Client, js: JetStreamContext, stream: str, first_seq: int,
                 kinds: Mapping[str, str] | None = None, fetch_timeout: float = 5.0) -> None:
        if first_seq < 1:
            raise ValueError("first_seq: JetStream sequences start at 1")
        _check_name(stream)
        bad = {k: v for k, v in (kinds or {}).items() if v not in KINDS}
        if bad:
            raise ValueError(f"kinds: unknown kind(s) {bad}; expected one of {', '.join(KINDS)}")
        self.nc, self.js, self.stream, self.first_seq = nc, js, stream, first_seq
        self.kinds: dict[str, str] = dict(kinds or {})
        self.fetch_timeout = fetch_timeout
        self.rows = 0
        self.malformed = 0  # payloads found not to be a msgpack map
        self._nuid = NUID()

    async def last_seq(self) -> int:
        try:
            info = await self.js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            raise StreamError(f"no JetStream stream {self.stream!r}") from None
        assert info.state is not None
        return int(info.state.last_seq)

    async def refresh(self) -> int:
        """Re-read the stream's last sequence: ``rows``; infers the kinds once there is a sample."""
        self.rows = max(0, await self.last_seq() - self.first_seq + 1)
        if not self.kinds and self.rows:
            _, samples = await self._fetch(0, min(self.rows, INFER_SAMPLES), strict=False)
            self.kinds = infer_kinds(samples)
        return self.rows

    async def read(self, lo: int, hi: int, columns: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        if hi > self.rows:
            await self.refresh()
        if not 0 <= lo <= hi <= self.rows:
            raise StreamError(f"stream {self.stream}: records [{lo}, {hi}) are outside [0, {self.rows})")
        names = list(self.kinds) if columns is None else list(columns)
        unknown = [c for c in names if c not in self.kinds]
        if unknown:
            raise StreamError(f"stream {self.stream}: no column(s) {', '.join(unknown)} (it has {', '.join(self.kinds)})")
        seqs, samples = await self._fetch(lo, hi)
        return _decode(samples, seqs, self.kinds, names, self.stream)

    async def _fetch(self, lo: int, hi: int, strict: bool = True) -> tuple[list[int], list[dict[str, Any]]]:
        """The decoded samples of sequences ``[first_seq + lo, first_seq + hi)``, all of them or an error
        (``strict=False``, to infer kinds: those there are, skipping bad payloads).

        An ephemeral pull consumer starting at the first wanted sequence (no acks, in memory, removed by
        the server if this process dies before deleting it), pulled in batches of :data:`FETCH_BATCH`
        into a plain subscription with a callback: nats-py's ``fetch`` waits for each message
        separately and was 3x slower.  A gap in the delivered sequences is a missing record.
        """
        want, stop = self.first_seq + lo, self.first_seq + hi
        if want >= stop:
            return [], []
        name = self._nuid.next().decode()
        cfg = ConsumerConfig(name=name, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=want,
                             ack_policy=AckPolicy.NONE, mem_storage=True, inactive_threshold=30.0)
        try:
            await self.js.add_consumer(self.stream, config=cfg)
        except nats.js.errors.NotFoundError:
            raise StreamError(f"no JetStream stream {self.stream!r}") from None
        got: list[Msg] = []
        ended = asyncio.Event()  # the batch is complete, or the server said there is no more
        need = 0

        async def on_msg(m: Msg) -> None:
            if not m.data and m.headers and m.headers.get("Status"):
                if m.headers["Status"] != "100":  # 404 no messages, 408 request expired, 409 ...; 100 = heartbeat
                    ended.set()
                return
            got.append(m)
            if len(got) >= need:
                ended.set()

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=4 * FETCH_BATCH,
                                      pending_bytes_limit=256 << 20)
        nxt = f"{self.js._prefix}.CONSUMER.MSG.NEXT.{self.stream}.{name}"  # the JS API prefix (domain aware)
        seqs: list[int] = []
        samples: list[dict[str, Any]] = []
        empty = 0
        try:
            while want < stop:
                got.clear()
                ended.clear()
                need = min(stop - want, FETCH_BATCH)
                # no_wait: what exists now, then a 404 status at once (no waiting for the tail to appear)
                await self.nc.publish(nxt, json.dumps({"batch": need, "no_wait": True}).encode(), reply=inbox)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), self.fetch_timeout)
                empty = 0 if got else empty + 1
                if empty >= 2 and not strict:
                    break
                if empty >= 2:  # twice nothing (once could be a late status of the previous pull)
                    raise StreamError(f"stream {self.stream}: sequences {want}..{stop - 1} are missing "
                                      "(deleted, purged or past the end)")
                for m in got:
                    seq = m.metadata.sequence.stream
                    if seq != want and strict:
                        raise StreamError(f"stream {self.stream}: sequence {want} is missing (deleted or purged; "
                                          f"the next one is {seq})")
                    try:
                        samples.append(_unpack(m.data, seq, self.stream))
                        seqs.append(seq)
                    except StreamError:
                        if strict:
                            self.malformed += 1
                            raise
                    want = seq + 1
                    if want >= stop:
                        break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.stream, name)
        return seqs, samples


class StreamSource:
    """A JetStream stream as a :class:`pacer.data.sources.Source`: record ``i`` is sequence ``first_seq + i``.

    Synchronous: its own connection and event loop run on a daemon thread (like
    :class:`pacer.shards.client.BlockingShardClient`), so a TensorFlow input
    thread calls it directly; concurrent ``read`` calls from several threads are
    fine (each uses its own ephemeral consumer).  ``rows`` is fixed at open and
    at each :meth:`refresh` (a read past it refreshes first).
    """

    def __init__(self, nats_url: str, stream: str, *, first_seq: int, kinds: Mapping[str, str] | None = None,
                 connect_kwargs: Mapping[str, Any] | None = None, fetch_timeout: float = 5.0) -> None:
        self.uri = stream_uri(stream)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"pacer-stream-{stream}", daemon=True)
        self._thread.start()
        self._bus: Bus | None = None
        try:
            self._bus = self._run(Bus.connect(nats_url, **{"name": f"stream-source-{stream}", **(connect_kwargs or {})}))
            self._reader = StreamReader(self._bus.nc, self._bus.js, stream, first_seq, kinds, fetch_timeout)
            self._run(self._reader.refresh())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def stream(self) -> str:
        return self._reader.stream

    @property
    def first_seq(self) -> int:
        return self._reader.first_seq

    @property
    def rows(self) -> int:
        return self._reader.rows

    @property
    def kinds(self) -> dict[str, str]:
        return dict(self._reader.kinds)

    @property
    def columns(self) -> tuple[Column, ...]:
        return tuple(Column(k, v) for k, v in self._reader.kinds.items())

    @property
    def files(self) -> list[str]:
        return [self.uri]

    @property
    def malformed(self) -> int:
        """Payloads found not to be a msgpack map (each also raised)."""
        return self._reader.malformed

    def refresh(self) -> int:
        """Re-read the stream's info: the new ``rows``."""
        return self._run(self._reader.refresh())

    def read(self, lo: int, hi: int, columns: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Records ``[lo, hi)``: exactly sequences ``[first_seq + lo, first_seq + hi)``, or :class:`StreamError`."""
        return self._run(self._reader.read(lo, hi, columns))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._bus is not None and self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._run(self._bus.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> StreamSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ following


class StreamFollower:
    """Appends a stream's new samples to a streaming dataset of the shard service, and closes it when idle.

    ``ShardAdmin.append(job, dataset, n)`` means "``n`` more records exist":
    a delta, records ``[known, known + n)`` of the dataset (``known`` being
    the records registered plus every append so far) become TODO shards.  So
    the follower keeps ``appended`` (records of the stream, from
    ``first_seq``, the dataset has) and sends only the difference.  A retried
    append whose first reply was lost would add the records twice: appends
    are sent without retries, and after a failed one ``appended`` is re-read
    from the service (``DatasetStatus.records_total``, which for a streaming
    dataset is the records known) before anything else is appended.  After a
    restart, build it with ``appended=`` that count (:meth:`resume` does it).

    The dataset is registered by the caller (``DatasetSpec(mode=STREAMING,
    records=0)``, or with records already in the stream and ``appended`` set
    to them).  ``idle_close_s``: close the dataset (``append(..., 0,
    close=True)``) once the stream got no new message for that long; ``None``
    never closes it (a true online job runs until stopped).
    """

    def __init__(self, bus_or_js: Bus | JetStreamContext, admin: ShardAdmin, job: str, dataset: str, stream: str,
                 first_seq: int, *, poll_s: float = 0.5, idle_close_s: float | None = None,
                 appended: int = 0) -> None:
        if first_seq < 1:
            raise ValueError("first_seq: JetStream sequences start at 1")
        _check_name(stream)
        self.js = bus_or_js.js if isinstance(bus_or_js, Bus) else bus_or_js
        self._admin = ShardAdmin(admin.bus, admin.timeout, NO_RETRY)  # an append is not idempotent
        self._status_admin = admin
        self.job, self.dataset, self.stream, self.first_seq = job, dataset, stream, first_seq
        self.poll_s, self.idle_close_s = poll_s, idle_close_s
        self.appended = appended
        self.appends = 0  # append requests that succeeded
        self.closed = False
        self._last_seen = -1
        self._since = time.monotonic()
        self._resync = False

    @classmethod
    async def resume(cls, bus_or_js: Bus | JetStreamContext, admin: ShardAdmin, job: str, dataset: str,
                     stream: str, first_seq: int, **kwargs: Any) -> StreamFollower:
        """A follower that carries on from what the shard service already has (after a restart)."""
        st = await admin.status(job, dataset)
        f = cls(bus_or_js, admin, job, dataset, stream, first_seq, appended=st.records_total, **kwargs)
        f.closed = st.closed
        return f

    async def available(self) -> int:
        """Records of the stream from ``first_seq`` on, now."""
        try:
            info = await self.js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            raise StreamError(f"no JetStream stream {self.stream!r}") from None
        assert info.state is not None
        return max(0, int(info.state.last_seq) - self.first_seq + 1)

    async def poll(self) -> int:
        """One round: append the records that became available, close when idle; the records appended."""
        if self.closed:
            return 0
        if self._resync:
            st = await self._status_admin.status(self.job, self.dataset)
            self.appended, self.closed, self._resync = st.records_total, st.closed, False
            if self.closed:
                return 0
        avail = await self.available()
        now = time.monotonic()
        if avail != self._last_seen:
            self._last_seen, self._since = avail, now
        new = avail - self.appended
        if new > 0:
            try:
                await self._admin.append(self.job, self.dataset, new)
            except BaseException:
                self._resync = True  # it may have landed: ask the service before appending again
                raise
            self.appended += new
            self.appends += 1
            return new
        if self.idle_close_s is not None and now - self._since >= self.idle_close_s:
            try:
                await self._admin.append(self.job, self.dataset, 0, close=True)
            except BaseException:
                self._resync = True
                raise
            self.closed = True
        return 0

    async def run(self) -> None:
        """Poll every ``poll_s`` until the dataset is closed (or the task is cancelled); errors are logged
        and retried on the next round."""
        while not self.closed:
            try:
                await self.poll()
            except Exception as exc:  # NATS down, a stream not there yet, an error reply: try again next round
                log.warning("stream follower round failed: %s: %s", type(exc).__name__, exc)
            if not self.closed:
                await asyncio.sleep(self.poll_s)
