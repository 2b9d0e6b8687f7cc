"""What the hostile-input tests of the shard service share: the harness, the seeded dataset, the checks.

Hostile and malformed input never crashes the shard service.  Every junk
request gets a clear error reply (an ``ErrorEnvelope`` that
:func:`decode_reply` turns into a :class:`PacerError` naming what is wrong),
is counted in ``errors``, and leaves the shard state alone; a valid-looking
request with hostile contents is answered with per-shard rejections and
changes nothing either.  Malformed node-death events are dead-lettered and
terminated, not redelivered.  (The tests: tests/integration/test_shard_hostile_*.py.)

Hypothesis drives sync test functions; each example submits coroutines to an
event loop running in a background thread, on which one real ``nats-server``
and one ``ShardService`` live for the whole module (the fixture ``h``: each
test file has its own).  Before the fuzzing a worker consumes part of a
dataset (and keeps a few shards); the last test of
test_shard_hostile_request_contents.py checks that the junk changed nothing
and that the dataset still finishes with every record covered exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import nats.errors
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from pacer import subjects
from pacer.bus import NO_RETRY, Bus
from pacer.codec import decode, encode
from pacer.contracts.common import Health, decode_reply
from pacer.contracts.shards import (
    AppendRequest,
    CheckpointRequest,
    DatasetRef,
    DatasetSpec,
    DatasetStatus,
    LeaseReply,
    LeaseRequest,
    ShardLease,
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
EDGE_INTS = st.sampled_from([0, 1, -1, MAX_WANT, MAX_WANT + 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1])

TOKENS = st.from_regex(r"\A[A-Za-z0-9_-]{1,64}\Z")
BAD_IDS = st.one_of(
    st.sampled_from(["", ".", "*", ">", "a.b", "w0.>", "w0.*", "w0 ", "x" * 65, "x" * 1000, "é", "节点", "w0\n"]),
    st.text(max_size=80).filter(lambda s: not is_token(s)),
)
OPS = st.sampled_from(ShardOp.ALL)
