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
  owner answers the client directly.  NATS's ``allow_responses`` grants a
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

Concurrency: everything runs on one event loop; each job's lease is driven
by one task (its loop), the rest only reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
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


class Ownership:
    """Which jobs this instance of ``service`` owns; see the module docstring."""

    def __init__(self, bus: Bus, service: str, on_acquired: OnAcquired, on_lost: OnLost, *,
                 instance: str | None = None, ttl_s: float = DEFAULT_TTL_S, bucket: str = LEASE_BUCKET,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bus, self.service, self.bucket = bus, service, bucket
        self.instance = instance_id(service, instance)
        self.on_acquired, self.on_lost = on_acquired, on_lost
        self.ttl_s, self.clock = ttl_s, clock
        self.kv: KeyValue | None = None
        self.jobs: dict[str, _Job] = {}
        self.forwarded = 0  # requests passed to their owner
        self._tg: asyncio.TaskGroup | None = None
        self._sub: Subscription | None = None
        self._closed = False

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

    async def close(self) -> None:
        """Stop every job (``on_lost`` first, then the lease is released) and the forward subscription."""
        self._closed = True
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
        if owner and owner != self.instance and not forwarded:
            headers = {**(msg.headers or {}), FORWARDED_BY: self.instance, ORIGINAL_SUBJECT: msg.subject}
            await self.bus.nc.publish(forward_subject(self.service, _token(owner)), msg.data,
                                      reply=msg.reply, headers=headers)
            self.forwarded += 1
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
            if not lease.held and not await lease.acquire():
                return
            try:
                await self.on_acquired(st.job, lease)
            except Exception:
                log.exception("on_acquired failed; giving the job up", extra={"fields": {"job": st.job}})
                await lease.release()
                return
            st.owned = True
            log.info("job owned", extra={"fields": {"service": self.service, "job": st.job,
                                                    "instance": self.instance, "token": lease.token}})
            return
        action = decide(lease.view, lease.timing, lease.clock())
        if action is LeaseAction.RENEW or action is LeaseAction.LOST:
            await lease.renew()
        if not lease.held:
            await self._lose(st)

    async def _lose(self, st: _Job) -> None:
        if not st.owned:
            return
        st.owned = False
        log.warning("job no longer owned", extra={"fields": {"service": self.service, "job": st.job,
                                                             "instance": self.instance}})
        try:
            await self.on_lost(st.job)
        except Exception:
            log.exception("on_lost failed", extra={"fields": {"job": st.job}})
