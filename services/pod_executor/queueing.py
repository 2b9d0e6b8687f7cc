"""One sequential worker per job: work of one job runs in order, different jobs in parallel.

Concurrency contract (kopf ``_core/reactor/queueing.py`` style):

* every piece of work on a job (a plan, a lifecycle event, a node command, a
  pod status change, a reconcile pass) is a coroutine function submitted
  under the job's name; one worker task per job runs them one after the
  other, in submission order, so a job's record is only ever changed by one
  coroutine at a time and no lock is needed around it;
* workers of different jobs run concurrently: a job whose backend call or
  bus request waits (5-10 s timeouts) holds up nobody else;
* there is no lock shared across jobs;
* a worker with nothing to do for ``idle_s`` ends; the next submission
  starts a new one (checking and forgetting the queue happen with no await
  between them, so no submission is lost);
* an exception of posted work (fire-and-forget) is logged and counted at
  this loop boundary and never ends the worker; ``run`` hands it back to the
  caller instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from pacer.errors import PacerError
from pacer.telemetry import Counters

log = logging.getLogger("pacer.executor.queue")
T = TypeVar("T")
Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]
_Item = tuple[Callable[[], Awaitable[Any]], "asyncio.Future[Any] | None", str]


class JobQueues:
    def __init__(self, spawn: Spawn, counters: Counters, idle_s: float = 30.0) -> None:
        self._spawn = spawn
        self._counters = counters
        self._idle_s = idle_s
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._unfinished = 0  # submitted and not done yet, over every job

    def post(self, job: str, work: Callable[[], Awaitable[Any]], what: str = "work") -> None:
        """Queue ``work`` on ``job``'s worker; its errors are logged, not returned."""
        self._queue(job).put_nowait((work, None, what))
        self._unfinished += 1

    async def run(self, job: str, work: Callable[[], Awaitable[T]], what: str = "work") -> T:
        """Queue ``work`` on ``job``'s worker and wait for its result (or its exception)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue(job).put_nowait((work, fut, what))
        self._unfinished += 1
        result: T = await fut
        return result

    def pending(self, job: str) -> int:
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
            q = self._queues[job] = asyncio.Queue()
            self._spawn(self._worker(job, q), f"pacer:executor:job:{job}")
        return q

    async def _worker(self, job: str, q: asyncio.Queue[_Item]) -> None:
        while True:
            try:
                async with asyncio.timeout(self._idle_s):  # a cancelled get leaves its item in the queue
                    work, fut, what = await q.get()
            except TimeoutError:
                if q.empty():  # no await between this check and forgetting the queue
                    self._queues.pop(job, None)
                    return
                continue
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
