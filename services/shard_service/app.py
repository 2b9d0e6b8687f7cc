"""The shard service: wires the bus, the pure core and the durable log.

Concurrency contract
--------------------
* All requests arrive on one subscription (``pacer.rpc.shard.*.*``) whose
  callback only puts each request into its job's inbox
  (:class:`pacer.owned.queues.JobQueues`): one worker per job handles them in arrival order,
  different jobs in parallel, so a request that waits (routing to the
  owner, reading a checkpoint) delays its own job only.  Handling decodes,
  runs the job's core synchronously and hands the resulting log records and
  the reply to that job's *committer*.
* The core's work per request is bounded before it starts
  (:class:`~.core.ShardLimits`: shards per epoch and per job, datasets,
  nodes, ids per report), so no decision holds the event loop for long;
  rebuilding a job from its snapshot runs in a thread.
* A committer (one task per job) appends everything queued since its last
  append as one JetStream message (group commit), waits for the stream's
  ack, and only then sends the replies and events.  A reply therefore never
  reveals state that is not durable.  Read-only requests (status) still go
  through the committer so they never show uncommitted state either.
* If an append fails, the in-memory state may hold records the log lacks:
  every queued reply gets a temporary error and the job is rebuilt from the
  log before it serves again (clients retry; nothing is lost or invented).
* Different jobs commit in parallel.

Two instances (issue 13, :mod:`pacer.ownership`)
-----------------------------------------------
Every instance competes for the lease ``shard.<job>`` of each job it hears
of (every job with a log, at start; a request or a node death naming it).
Only the job's owner holds its :class:`JobRuntime`: ``on_acquired`` loads it
from the snapshot and the log exactly as a restart does, ``on_lost`` drops
it at once (queued requests get a temporary ``unavailable`` error: clients
retry and reach the new owner).  A request reaching a non-owner is forwarded
to the owner (reply subject unchanged; :mod:`pacer.owned.router`); node deaths come through one durable
consumer shared by the instances, and a non-owner hands the message back
(nak) for the owner.  Safety does not rest on the lease's timing: appends
carry the log's expected last sequence, so a stale owner's append is
refused (``Fenced``); it then gives the job up instead of rebuilding it,
unless the lease still names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode
from pacer.consumer import jittered
from pacer.contracts.common import clip
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import ProgressEvent, ShardEvent
from pacer.errors import (
    DecodeError,
    NotFound,
    PacerError,
    ReplyTooLarge,
    Unavailable,
    ValidationError,
)
from pacer.lease import Lease
from pacer.owned.queues import JobQueues
from pacer.owned.router import Router
from pacer.ownership import DEFAULT_TTL_S, Ownership
from pacer.runtime import RuntimeConfig, guard
from pacer.telemetry import Counters
from pacer_services.shard_service import handlers
from pacer_services.shard_service.core import DEFAULT_LIMITS, JobShards, Outcome, ShardLimits
from pacer_services.shard_service.effects import Fenced, ShardLogStore, retry_forever
from pacer_services.shard_service.follow import Follow, decide

log = logging.getLogger("pacer.shard")

Done = Callable[[PacerError | None], Awaitable[None]]


@dataclass
class ShardServiceConfig:
    snapshot_every: int = 50_000  # records appended between snapshots (bounds replay)
    reap_interval_s: float = 0.25  # how often expired leases are looked for
    progress_interval_s: float = 2.0  # how often ProgressEvents are published
    commit_timeout_s: float = 5.0
    node_events_durable: str = "shard-service-node-died"  # shared by the instances
    instance: str | None = None  # None: PACER_INSTANCE, else shard-<random>
    lease_ttl_s: float = DEFAULT_TTL_S
    claim_at_start_s: float = 2.0  # how long start waits for the jobs of the log (a dead owner's: one TTL later)
    limits: ShardLimits = DEFAULT_LIMITS  # the work one request may cause (PACER_SHARD_MAX_*)
    max_queued: int = 10_000  # requests one job may have waiting; more are told to retry (PACER_SHARD_MAX_QUEUED)
    follow_interval_s: float = 0.5  # how often the streams of streaming datasets are looked at (follow.py)


class JobRuntime:
    """One job: its core, its log position and its committer queue."""

    def __init__(self, job: str, core: JobShards, last_seq: int) -> None:
        self.job = job
        self.core = core
        self.last_seq = last_seq
        self.ready = True
        self.records: list[list[Any]] = []
        self.waiters: list[Done] = []
        self.wake = asyncio.Event()
        self.since_snapshot = 0
        self.dirty = True  # something changed since the last ProgressEvent
        self.snapshotting = False  # a snapshot upload is in flight
        self.closed = False  # no longer ours (lease lost or append fenced): serves nothing more
        self.task: asyncio.Task[None] | None = None


class ShardService:
    name = subjects.SHARD_SERVICE

    def __init__(
        self,
        bus: Bus,
        store: ShardLogStore,
        cfg: ShardServiceConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.store = store
        self.cfg = cfg or ShardServiceConfig()
        self.clock = clock
        self.wall = wall
        self.counters = Counters(self.name)
        self.jobs: dict[str, JobRuntime] = {}
        self.inbox: JobQueues | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._sub: Subscription | None = None
        self._node_sub: Any = None  # the node-death consumer made at start, taken over by its loop
        self._draining = False
        self.rpc = handlers.build(self)
        self.follows: dict[tuple[str, str], Follow] = {}  # (job, dataset) -> timings of a followed stream
        self.own = Ownership(bus, self.name, self._acquired, self._lost, instance=self.cfg.instance,
                             ttl_s=self.cfg.lease_ttl_s)
        # A job's requests run in its inbox (one after the other); routing to the owner too (finding
        # the owner takes IO: only the job's later requests wait behind it).
        self.router = Router(bus, self.own, self.counters, self.rpc, check_job=subjects.shard_log,
                             unknown=self._unknown, after=self._after_route, run=self._enqueue)

    # ================================================================ lifecycle
    async def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        self.inbox = JobQueues(lambda coro, name: tg.create_task(coro, name=name), self.counters, name="shard",
                               idle_s=0, max_queued=self.cfg.max_queued)
        await self.bus.ensure_streams()
        await self.store.open()
        await self.own.start(tg, on_forwarded=self.router.on_forwarded)
        t0 = time.perf_counter()
        # Compete for every job of the log; the ones we win are loaded by _acquired.  A job whose
        # owner was killed is free one TTL later: it is not waited for here.
        known = await self.store.jobs()
        await asyncio.gather(*(self.own.claim(job, within=self.cfg.claim_at_start_s) for job in known))
        log.info("shard state rebuilt", extra={"fields": {"jobs": len(self.jobs), "known": len(known),
                                                          "instance": self.own.instance,
                                                          "s": round(time.perf_counter() - t0, 3)}})
        # The node-death consumer exists before the first lease is served: made by the loop's task
        # instead, a death published between a grant and the consumer's creation was skipped (its
        # deliver policy is "new") and the dead node's shards waited for their lease to run out.
        self._node_sub = await self._node_events_subscribe()
        self._sub = await self.bus.nc.subscribe(
            subjects.rpc_wildcard(self.name), queue="shard-service", cb=self.router.on_rpc, pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )
        tg.create_task(guard("reaper", self._reap_loop), name="pacer:shard:reaper")
        tg.create_task(guard("progress", self._progress_loop), name="pacer:shard:progress")
        tg.create_task(guard("node-events", self._node_events_loop), name="pacer:shard:node-events")
        tg.create_task(guard("follow", self._follow_loop), name="pacer:shard:follow")

    async def drain(self) -> None:
        self._draining = True
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        while (self.inbox is not None and self.inbox.pending()) or any(rt.records or rt.waiters
                                                                        for rt in self.jobs.values()):
            await asyncio.sleep(0.01)
        await self.own.close()  # the other instance takes the jobs over at once

    # ================================================================ ownership
    async def _acquired(self, job: str, lease: Lease) -> None:
        """We own ``job``: rebuild it from its snapshot and log, as a restart does (nothing if it has no log)."""
        old = self.jobs.pop(job, None)
        if old is not None:
            await self._close(old, "the job changes hands")
        for _ in range(5):
            core, seq, applied = await self.store.load(job)
            if seq == 0 and not core.datasets:
                self.counters.inc("jobs_acquired")
                return  # no log yet: the first register creates it
            try:
                # A term marker (an empty batch) moves the log's last sequence on: any append of the
                # previous owner, prepared against the log as it was, is refused from now on.
                seq = await self.store.append(job, [], seq, self.cfg.commit_timeout_s)
                break
            except Fenced:  # the previous owner appended after our load: load again
                continue
        else:
            raise Unavailable(f"shard log of job {job!r} keeps moving under its new owner")
        self.counters.inc("jobs_acquired")
        core.limits = self.cfg.limits
        core.renew_all(self.clock())
        self._add_job(job, core, seq)
        self.counters.inc("records_replayed", applied)

    async def _lost(self, job: str) -> None:
        """Stop serving ``job`` at once: queued requests are told to retry (they reach the new owner)."""
        self.counters.inc("jobs_lost")
        rt = self.jobs.pop(job, None)
        if rt is not None:
            await self._close(rt, "this instance no longer owns it")

    async def _close(self, rt: JobRuntime, why: str) -> None:
        rt.closed, rt.ready = True, False
        waiters = rt.waiters
        rt.records, rt.waiters = [], []
        rt.wake.set()  # the committer exits (after the append in flight, if any)
        err = Unavailable(f"shard job {rt.job!r}: {why}; retry")
        for w in waiters:
            with contextlib.suppress(Exception):
                await w(err)

    def _add_job(self, job: str, core: JobShards, seq: int) -> JobRuntime:
        rt = JobRuntime(job, core, seq)
        self.jobs[job] = rt
        assert self._tg is not None
        rt.task = self._tg.create_task(self._committer(rt), name=f"pacer:shard:commit:{job}")
        return rt

    def job(self, job: str, create: bool = False) -> JobRuntime:
        rt = self.jobs.get(job)
        if rt is None:
            if self.own.wanted(job) and not self.own.owns(job):
                raise Unavailable(f"shard job {job!r} is changing owner; retry")
            if not create:
                raise NotFound(f"unknown job {job!r}: register a dataset first")
            subjects.shard_log(job)  # validates the id
            if not self.own.owns(job):
                raise Unavailable(f"shard job {job!r} has no owner yet; retry")
            rt = self._add_job(job, JobShards(job, self.cfg.limits), 0)
        if not rt.ready:
            raise Unavailable(f"job {job!r} is being rebuilt from its log; retry")
        return rt

    # ================================================================ requests
    async def _enqueue(self, job: str, msg: Msg, work: Callable[[], Awaitable[None]]) -> None:
        assert self.inbox is not None
        if not self.inbox.post(job, work, "request"):
            self.counters.inc("errors", code="unavailable", op="queue_full")
            await self.bus.respond_error(msg, Unavailable(
                f"shard job {job!r} has {self.inbox.max_queued} requests waiting; retry later"))

    async def _unknown(self, job: str, op: str) -> bool:
        """A job nobody holds and that has no log is unknown (but a registration creates it)."""
        if op == subjects.ShardOp.REGISTER or self.own.wanted(job) or job in self.jobs:
            return False
        try:
            return await self.own.owner_of(job) is None and await self.store.last_seq(job) == 0
        except Exception:
            return False  # cannot tell: route it

    async def _after_route(self, job: str, how: str) -> None:
        if how == "handled" and job not in self.jobs and self.own.owns(job):
            await self.own.drop(job)  # a refused first registration: hold no lease for a job that is not

    def submit(self, rt: JobRuntime, out: Outcome, done: Done | None) -> None:
        """Queue an outcome's records for the next group commit; ``done`` runs after it."""
        if out.records:
            rt.records.extend(out.records)
            rt.dirty = True
        if out.events:
            events = list(out.events)
            prev = done

            async def publish_events(err: PacerError | None) -> None:
                if err is None:
                    now = self.wall()
                    for e in events:
                        self.counters.inc("events", kind=e.kind)
                        await self.bus.publish(
                            subjects.event("shard", rt.job, e.kind),
                            ShardEvent(rt.job, e.dataset, e.kind, now, e.shard, e.node, e.epoch, e.detail),
                        )
                if prev is not None:
                    await prev(err)

            done = publish_events
        if done is not None:
            rt.waiters.append(done)
        if out.records or done is not None:
            rt.wake.set()

    def reply_after_commit(self, msg: Msg, reply: Any) -> Done:
        async def send(err: PacerError | None) -> None:
            if err is None:
                try:
                    if not await self.bus.respond(msg, reply):  # too large: an error reply went instead
                        self.counters.inc("errors", code=ReplyTooLarge.code, op="commit")
                    return
                except Exception as exc:  # unencodable: still answer
                    log.warning("reply could not be sent: %s", exc)
                    err = PacerError(
                        f"the reply could not be sent ({type(exc).__name__}: {exc}); the request was applied",
                        code="reply_failed",
                    )
            self.counters.inc("errors", code=err.code, op="commit")
            await self.bus.respond_error(msg, err)

        return send

    # ================================================================ group commit
    async def _committer(self, rt: JobRuntime) -> None:
        """The job's commit loop, restarted if it crashes, until the job is closed (no longer ours)."""
        while not rt.closed:
            try:
                await self._commit_loop(rt)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("commit loop of %s crashed; restarting in 1s", rt.job)
                await asyncio.sleep(1.0)

    async def _commit_loop(self, rt: JobRuntime) -> None:
        while not rt.closed:
            await rt.wake.wait()
            rt.wake.clear()
            while (rt.records or rt.waiters) and not rt.closed:
                records, waiters = rt.records, rt.waiters
                rt.records, rt.waiters = [], []
                snap = None
                # One snapshot upload per job at a time: an older one finishing last would
                # overwrite a newer one whose log prefix is already purged.
                if records and not rt.snapshotting and rt.since_snapshot + len(records) >= self.cfg.snapshot_every:
                    # Taken synchronously: the state now is exactly log + this batch.
                    snap = rt.core.snapshot()
                err: PacerError | None = None
                if records:
                    try:
                        rt.last_seq = await self.store.append(rt.job, records, rt.last_seq, self.cfg.commit_timeout_s)
                        self.counters.inc("appends")
                        self.counters.inc("records_appended", len(records))
                        rt.since_snapshot += len(records)
                    except PacerError as exc:
                        err = exc
                if err is not None:
                    if not await self._still_owner(rt, err):
                        await self._give_up(rt, waiters, err)
                        return
                    await self._fail_and_rebuild(rt, waiters, err)
                    continue
                if snap is not None and not rt.closed:
                    rt.since_snapshot = 0
                    assert self._tg is not None
                    rt.snapshotting = True
                    self._tg.create_task(self._snapshot(rt, snap, rt.last_seq), name=f"pacer:shard:snap:{rt.job}")
                for w in waiters:
                    try:
                        await w(None)
                    except Exception:  # one failed reply or ack must not drop the others
                        self.counters.inc("internal_errors", op="commit")
                        log.exception("post-commit step failed")

    async def _still_owner(self, rt: JobRuntime, err: PacerError) -> bool:
        """After a failed append: may we rebuild the job and go on (else it is given up)?"""
        if rt.closed or not self.own.owns(rt.job):
            return False
        if isinstance(err, Fenced):  # someone else appended: rebuild only if the lease still names us
            try:
                return await self.own.owner_of(rt.job) == self.own.instance
            except Exception:
                return False
        return True  # the log was unreachable: our lease still counts

    async def _give_up(self, rt: JobRuntime, waiters: list[Done], err: PacerError) -> None:
        """A stale owner's append was refused: stop serving the job at once, without rebuilding it
        (a later term of ours loads it afresh)."""
        self.counters.inc("jobs_given_up")
        log.warning("append refused and the job is no longer ours; dropping it",
                    extra={"fields": {"job": rt.job, "error": err.message, "instance": self.own.instance}})
        if not rt.closed:
            rt.closed, rt.ready = True, False  # answers 'unavailable' until the lease is given up
        tmp = Unavailable(f"shard job {rt.job!r} changed owner ({err.message}); retry")
        waiters = waiters + rt.waiters
        rt.records, rt.waiters = [], []
        for w in waiters:
            with contextlib.suppress(Exception):
                await w(tmp)
        # Our lease is stale even if its clock has not told it yet: give it up (on_lost drops the runtime),
        # then compete again as a standby; requests meanwhile go to the owner the lease names.
        await self.own.drop(rt.job)
        if self.jobs.get(rt.job) is rt:
            del self.jobs[rt.job]
        if not self._draining:
            self.own.want(rt.job)

    async def _fail_and_rebuild(self, rt: JobRuntime, waiters: list[Done], err: PacerError) -> None:
        self.counters.inc("commit_failures")
        log.warning("commit failed; rebuilding job from its log", extra={"fields": {"job": rt.job, "error": err.message}})
        rt.ready = False
        waiters = waiters + rt.waiters
        rt.records, rt.waiters = [], []
        tmp = Unavailable(f"shard log write failed ({err.message}); state rebuilt, retry")
        for w in waiters:
            with contextlib.suppress(Exception):
                await w(tmp)
        core, seq, _ = await retry_forever(f"rebuild {rt.job}", self.store.load, rt.job)
        if rt.closed:
            return  # lost meanwhile: the next owner loads it
        core.limits = self.cfg.limits
        core.renew_all(self.clock())
        rt.core, rt.last_seq, rt.ready, rt.since_snapshot = core, seq, True, 0
        self.counters.inc("rebuilds")

    async def _snapshot(self, rt: JobRuntime, snap: dict[str, Any], seq: int) -> None:
        try:
            if rt.closed or not self.own.owns(rt.job):
                return  # a stale owner's snapshot could overwrite a newer one
            await self.store.put_snapshot(rt.job, snap, seq)
            self.counters.inc("snapshots")
        except Exception:
            log.exception("snapshot failed (replay will just be longer)")
        finally:
            rt.snapshotting = False

    # ================================================================ loops
    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reap_interval_s)
            now = self.clock()
            for rt in list(self.jobs.values()):
                if rt.ready:
                    out = rt.core.expire(now)
                    if out.records:
                        self.counters.inc("leases_expired", len(out.records))
                        self.submit(rt, out, None)

    async def _progress_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.progress_interval_s)
            now = self.wall()
            for rt in list(self.jobs.values()):
                if rt.ready and rt.dirty:
                    rt.dirty = False
                    for name in list(rt.core.datasets):
                        await self.bus.publish(
                            subjects.event("shard", rt.job, subjects.ShardEventKind.PROGRESS),
                            ProgressEvent(now, rt.core.status(name)),
                        )

    async def _follow_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.follow_interval_s)
            for rt in list(self.jobs.values()):
                for name in list(rt.core.datasets):
                    await self.follow_once(rt, name)

    async def follow_once(self, rt: JobRuntime, name: str) -> None:
        """One round of following dataset ``name``'s stream (follow.py): append what arrived, close
        when idle.  The records known are read after the stream, in the same step as the append."""
        ds = rt.core.datasets.get(name)
        if ds is None or not ds.spec.stream or ds.closed or not rt.ready or rt.closed:
            return
        spec = ds.spec
        key = (rt.job, name)
        try:
            info = await self.bus.js.stream_info(spec.stream)
        except nats.js.errors.NotFoundError:
            if key not in self.follows or self.follows[key].avail != -2:
                self.counters.inc("stream_missing")
                log.warning("the stream of a streaming dataset is gone; its workers' reads will fail",
                            extra={"fields": {"job": rt.job, "dataset": name, "stream": spec.stream}})
            self.follows.setdefault(key, Follow()).avail = -2  # said once, until it is back
            return
        except (nats.errors.Error, TimeoutError):
            return  # the bus is failing over: next round
        if self.jobs.get(rt.job) is not rt or not rt.ready or rt.closed:
            return  # changed hands (or is being rebuilt) meanwhile
        ds = rt.core.datasets.get(name)
        if ds is None or ds.closed:
            return
        assert info.state is not None
        avail = max(0, int(info.state.last_seq) - spec.first_seq + 1)
        f = self.follows.setdefault(key, Follow(changed_at=self.clock()))
        n, close = decide(f, avail, ds.records_known, spec, self.clock(),
                          max_records=rt.core.limits.shards_per_epoch * ds.shard_records)
        if not n and not close:
            return
        try:
            out = rt.core.append(name, n, close)
        except PacerError as exc:  # a limit of the job (shards per job, records): counted, said, retried
            self.counters.inc("stream_append_refused")
            log.warning("stream samples not appended", extra={"fields": {"job": rt.job, "dataset": name,
                                                                         "error": exc.message}})
            return
        self.counters.inc("stream_appends")
        self.counters.inc("stream_records", n)
        if close:
            self.follows.pop(key, None)
        self.submit(rt, out, None)

    async def _node_events_subscribe(self) -> Any:
        """The pull subscription of the shared durable node-death consumer (created if new)."""
        filt = subjects.events_of("node", kind=subjects.NodeEventKind.DIED)
        return await self.bus.js.pull_subscribe(
            filt,
            durable=self.cfg.node_events_durable,
            stream=subjects.EVENTS_STREAM,
            config=ConsumerConfig(
                durable_name=self.cfg.node_events_durable,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.NEW,
                ack_wait=30.0,
                max_deliver=-1,
                filter_subject=filt,
            ),
        )

    async def _node_events_loop(self) -> None:
        """Node deaths from the durable events stream: a restart misses none."""
        sub, self._node_sub = self._node_sub or await self._node_events_subscribe(), None
        try:
            while not self._draining:
                try:
                    msgs = await sub.fetch(64, timeout=1.0)
                except TimeoutError:  # nats-py raises plain asyncio.TimeoutError here too
                    continue
                for m in msgs:
                    await self._on_node_died(m)
        finally:
            # nats-py's fetch takes stale status messages off the pending queue
            # without task_done(), so draining the connection would wait on this
            # subscription until Bus.close gives up (5 s).  Nothing of it is needed
            # any more: the durable consumer keeps our position.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_node_died(self, m: Msg) -> None:
        try:
            ev = decode(NodeEvent, m.data)
            subject_job = m.subject.split(".")[3]  # pacer.events.node.<job>.died
            if ev.job != subject_job:
                raise ValidationError(f"job: body names {ev.job!r} but the subject is for {subject_job!r}")
        except (DecodeError, ValidationError) as exc:
            # Permanent: a retry cannot fix it.  Dead-letter it, say why, count it.
            self.counters.inc("bad_node_events")
            # The error may echo the bad input: cut, so that the dead letter (the event plus headers)
            # still fits the max payload; one that does not is dropped, the event terminated anyway.
            with contextlib.suppress(nats.errors.MaxPayloadError):
                await self.bus.nc.publish(
                    subjects.dead_letter(self.name), m.data,
                    headers={"Pacer-Error": clip(exc.message, 1024), "Pacer-Subject": m.subject},
                )
            await m.term()
            return
        rt = self.jobs.get(ev.job)
        if rt is None or not rt.ready or rt.closed:
            if rt is not None:
                await m.nak(delay=jittered(0.5))  # being rebuilt, or no longer ours: later, or the owner
            elif self.own.owns(ev.job) or not await self._has_owner_or_log(ev.job):
                await m.ack()  # no shards of that job anywhere: nothing to return
            else:
                self.own.want(ev.job)  # nobody may own it yet; the owner (maybe we) gets it again
                self.counters.inc("node_events_passed")
                await m.nak(delay=jittered(0.2))  # jittered: see pacer.consumer.jittered
            return
        out = rt.core.node_died(ev.node)
        self.counters.inc("node_deaths")

        async def ack(err: PacerError | None) -> None:
            if err is None:
                await m.ack()
            else:
                await m.nak(delay=jittered(0.5))

        self.submit(rt, out, ack)


    async def _has_owner_or_log(self, job: str) -> bool:
        try:
            return await self.own.owner_of(job) is not None or await self.store.last_seq(job) > 0
        except Exception:
            return True  # cannot tell: keep the event

