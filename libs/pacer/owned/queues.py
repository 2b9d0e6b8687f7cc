"""A job's work in order, different jobs in parallel: the one home of per-job serialisation.

Every service that owns jobs changes a job's state from several inputs
(requests, events, timers).  None of them may use a lock shared by every
job: one job waiting on a slow backend call, a 5-10 s bus request or a
multi-second NSGA-II step would hold up every other job.  Two shapes, one
contract:

:class:`JobQueues` — one worker task per job (kopf's
``_core/reactor/queueing.py`` style), for work a caller may *post* and not
wait for (the executor's plans, pod events and commands; the shard
service's requests):

* work submitted under a job runs one item after the other, in submission
  order, so a job's state is only ever changed by one coroutine at a time;
  workers of different jobs run concurrently, and each yields to the loop
  between two items, so a job flooding the service shares the loop;
* a worker with nothing to do for ``idle_s`` ends (at once with
  ``idle_s=0``); the next submission starts a new one (checking and
  forgetting the queue happen with no await between them, so no submission
  is lost);
* with ``max_queued``, a job's queue is bounded: :meth:`post` refuses (False)
  and the caller answers "retry later" instead of queueing without bound;
* an exception of posted work (fire-and-forget) is logged and counted
  (``errors`` by code for a :class:`PacerError`, else ``internal_errors``)
  at this loop boundary and never ends the worker; :meth:`run` hands it
  back to the caller instead.

:class:`JobLocks` — the in-line form, for a caller that must wait anyway
(an RPC reply, a stream event acknowledged after its change):

* ``async with locks.hold(job)`` serialises a job's critical sections in
  arrival order (``asyncio.Lock`` wakes its waiters first come, first
  served); other jobs' go on;
* ``hold(*jobs)`` takes several jobs' locks in sorted order, so two callers
  that need overlapping sets never deadlock (a cluster-wide round holds
  only the jobs it steps);
* a job's lock is forgotten when nobody holds or waits for it, so a
  long-lived service does not keep one per job it ever saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from pacer.errors import PacerError
from pacer.telemetry import Counters

log = logging.getLogger("pacer.owned.queues")
T = TypeVar("T")
Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]
_Item = tuple[Callable[[], Awaitable[Any]], "asyncio.Future[Any] | None", str]


class QueueFull(Exception):
    """:meth:`JobQueues.run` on a job whose bounded queue is full."""


class JobQueues:
    def __init__(self, spawn: Spawn, counters: Counters, *, name: str, idle_s: float = 30.0,
                 max_queued: int | None = None) -> None:
        self._spawn = spawn
        self._counters = counters
        self._name = name  # of the worker tasks: pacer:<name>:job:<job>
        self._idle_s = idle_s
        self.max_queued = max_queued
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._unfinished = 0  # submitted and not done yet, over every job

    def post(self, job: str, work: Callable[[], Awaitable[Any]], what: str = "work") -> bool:
        """Queue ``work`` on ``job``'s worker; its errors are logged, not returned.  False (nothing
        queued) when the job's queue is full."""
        try:
            self._queue(job).put_nowait((work, None, what))
        except asyncio.QueueFull:
            return False
        self._unfinished += 1
        return True

    async def run(self, job: str, work: Callable[[], Awaitable[T]], what: str = "work") -> T:
        """Queue ``work`` on ``job``'s worker and wait for its result (or its exception)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            self._queue(job).put_nowait((work, fut, what))
        except asyncio.QueueFull:
            raise QueueFull(job) from None
        self._unfinished += 1
        result: T = await fut
        return result

    def pending(self, job: str | None = None) -> int:
        """Items queued and not started, of ``job``; with no job, items queued or running over every job."""
        if job is None:
            return self._unfinished
        q = self._queues.get(job)
        return q.qsize() if q is not None else 0

    def busy(self, job: str) -> bool:
        """Whether ``job`` has a worker: work queued or running, or done less than ``idle_s`` ago."""
        return job in self._queues

    async def join(self, timeout: float) -> bool:
        """Wait until every queue is empty and no work runs; False when ``timeout`` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._unfinished:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def _queue(self, job: str) -> asyncio.Queue[_Item]:
        q = self._queues.get(job)
        if q is None:
            q = self._queues[job] = asyncio.Queue(self.max_queued or 0)
            self._spawn(self._worker(job, q), f"pacer:{self._name}:job:{job}")
        return q

    async def _next(self, q: asyncio.Queue[_Item]) -> _Item | None:
        """The next item, or None when the worker has been idle for ``idle_s``."""
        if self._idle_s <= 0:
            return q.get_nowait() if not q.empty() else None
        try:
            async with asyncio.timeout(self._idle_s):  # a cancelled get leaves its item in the queue
                return await q.get()
        except TimeoutError:
            return None

    async def _worker(self, job: str, q: asyncio.Queue[_Item]) -> None:
        while True:
            item = await self._next(q)
            if item is None:
                if q.empty():  # no await between this check and forgetting the queue
                    if self._queues.get(job) is q:
                        del self._queues[job]
                    return
                continue
            work, fut, what = item
            try:
                result = await work()
            except asyncio.CancelledError:
                if fut is not None and not fut.done():
                    fut.cancel()
                raise
            except Exception as exc:  # loop boundary of one job's work
                if fut is not None:
                    if not fut.done():
                        fut.set_exception(exc)
                elif isinstance(exc, PacerError):
                    self._counters.inc("errors", code=exc.code, op=what)
                    log.warning("%s of job %s: %s", what, job, exc.message)
                else:
                    self._counters.inc("internal_errors", op=what)
                    log.exception("%s of job %s failed", what, job)
            else:
                if fut is not None and not fut.done():
                    fut.set_result(result)
            finally:
                self._unfinished -= 1
            await asyncio.sleep(0)  # let the other jobs' workers (and the loop's IO) run


class JobLocks:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # job -> (its lock, holders and waiters)

    @contextlib.asynccontextmanager
    async def hold(self, *jobs: str) -> AsyncIterator[None]:
        """Hold the locks of ``jobs`` (taken in sorted order: no deadlock between overlapping sets)."""
        names = sorted(set(jobs))
        locks = [self._use(job) for job in names]
        taken: list[asyncio.Lock] = []
        try:
            for lock in locks:
                await lock.acquire()
                taken.append(lock)
            yield
        finally:
            for lock in reversed(taken):
                lock.release()
            for job in names:
                self._unuse(job)

    def held(self, job: str) -> bool:
        entry = self._locks.get(job)
        return entry is not None and entry[0].locked()

    async def idle(self) -> None:
        """Wait until no job's lock is held or waited for (every change in flight has ended)."""
        while self._locks:
            job = next(iter(self._locks))
            async with self.hold(job):
                pass

    def __len__(self) -> int:
        return len(self._locks)

    def _use(self, job: str) -> asyncio.Lock:
        lock, n = self._locks.get(job) or (asyncio.Lock(), 0)
        self._locks[job] = (lock, n + 1)
        return lock

    def _unuse(self, job: str) -> None:
        lock, n = self._locks[job]
        if n <= 1:
            del self._locks[job]
        else:
            self._locks[job] = (lock, n - 1)
