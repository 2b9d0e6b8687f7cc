"""Worker-side shard client: prefetch, combined report-and-get, lease renewal.

Usage (async)::

    client = ShardClient(bus, job, dataset, node, prefetch=4)
    await client.start()
    while (shard := await client.next()) is not None:
        pos = shard.start
        while pos < client.end_of(shard):          # the end may move down: another node took the rest
            ...                                    # a batch of records [pos, hi), hi <= end_of(shard)
            client.progress(shard, hi - shard.offset)   # optional, cheap
            client.discarded(shard, lo, hi)        # that step's gradient was discarded: serve them again
        client.done(shard)
    await client.close()

Every request to the service carries the reports queued since the last one
and tops the prefetch window up, so a steady worker costs about one request
per ``prefetch / 2`` shards.  A heartbeat task renews the lease when the
worker is busy with one long shard.  Across a shard-service restart or a
lost reply, requests are retried; the service re-sends the shards it believes
this node holds but the client does not list (``held``), so a lost reply
loses nothing and a retried request grants nothing twice.

:class:`BlockingShardClient` offers the same API to threads (TensorFlow input
pipelines) by running the async client on a private event loop thread.

Records whose gradients were discarded (BSP with backup workers drops late
gradients as stale) are reported with ``discarded`` before the shard is
reported done; the service serves them again, to another node when one can
take them.

Near the end of a finite dataset the service may give the last part of a
shard this node holds to an idle node (work stealing); the reply says so
(``LeaseReply.shortened``) and :meth:`ShardClient.end_of` returns the new end
from then on.  A reader checks it before each batch, stops there and reports
the shard done as usual.  If it had already read past the new end, it reports
how far (``progress``, kept beside the ``done``): those records were trained
twice, which the service counts as duplicated.

Concurrency: ``ShardClient`` is used from one event loop; ``done``,
``progress`` and ``discarded`` only queue and never block.
:meth:`BlockingShardClient.end_of` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import nats.errors

from pacer import subjects
from pacer.bus import DEFAULT_RETRY, Bus, RetryPolicy
from pacer.bus import give_up_refused_s as bus_give_up_refused_s
from pacer.contracts.executor import EXIT_REFUSED
from pacer.contracts.shards import (
    REPORTS_PER_LEASE,
    AppendRequest,
    CheckpointReply,
    CheckpointRequest,
    DatasetRef,
    DatasetSpec,
    DatasetStatus,
    LeaseReply,
    LeaseRequest,
    ShardLease,
    ShardProgress,
    ShardRange,
)
from pacer.errors import PacerError
from pacer.subjects import ShardOp

log = logging.getLogger("pacer.shards.client")
T = TypeVar("T")

# The rate a client reports (LeaseRequest.rate) is measured over at least this long.
RATE_EVERY_S = 2.0
# Workers ride out a shard-service restart: retry for about a minute.
WORKER_RETRY = RetryPolicy(attempts=60, first_delay=0.05, max_delay=1.0)


class ShardAdmin:
    """Dataset-level operations (register, status, checkpoint, ...), for jobs and tools."""

    def __init__(self, bus: Bus, timeout: float = 5.0, retry: RetryPolicy = DEFAULT_RETRY) -> None:
        self.bus = bus
        self.timeout = timeout
        self.retry = retry

    async def _call(self, job: str, op: str, msg: Any, reply: type[T]) -> T:
        return await self.bus.request(subjects.rpc(subjects.SHARD_SERVICE, job, op), msg, reply, self.timeout, self.retry)

    async def register(self, spec: DatasetSpec) -> DatasetStatus:
        return await self._call(spec.job, ShardOp.REGISTER, spec, DatasetStatus)

    async def status(self, job: str, dataset: str) -> DatasetStatus:
        return await self._call(job, ShardOp.STATUS, DatasetRef(job, dataset), DatasetStatus)

    async def checkpoint(self, job: str, dataset: str, checkpoint: str) -> CheckpointReply:
        return await self._call(job, ShardOp.CHECKPOINT, CheckpointRequest(job, dataset, checkpoint), CheckpointReply)

    async def restore(self, job: str, dataset: str, checkpoint: str) -> DatasetStatus:
        return await self._call(job, ShardOp.RESTORE, CheckpointRequest(job, dataset, checkpoint), DatasetStatus)

    async def append(self, job: str, dataset: str, records: int, close: bool = False) -> DatasetStatus:
        return await self._call(job, ShardOp.APPEND, AppendRequest(job, dataset, records, close), DatasetStatus)

    async def retry_failed(self, job: str, dataset: str) -> DatasetStatus:
        return await self._call(job, ShardOp.RETRY_FAILED, DatasetRef(job, dataset), DatasetStatus)


class ShardClient:
    """One worker's view of one dataset."""

    def __init__(
        self,
        bus: Bus,
        job: str,
        dataset: str,
        node: str,
        prefetch: int = 4,
        max_records: int = 0,
        timeout: float = 2.0,
        retry: RetryPolicy = WORKER_RETRY,
        poll_s: float = 0.2,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not 1 <= prefetch <= 64:
            raise ValueError("prefetch must be in [1, 64]")
        self.bus = bus
        self.job, self.dataset, self.node = job, dataset, node
        self.prefetch = prefetch
        self.max_records = max_records  # the controller may shrink it for a straggler
        self.timeout = timeout
        self.retry = retry
        self.poll_s = poll_s
        self.clock = clock or time.monotonic  # what the rate is measured against (tests inject their own)
        self._subject = subjects.rpc(subjects.SHARD_SERVICE, job, ShardOp.LEASE)
        self._ready: deque[ShardLease] = deque()  # granted, not yet handed out
        self._held: dict[int, ShardLease] = {}  # granted and not reported done
        self._done: list[int] = []
        self._failed: list[int] = []
        self._progress: dict[int, int] = {}
        self._discarded: list[ShardRange] = []
        self._lock = asyncio.Lock()
        self._lease_s = 30.0
        self._lease_known = False  # _lease_s came from a reply
        self._since_sync = 0.0
        self._hb: asyncio.Task[None] | None = None
        self._bg: asyncio.Task[None] | None = None
        self.finished = False
        self.requests = 0
        self.rejected = 0
        self.records_discarded = 0  # records reported with ``discarded``
        self.records_stolen = 0  # records cut off the end of held shards for other nodes (work stealing)
        self.rate = 0.0  # records/s trained, as last measured (0: not yet)
        self._trained = 0  # records trained so far (``trained``)
        self._rate_mark: tuple[float, int] | None = None  # (when, _trained) the rate is measured from
        # Optional per-request timings (seconds, shards reported, shards granted),
        # filled only when a caller sets it to a list (benchmarks).
        self.timings: list[tuple[float, int, int]] | None = None

    async def start(self) -> None:
        self._hb = asyncio.create_task(self._heartbeat(), name=f"pacer:shard-client:hb:{self.node}")

    async def close(self, release: bool = True) -> None:
        """Flush reports; hand back unread shards (``release``) so others get them now."""
        for t in (self._hb, self._bg):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        self._hb = self._bg = None
        released = [s.shard for s in self._ready] if release else []
        if self._done or self._progress or self._failed or self._discarded or released:
            with contextlib.suppress(PacerError):
                await self._sync(0, released=released)
        self._ready.clear()

    # ------------------------------------------------------------ the worker API
    async def next(self, wait: bool = True) -> ShardLease | None:
        """The next shard to read, or None once the dataset is finished.

        With ``wait=False`` it also returns None when no shard can be had right
        now (others hold the rest); ``finished`` tells the two apart.  A BSP
        worker uses it to keep taking part in steps instead of blocking them.
        """
        while True:
            if self._ready:
                shard = self._ready.popleft()
                if len(self._ready) <= self.prefetch // 2 and not self.finished:
                    self._kick()
                return shard
            if self.finished:
                return None
            if self._bg is not None and not self._bg.done():
                await asyncio.shield(self._bg)
                continue
            reply = await self._sync(self._want())
            if not reply.shards and not reply.finished:
                if not wait:
                    return None
                await asyncio.sleep(self.poll_s)  # others hold the rest, or a stream awaits data

    def put_back(self, shard: ShardLease) -> None:
        """Return a shard taken by :meth:`next` but not read: the next ``next`` gives it again, and
        ``close(release=True)`` hands it back to the service."""
        self._ready.appendleft(shard)

    def report_soon(self) -> None:
        """Send what was reported (done, progress, ...) in the background now, not at the next heartbeat:
        what ``next`` does when it takes a shard, for a reader that took its next shard earlier."""
        self._kick()

    async def flush(self) -> None:
        """Send what was reported and wait for the service's answer (before a shard checkpoint)."""
        if self._bg is not None and not self._bg.done():
            await asyncio.shield(self._bg)
        await self._sync(0)

    def end_of(self, shard: ShardLease) -> int:
        """One past the last record of ``shard`` to read now: ``shard.end``, or less once the service
        gave the rest of it to another node (``LeaseReply.shortened``, work stealing)."""
        held = self._held.get(shard.shard)
        return shard.end if held is None else min(shard.end, held.end)

    def done(self, shard: ShardLease) -> None:
        held = self._held.pop(shard.shard, None)
        read = self._progress.pop(shard.shard, None)
        if held is not None and read is not None and read > held.end - held.offset:
            # Read past the end its shard was cut to before it learnt of the cut: the service counts
            # those records as trained twice when this progress comes beside the done.
            self._progress[shard.shard] = read
        self._done.append(shard.shard)

    def progress(self, shard: ShardLease, consumed: int) -> None:
        """Records of ``shard`` consumed so far, counted from ``shard.offset``."""
        self._progress[shard.shard] = consumed

    def discarded(self, shard: ShardLease, start: int, end: int) -> None:
        """Records [start, end) of ``shard`` (counted from ``shard.offset``, like ``progress``) were
        consumed but the gradient they were trained with was discarded: the service serves them again.

        Call it before ``done(shard)`` (a range reported after the shard is done is refused) and in
        the order the records were consumed.  The request that carries it also reports progress up
        to ``end`` at least: the service accepts only ranges within what the node reported consumed.
        """
        if end <= start:
            return
        last = self._discarded[-1] if self._discarded else None
        if last is not None and last.shard == shard.shard and last.end == start:
            self._discarded[-1] = ShardRange(shard.shard, last.start, end)  # one piece, not one per batch
        else:
            self._discarded.append(ShardRange(shard.shard, start, end))
        self.records_discarded += end - start

    def trained(self, records: int) -> None:
        """A step trained ``records`` records: the rate this node reports with its requests, which
        sizes its pieces near the end of the data (``DatasetSpec.tail_split``)."""
        self._trained += records

    def _measure_rate(self) -> float:
        """Records/s since the last measurement at least :data:`RATE_EVERY_S` ago, averaged with the
        one before (an idle node's rate decays towards 0, i.e. "not known", the mean)."""
        now = self.clock()
        if self._rate_mark is None:
            self._rate_mark = (now, self._trained)
        elif now - self._rate_mark[0] >= RATE_EVERY_S:
            at, n = self._rate_mark
            now_rate = (self._trained - n) / (now - at)
            self.rate = now_rate if not self.rate else (self.rate + now_rate) / 2
            self._rate_mark = (now, self._trained)
        return self.rate

    def failed(self, shard: ShardLease) -> None:
        """The shard could not be read: it goes back (and counts one failure)."""
        self._held.pop(shard.shard, None)
        self._progress.pop(shard.shard, None)
        self._failed.append(shard.shard)

    # ------------------------------------------------------------ internals
    def _want(self) -> int:
        return max(0, self.prefetch - len(self._held))

    def _kick(self) -> None:
        if self._bg is None or self._bg.done():
            self._bg = asyncio.create_task(self._sync_quietly(), name=f"pacer:shard-client:sync:{self.node}")

    async def _sync_quietly(self) -> None:
        try:
            await self._sync(self._want())
        except PacerError as exc:
            log.warning("shard prefetch failed: %s", exc)

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # The service counts on a request every lease_s / REPORTS_PER_LEASE (it sizes the margin
            # a holder keeps when its shard is cut by it): sleep until the next one is due.  Until
            # the first reply the lease is not known and may be much shorter than the 30 s assumed
            # (a sleep begun with that would outlive a 1 s lease): wake every 0.25 s until then.
            # (Waking every 0.25 s for good was 40,000 wake-ups a second in 10,000 pods' readers.)
            every = self._lease_s / REPORTS_PER_LEASE
            due = self._since_sync + every - loop.time()
            retry = min(max(every, 0.05), 0.25)  # not known yet, or overdue (the last one failed)
            await asyncio.sleep(due if self._lease_known and due > 0 else retry)
            if loop.time() - self._since_sync >= every:
                try:
                    await self._sync(0)
                except PacerError as exc:
                    log.warning("shard heartbeat failed: %s", exc)

    async def _sync(self, want: int, released: list[int] | None = None) -> LeaseReply:
        async with self._lock:
            done, failed, discarded = self._done, self._failed, self._discarded
            for d in discarded:  # a discarded range lies within the progress sent with it
                if d.shard in self._held and self._progress.get(d.shard, 0) < d.end:
                    self._progress[d.shard] = d.end
            progress = [ShardProgress(k, v) for k, v in self._progress.items()]
            self._done, self._failed, self._discarded = [], [], []
            sent_progress = dict(self._progress)
            req = LeaseRequest(
                job=self.job,
                dataset=self.dataset,
                node=self.node,
                want=0 if self.finished else want,
                held=sorted(self._held),
                done=done,
                progress=progress,
                failed=failed,
                released=released or [],
                max_records=self.max_records,
                rate=self._measure_rate(),
                discarded=discarded,
            )
            t0 = time.perf_counter()
            try:
                reply = await self.bus.request(self._subject, req, LeaseReply, self.timeout, self.retry)
            except BaseException:
                # Not sent for sure: report again next time (a duplicate is rejected harmlessly).
                self._done, self._failed = done + self._done, failed + self._failed
                self._discarded = discarded + self._discarded
                raise
            self.requests += 1
            self._since_sync = asyncio.get_running_loop().time()
            if self.timings is not None:
                self.timings.append((time.perf_counter() - t0, len(done), len(reply.shards)))
            for k, v in sent_progress.items():
                if self._progress.get(k) == v:
                    del self._progress[k]
            for sid in released or ():
                self._held.pop(sid, None)
            self._lease_s = reply.lease_s
            self._lease_known = True
            for r in reply.rejected:
                # A retried report that did land shows up as not_doing:done (or, for a discarded
                # range, discard_repeated): not a problem.
                if r.reason not in ("not_doing:done", "discard_repeated"):
                    self.rejected += 1
                    log.warning("shard report rejected", extra={"fields": {"shard": r.shard, "reason": r.reason}})
            for s in reply.shards:
                if s.shard not in self._held:
                    self._held[s.shard] = s
                    self._ready.append(s)
            if reply.shortened:
                self._shorten(reply.shortened)
            self.finished = reply.finished
            return reply

    def _shorten(self, leases: list[ShardLease]) -> None:
        """Apply ``LeaseReply.shortened``: the shards end earlier (idempotent: every reply repeats it)."""
        for s in leases:
            held = self._held.get(s.shard)
            if held is None or s.end >= held.end:
                continue  # reported done meanwhile, or known already
            self.records_stolen += held.end - s.end
            new = replace(held, end=s.end)
            self._held[s.shard] = new  # end_of() sees it from now on
            # Not handed out yet: hand it out with its new end.
            self._ready = deque(new if r.shard == s.shard else r for r in self._ready)


def exit_refused() -> None:
    """A pod's trainer whose bus credentials were refused for good exits with EXIT_REFUSED, and its pod
    with it (the executor relaunches the node with a fresh token while the job runs)."""
    log.error("the bus refused this pod's credentials for good: exiting with %d", EXIT_REFUSED)
    logging.shutdown()
    os._exit(EXIT_REFUSED)  # from the client's thread: TensorFlow's would wait for shards for ever


class BlockingShardClient:
    """The :class:`ShardClient` API for threads: a private loop runs the async client.

    Its bus gives up once it has refused the pod's credentials for ``give_up_refused_s`` (default
    :func:`pacer.bus.give_up_refused_s`; 0: never) and calls ``on_refused``, which by default ends the
    process with EXIT_REFUSED: a trainer whose job was torn down or whose token expired would otherwise
    wait for the bus for ever, on Kubernetes too, where no pod supervisor stops it.
    """

    def __init__(self, nats_url: str, job: str, dataset: str, node: str, *, give_up_refused_s: float | None = None,
                 on_refused: Callable[[], None] = exit_refused, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"pacer-shards-{node}", daemon=True)
        self._thread.start()
        give_up = bus_give_up_refused_s() if give_up_refused_s is None else give_up_refused_s

        async def make() -> tuple[Bus, ShardClient]:
            try:
                bus = await Bus.connect(nats_url, name=f"shard-client-{node}", give_up_refused_s=give_up,
                                        on_give_up=on_refused)
            except nats.errors.AuthorizationError:  # refused for give_up s before it ever connected
                on_refused()
                raise
            client = ShardClient(bus, job, dataset, node, **kwargs)
            await client.start()
            return bus, client

        self._bus, self._client = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def next(self, wait: bool = True) -> ShardLease | None:
        return self._run(self._client.next(wait))

    def done(self, shard: ShardLease) -> None:
        self._loop.call_soon_threadsafe(self._client.done, shard)

    def put_back(self, shard: ShardLease) -> None:
        self._run(self._put_back(shard))

    def report_soon(self) -> None:
        self._loop.call_soon_threadsafe(self._client.report_soon)

    def flush(self) -> None:
        self._run(self._client.flush())

    async def _put_back(self, shard: ShardLease) -> None:
        self._client.put_back(shard)

    def progress(self, shard: ShardLease, consumed: int) -> None:
        self._loop.call_soon_threadsafe(self._client.progress, shard, consumed)

    def failed(self, shard: ShardLease) -> None:
        self._loop.call_soon_threadsafe(self._client.failed, shard)

    def discarded(self, shard: ShardLease, start: int, end: int) -> None:
        self._loop.call_soon_threadsafe(self._client.discarded, shard, start, end)

    def trained(self, records: int) -> None:
        self._loop.call_soon_threadsafe(self._client.trained, records)

    def end_of(self, shard: ShardLease) -> int:
        # Read without a trip through the loop (a reader calls it before every batch): one dict lookup
        # of an immutable lease, which the loop thread replaces whole.
        return self._client.end_of(shard)

    @property
    def finished(self) -> bool:
        return self._client.finished

    @property
    def records_stolen(self) -> int:
        return self._client.records_stolen

    def close(self, release: bool = True) -> None:
        async def shut() -> None:
            await self._client.close(release)
            await self._bus.close()

        try:
            self._run(shut())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