async def create(bus: Bus, cfg: RuntimeConfig) -> ShardService:
    """App factory: the only place that builds a ShardService from configuration."""
    env = os.environ
    scfg = ShardServiceConfig(lease_ttl_s=float(env.get("PACER_LEASE_TTL_S", DEFAULT_TTL_S)),
                              limits=limits_from_env(env),
                              max_queued=_positive(env, "PACER_SHARD_MAX_QUEUED", ShardServiceConfig.max_queued))
    return ShardService(bus, ShardLogStore(bus.js, cfg.replicas), scfg)


def _positive(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a whole number, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name}: must be >= 1, got {value}")
    return value


def limits_from_env(env: Mapping[str, str]) -> ShardLimits:
    """The shard limits from ``PACER_SHARD_MAX_*`` (docs/settings.md); an unset one keeps its default,
    a malformed one stops the service at start."""
    d = DEFAULT_LIMITS
    return ShardLimits(
        shards_per_epoch=_positive(env, "PACER_SHARD_MAX_SHARDS_PER_EPOCH", d.shards_per_epoch),
        shards_per_job=_positive(env, "PACER_SHARD_MAX_SHARDS_PER_JOB", d.shards_per_job),
        datasets_per_job=_positive(env, "PACER_SHARD_MAX_DATASETS_PER_JOB", d.datasets_per_job),
        epochs=_positive(env, "PACER_SHARD_MAX_EPOCHS", d.epochs),
        nodes_per_dataset=_positive(env, "PACER_SHARD_MAX_NODES_PER_DATASET", d.nodes_per_dataset),
        report_ids=_positive(env, "PACER_SHARD_MAX_REPORT_IDS", d.report_ids),
    )
