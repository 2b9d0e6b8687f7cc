"""Per-job ownership for a service that runs N instances (issue 13), on top of :mod:`pacer.lease`.

Every instance of a service (``instance``: ``PACER_INSTANCE``, else the
service's name and a random suffix) competes for the lease
``<service>.<job>`` of the bucket :data:`LEASE_BUCKET` for every job it
learns of (:meth:`Ownership.want`: from the event or the request that names
the job).  At most one instance owns a job at a time; it runs the job's
work between ``on_acquired(job, lease)`` and ``on_lost(job)``:

* ``on_acquired`` loads the job's state (from KV or streams) and starts the
  per-job work; :meth:`Ownership.owns` is True only once it returned;
* ``on_lost`` stops that work at once: it runs as soon as the lease cannot
  be counted on any more (taken over, not renewed in time, or a graceful
  stop, *before* the lease is released);
* a dead owner stops renewing: a contender takes the job over one TTL after
  it last saw the lease change (``ttl_s``, default 6 s).

Fencing: the job's state lives beside its lease, in the same bucket
(:func:`state_key`), and is written only through :meth:`Ownership.put_state`,
i.e. :meth:`Lease.fenced_put`: the server refuses the write of an owner
whose lease moved on (:class:`~pacer.lease.LeaseLost`), however late it
arrives.  Work with effects outside the bucket writes its intention there
first (see the controller), so a stale owner is stopped before it acts.

Requests (:meth:`Ownership.route`).  A service keeps subscribing its RPC
wildcard in a queue group, so a request for job J reaches any one instance:

* the owner of J handles it;
* an instance that does not own J reads who does (the lease's value) and
  forwards the message, unchanged and with the client's reply subject, to
  the owner's own subject :func:`forward_subject` (header
  ``Pacer-Forwarded-By``; the original subject in ``Pacer-Subject``): the
  owner answers the client directly.  The forwarder competes for J from
  then on (a standby: it takes J if the owner dies or hands it over).  NATS's ``allow_responses`` grants a
  user the right to publish to the reply subject of any message delivered
  to it, so the owner may answer a forwarded request as if it had been
  asked itself (tests/integration/test_ownership.py checks this on a
  server with users and permissions);
* nobody owns J: the receiver claims it (one acquisition attempt) and
  handles it if it won;
* a forwarded message is never forwarded again (the ownership changed in
  between): the receiver handles it if the service can answer for any job
  (``local_ok``), else replies ``unavailable`` and the client retries.
  ``local_ok`` also covers an owner that cannot be read or claimed.

Balance (:func:`jobs_to_give_up`).  Left alone, the first instance to hear
of a job keeps it, so one instance may do all the work.  Every
``balance_every_s`` (``PACER_BALANCE_EVERY_S``, default 30 s; 0: off) an
instance reads the service's leases and the live instances (each keeps a
presence key :func:`presence_key`, written with a per-message TTL of one
lease TTL and renewed three times per TTL, deleted on :meth:`Ownership.close`)
and gives up at most one job, and only while it holds at least two more
than the least-loaded live instance.  Giving up is the graceful hand-over:
``on_lost``, then the lease is released; the other instances, which compete
for the job too (they heard of it), take it within a poll of their lease
loop.  This instance leaves the released job alone for a grace of two TTLs
and takes it back only if nobody took it by then (a job never stays
ownerless; a hand-over that found no taker pauses balancing for
:data:`HOLD_PERIODS` periods), and does not give the same job up again for
:data:`HOLD_PERIODS` periods.  A service opts out (``balance_every_s=0``)
or keeps some jobs in place (``movable``).

Concurrency: everything runs on one event loop; each job's lease is driven
by one task (its loop), the rest only reads (the balance loop only marks a
job to be given up: its own loop does it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue

from pacer import subjects
from pacer.bus import Bus
from pacer.errors import Unavailable
from pacer.lease import Lease, LeaseAction, LeaseLost, decide

log = logging.getLogger("pacer.ownership")

LEASE_BUCKET = subjects.LEASE_BUCKET  # "pacer-leases": <service>.<job> and the owners' fenced state state.<service>.<job>
FORWARDED_BY = "Pacer-Forwarded-By"
ORIGINAL_SUBJECT = "Pacer-Subject"
DEFAULT_TTL_S = 6.0
PRESENCE = "alive"  # alive.<service>.<instance>: the live instances of a service (balance)
BALANCE_ENV = "PACER_BALANCE_EVERY_S"
DEFAULT_BALANCE_EVERY_S = 30.0
HOLD_PERIODS = 3  # a job given up is not given up again, and a failed hand-over pauses balancing, this many periods

OnAcquired = Callable[[str, Lease], Awaitable[None]]
OnLost = Callable[[str], Awaitable[None]]
Handler = Callable[[Msg], Awaitable[None]]


def _token(text: str) -> str:
    """``text`` as one safe subject token (and KV key part)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)[:64] or "_"


