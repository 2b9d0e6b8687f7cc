"""Hostile and malformed input never crashes the shard service.

Every junk request gets a clear error reply (an ``ErrorEnvelope`` that
:func:`decode_reply` turns into a :class:`PacerError` naming what is wrong),
is counted in ``errors``, and leaves the shard state alone; a valid-looking
request with hostile contents is answered with per-shard rejections and
changes nothing either.  Malformed node-death events are dead-lettered and
terminated, not redelivered.

Hypothesis drives sync test functions; each example submits coroutines to an
event loop running in a background thread, on which one real ``nats-server``
and one ``ShardService`` live for the whole module.  Before the fuzzing a
worker consumes part of a dataset (and keeps a few shards); the last test
checks that the junk changed nothing and that the dataset still finishes
with every record covered exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import nats.errors
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pacer import subjects
from pacer.bus import NO_RETRY, Bus
from pacer.codec import decode, encode
from pacer.contracts.common import Health, decode_reply
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import (
    AppendRequest,
    CheckpointRequest,
    DatasetMode,
    DatasetRef,
    DatasetSpec,
    DatasetStatus,
    LeaseReply,
    LeaseRequest,
    ShardLease,
    ShardProgress,
    ShardRange,
)
from pacer.embedded import EmbeddedNats
from pacer.errors import Conflict, DecodeError, NotFound, PacerError, ValidationError
from pacer.ids import is_token
from pacer.runtime import RuntimeConfig, run_service
from pacer.shards.client import ShardAdmin, ShardClient
from pacer.subjects import ShardOp
from pacer_services.shard_service.app import ShardService, ShardServiceConfig
from pacer_services.shard_service.core import MAX_WANT, ShardLimits
from pacer_services.shard_service.effects import ShardLogStore

T = TypeVar("T")

JOB = "hostile"
DS = "train"
NODE = "w0"  # the honest worker
RECORDS = 20_000
SHARD_LEN = 100  # batch_size 10 * batches_per_shard 10
N_SHARDS = RECORDS // SHARD_LEN
SPEC = DatasetSpec(JOB, DS, RECORDS, batch_size=10, batches_per_shard=10, lease_s=600.0,
                   tail_split=False)  # whole shards: the counts below are exact
# The server's max payload is NATS's default (1 MB, the stack's is 8 MB) and reports of up to 50k ids
# are let in, so that a reply too large for the bus can be provoked without a request so large that
# deciding it stalls the service (test_reply_too_big_for_the_bus_still_gets_an_error_reply).
MAX_PAYLOAD = 1024 * 1024
LIMITS = ShardLimits(report_ids=50_000)
STREAM = "stream"  # streaming datasets of JOB used by the append tests
STREAM_BIG = "stream-big"

REQUEST_CLS: dict[str, type[Any]] = {
    ShardOp.REGISTER: DatasetSpec,
    ShardOp.LEASE: LeaseRequest,
    ShardOp.STATUS: DatasetRef,
    ShardOp.CHECKPOINT: CheckpointRequest,
    ShardOp.RESTORE: CheckpointRequest,
    ShardOp.APPEND: AppendRequest,
    ShardOp.RETRY_FAILED: DatasetRef,
}
CLIENT_ERRORS = (DecodeError, ValidationError, NotFound, Conflict)

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    database=None,  # no .hypothesis/ directory in the repo
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ====================================================================== harness
class Harness:
    """A nats-server, a ShardService and a test Bus, all on one background loop."""

    def __init__(self, srv: EmbeddedNats) -> None:
        self.srv = srv
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hostile-loop", daemon=True)
        self.thread.start()
        self.svc: ShardService | None = None
        self.bus: Bus | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        # Filled in by seed(): the honest worker's first pass over SPEC.
        self.got_before: list[ShardLease] = []
        self.held: dict[int, ShardLease] = {}
        self.baseline: DatasetStatus | None = None
        self.jobs_before: set[str] = set()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ------------------------------------------------------------ lifecycle
    async def _start(self) -> None:
        ready = asyncio.Event()

        async def factory(b: Bus, rc: RuntimeConfig) -> ShardService:
            svc = ShardService(
                b, ShardLogStore(b.js), ShardServiceConfig(reap_interval_s=0.05, progress_interval_s=0.2,
                                                           limits=LIMITS)
            )
            orig = svc.start

            async def start(tg: asyncio.TaskGroup) -> None:
                await orig(tg)
                ready.set()

            svc.start = start  # type: ignore[method-assign]
            self.svc = svc
            return svc

        self._stop = asyncio.Event()
        self._task = asyncio.create_task(
            run_service(factory, RuntimeConfig(nats_url=self.srv.url), self._stop, install_signals=False)
        )
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([waiter, self._task], return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            self._task.result()
        self.bus = await Bus.connect(self.srv.url, name="hostile-test")
        await self._health(wait=True)

    async def _close(self) -> None:
        if self.bus is not None:
            await self.bus.close()
        if self._stop is not None and self._task is not None:
            self._stop.set()
            await asyncio.wait_for(self._task, 15)

    def start(self) -> None:
        self.run(self._start())

    def close(self) -> None:
        try:
            self.run(self._close(), 25)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)

    # ------------------------------------------------------------ helpers
    @property
    def service(self) -> ShardService:
        assert self.svc is not None
        return self.svc

    @property
    def b(self) -> Bus:
        assert self.bus is not None
        return self.bus

    def service_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _health(self, wait: bool = False) -> Health:
        deadline = time.monotonic() + 20
        while True:
            try:
                h = await self.b.request(subjects.health("shard"), None, Health, timeout=2.0, retry=NO_RETRY)
                if h.status == "ready" or not wait:
                    return h
            except PacerError:
                if not wait or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)

    def health(self) -> Health:
        return self.run(self._health())

    async def _counters(self) -> dict[str, int]:
        return dict(self.service.counters.values)

    def counters(self) -> dict[str, int]:
        return self.run(self._counters())

    async def _raw(self, subject: str, data: bytes, wait_s: float) -> bytes:
        try:
            resp = await self.b.nc.request(subject, data, timeout=wait_s)
        except nats.errors.TimeoutError:
            raise AssertionError(f"no reply on {subject[:120]!r} within {wait_s}s (missing reply or hang)") from None
        return bytes(resp.data)

    def raw(self, subject: str, data: bytes, timeout: float = 5.0) -> bytes:
        return self.run(self._raw(subject, data, timeout), timeout + 5)

    def status(self, dataset: str = DS) -> DatasetStatus:
        return decode_reply(DatasetStatus, self.raw(rpc(JOB, ShardOp.STATUS), encode(DatasetRef(JOB, dataset))))

    def jobs(self) -> set[str]:
        async def get() -> set[str]:
            return set(self.service.jobs)

        return self.run(get())


def rpc(job: str, op: str) -> str:
    """The raw request subject, without the id checks of ``subjects.rpc``."""
    return f"pacer.rpc.shard.{job}.{op}"


async def consume(bus: Bus, node: str, limit: int | None = None) -> tuple[list[ShardLease], list[ShardLease]]:
    """Read shards as ``node``; with ``limit``, stop after that many and keep the last 5 unreported."""
    # Unreported shards count against the prefetch window: it must exceed the 5 kept.
    c = ShardClient(bus, JOB, DS, node, prefetch=8, timeout=5.0)
    await c.start()
    done: list[ShardLease] = []
    kept: list[ShardLease] = []
    while (limit is None or len(done) + len(kept) < limit) and (s := await c.next()) is not None:
        if limit is not None and len(done) >= limit - 5:
            kept.append(s)  # handed to the "application", never reported: stays DOING under NODE
        else:
            done.append(s)
            c.done(s)
    await c.close()  # flushes the reports and releases prefetched, unread shards
    return done, kept


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    srv = EmbeddedNats(store_dir=Path(tmp_path_factory.mktemp("nats")), max_payload=MAX_PAYLOAD).start()
    harness = Harness(srv)
    try:
        harness.start()

        async def seed() -> None:
            await ShardAdmin(harness.b).register(SPEC)
            done, kept = await consume(harness.b, NODE, limit=30)
            harness.got_before = done
            # What NODE holds, as the service sees it: the kept shards, plus any grant
            # whose reply the closing client no longer waited for.
            ask = LeaseRequest(JOB, DS, NODE, want=0)
            reply = await harness.b.request(rpc(JOB, ShardOp.LEASE), ask, LeaseReply)
            harness.held = {s.shard: s for s in reply.shards}
            assert {s.shard for s in kept} <= set(harness.held)

        harness.run(seed())
        harness.baseline = harness.status()
        harness.jobs_before = harness.jobs()
        assert harness.baseline.done == 25 and harness.baseline.doing == len(harness.held), harness.baseline
        yield harness
    finally:
        try:
            harness.close()
        finally:
            srv.stop()


# ====================================================================== checks
def expect_error(
    h: Harness, subject: str, data: bytes, classes: tuple[type[PacerError], ...] = CLIENT_ERRORS
) -> PacerError:
    """Send junk; it must get an error reply, be counted, and never be an internal error."""
    before = h.counters()
    reply = h.raw(subject, data)
    obj = msgpack.unpackb(reply, raw=False, strict_map_key=False)
    assert isinstance(obj, dict) and "error" in obj, f"expected an error reply, got {obj!r:.300}"
    with pytest.raises(PacerError) as ei:
        decode_reply(DatasetStatus, reply)
    err = ei.value
    assert isinstance(err, classes), f"{type(err).__name__} ({err.code}): {err.message}"
    assert err.message and len(err.message) >= 8, f"unhelpful message {err.message!r}"
    assert not err.temporary, f"junk must not be reported as temporary: {err.message}"
    after = h.counters()
    assert after["errors"] == before.get("errors", 0) + 1, "the refusal was not counted"
    assert after.get("internal_errors", 0) == before.get("internal_errors", 0), "junk caused an internal error"
    assert h.service_alive()
    return err


def names_a_field(message: str, cls: type[Any]) -> bool:
    return cls.__name__ in message or any(f.name in message for f in dataclasses.fields(cls))


def decodes(cls: type[Any], data: bytes) -> bool:
    try:
        decode(cls, data)
    except DecodeError:
        return False
    return True


# ====================================================================== strategies
INT64 = st.integers(-(2**63), 2**64 - 1)
EDGE_INTS = st.sampled_from([0, 1, -1, MAX_WANT, MAX_WANT + 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1])
INTS = st.one_of(INT64, EDGE_INTS)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
NASTY_STRINGS = [
    "", ".", "*", ">", "a.b", "w0.>", "w0.*", " ", "w0 ", "w0\n", "\x00", "$SYS", "../w0",
    "x" * 65, "x" * 1000, "é", "节点", "💥", "pacer.rpc.shard.*.*", JOB, DS, NODE, "finite", "streaming",
]
STRS = st.one_of(st.text(max_size=40), st.sampled_from(NASTY_STRINGS))
FIELD_NAMES = sorted(
    {f.name for cls in (*REQUEST_CLS.values(), ShardProgress) for f in dataclasses.fields(cls)} | {"error"}
)
KEYS = st.one_of(st.sampled_from(FIELD_NAMES), STRS, INTS)
LEAVES = st.one_of(st.none(), st.booleans(), INTS, FLOATS, STRS, st.binary(max_size=40))
VALUES = st.recursive(
    LEAVES,
    lambda children: st.one_of(st.lists(children, max_size=6), st.dictionaries(KEYS, children, max_size=8)),
    max_leaves=25,
)
TOP_VALUES = st.one_of(VALUES, st.dictionaries(KEYS, VALUES, max_size=12))

TOKENS = st.from_regex(r"\A[A-Za-z0-9_-]{1,64}\Z")
BAD_IDS = st.one_of(
    st.sampled_from(["", ".", "*", ">", "a.b", "w0.>", "w0.*", "w0 ", "x" * 65, "x" * 1000, "é", "节点", "w0\n"]),
    st.text(max_size=80).filter(lambda s: not is_token(s)),
)
# One level of a subject that nats-server will route: no '.', no whitespace or control characters.
SUBJECT_TOKENS = st.text(
    st.characters(exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp"), exclude_characters="."),
    min_size=1,
    max_size=80,
)
OPS = st.sampled_from(ShardOp.ALL)


def valid_body(op: str, job: str) -> bytes:
    """A well-formed request of ``op`` naming ``job`` (refused only for what the job/subject is)."""
    if op == ShardOp.REGISTER:
        return encode(dataclasses.replace(SPEC, job=job, dataset="fresh"))
    if op == ShardOp.LEASE:
        return encode(LeaseRequest(job, DS, "mallory", want=1))
    if op in (ShardOp.CHECKPOINT, ShardOp.RESTORE):
        return encode(CheckpointRequest(job, DS, "ck1"))
    if op == ShardOp.APPEND:
        return encode(AppendRequest(job, STREAM, 10))
    return encode(DatasetRef(job, DS))


# ====================================================================== raw junk
@SETTINGS
@given(op=OPS, job=st.sampled_from([JOB, "nojob"]), value=TOP_VALUES)
def test_random_msgpack_values_get_a_clear_error(h: Harness, op: str, job: str, value: Any) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    assume(not decodes(REQUEST_CLS[op], data))
    err = expect_error(h, rpc(job, op), data, (DecodeError,))
    assert names_a_field(err.message, REQUEST_CLS[op]), err.message


@st.composite
def junk_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "truncated", "corrupted", "trailing"]))
    if kind == "random":
        return draw(st.binary(max_size=4096))
    valid = encode(
        LeaseRequest(JOB, DS, "mallory", want=3, done=[1, 2, 3], progress=[ShardProgress(4, 5)], max_records=7)
    )
    if kind == "truncated":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    if kind == "trailing":
        return valid + draw(st.binary(min_size=1, max_size=16))
    i = draw(st.integers(0, len(valid) - 1))
    return valid[:i] + bytes([valid[i] ^ draw(st.integers(1, 255))]) + valid[i + 1 :]


@SETTINGS
@given(op=OPS, data=junk_bytes())
def test_random_bytes_get_a_clear_error(h: Harness, op: str, data: bytes) -> None:
    assume(not decodes(REQUEST_CLS[op], data))
    err = expect_error(h, rpc(JOB, op), data, (DecodeError,))
    assert names_a_field(err.message, REQUEST_CLS[op]), err.message


# ====================================================================== hostile lease requests
SHARD_IDS = st.one_of(st.integers(0, N_SHARDS - 1), st.integers(-(2**63), 2**64 - 1), st.integers(N_SHARDS, 10**6))
CONSUMED = st.one_of(
    st.integers(-(2**63), -1), st.integers(SHARD_LEN + 1, 2**64 - 1), st.integers(0, SHARD_LEN), EDGE_INTS
)


@st.composite
def hostile_leases(draw: st.DrawFn) -> dict[str, Any]:
    ids = st.lists(SHARD_IDS, max_size=20)
    huge = draw(st.sampled_from([0] * 12 + [20_000, 60_000]))
    done = draw(ids) + list(range(-huge, huge, 2))  # a huge report: every id unknown
    return {
        "job": draw(st.sampled_from([JOB] * 6 + ["other", "", "x" * 1000])),
        "dataset": draw(st.sampled_from([DS] * 6 + ["nope", "", "a.b", "x" * 1000])),
        "node": draw(st.one_of(st.sampled_from([NODE, NODE, "mallory", "w1"]), TOKENS, BAD_IDS)),
        "want": draw(
            st.one_of(st.integers(0, MAX_WANT), st.integers(-(2**63), -1), st.integers(MAX_WANT + 1, 2**64 - 1))
        ),
        "held": draw(ids),
        "done": done,
        "progress": draw(st.lists(st.builds(ShardProgress, SHARD_IDS, CONSUMED), max_size=8)),
        "discarded": draw(st.lists(st.builds(ShardRange, SHARD_IDS, CONSUMED, CONSUMED), max_size=8)),
        "failed": draw(ids),
        "released": draw(ids),
        "max_records": draw(st.one_of(st.just(0), st.integers(1, 1000), st.integers(-(2**63), -1))),
    }


def first_bad_field(req: dict[str, Any]) -> str | None:
    """What the service must complain about first, or None if the request is acceptable."""
    if req["job"] != JOB:
        return "job"
    if req["dataset"] != DS:
        return "dataset"
    if not is_token(req["node"]):
        return "node"
    if not 0 <= req["want"] <= MAX_WANT:
        return "want"
    if req["max_records"] < 0:
        return "max_records"
    for key in ("held", "done", "progress", "discarded", "failed", "released"):
        if len(req[key]) > LIMITS.report_ids:
            return key
    return None


@SETTINGS
@given(req=hostile_leases())
def test_hostile_lease_requests_are_refused_or_rejected_without_effect(h: Harness, req: dict[str, Any]) -> None:
    bad = first_bad_field(req)
    if bad is not None:
        err = expect_error(h, rpc(JOB, ShardOp.LEASE), encode(LeaseRequest(**req)), (ValidationError, NotFound))
        if bad == "dataset":
            assert isinstance(err, NotFound) and "dataset" in err.message, err.message
        else:
            assert err.message.startswith(f"{bad}:"), f"expected the message to name {bad!r}: {err.message}"
    else:
        # Acceptable: make it a pure report that cannot legitimately change anything
        # (no grants; never report the honest worker's shards in its name).
        held = set(h.held) if req["node"] == NODE else set()
        req["want"] = 0
        for k in ("done", "failed", "released"):
            req[k] = [s for s in req[k] if s not in held]
        req["progress"] = [p for p in req["progress"] if p.shard not in held or not 0 <= p.consumed <= SHARD_LEN]
        req["discarded"] = [r for r in req["discarded"] if r.shard not in held or not 0 <= r.start < r.end <= SHARD_LEN]
        before = h.counters()
        reply = decode_reply(LeaseReply, h.raw(rpc(JOB, ShardOp.LEASE), encode(LeaseRequest(**req))))
        reported = (len(req["done"]) + len(req["progress"]) + len(req["discarded"]) + len(req["failed"])
                    + len(req["released"]))
        assert len(reply.rejected) == reported, "every hostile report must be rejected"
        for p in req["progress"]:
            if p.shard in held:
                assert any(r.shard == p.shard and r.reason == "bad_progress" for r in reply.rejected)
        for d in req["discarded"]:
            if d.shard in held:
                assert any(r.shard == d.shard and r.reason == "bad_discard" for r in reply.rejected)
        resent = sorted(set(held) - set(req["held"]))  # shards the node holds but did not list
        assert sorted(s.shard for s in reply.shards) == resent
        assert not reply.finished and not reply.exhausted
        after = h.counters()
        assert after.get("internal_errors", 0) == before.get("internal_errors", 0)
        assert after.get("errors", 0) == before.get("errors", 0)
    assert h.status() == h.baseline


def test_reply_too_big_for_the_bus_still_gets_an_error_reply(h: Harness) -> None:
    """45k unknown ids: the rejection list exceeds max_payload; the caller must hear so, and so must
    requests decided in the same group commit."""
    n = 45_000
    big = encode(LeaseRequest(JOB, DS, "mallory", done=list(range(10**6, 10**6 + n))))
    assert len(big) < MAX_PAYLOAD

    async def go() -> list[bytes]:
        return await asyncio.gather(
            h._raw(rpc(JOB, ShardOp.LEASE), big, 15.0),
            *(h._raw(rpc(JOB, ShardOp.STATUS), encode(DatasetRef(JOB, DS)), 15.0) for _ in range(5)),
        )

    before = h.counters()
    replies = h.run(go(), 40)
    with pytest.raises(PacerError) as ei:
        decode_reply(LeaseReply, replies[0])
    assert "reply" in ei.value.message, ei.value.message
    for r in replies[1:]:
        assert decode_reply(DatasetStatus, r) == h.baseline
    after = h.counters()
    assert after["errors"] == before.get("errors", 0) + 1
    assert h.status() == h.baseline and h.service_alive()


# ====================================================================== dataset specs
NEW_JOB = "newjob"  # a valid, unregistered job: a refused spec must not create it
BASE_SPEC: dict[str, Any] = dict(
    job=JOB, dataset="fresh", records=1000, batch_size=10, batches_per_shard=10, epochs=1,
    shuffle=True, seed=0, mode="finite", max_failures=5, lease_s=30.0,
)
MISSING = object()
BAD_SPEC_FIELDS: list[tuple[str, dict[str, Any]]] = [
    *[("job", {"job": v}) for v in ["", "a.b", "*", ">", "w0 ", "x" * 65, "x" * 1000, "é", 7, None, [JOB], MISSING]],
    *[("dataset", {"dataset": v}) for v in ["", "a.b", "*", ">", "x" * 65, "é", "节点", 7, [], MISSING]],
    *[("records", {"records": v}) for v in [0, -1, -(2**63), "100", 1.5, None, MISSING]],
    ("records", {"records": -1, "mode": "streaming"}),
    *[("batch_size", {"batch_size": v}) for v in [0, -1, -(2**63), 2.0, True, "10", MISSING]],
    *[("batches_per_shard", {"batches_per_shard": v}) for v in [0, -5, -(2**63), "x", 1.0]],
    *[("epochs", {"epochs": v}) for v in [0, -1, -(2**63), 1.0, "2"]],
    ("epochs", {"epochs": 2, "mode": "streaming"}),
    *[("shuffle", {"shuffle": v}) for v in [1, "yes", None]],
    *[("seed", {"seed": v}) for v in [1.5, "x", None, math.nan]],
    *[("mode", {"mode": v}) for v in ["bogus", "", "FINITE", 1, None]],
    *[("max_failures", {"max_failures": v}) for v in [0, -1, -(2**63), 2.5]],
    *[("lease_s", {"lease_s": v}) for v in [0.0, 0, -1.0, math.nan, math.inf, -math.inf, 86_400.5, 1e300, "30"]],
    # Valid-looking but hostile sizes: 2**62 one-record shards would take the service
    # forever to build; records * epochs beyond 64 bits cannot even be reported.
    ("records", {"records": 2**62, "batch_size": 1, "batches_per_shard": 1}),
    ("records", {"records": 2**63 - 1, "batch_size": 2, "batches_per_shard": 3}),
    ("epochs", {"records": 2**62, "batch_size": 2**40, "batches_per_shard": 2**20, "epochs": 2**62}),
]


@SETTINGS
@given(case=st.sampled_from(BAD_SPEC_FIELDS), job=st.sampled_from([JOB, NEW_JOB]), ints=st.integers(-(2**63), 0))
def test_dataset_specs_with_an_invalid_field_are_refused(
    h: Harness, case: tuple[str, dict[str, Any]], job: str, ints: int
) -> None:
    field_, overrides = case
    body = {**BASE_SPEC, "job": job, **overrides}
    if field_ in ("batch_size", "batches_per_shard", "max_failures") and overrides[field_] == 0:
        body[field_] = ints  # any value <= 0, drawn
    body = {k: v for k, v in body.items() if v is not MISSING}
    subject_job = job
    if field_ == "job":
        j = body.get("job")
        # The subject carries the (bad) job when it can; otherwise the body disagrees with the subject.
        subject_job = j if isinstance(j, str) and j and not any(c in j for c in ". \n") else job
    err = expect_error(h, rpc(subject_job, ShardOp.REGISTER), msgpack.packb(body, use_bin_type=True),
                       (DecodeError, ValidationError))
    assert field_ in err.message, f"the message should name {field_!r}: {err.message}"
    assert h.jobs() == h.jobs_before, "a refused registration left a job behind"


def test_conflicting_reregistration_is_refused(h: Harness) -> None:
    for change in ({"records": RECORDS + 1}, {"seed": 1}, {"lease_s": 30.0}, {"shuffle": False}):
        err = expect_error(h, rpc(JOB, ShardOp.REGISTER), encode(dataclasses.replace(SPEC, **change)), (Conflict,))
        assert DS in err.message
    assert h.status() == h.baseline


def test_hostile_appends_are_refused(h: Harness) -> None:
    admin = ShardAdmin(h.b)
    small = DatasetSpec(JOB, STREAM, 0, batch_size=10, batches_per_shard=10, mode=DatasetMode.STREAMING)
    big = dataclasses.replace(small, dataset=STREAM_BIG, batch_size=2**30, batches_per_shard=2**30)
    h.run(admin.register(small))
    h.run(admin.register(big))
    before = h.status(STREAM)
    cases: list[tuple[str, AppendRequest]] = [
        ("finite", AppendRequest(JOB, DS, 10)),
        ("records", AppendRequest(JOB, STREAM, -1)),
        ("records", AppendRequest(JOB, STREAM, -(2**63))),
        ("records", AppendRequest(JOB, STREAM, 2**62)),  # 2**62 / 100 shards: would stall the service
        ("dataset", AppendRequest(JOB, "nope", 10)),
    ]
    for word, req in cases:
        err = expect_error(h, rpc(JOB, ShardOp.APPEND), encode(req))
        assert word in err.message, err.message
    assert h.status(STREAM) == before
    # Appends of few (2**60-record) shards each, whose sum no longer fits a 64-bit integer:
    # the dataset's status could not even be encoded any more.
    h.run(admin.append(JOB, STREAM_BIG, 2**62))
    grown = h.status(STREAM_BIG)
    assert grown.records_total == 2**62
    err = expect_error(h, rpc(JOB, ShardOp.APPEND), encode(AppendRequest(JOB, STREAM_BIG, 2**64 - 1)))
    assert "records" in err.message
    assert h.status(STREAM_BIG) == grown
    assert h.status() == h.baseline


# ====================================================================== subjects
@SETTINGS
@given(op=SUBJECT_TOKENS.filter(lambda s: s not in ShardOp.ALL), job=st.one_of(st.just(JOB), SUBJECT_TOKENS))
def test_unknown_operations_are_refused(h: Harness, op: str, job: str) -> None:
    err = expect_error(h, rpc(job, op), encode(DatasetRef(JOB, DS)), (NotFound,))
    assert "unknown operation" in err.message and repr(op) in err.message


@SETTINGS
@given(op=OPS, job=st.one_of(SUBJECT_TOKENS, TOKENS).filter(lambda j: j != JOB))
def test_bad_or_unknown_job_tokens_are_refused(h: Harness, op: str, job: str) -> None:
    assume(op != ShardOp.REGISTER or not is_token(job))  # registering a valid new job is legitimate
    err = expect_error(h, rpc(job, op), valid_body(op, job), (NotFound, ValidationError))
    assert "job" in err.message, err.message
    if is_token(job):
        assert isinstance(err, NotFound) and "unknown job" in err.message
    # The body must name the subject's job: a request for JOB sent on another job's subject is refused.
    err = expect_error(h, rpc(job, op), valid_body(op, JOB), (ValidationError,))
    assert err.message.startswith("job:"), err.message
    assert h.jobs() == h.jobs_before


def test_subjects_with_extra_levels_never_reach_the_service(h: Harness) -> None:
    async def go(subject: str) -> type[Exception] | None:
        try:
            await h.b.nc.request(subject, encode(DatasetRef(JOB, DS)), timeout=2.0)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            return type(exc)
        return None

    before = h.counters()
    for subject in (f"pacer.rpc.shard.{JOB}.x.status", f"pacer.rpc.shard.{JOB}", "pacer.rpc.shard.a.b.c.d"):
        assert h.run(go(subject)) is nats.errors.NoRespondersError, subject
    after = h.counters()
    for name in ("requests", "errors", "internal_errors"):
        assert after.get(name, 0) == before.get(name, 0), name


@SETTINGS
@given(ckpt=st.one_of(BAD_IDS, st.sampled_from(["x" * 5000, "../snap." + JOB, "*.>"])), op=st.sampled_from(
    [ShardOp.CHECKPOINT, ShardOp.RESTORE]), dataset=st.sampled_from([DS, "nope"]))
def test_hostile_checkpoint_ids_are_refused(h: Harness, ckpt: str, op: str, dataset: str) -> None:
    err = expect_error(h, rpc(JOB, op), encode(CheckpointRequest(JOB, dataset, ckpt)), (ValidationError, NotFound))
    assert "checkpoint" in err.message or "dataset" in err.message, err.message
    assert h.status() == h.baseline


# ====================================================================== node events
def test_malformed_node_events_are_dead_lettered_and_terminated(h: Harness) -> None:
    died = subjects.event("node", JOB, "died")
    cases: list[tuple[str, bytes]] = [
        (died, b""),
        (died, b"\xc1"),
        (died, b"not msgpack at all"),
        (died, msgpack.packb([JOB, NODE, "died"])),
        (died, msgpack.packb({"job": JOB})),
        (died, msgpack.packb({"job": JOB, "node": 5, "kind": "died", "ts": 0.0})),
        (died, msgpack.packb({"job": JOB, "node": NODE, "kind": "died", "ts": "yesterday"})),
        # Well-formed, but published under another job's subject: it must not kill JOB's node.
        (subjects.event("node", "ghost", "died"), encode(NodeEvent(JOB, NODE, "died", 0.0, "spoofed"))),
    ]
    durable = h.service.cfg.node_events_durable

    async def go() -> tuple[list[Any], Any]:
        sub = await h.b.nc.subscribe(subjects.dead_letter("shard"))
        for subject, data in cases:
            await h.b.js.publish(subject, data, timeout=5.0)
        letters = [await sub.next_msg(timeout=10.0) for _ in cases]
        await sub.unsubscribe()
        info = None
        for _ in range(100):
            info = await h.b.js.consumer_info(subjects.EVENTS_STREAM, durable)
            if info.num_ack_pending == 0 and info.num_pending == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a nak'd or un-acked message would come back
        return letters, await h.b.js.consumer_info(subjects.EVENTS_STREAM, durable)

    before = h.counters()
    info0 = h.run(h.b.js.consumer_info(subjects.EVENTS_STREAM, durable))
    letters, info = h.run(go(), 60)
    for (subject, data), letter in zip(cases, letters, strict=True):
        assert letter.data == data
        assert letter.headers["Pacer-Subject"] == subject
        assert len(letter.headers["Pacer-Error"]) >= 8, letter.headers
    assert "job" in letters[-1].headers["Pacer-Error"]
    after = h.counters()
    assert after["bad_node_events"] == before.get("bad_node_events", 0) + len(cases)
    assert after.get("node_deaths", 0) == before.get("node_deaths", 0)
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0
    assert info.delivered.consumer_seq == info0.delivered.consumer_seq + len(cases), "redelivered"
    assert h.status() == h.baseline


def test_death_of_a_node_of_an_unknown_job_is_acked_and_ignored(h: Harness) -> None:
    durable = h.service.cfg.node_events_durable
    before = h.counters()
    info0 = h.run(h.b.js.consumer_info(subjects.EVENTS_STREAM, durable))

    async def go() -> Any:
        await h.b.publish_durable(subjects.event("node", "ghost", "died"), NodeEvent("ghost", NODE, "died", 0.0))
        for _ in range(100):
            info = await h.b.js.consumer_info(subjects.EVENTS_STREAM, durable)
            if info.delivered.consumer_seq > info0.delivered.consumer_seq and info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        return await h.b.js.consumer_info(subjects.EVENTS_STREAM, durable)

    info = h.run(go())
    assert info.delivered.consumer_seq == info0.delivered.consumer_seq + 1
    assert info.num_ack_pending == 0 and info.num_redelivered == 0
    after = h.counters()
    assert after.get("bad_node_events", 0) == before.get("bad_node_events", 0)
    assert after.get("node_deaths", 0) == before.get("node_deaths", 0)
    assert h.status() == h.baseline and h.jobs() == h.jobs_before


# ====================================================================== afterwards
def test_after_the_junk_state_is_intact_and_the_dataset_still_finishes(h: Harness) -> None:
    assert h.service_alive()
    assert h.status() == h.baseline, "junk changed the shard state"
    assert h.jobs() == h.jobs_before
    health = h.health()
    assert health.status == "ready"
    assert health.counters.get("internal_errors", 0) == 0
    assert health.counters.get("errors", 0) > 0
    # The honest worker comes back: its 5 kept shards are re-sent, the rest is granted.
    done, _ = h.run(consume(h.b, NODE), 60)
    assert {s.shard for s in done} >= set(h.held)
    ranges = sorted((s.start, s.end) for s in h.got_before + done)
    pos = 0
    for a, b in ranges:
        assert a == pos, f"gap or overlap at record {pos} (next range starts at {a})"
        pos = b
    assert pos == RECORDS
    st_ = h.status()
    assert st_.finished and st_.done == N_SHARDS and st_.records_done == RECORDS and st_.doing == 0
    assert h.health().status == "ready"
