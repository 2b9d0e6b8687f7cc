"""The brain's IO: its KV buckets, the job service's records, publishing plans and decisions.

* ``pacer-brain-history`` (the config DB, one JSON :class:`~.core.history.JobHistory`
  per finished job) and ``pacer-brain-jobs`` (one
  :class:`~pacer.contracts.brain.RunningJob` per running job) are the
  brain's own; every write is a compare-and-set (:meth:`Bus.kv_update`):
  the current revision is read, the change applied to what was read, and a
  write that lost (another brain instance wrote the key meanwhile: every
  instance folds every event) is re-read and re-applied.  Nothing is written with a blind put.
* The job service's ``pacer-jobs`` KV is read for a job's spec and state
  (never for its plan: the plan in force comes from the executor's events).
  The executor's KV is never read.
* Plans and decisions are durable publishes (JetStream acks them), with a
  message id the job's next owner would use for the same decision
  (:mod:`.state`), so a decision is stored once across a hand-over.

No method holds a lock: the service calls them outside the job's autoscaler
lock (:class:`pacer.owned.queues.JobLocks`), so a slow server never stalls a
job's decisions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import nats.js.errors
from nats.js.kv import KeyValue
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode, encode
from pacer.contracts.brain import BrainDecision, RunningJob
from pacer.contracts.jobs import JobRecord, ResourcePlan
from pacer.errors import StaleRevision

from .core.history import JobHistory

log = logging.getLogger("pacer.brain")

CAS_ATTEMPTS = 5  # a compare-and-set that keeps losing: another writer is busy with the key; give up loudly


class BrainStore:
    """The brain's KV buckets and the job service's records."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._history: KeyValue | None = None
        self._running: KeyValue | None = None
        self._jobs: KeyValue | None = None

    async def open(self) -> None:
        self._history = await self.bus.kv(subjects.BRAIN_BUCKET, "Pacer brain: the config DB of finished jobs")
        self._running = await self.bus.kv(subjects.BRAIN_JOBS_BUCKET,
                                          "Pacer brain: what the executor runs for each job, from its events")
        self._jobs = await self.bus.kv(subjects.JOB_BUCKET, "Pacer jobs: one JobRecord per job")

    # ------------------------------------------------------------ the config DB
    async def history(self) -> dict[str, bytes]:
        """Every record of the config DB (JSON), by job."""
        return await self.bus.kv_items(subjects.BRAIN_BUCKET)

    async def record(self, h: JobHistory) -> None:
        """Write a finished job's record: created, or (a job end delivered again) updated at its revision."""
        assert self._history is not None
        value = json.dumps(h.to_dict()).encode()
        await _compare_and_set(self._history, h.job, lambda _old: value)

    async def recorded_at(self, job: str) -> float | None:
        """When the config DB's record of ``job`` says it finished (None: no readable record)."""
        assert self._history is not None
        try:
            entry = await self._history.get(job)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        try:
            return JobHistory.from_dict(json.loads(entry.value or b"")).finished_at
        except (ValueError, KeyError, TypeError):
            return None

    # ------------------------------------------------------------ running jobs
    async def running(self) -> dict[str, RunningJob]:
        """Every running job's record, by job."""
        return {job: decode(RunningJob, value) for job, value in
                (await self.bus.kv_items(subjects.BRAIN_JOBS_BUCKET)).items()}

    async def running_of(self, job: str) -> RunningJob | None:
        """One job's record (what another instance folded meanwhile, too)."""
        assert self._running is not None
        return await Bus.kv_get(self._running, job, RunningJob)

    async def update_running(self, job: str, fold: Callable[[RunningJob | None], RunningJob | None]
                             ) -> tuple[RunningJob | None, bool]:
        """Apply ``fold`` to the stored record of ``job`` and store the result (compare-and-set).

        ``fold`` returns None for "no change" (nothing is written).  Returns
        the record as stored afterwards (None: there is none) and whether
        ``fold`` changed it.
        """
        assert self._running is not None
        out: list[RunningJob | None] = [None]
        changed = [False]

        def change(old: bytes | None) -> bytes | None:
            rec = decode(RunningJob, old) if old else None
            new = fold(rec)
            out[0], changed[0] = (new, True) if new is not None else (rec, False)
            return encode(new) if new is not None else None

        await _compare_and_set(self._running, job, change)
        return out[0], changed[0]

    async def drop_running(self, job: str) -> None:
        """Delete a job's record (it ended) at the revision read."""
        assert self._running is not None
        for _ in range(CAS_ATTEMPTS):
            try:
                entry = await self._running.get(job)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                return
            try:
                await self._running.delete(job, last=entry.revision)
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
        raise StaleRevision(f"{job}: its running record kept changing while it was deleted")

    # ------------------------------------------------------------ the job service's records
    async def job(self, job: str) -> JobRecord | None:
        """The job service's record of ``job`` (its spec and state)."""
        assert self._jobs is not None
        return await Bus.kv_get(self._jobs, job, JobRecord)

    # ------------------------------------------------------------ events
    async def publish_plan(self, plan: ResourcePlan, msg_id: str = "") -> None:
        """``msg_id``: the same plan published again (by the job's next owner) is stored once."""
        await self.bus.publish_durable(subjects.job_event(plan.job, subjects.JobEventKind.PLAN), plan, msg_id=msg_id)

    async def publish_decision(self, decision: BrainDecision, msg_id: str = "") -> None:
        await self.bus.publish_durable(subjects.brain_decision(decision.job), decision, msg_id=msg_id)


async def _compare_and_set(kv: KeyValue, key: str, change: Callable[[bytes | None], bytes | None]) -> None:
    """Read ``key``, write ``change(value)`` at the revision read (None: write nothing); retry a lost write."""
    for _ in range(CAS_ATTEMPTS):
        old: bytes | None
        rev: int | None
        try:
            entry = await kv.get(key)
            old, rev = (entry.value or None), entry.revision
        except nats.js.errors.KeyDeletedError as exc:  # a tombstone: written at its revision
            old, rev = None, exc.entry.revision if exc.entry is not None else None
        except nats.js.errors.KeyNotFoundError:
            old, rev = None, None
        new = change(old)
        if new is None:
            return
        try:
            await Bus.kv_update(kv, key, new, rev)
            return
        except StaleRevision:
            log.info("KV write lost to another writer; re-reading", extra={"fields": {"key": key}})
    raise StaleRevision(f"{key}: kept changing while it was written ({CAS_ATTEMPTS} attempts)")
