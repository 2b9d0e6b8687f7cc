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

URIs, reading and following
---------------------------
A dataset URI ``jetstream://<STREAM>`` (:func:`stream_uri`) names a stream on
the job's own NATS; it must have ``allow_direct`` on (``nats stream add
--allow-direct``, ``StreamConfig(allow_direct=True)``), because a worker
reads exactly its records' sequences by batched direct gets: read-only
requests that need no consumer (:meth:`StreamReader._fetch`), so a pod's
NATS user is granted ``$JS.API.DIRECT.GET.<STREAM>`` and
``$JS.API.STREAM.INFO.<STREAM>`` of its own job's stream and nothing else
of JetStream (:func:`pacer.security.agent_job_permissions`).
:class:`StreamSource` is the worker's reader (the
:class:`pacer.data.sources.Source` interface, synchronous, on a private event
loop thread).  The shard service follows the stream for the job (the
dataset's ``DatasetSpec.stream``): it appends new samples as shards, a full
shard at once and a partial one after ``max_wait_s``, and closes the
dataset after ``idle_close_s`` without a new sample
(``pacer_services.shard_service.follow``).

A streaming dataset is read in stream order, never shuffled: online learning
trains on the past to predict the future.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import msgpack
import nats.errors
import nats.js.errors
import numpy as np
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from pacer import security
from pacer.bus import Bus
from pacer.data.criteo import DataError
from pacer.errors import ValidationError

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


def check_data_stream(name: str) -> str:
    """``name`` if a job may train on that stream (:func:`pacer.security.check_data_stream`), else
    :class:`StreamError`."""
    try:
        return security.check_data_stream(name)
    except ValidationError as exc:
        raise StreamError(exc.message) from None


def schema_kinds(schema: Any) -> dict[str, str]:
    """Column kinds for a :class:`pacer.data.schema.Schema` whose stream holds no sample yet: numbers are
    ``float``, categorical ids ``string``, multi-hot ``list<string>`` (a sample's ints are read as their
    decimal text, so they hash as the same ids they would as strings)."""
    kinds = {schema.label: "float"}
    if schema.weight:
        kinds[schema.weight] = "float"
    kinds.update({d.name: "float" for d in schema.dense})
    kinds.update({c.name: "string" for c in schema.categorical})
    kinds.update({m.name: "list<string>" for m in schema.multi_hot})
    return kinds


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
                    if kind == "list<string>" and v:
                        v = [x.decode() if isinstance(x, bytes) else str(x) for x in v]
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

        Batched direct gets (``$JS.API.DIRECT.GET.<STREAM>`` with ``{"seq", "batch"}``; the stream has
        ``allow_direct``): read-only, no consumer is created, so a pod needs no right to make the server
        deliver anything anywhere.  Each answer is the messages from ``seq`` on, then an end-of-batch
        status (204); a start past the last message answers 404.  The server skips deleted sequences,
        so a gap in the delivered ones is a missing record.
        """
        want, stop = self.first_seq + lo, self.first_seq + hi
        if want >= stop:
            return [], []
        got: list[Msg] = []
        ended = asyncio.Event()  # the batch is complete (end-of-batch or an error status)
        status: list[str] = []

        async def on_msg(m: Msg) -> None:
            code = m.headers.get("Status") if m.headers else None
            if code is not None and not m.data:
                status.append(code)
                ended.set()
                return
            got.append(m)

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=4 * FETCH_BATCH,
                                      pending_bytes_limit=256 << 20)
        subject = f"{self.js._prefix}.DIRECT.GET.{self.stream}"  # the JS API prefix (domain aware)
        seqs: list[int] = []
        samples: list[dict[str, Any]] = []
        try:
            while want < stop:
                got.clear()
                status.clear()
                ended.clear()
                need = min(stop - want, FETCH_BATCH)
                await self.nc.publish(subject, json.dumps({"seq": want, "batch": need}).encode(), reply=inbox)
                try:
                    await asyncio.wait_for(ended.wait(), self.fetch_timeout)
                except TimeoutError:
                    raise StreamError(f"stream {self.stream}: no answer to a read of sequences {want}..{stop - 1} "
                                      f"within {self.fetch_timeout:g} s (is allow_direct on?)") from None
                if status and status[0] == "503":
                    raise StreamError(f"no JetStream stream {self.stream!r} (or it has allow_direct off)")
                if not got:
                    if not strict:
                        break
                    raise StreamError(f"stream {self.stream}: sequences {want}..{stop - 1} are missing "
                                      "(deleted, purged or past the end)")
                for m in got:
                    seq = int(m.headers["Nats-Sequence"]) if m.headers else -1
                    if seq >= stop:
                        break
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
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
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