def instance_id(service: str, given: str | None = None) -> str:
    """This instance's name: ``given``, else ``PACER_INSTANCE``, else ``<service>-<random>``; one subject token."""
    name = given or os.environ.get("PACER_INSTANCE") or f"{service}-{uuid.uuid4().hex[:10]}"
    return _token(name)


def lease_key(service: str, job: str) -> str:
    return f"{service}.{job}"


def state_key(service: str, job: str) -> str:
    """Where the owner of ``job`` keeps the job's state (fenced by the lease :func:`lease_key`)."""
    return f"state.{service}.{job}"


def presence_key(service: str, instance: str) -> str:
    """``alive.<service>.<instance>``: present while the instance runs (per-message TTL, renewed)."""
    return f"{PRESENCE}.{service}.{instance}"


def balance_period(given: float | None = None) -> float:
    """The balance period in seconds: ``given``, else ``PACER_BALANCE_EVERY_S``, else 30; 0 turns balancing off."""
    if given is None:
        raw = os.environ.get(BALANCE_ENV, "").strip()
        if not raw:
            return DEFAULT_BALANCE_EVERY_S
        try:
            given = float(raw)
        except ValueError:
            raise ValueError(f"{BALANCE_ENV} must be a number of seconds (0: no balancing), not {raw!r}") from None
    if not math.isfinite(given) or given < 0:
        raise ValueError(f"{BALANCE_ENV} must be a number of seconds >= 0 (0: no balancing), not {given!r}")
    return given


def jobs_to_give_up(holders: Mapping[str, str], live: Iterable[str], me: str, acquired: Mapping[str, float],
                    given: Mapping[str, float], now: float, period: float,
                    in_flight: Iterable[str] = ()) -> list[str]:
    """Which of my jobs to give up now, so that the service's jobs spread over its instances (pure).

    ``holders``: job -> the instance its lease names (every lease of the
    service, as read from KV); ``live``: the instances with a presence key
    (``me`` counts as live); ``acquired``: the jobs I own and may give up ->
    when I acquired them; ``given``: the jobs I gave up -> when;
    ``in_flight``: those I gave up and have not yet seen taken (by another
    instance, or back by me); ``now`` and ``period`` (the balance period) in
    the same clock.

    At most one job per call (one call per period), and only when:

    * no hand-over of mine is still in flight (a job of ``in_flight`` that
      nobody holds yet): the next move is judged on counts that include the
      last one;
    * I hold at least two more jobs than the least-loaded live instance, so
      a move strictly narrows the spread and can never be answered by a move
      back (after it, I hold at least as many as the receiver);
    * I am the most loaded instance (ties: the first name): with three or
      more instances, two of them never feed the same one at once.

    The job: of those I acquired at least a period ago (a job just handed to
    me stays a while) and did not give up in the last :data:`HOLD_PERIODS`
    periods, the most recently acquired, ties by name.  The most recent is
    usually the youngest job, whose hand-over costs least (a short shard log
    to reload), and the jobs that have run here longest stay where they are;
    the choice is deterministic, so the same inputs always move the same job.
    """
    hold = HOLD_PERIODS * period
    if any(job not in holders for job in in_flight):
        return []
    counts = dict.fromkeys({*live, me}, 0)
    for holder in holders.values():
        if holder in counts:
            counts[holder] += 1
    mine, least, most = counts[me], min(counts.values()), max(counts.values())
    if mine - least < 2 or mine < most or min(i for i, n in counts.items() if n == most) != me:
        return []
    eligible = [job for job, at in acquired.items()
                if holders.get(job) == me and now - at >= period and not now - given.get(job, -math.inf) < hold]
    if not eligible:
        return []
    return [max(eligible, key=lambda job: (acquired[job], job))]


