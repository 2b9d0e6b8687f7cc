"""Per-job inboxes of the shard service: a job's requests in order, different jobs in parallel.

Concurrency contract (kopf ``_core/reactor/queueing.py`` style, as the
executor's ``JobQueues``):

* the subscription callback only parses the subject and appends the work to
  its job's inbox, so it never waits: one job's request that waits on IO
  (finding the job's owner, reading a checkpoint) holds up that job only;
* one worker task per job with queued work runs it one item after the
  other, in arrival order, and yields to the loop between two items, so a
  job flooding the service shares the loop with the others;
* a worker whose inbox is empty ends; the next request starts a new one
  (checking for more and forgetting the inbox happen with no await between
  them, so nothing queued is lost);
* an inbox holds at most ``max_queued`` items: beyond that ``put`` refuses
  and the caller answers "retry later", instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger("pacer.shard.queue")

Work = Callable[[], Awaitable[None]]
Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


class JobInboxes:
    def __init__(self, spawn: Spawn, max_queued: int) -> None:
        self._spawn = spawn
        self.max_queued = max_queued
        self._inboxes: dict[str, collections.deque[Work]] = {}

    def put(self, job: str, work: Work) -> bool:
        """Queue ``work`` behind ``job``'s earlier requests; False (nothing queued) when its inbox is full."""
        q = self._inboxes.get(job)
        if q is None:
            q = self._inboxes[job] = collections.deque()
            self._spawn(self._worker(job, q), f"pacer:shard:inbox:{job}")
        elif len(q) >= self.max_queued:
            return False
        q.append(work)
        return True

    def pending(self) -> int:
        """Items queued or running, over every job."""
        return sum(len(q) for q in self._inboxes.values()) + len(self._inboxes)

    async def _worker(self, job: str, q: collections.deque[Work]) -> None:
        try:
            while q:
                work = q.popleft()
                try:
                    await work()
                except asyncio.CancelledError:
                    raise
                except Exception:  # the work answers its own errors; this is only the last guard
                    log.exception("request of job %s failed", job)
                await asyncio.sleep(0)  # let the other jobs' workers (and the loop's IO) run
        finally:
            if self._inboxes.get(job) is q:
                del self._inboxes[job]
