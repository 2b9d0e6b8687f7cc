"""The job service: submissions, the lifecycle of every job, and its first plan.

Requests (``pacer.rpc.jobs.<job>.<op>``): ``submit`` (a YAML/JSON spec ->
JobRecord, or an ``invalid`` error naming every bad field), ``get``,
``list`` (on ``pacer.rpc.jobs._all.list``), ``stop``.

A submission is validated (:func:`pacer.jobs.spec.parse_job_spec`, in a
thread: a spec is up to 256 KiB of YAML), its dataset checked in place
(:meth:`.datasets.Datasets.check_files`: it exists, the schema's columns are there
with fitting types, and the record count, from Parquet footers or a record
file's header alone, or from the row-offset index that one scan of a CSV or
TFRecord dataset builds; nothing is copied, except a gzipped Criteo text
file, which cannot be read by row ranges and is converted to a record file)
and registered with the shard service, and the job gets a plan: the
brain-optimizer's when the spec leaves resources to it
(``policies.optimizer: brain``, the default) and it answers within
``brain_timeout_s``, else the documented default plan
(:func:`pacer.jobs.spec.default_plan`), saying why in the plan's reason.
The plan is published as ``pacer.events.job.<job>.plan``, which the
pod-executor applies.

Datasets are checked by :mod:`.datasets` (local files only under the data
roots, object storage with this service's credentials, streams on the bus).

Lifecycle (:mod:`pacer.jobs.lifecycle`, one event per state on
``pacer.events.job.<job>.<state>``): ``submitted -> planning`` when the spec
is accepted; ``running`` when the executor says every node of the plan runs
(``pacer.events.executor.<job>.applied``); ``completed`` when the shard
service says the training dataset finished; ``failed`` when the executor
reports an unretryable node error or a shard is parked after repeated
failures; ``stopped`` on request.

The job records live in the KV bucket ``pacer-jobs`` (the executor and the
HTTP API read them) and are rebuilt from it on restart; the inputs come from
a durable consumer, so events published while the service was down are
applied when it comes back.

Every write of a record is a compare-and-set (:meth:`pacer.bus.Bus.kv_update`):
created only if absent, updated only at the revision this service last read.
A change is a pure function of the record and the job's lifecycle
(:mod:`.core`, applied by :meth:`JobService._commit`); when another writer got there first (a second
instance during a rolling update, an operator's fix) the service re-reads the
record and applies the change again on it, so the change's guards and the
transition table judge the record as it is now.  After ``CAS_ATTEMPTS`` lost
writes it gives up with a temporary, counted error (``cas_gave_up``): the
event is redelivered, the request retried.

Concurrency: each job's lock (:class:`pacer.owned.queues.JobLocks`)
serialises every change of its record (requests and events), so a job's
messages are applied in order and its in-memory record, revision and
lifecycle change together; no lock is shared between jobs, so one job's
slow write holds up no other job.  A submission
prepares its data and plan before taking the lock, with its name reserved.

Two (or more) instances (issue 13, docs/ha.md).  The bucket is the truth;
what an instance holds in memory is only the base of its next
compare-and-set, never an answer:

* ``get`` and ``list`` read the bucket (``get`` from the stream's leader, so
  a record another instance stored a moment ago is seen); any instance
  answers.
* Events come from one shared durable consumer, so each event is delivered to
  one instance at a time (again to the other only if it was not acked, e.g.
  its instance was killed).  Applying it is the compare-and-set above: a
  stale in-memory base loses the write and the change is judged again on the
  re-read record, so the lifecycle takes each edge once, whichever instance
  applies which event and in which order; a job unknown in memory (submitted
  through the other instance) is read from the bucket first.  No per-job
  owner is needed for this.
* A submission is the one thing that needs exclusivity, because it has
  effects before its record is created (the dataset converted under
  ``data_dir``, registered with the shard service): the creation alone
  being atomic would still let two instances prepare the same name at once.
  The name is therefore claimed first as the lease ``jobs.<job>``
  (:class:`pacer.ownership.Ownership`, bucket ``pacer-leases``), held only
  while the submission is prepared and stored, then released.  A name held
  by the other instance is a ``conflict`` (it is being submitted there); a
  held name whose record exists is a ``conflict`` naming the job's state.
  If the lease is lost while preparing (this instance stalled past its TTL)
  the submission gives up with a temporary error; the atomic creation stays
  the last guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from pacer import subjects
from pacer.bus import NO_RETRY, Bus, RetryPolicy
from pacer.codec import decode, encode
from pacer.consumer import DurableConsumer
from pacer.contracts.brain import PlanRequest
from pacer.contracts.executor import ExecutorEvent, ExecutorEventKind
from pacer.contracts.jobs import (
    DataFormat,
    JobEvent,
    JobList,
    JobQuery,
    JobRecord,
    JobSpec,
    JobState,
    ListRequest,
    ModelExported,
    OutboxEntry,
    ResourcePlan,
    StopRequest,
    SubmitRequest,
)
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetMode, DatasetSpec, ProgressEvent, ShardEvent
from pacer.data.stream import parse_stream_uri
from pacer.errors import Conflict, NotFound, PacerError, StaleRevision, Unavailable, ValidationError
from pacer.ids import is_namespace
from pacer.jobs.lifecycle import JobLifecycle, JobTrigger
from pacer.jobs.spec import MAX_SPEC_BYTES, default_plan, parse_job_spec
from pacer.lease import Lease
from pacer.owned.queues import JobLocks
from pacer.ownership import DEFAULT_TTL_S, Ownership
from pacer.runtime import RuntimeConfig, dispatch_rpc, guard
from pacer.shards.client import ShardAdmin
from pacer.subjects import BrainOp, JobEventKind, JobOp, NodeEventKind, ShardEventKind
from pacer.telemetry import Counters
from pacer_services.job_service import core
from pacer_services.job_service.datasets import Datasets

log = logging.getLogger("pacer.jobs")

#: Lost compare-and-set writes of one change before the service gives up (temporary error).
CAS_ATTEMPTS = 5



@dataclass
class JobServiceConfig:
    data_dir: Path = Path(".pacer")  # row-offset indexes in <data_dir>/index/; converted .gz text in datasets/<job>/
    # Where dataset files may be (PACER_DATA_ROOTS); none given: data_dir alone.
    data_roots: tuple[Path, ...] = ()
    durable: str = "job-service"
    batches_per_shard: int = 100
    lease_s: float = 30.0
    max_spec_bytes: int = MAX_SPEC_BYTES
    brain_timeout_s: float = 5.0
    ack_wait_s: float = 30.0  # an event a dead instance fetched but did not ack goes to the other after this
    instance: str | None = None  # None: PACER_INSTANCE, else jobs-<random>
    name_lease_ttl_s: float = DEFAULT_TTL_S  # a submitting instance that died holds its name this long
    outbox_sweep_s: float = 15.0  # how often the bucket is searched for events a dead writer left unpublished

    @classmethod
    def from_env(cls) -> JobServiceConfig:
        """``PACER_DATA_DIR``, ``PACER_DATA_ROOTS`` (directories joined by ``os.pathsep``; unset or
        empty: the data dir alone), ``PACER_BATCHES_PER_SHARD``, ``PACER_SHARD_LEASE_S``,
        ``PACER_LEASE_TTL_S``, ``PACER_JOBS_OUTBOX_SWEEP_S``."""
        env = os.environ
        roots = tuple(Path(r) for r in env.get("PACER_DATA_ROOTS", "").split(os.pathsep) if r.strip())
        return cls(data_dir=Path(env.get("PACER_DATA_DIR", ".pacer")), data_roots=roots,
                   batches_per_shard=int(env.get("PACER_BATCHES_PER_SHARD", "100")),
                   lease_s=float(env.get("PACER_SHARD_LEASE_S", "30")),
                   name_lease_ttl_s=float(env.get("PACER_LEASE_TTL_S", DEFAULT_TTL_S)),
                   outbox_sweep_s=float(env.get("PACER_JOBS_OUTBOX_SWEEP_S", "15")))


class JobService:
    name = subjects.JOB_SERVICE

    def __init__(self, bus: Bus, cfg: JobServiceConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.bus = bus
        self.cfg = cfg or JobServiceConfig()
        self.clock = clock
        self.counters = Counters(self.name)
        # Jobs this instance moved to `failed` (pacer_service_events_total{service="jobs",name="jobs_failed"},
        # the PacerJobFailed alert).  Exported from 0 at start: Prometheus' increase() sees a series' first
        # sample as its start, so a counter born at 1 would hide the first failure.
        self.counters.inc("jobs_failed", 0)
        self.datasets = Datasets(bus, self.counters, self.cfg.data_dir, self.cfg.data_roots)
        self.records: dict[str, JobRecord] = {}
        self.revisions: dict[str, int] = {}  # job -> KV revision of self.records[job]
        self._submitting: set[str] = set()  # names whose submission is being prepared
        self.lifecycles: dict[str, JobLifecycle] = {}
        self.locks = JobLocks()  # each job's: its requests and events change its record one at a time
        # Submissions claim their job's name here (see the module docstring); nothing else is owned.
        self.names = Ownership(bus, self.name, self._name_claimed, self._name_lost, instance=self.cfg.instance,
                               ttl_s=self.cfg.name_lease_ttl_s, balance_every_s=0)  # held briefly: no balance
        self.admin = ShardAdmin(bus, timeout=10.0, retry=RetryPolicy(attempts=10))
        self.rpc = {JobOp.SUBMIT: self._submit, JobOp.GET: self._get, JobOp.LIST: self._list, JobOp.STOP: self._stop}
        self.consumer = DurableConsumer(
            bus, self.name, self.cfg.durable,
            [subjects.events_of("shard", kind=k) for k in
             (ShardEventKind.FINISHED, ShardEventKind.PROGRESS, ShardEventKind.PARKED)]
            + [subjects.events_of(subjects.EXECUTOR_SERVICE),
               subjects.events_of("node", kind=NodeEventKind.DIED),
               subjects.events_of("node", kind=NodeEventKind.FINISHED)],
            self._on_event, self.counters, ack_wait_s=self.cfg.ack_wait_s)
        self._kv: KeyValue | None = None
        self._rpc_sub: Subscription | None = None

    # ================================================================ lifecycle
    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.bus.ensure_streams()
        self._kv = await self.bus.kv(subjects.JOB_BUCKET, "Pacer jobs: one JobRecord per job")
        await self.names.start(tg)
        await self._load()
        self._rpc_sub = await self.bus.nc.subscribe(subjects.rpc_wildcard(self.name), queue=self.name,
                                                    cb=self._on_rpc)
        await self.bus.nc.flush()
        tg.create_task(guard("events", self.consumer.run), name="pacer:jobs:events")
        tg.create_task(self._resume(), name="pacer:jobs:resume")
        tg.create_task(guard("outbox", self._sweep_loop), name="pacer:jobs:outbox")

    async def drain(self) -> None:
        if self._rpc_sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._rpc_sub.unsubscribe()
        await self.consumer.stop()
        await self.locks.idle()  # every change in flight ends first
        await self.names.close()

    async def _name_claimed(self, job: str, lease: Lease) -> None:
        self.counters.inc("names_claimed")

    async def _name_lost(self, job: str) -> None:
        pass  # the submission checks self.names.owns(job) before it stores the record

    async def _load(self) -> None:
        for key in await self.bus.kv_items(subjects.JOB_BUCKET):
            # Read again with get: the value and its revision together, the base of the next compare-and-set.
            with contextlib.suppress(NotFound):
                await self._reread(key)

    async def _reread(self, job: str) -> JobRecord:
        """The job's record as stored now, adopted with its revision and a lifecycle in its state."""
        rec, revision = await self._read(job)
        old = self.lifecycles.get(job)
        lc = core.lifecycle_of(rec, old.done if old is not None else frozenset())
        self.records[job], self.revisions[job], self.lifecycles[job] = rec, revision, lc
        return rec

    async def _read(self, job: str) -> tuple[JobRecord, int]:
        """The job's record as stored now and its revision, read from the stream's leader (not a replica
        that may lag behind a write of the other instance); NotFound if there is none (or it is unreadable)."""
        stream, subject = f"KV_{subjects.JOB_BUCKET}", f"$KV.{subjects.JOB_BUCKET}.{job}"
        try:
            msg = await self.bus.js.get_last_msg(stream, subject, direct=False)
        except nats.js.errors.NotFoundError:
            raise NotFound(f"job {job}: its record is gone from {subjects.JOB_BUCKET}") from None
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            raise NotFound(f"job {job}: its record is gone from {subjects.JOB_BUCKET}")
        try:
            rec = decode(JobRecord, msg.data or b"")
        except PacerError:
            self.counters.inc("bad_records")
            log.error("unreadable job record %s; ignored", job)
            raise NotFound(f"job {job}: its record is unreadable") from None
        assert msg.seq is not None
        return rec, msg.seq

    async def _known(self, job: str) -> bool:
        """Whether ``job`` has a record; one this instance has not seen (the other instance created it)
        is read from the bucket and adopted.  Call with the lock held."""
        if job in self.records:
            return True
        try:
            await self._reread(job)
        except NotFound:
            return False
        return True

    async def _resume(self) -> None:
        """After a restart: publish what a writer that died left in the outboxes; a job still planning may
        have lost its plan event (stored before the outbox existed): publish it again (idempotent)."""
        with contextlib.suppress(PacerError, nats.errors.Error, TimeoutError):
            await self.sweep_outboxes(min_age_s=2.0)
        for rec in list(self.records.values()):
            if rec.state is JobState.PLANNING and rec.plan is not None:
                with contextlib.suppress(PacerError, nats.errors.Error):
                    await self.bus.publish_durable(subjects.job_event(rec.job, JobEventKind.PLAN), rec.plan)

    async def _commit(self, job: str, change: core.Change, also: Sequence[tuple[str, bytes]] = ()) -> JobRecord:
        """Apply ``change`` to the job's record, store it with a revision check, then publish its events.

        The record is created if this service has no revision for it (a
        lost creation is a ``conflict``: the job exists), else updated at the
        revision it read (a lost update re-reads the record and runs
        ``change`` again on it).  A change that alters nothing writes
        nothing.

        Events go out through the record's outbox: the change's lifecycle
        events (and ``also``: more (subject, encoded event) pairs, e.g. the
        first plan) are stored in the same write as the change they report,
        then published, then cleared (:meth:`_flush`).  An instance killed
        between the write and the publish leaves them in the record, where
        the next write of the job or the sweep of any instance finds and
        publishes them; each carries a ``Nats-Msg-Id``, so publishing one
        twice within the events stream's duplicate window stores it once.
        So an event is published at least once and only after its record.
        """
        assert self._kv is not None
        for _ in range(CAS_ATTEMPTS):
            rec, lc = self.records[job], self.lifecycles[job].copy()
            new: JobRecord
            events: list[JobEvent]
            new, events = change(rec, lc)
            if new == rec and not events:
                self.lifecycles[job] = lc
                return rec
            fresh = [OutboxEntry(subjects.job_event(ev.job, ev.state.value), encode(ev), _msg_id(job))
                     for ev in events]
            fresh += [OutboxEntry(subject, data, _msg_id(job)) for subject, data in also]
            # rec.outbox: what a writer that died before publishing left; it goes out with ours, first
            new = replace(new, updated_at=self.clock(), outbox=[*rec.outbox, *fresh])
            try:
                rev = await self.bus.kv_update(self._kv, job, encode(new), self.revisions.get(job))
            except StaleRevision as exc:
                self.counters.inc("cas_conflicts")
                if job not in self.revisions:  # a creation: another writer stored this job first
                    await self._reread(job)
                    raise Conflict(f"name: a job named {job!r} exists ({self.records[job].state.value}); "
                                   "choose another name") from None
                log.warning("job record written by another writer; re-reading and applying again",
                            extra={"fields": {"job": job, "error": exc.message}})
                await self._reread(job)
                continue
            self.records[job], self.revisions[job], self.lifecycles[job] = new, rev, lc
            for ev in events:
                self.counters.inc("transitions", state=ev.state.value)
                if ev.state is JobState.FAILED:
                    self.counters.inc("jobs_failed")
                log.info("job %s", ev.state.value, extra={"fields": {"job": ev.job, "reason": ev.reason}})
            await self._flush(job)
            return self.records[job]
        self.counters.inc("cas_gave_up")
        log.error("job record kept changing under every write; change not applied", extra={"fields": {"job": job}})
        raise StaleRevision(f"job {job}: its record changed under {CAS_ATTEMPTS} writes in a row; retry",
                            temporary=True)

    async def _flush(self, job: str) -> None:
        """Publish the events in the job's outbox, oldest first, then store the record without them.

        Call with the lock held.  A publish that fails leaves the rest for
        later (the next write or the sweep); a clearing write that loses to
        another writer leaves them in the record it stored, to be published
        again (the stream drops the repeat by its message id).
        """
        assert self._kv is not None
        rec = self.records[job]
        sent: list[OutboxEntry] = []
        for entry in rec.outbox:
            try:
                await self.bus.publish_encoded(entry.subject, entry.data, msg_id=entry.msg_id)
            except (nats.errors.Error, TimeoutError) as exc:
                self.counters.inc("outbox_deferred")
                log.warning("job event not published yet; it stays in the record's outbox",
                            extra={"fields": {"job": job, "subject": entry.subject, "error": repr(exc)}})
                break
            sent.append(entry)
        if not sent:
            return
        self.counters.inc("outbox_published", n=len(sent))
        cleared = replace(rec, outbox=rec.outbox[len(sent):])
        try:
            rev = await self.bus.kv_update(self._kv, job, encode(cleared), self.revisions[job])
        except StaleRevision:
            self.counters.inc("cas_conflicts")
            await self._reread(job)
            return
        except (nats.errors.Error, TimeoutError):
            return  # still in the stored record: published again later, dropped as a repeat
        self.records[job], self.revisions[job] = cleared, rev

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.outbox_sweep_s)
            try:
                await self.sweep_outboxes()
            except (nats.errors.Error, TimeoutError, PacerError) as exc:  # the bus is failing over: next period
                self.counters.inc("outbox_sweep_failed")
                log.warning("outbox sweep failed; trying again next period", extra={"fields": {"error": repr(exc)}})

    async def sweep_outboxes(self, min_age_s: float | None = None) -> int:
        """Publish what any writer left in a record's outbox at least ``min_age_s`` ago (default: one sweep
        period, so a live writer about to publish is not raced); returns how many records had some."""
        age = self.cfg.outbox_sweep_s if min_age_s is None else min_age_s
        found = 0
        for key, value in (await self.bus.kv_items(subjects.JOB_BUCKET)).items():
            try:
                rec = decode(JobRecord, value)
            except PacerError:
                continue
            if not rec.outbox or self.clock() - rec.updated_at < age:
                continue
            found += 1
            self.counters.inc("outbox_swept")
            async with self.locks.hold(key):
                with contextlib.suppress(NotFound):
                    await self._reread(key)
                    if self.records[key].outbox:
                        await self._flush(key)
        return found

    async def _update(self, job: str, fn: Callable[[JobRecord], JobRecord]) -> JobRecord:
        return await self._commit(job, core.data_only(fn))

    # ================================================================ rpc
    async def _on_rpc(self, msg: Msg) -> None:
        await dispatch_rpc(self.bus, self.counters, self.rpc, msg)

    async def _record(self, job: str) -> JobRecord:
        """The job's record as stored now (whichever instance wrote it last)."""
        try:
            rec, _ = await self._read(job)
        except NotFound:
            raise NotFound(f"no job named {job!r}") from None
        return rec

    async def _submit(self, job: str, msg: Msg) -> None:
        req = decode(SubmitRequest, msg.data)
        if not is_namespace(req.namespace):
            raise ValidationError(f"namespace: {req.namespace!r} is not a namespace name (1-63 of [a-z0-9-])")
        if len(req.spec.encode()) > self.cfg.max_spec_bytes:
            raise ValidationError(f"spec: larger than {self.cfg.max_spec_bytes} bytes")
        # JobSpecError: one line per bad field.  A thread: 256 KiB of YAML takes a while to read.
        spec = await asyncio.to_thread(parse_job_spec, req.spec)
        if spec.name != job:
            raise ValidationError(f"name: the spec names {spec.name!r} but it was submitted as {job!r}")
        if spec.name.startswith("_"):
            raise ValidationError(f"name: names starting with '_' are reserved, got {spec.name!r}")
        if job in self._submitting:
            raise Conflict(f"name: a job named {job!r} is being submitted; choose another name")
        # The slow part (converting data, asking the brain, registering the dataset) runs outside the lock,
        # so that events of running jobs are not held up by a submission; the name is reserved meanwhile,
        # here and, by its lease, across the instances.
        self._submitting.add(job)
        try:
            await self._claim_name(job)
            streaming = spec.dataset.format is DataFormat.STREAM
            if streaming:
                spec, data_path, records, columns = await self.datasets.check_stream(spec)
                eval_path = ""
            else:
                data_path, eval_path, records, columns = await asyncio.to_thread(self.datasets.check_files, spec)
            if spec.export is not None:
                spec = replace(spec, export=replace(spec.export, path=self.datasets.export_location(spec.export.path)))
            plan = await self._first_plan(spec, records, req.namespace)
            per_worker = max(1, spec.batch_size // plan.workers)
            dataset = DatasetSpec(
                job=job, dataset=spec.dataset.name, records=records, batch_size=per_worker,
                batches_per_shard=self.cfg.batches_per_shard, epochs=spec.epochs, lease_s=self.cfg.lease_s)
            if streaming:  # the shard service follows the stream from first_seq: it appends every sample
                opts = spec.dataset.options
                dataset = replace(dataset, records=0, mode=DatasetMode.STREAMING, shuffle=False,
                                  stream=parse_stream_uri(data_path), first_seq=int(opts["first_seq"]),
                                  max_wait_s=float(opts.get("max_wait_s", 5.0)),
                                  idle_close_s=float(opts.get("idle_close_s", 0.0)))
            await self.admin.register(dataset)
            async with self.locks.hold(job):
                if not self.names.owns(job):
                    self.counters.inc("name_lease_lost")
                    raise Unavailable(f"name: the claim on {job!r} lapsed while the job was prepared; retry")
                now = self.clock()
                lc, first = JobLifecycle.submitted(job, [spec.dataset.name], now)
                self.lifecycles[job] = lc
                self.records[job] = JobRecord(job, spec, JobState.SUBMITTED, now, plan=plan, data_path=data_path,
                                              eval_path=eval_path, records=records, columns=columns,
                                              index_dir=str(self.datasets.index_dir()), namespace=req.namespace)
                accepted = f"plan: {plan.source.value} ({plan.reason})" if plan.reason else f"plan: {plan.source.value}"
                try:  # a creation: refused if another writer stored the job meanwhile
                    rec = await self._commit(job, core.submitted(first, now, accepted),
                                             also=[(subjects.job_event(job, JobEventKind.PLAN), encode(plan))])
                except PacerError:
                    if job not in self.revisions:  # nothing stored, nothing adopted: forget the job again
                        self.records.pop(job, None)
                        self.lifecycles.pop(job, None)
                    raise
        finally:
            self._submitting.discard(job)
            await self.names.drop(job)
        self.counters.inc("submitted")
        await self.bus.respond(msg, replace(rec, outbox=[]))

    async def _claim_name(self, job: str) -> None:
        """Hold the lease on ``job``'s name, and check that no record of that name exists; else a conflict
        (or, when the lease's holder cannot be told, a temporary error)."""
        if not await self.names.claim(job, within=max(1.0, self.cfg.name_lease_ttl_s / 2)):
            holder: str | None = None
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                holder = await self.names.owner_of(job)
            if holder is not None and holder != self.names.instance:
                self.counters.inc("name_held_elsewhere")
                raise Conflict(f"name: a job named {job!r} is being submitted; choose another name")
            raise Unavailable(f"name: {job!r} cannot be reserved now; retry")
        async with self.locks.hold(job):
            try:
                rec = await self._reread(job)
            except NotFound:  # free: forget what this instance may remember of a deleted record
                self.records.pop(job, None)
                self.revisions.pop(job, None)
                self.lifecycles.pop(job, None)
                return
        raise Conflict(f"name: a job named {job!r} exists ({rec.state.value}); choose another name")

    async def _first_plan(self, spec: JobSpec, records: int, namespace: str) -> ResourcePlan:
        """The brain's plan when the job's optimizer is ``brain`` (and it answers), else the default plan."""
        if spec.policies.optimizer != subjects.BRAIN_SERVICE:
            return default_plan(spec)
        try:
            plan = await self.bus.request(subjects.brain_rpc(spec.name, BrainOp.PLAN),
                                          PlanRequest(spec.name, spec, records, namespace), ResourcePlan,
                                          timeout=self.cfg.brain_timeout_s, retry=NO_RETRY)
        except PacerError as exc:
            self.counters.inc("brain_unavailable")
            base = default_plan(spec)
            return replace(base, reason=f"brain unavailable ({exc.code}): default plan; {base.reason}".rstrip("; "))
        if plan.job != spec.name:
            base = default_plan(spec)
            return replace(base, reason=f"brain answered for {plan.job!r}: default plan; {base.reason}".rstrip("; "))
        return plan

    async def _get(self, job: str, msg: Msg) -> None:
        q = decode(JobQuery, msg.data)
        if q.job != job:
            raise ValidationError(f"job: body names {q.job!r} but the subject is for {job!r}")
        await self.bus.respond(msg, replace(await self._record(job), outbox=[]))

    async def _list(self, job: str, msg: Msg) -> None:
        req = decode(ListRequest, msg.data)
        if not 1 <= req.limit <= 1000:
            raise ValidationError(f"limit: must be 1..1000, got {req.limit}")
        recs: list[JobRecord] = []
        for key, value in (await self.bus.kv_items(subjects.JOB_BUCKET)).items():
            try:
                recs.append(replace(decode(JobRecord, value), outbox=[]))
            except PacerError:
                self.counters.inc("bad_records")
                log.error("unreadable job record %s; left out of the list", key)
        recs.sort(key=lambda r: r.submitted_at, reverse=True)
        if req.state is not None:
            recs = [r for r in recs if r.state is req.state]
        if req.namespaces:
            recs = [r for r in recs if r.namespace in req.namespaces]
        await self.bus.respond(msg, JobList(recs[: req.limit]))

    async def _stop(self, job: str, msg: Msg) -> None:
        req = decode(StopRequest, msg.data)
        if req.job != job:
            raise ValidationError(f"job: body names {req.job!r} but the subject is for {job!r}")
        async with self.locks.hold(job):
            if not await self._known(job):
                raise NotFound(f"no job named {job!r}")
            rec = await self._commit(job, core.transition(JobTrigger.STOP, self.clock(),
                                                          req.reason or "stopped by the user"))
        await self.bus.respond(msg, replace(rec, outbox=[]))

    # ================================================================ events in
    async def _on_event(self, m: Msg) -> None:
        parts = m.subject.split(".")  # pacer.events.<domain>.<job>.<kind>
        if len(parts) != 5:
            raise ValidationError(f"not an event subject: {m.subject!r}")
        domain, job, kind = parts[2], parts[3], parts[4]
        async with self.locks.hold(job):
            if not await self._known(job):
                self.counters.inc("events_unknown_job")
                return  # a job this service does not run (e.g. `pacer train local`)
            if domain == "shard":
                await self._on_shard(job, kind, m.data)
            elif domain == subjects.EXECUTOR_SERVICE:
                await self._on_executor(job, decode(ExecutorEvent, m.data))
            elif domain == "node":
                await self._on_node(job, kind, decode(NodeEvent, m.data))

    # The guards of each decision sit inside its change (core), so that after a lost compare-and-set they
    # judge the re-read record, not the one this service held.
    async def _on_shard(self, job: str, kind: str, data: bytes) -> None:
        dataset = self.records[job].spec.dataset.name
        if kind == ShardEventKind.PROGRESS:
            st = decode(ProgressEvent, data).status
            if st.dataset == dataset:
                progress = core.progress_of(st)
                await self._update(job, lambda rec: replace(rec, progress=progress))
            return
        ev = decode(ShardEvent, data)
        if ev.dataset != dataset:
            return
        if kind == ShardEventKind.FINISHED:
            with contextlib.suppress(PacerError):  # the exact final counts
                final = core.progress_of(await self.admin.status(job, ev.dataset))
                await self._update(job, lambda rec: replace(rec, progress=final))
            await self._commit(job, core.dataset_finished(ev.dataset, self.clock()))
        elif kind == ShardEventKind.PARKED:
            await self._commit(job, core.fail_unless_over(
                self.clock(), f"shard {ev.shard} of {ev.dataset} failed repeatedly and was parked ({ev.detail})"))

    async def _on_executor(self, job: str, ev: ExecutorEvent) -> None:
        if ev.kind is ExecutorEventKind.APPLIED:
            await self._commit(job, core.plan_applied(self.clock(), ev.overhead_s))
        elif ev.kind is ExecutorEventKind.FAILED:
            await self._commit(job, core.fail_unless_over(self.clock(), ev.reason or "the executor failed the job"))
        elif ev.kind is ExecutorEventKind.TORN_DOWN:
            await self._update(job, lambda rec: replace(rec, torn_down=True))

    async def _on_node(self, job: str, kind: str, ev: NodeEvent) -> None:
        if kind == NodeEventKind.DIED and ev.relaunch:
            await self._update(job, core.node_relaunched(ev))
        elif kind == NodeEventKind.FINISHED and ev.result and ev.node == core.CHIEF:
            result = dict(ev.result)
            exports = [str(x) for x in result.get("exports", []) if isinstance(x, str)]
            if not exports:
                await self._update(job, lambda rec: replace(rec, result=result))
                return
            event = ModelExported(job, exports[-1], len(exports))
            await self._commit(job, core.data_only(lambda rec: replace(rec, result=result, exported=exports[-1])),
                               also=[(subjects.job_event(job, JobEventKind.EXPORTED), encode(event))])


async def create(bus: Bus, rc: RuntimeConfig) -> JobService:
    """App factory: the only place that builds a JobService from configuration."""
    return JobService(bus, JobServiceConfig.from_env())


def _msg_id(job: str) -> str:
    """A fresh ``Nats-Msg-Id`` for one outbox entry (unique: a job of the same name later gets new ids)."""
    return f"job-{job}-{uuid.uuid4().hex}"