def forward_subject(service: str, instance: str) -> str:
    """``pacer.svc.<service>.<instance>.forward``: requests the other instances pass to this one."""
    return subjects.ownership_forward(service, instance)


@dataclass
class _Job:
    job: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    attempted: asyncio.Event = field(default_factory=asyncio.Event)  # the first acquisition attempt is done
    lease: Lease | None = None
    owned: bool = False  # on_acquired returned and on_lost has not run
    task: asyncio.Task[None] | None = None
    acquired_at: float | None = None  # when on_acquired returned (our clock)
    give_up: bool = False  # the balance rule chose it: the job's loop hands it over at its next round
    released_at: float | None = None  # handed over by balancing and not yet seen taken by another instance


class Ownership:
    """Which jobs this instance of ``service`` owns; see the module docstring."""

    def __init__(self, bus: Bus, service: str, on_acquired: OnAcquired, on_lost: OnLost, *,
                 instance: str | None = None, ttl_s: float = DEFAULT_TTL_S, bucket: str = LEASE_BUCKET,
                 clock: Callable[[], float] = time.monotonic, balance_every_s: float | None = None,
                 movable: Callable[[str], bool] | None = None) -> None:
        """``balance_every_s``: the balance period (None: ``PACER_BALANCE_EVERY_S``, else 30 s; 0: this
        instance neither announces itself nor gives jobs up); ``movable(job)``: whether the balance rule
        may give ``job`` up (default: every job)."""
        self.bus, self.service, self.bucket = bus, service, bucket
        self.instance = instance_id(service, instance)
        self.on_acquired, self.on_lost = on_acquired, on_lost
        self.ttl_s, self.clock = ttl_s, clock
        self.balance_every_s = balance_period(balance_every_s)
        self.movable: Callable[[str], bool] = movable or (lambda job: True)
        self.kv: KeyValue | None = None
        self.jobs: dict[str, _Job] = {}
        self.forwarded = 0  # requests passed to their owner
        self.owner_gone = 0  # requests whose job's lease named an instance no longer present
        self.given_up = 0  # jobs handed over by the balance rule
        self.taken_back = 0  # of those, taken back because nobody took them
        self._given: dict[str, float] = {}  # job -> when we handed it over (balance)
        self._quiet_until = -math.inf  # no balancing before (a hand-over found no taker)
        self._tg: asyncio.TaskGroup | None = None
        self._sub: Subscription | None = None
        self._closed = False
        self._closing = asyncio.Event()
        self._presence: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ lifecycle
    async def start(self, tg: asyncio.TaskGroup, on_forwarded: Handler | None = None, within: float = 30.0) -> None:
        """Open the bucket (retried while the cluster elects a leader) and, given ``on_forwarded``,
        subscribe this instance's forward subject."""
        self._tg = tg
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while self.kv is None:
            try:
                self.kv = await self.bus.kv(self.bucket, "Pacer leases: which instance owns what")
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        if on_forwarded is not None:
            async def forwarded(msg: Msg) -> None:
                headers = dict(msg.headers or {})
                original = headers.get(ORIGINAL_SUBJECT, "")
                inner = Msg(self.bus.nc, subject=original, reply=msg.reply, data=msg.data, headers=headers)
                await on_forwarded(inner)

            self._sub = await self.bus.nc.subscribe(forward_subject(self.service, self.instance), cb=forwarded)
        if self.balance_every_s > 0:
            try:
                await self._announce()  # present before the first balance round of any instance
            except (nats.errors.Error, TimeoutError) as exc:  # the loop tries again; meanwhile nobody gives us jobs
                log.warning("presence not written: %s", exc, extra={"fields": {"service": self.service}})
            self._presence = tg.create_task(self._presence_loop(), name=f"pacer:{self.service}:presence")
            tg.create_task(self._balance_loop(), name=f"pacer:{self.service}:balance")

    async def close(self) -> None:
        """Stop every job (``on_lost`` first, then the lease is released), the forward subscription and the
        presence (deleted first, so that no instance counts on this one any more)."""
        self._closed = True
        self._closing.set()
        if self._presence is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._presence  # not renewing any more, so the delete below stays the last word
            if self.kv is not None:
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await self.kv.purge(presence_key(self.service, self.instance), msg_ttl=self._presence_ttl())
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        for job in list(self.jobs):
            await self.drop(job)

    # ------------------------------------------------------------ jobs
    def want(self, job: str) -> None:
        """Compete for ``job`` from now on (no-op if already competing or closed)."""
        if job in self.jobs or self._closed:
            return
        assert self._tg is not None, "Ownership.start first"
        st = self.jobs[job] = _Job(job)
        st.task = self._tg.create_task(self._run(st), name=f"pacer:{self.service}:lease:{job}")

    def wanted(self, job: str) -> bool:
        return job in self.jobs

    async def drop(self, job: str) -> None:
        """Stop competing for ``job``: ``on_lost`` if we owned it, then the lease is released."""
        st = self.jobs.pop(job, None)
        if st is None:
            return
        st.stop.set()
        if st.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await st.task

    def owns(self, job: str) -> bool:
        """Whether we may act as the owner of ``job`` now (its lease is held and recent enough)."""
        st = self.jobs.get(job)
        return st is not None and st.owned and st.lease is not None and st.lease.valid()

    def owned(self) -> list[str]:
        return sorted(j for j in self.jobs if self.owns(j))

    def lease(self, job: str) -> Lease | None:
        st = self.jobs.get(job)
        return st.lease if st is not None and self.owns(job) else None

    async def claim(self, job: str, within: float = 5.0) -> bool:
        """Compete for ``job`` and wait, at most ``within``, until we own it or another instance is
        seen holding it (an attempt of unknown outcome, e.g. during a failover, is waited out); whether we own it."""
        self.want(job)
        st = self.jobs.get(job)
        if st is None:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not self.owns(job):
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(st.attempted.wait(), left)
            if self.owns(job):
                break
            if st.attempted.is_set():
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    holder = await self.owner_of(job)
                    if holder is not None and holder != self.instance:
                        return False
                await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
        return True

    async def present(self, instance: str) -> bool:
        """Whether ``instance`` has a presence key (it announces itself while it runs; a closing instance
        purges its key first).  A failed read says yes: forwarding is what happened before the check."""
        assert self.kv is not None
        try:
            await self.kv.get(presence_key(self.service, instance))
        except nats.js.errors.KeyNotFoundError:
            return False
        except (nats.errors.Error, TimeoutError):
            return True
        return True

    async def owner_of(self, job: str) -> str | None:
        """The instance the lease of ``job`` names now (None: nobody holds it)."""
        assert self.kv is not None
        try:
            entry = await self.kv.get(lease_key(self.service, job))
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value.decode() if entry.value else None

    # ------------------------------------------------------------ fenced state
    async def put_state(self, job: str, value: bytes) -> int:
        """Write the job's state, fenced by our lease (:class:`~pacer.lease.LeaseLost` if it moved on)."""
        st = self.jobs.get(job)
        if st is None or st.lease is None:
            raise LeaseLost(f"{self.instance} does not hold {job!r}")
        return await st.lease.fenced_put(state_key(self.service, job), value)

    async def get_state(self, job: str) -> bytes | None:
        assert self.kv is not None
        try:
            entry = await self.kv.get(state_key(self.service, job))
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value or None

    async def delete_state(self, job: str) -> None:
        """Forget the job's state (its work is over); fenced too: only while we own it."""
        st = self.jobs.get(job)
        if st is None or st.lease is None or not self.owns(job):
            return
        with contextlib.suppress(Exception):
            await st.lease.fenced_put(state_key(self.service, job), b"")

    # ------------------------------------------------------------ requests
    async def route(self, msg: Msg, job: str, handle: Handler, *, local_ok: bool = False) -> str:
        """Handle ``msg`` (a request about ``job``) here, or pass it to the owner; what was done:
        ``handled`` | ``forwarded`` | ``unavailable``."""
        if self.owns(job):
            await handle(msg)
            return "handled"
        forwarded = bool(msg.headers and msg.headers.get(FORWARDED_BY))
        owner: str | None = None
        if not forwarded:
            try:
                owner = await self.owner_of(job)
                if owner is None and await self.claim(job, within=max(1.0, self.ttl_s / 3)):
                    await handle(msg)
                    return "handled"
                if owner is None:
                    owner = await self.owner_of(job)
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("owner of %s unknown: %s", job, exc)
        if (owner and owner != self.instance and not forwarded and self.balance_every_s > 0
                and not await self.present(owner)):
            # Its lease outlived it (a release that lost a race with a renewal stays until the TTL): a
            # request passed on to it would come back as "no responders".  Nobody to pass it to.  (Only
            # instances that balance announce themselves; a service's instances share that setting.)
            self.owner_gone += 1
            owner = None
        if owner and owner != self.instance and not forwarded:
            headers = {**(msg.headers or {}), FORWARDED_BY: self.instance, ORIGINAL_SUBJECT: msg.subject}
            await self.bus.nc.publish(forward_subject(self.service, _token(owner)), msg.data,
                                      reply=msg.reply, headers=headers)
            self.forwarded += 1
            self.want(job)  # a standby from now on: takes the job if its owner dies or hands it over (balance)
            return "forwarded"
        if local_ok:
            await handle(msg)
            return "handled"
        await self.bus.respond_error(msg, Unavailable(
            f"{self.service}: job {job!r} is changing owner; retry"))
        return "unavailable"

    # ------------------------------------------------------------ the loop of one job
    async def _run(self, st: _Job) -> None:
        lease: Lease | None = None
        try:
            lease = await Lease.open(self.bus, self.bucket, lease_key(self.service, st.job), self.instance,
                                     self.ttl_s, clock=self.clock)
            st.lease = lease
            period = max(0.05, lease.timing.ttl_s * lease.timing.renew_after / 2)
            while not st.stop.is_set():
                try:
                    await self._round(st, lease)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("ownership round failed", extra={"fields": {"job": st.job}})
                st.attempted.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(st.stop.wait(), period)
        finally:
            st.attempted.set()
            await self._lose(st)
            if lease is not None:
                await lease.release()

    async def _round(self, st: _Job, lease: Lease) -> None:
        if not st.owned:
            if st.released_at is not None and not await self._may_take_back(st, lease):
                return
            if not lease.held and not await lease.acquire():
                return
            try:
                await self.on_acquired(st.job, lease)
            except Exception:
                log.exception("on_acquired failed; giving the job up", extra={"fields": {"job": st.job}})
                await lease.release()
                return
            st.owned, st.acquired_at = True, self.clock()
            log.info("job owned", extra={"fields": {"service": self.service, "job": st.job,
                                                    "instance": self.instance, "token": lease.token}})
            if st.released_at is not None:  # handed over, but nobody took it
                st.released_at = None
                self.taken_back += 1
                self._quiet_until = self.clock() + HOLD_PERIODS * self.balance_every_s
                log.warning("handed-over job taken back: no other instance took it", extra={"fields": {
                    "service": self.service, "job": st.job, "instance": self.instance}})
            return
        if st.give_up:
            await self._hand_over(st, lease)
            return
        action = decide(lease.view, lease.timing, lease.clock())
        if action is LeaseAction.RENEW or action is LeaseAction.LOST:
            await lease.renew()
        if not lease.held:
            await self._lose(st)

    async def _lose(self, st: _Job) -> None:
        st.give_up = False
        if not st.owned:
            return
        st.owned = False
        log.warning("job no longer owned", extra={"fields": {"service": self.service, "job": st.job,
                                                             "instance": self.instance}})
        try:
            await self.on_lost(st.job)
        except Exception:
            log.exception("on_lost failed", extra={"fields": {"job": st.job}})

    # ------------------------------------------------------------ balance
    def _presence_ttl(self) -> float:
        return float(max(1, math.ceil(self.ttl_s)))

    async def _announce(self) -> None:
        """Write (renew) our presence key; the value is how many jobs we own (for people reading the bucket)."""
        await self.bus.js.publish(
            f"$KV.{self.bucket}.{presence_key(self.service, self.instance)}", str(len(self.owned())).encode(),
            timeout=max(0.5, self.ttl_s / 3), headers={"Nats-TTL": f"{int(self._presence_ttl())}s"})

    async def _presence_loop(self) -> None:
        every = max(0.1, self.ttl_s / 3)
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), every)
            if self._closed:
                return
            try:
                await self._announce()
            except (nats.errors.Error, TimeoutError) as exc:  # a failover: the other instances see us gone
                log.warning("presence not renewed: %s", exc, extra={"fields": {"service": self.service}})

    async def _balance_loop(self) -> None:
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.balance_every_s)
            if self._closed:
                return
            try:
                await self.balance_once()
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("balance round skipped: %s", exc, extra={"fields": {"service": self.service}})
            except Exception:  # the loop's boundary: the next period tries again
                log.exception("balance round failed", extra={"fields": {"service": self.service}})

    async def balance_once(self) -> list[str]:
        """One balance round: read the service's leases and live instances, apply :func:`jobs_to_give_up`,
        and mark the chosen job to be handed over by its loop; the jobs chosen."""
        now = self.clock()
        period = self.balance_every_s
        if period <= 0 or self._closed or now < self._quiet_until:
            return []
        holders, live = await self.read_service()
        now = self.clock()
        if self._closed or now < self._quiet_until:  # (a hand-over came back while we read)
            return []
        self._given = {j: t for j, t in self._given.items() if now - t < HOLD_PERIODS * period}
        acquired = {job: st.acquired_at for job, st in self.jobs.items()
                    if st.acquired_at is not None and not st.give_up and self.owns(job) and self.movable(job)}
        in_flight = [job for job, st in self.jobs.items() if st.released_at is not None]
        chosen = jobs_to_give_up(holders, live, self.instance, acquired, self._given, now, period, in_flight)
        for job in chosen:
            self.jobs[job].give_up = True
            log.info("balance: handing a job over", extra={"fields": {
                "service": self.service, "job": job, "instance": self.instance,
                "mine": sum(1 for h in holders.values() if h == self.instance), "live": sorted(live)}})
        return chosen

    async def read_service(self) -> tuple[dict[str, str], set[str]]:
        """The service's leases (job -> the instance named) and its live instances, read from the bucket."""
        prefix = f"$KV.{self.bucket}."
        leases, alive = f"{prefix}{self.service}.", f"{prefix}{PRESENCE}.{self.service}."
        stream = f"KV_{self.bucket}"
        sub = await self.bus.js.pull_subscribe(
            "", stream=stream, config=ConsumerConfig(
                filter_subjects=[f"{leases}>", f"{alive}*"], ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, inactive_threshold=30.0, mem_storage=True))
        holders: dict[str, str] = {}
        live: set[str] = set()
        name: str | None = None
        try:
            info = await sub.consumer_info()
            name = info.name
            pending = int(info.num_pending or 0)
            while pending > 0:
                msgs = await sub.fetch(min(pending, 256), timeout=5.0)
                for m in msgs:
                    op = (m.headers or {}).get("KV-Operation", "")
                    if op in ("DEL", "PURGE") or not m.data:
                        continue
                    if m.subject.startswith(alive):
                        live.add(m.subject[len(alive):])
                    else:
                        holders[m.subject[len(leases):]] = m.data.decode()
                pending = int(msgs[-1].metadata.num_pending or 0) if msgs else 0
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if name is not None:
                with contextlib.suppress(Exception):
                    await self.bus.js.delete_consumer(stream, name)
        return holders, live

    async def _hand_over(self, st: _Job, lease: Lease) -> None:
        """Give ``st``'s job up for the balance rule: ``on_lost``, then the lease released (a graceful hand-over)."""
        await self._lose(st)
        await lease.release()
        st.released_at = now = self.clock()
        self._given[st.job] = now
        self.given_up += 1

    async def _may_take_back(self, st: _Job, lease: Lease) -> bool:
        """After a hand-over: whether our loop may compete for the job again.  Yes once another instance
        took it (we are a standby then: if it dies we take over as usual); yes if nobody took it within
        two TTLs (a job never stays ownerless); no before, so the other instances get it."""
        assert st.released_at is not None
        value = await lease.observe()
        if value and value != self.instance.encode():
            st.released_at = None  # it landed
            return True
        return bool(value) or self.clock() - st.released_at >= 2 * self.ttl_s
