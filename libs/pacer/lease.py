"""Per-key ownership with fencing: which instance of a service owns job J now.

A lease is one key of a JetStream KV bucket whose value names its holder.
It is written only by compare-and-set (``Nats-Expected-Last-Subject-Sequence``):

* **acquire**: create the key if absent (or deleted), or take it over at the
  revision seen unchanged for a whole TTL (its holder stopped renewing);
* **renew**: rewrite it at the revision we hold; a refused write means
  someone else took it -- the lease is lost;
* every write carries a per-message TTL (``Nats-TTL``, nats-server 2.11+,
  whole seconds), so the key of a dead holder also disappears by itself;
* **release**: delete it at our revision, so the next holder need not wait.

The holder counts its lease valid for ``lost_after * ttl`` from the moment it
*sent* its last acknowledged write: that write was stored, and any rival
started waiting, only later, so the holder stops believing before anyone
else can start.  Timing decides liveness only; safety comes from fencing:

* :attr:`Lease.token` is the revision at which this term began.  Revisions are
  stream sequences, so a later term always has a larger token: a resource
  that remembers the largest token it saw can refuse older ones.
* :meth:`Lease.fenced_put` writes another key of the same bucket only while
  the lease key is still at our revision (``...-Subject-Sequence-Subject``):
  a stale owner's write is refused by the server, however late it arrives.

The decisions (when to renew, when we lost it, when to take over) are the
pure :func:`decide`; :class:`Lease` applies them against the real KV, and
:func:`hold` runs the loop with ``on_acquired`` / ``on_lost`` callbacks.
Concurrency: one :class:`Lease` is driven by one task (``hold``: acquire,
renew, release); :meth:`Lease.fenced_put` may be called from other tasks of
the same event loop (it and ``renew`` take turns on a lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from pacer.bus import Bus

log = logging.getLogger("pacer.lease")

# "wrong last sequence": 10071 names the sequence found, 10164 (nats-server 2.12+) does not.
_WRONG_LAST_SEQUENCE = (10071, 10164)
_EXPECTED_SEQ = "Nats-Expected-Last-Subject-Sequence"
_EXPECTED_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"


class LeaseAction(str, Enum):
    """What a lease holder (or contender) does next; see :func:`decide`."""

    HOLD = "hold"  # we hold it and it is not yet time to renew
    RENEW = "renew"  # we hold it: rewrite it at our revision
    LOST = "lost"  # we held it but cannot be sure any more: stop acting as owner now
    ACQUIRE = "acquire"  # nobody holds it: create it
    TAKE_OVER = "take_over"  # its holder stopped renewing: rewrite it at the revision we saw
    WAIT = "wait"  # someone else holds it and renewed it recently


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """The TTL and when, as fractions of it after our last write was sent, to renew and to give up."""

    ttl_s: float
    renew_after: float = 1 / 3
    lost_after: float = 2 / 3

    def __post_init__(self) -> None:
        if self.ttl_s < 1:
            raise ValueError(f"lease ttl must be at least 1 s (the server keeps TTLs in whole seconds), not {self.ttl_s}")
        if not 0 < self.renew_after < self.lost_after < 1:
            raise ValueError("need 0 < renew_after < lost_after < 1")

    @property
    def server_ttl(self) -> str:
        """The ``Nats-TTL`` header: whole seconds, rounded up (the key then outlives our belief)."""
        return f"{math.ceil(self.ttl_s)}s"


@dataclass(frozen=True, slots=True)
class LeaseView:
    """What one participant knows, in its own monotonic seconds.

    ``written_at``: when we sent our last acknowledged write (None: we do not
    hold the lease).  ``seen_revision`` / ``seen_since``: the key's revision
    as we last read it (0: absent or deleted) and since when we have seen
    that same revision.
    """

    written_at: float | None = None
    seen_revision: int = 0
    seen_since: float = 0.0


def decide(view: LeaseView, timing: LeaseTiming, now: float) -> LeaseAction:
    """The next action of a holder or contender at ``now`` (pure: no IO, no clock)."""
    if view.written_at is not None:
        age = now - view.written_at
        if age >= timing.lost_after * timing.ttl_s:
            return LeaseAction.LOST
        return LeaseAction.RENEW if age >= timing.renew_after * timing.ttl_s else LeaseAction.HOLD
    if view.seen_revision == 0:
        return LeaseAction.ACQUIRE
    # The holder's last write was stored before we first saw it; a whole TTL later it counts itself lost.
    return LeaseAction.TAKE_OVER if now - view.seen_since >= timing.ttl_s else LeaseAction.WAIT


class Lease:
    """One key of a KV bucket held by ``holder``; see the module docstring.

    ``token`` (the revision this term began at) and ``revision`` (of our last
    write) are None while not held.  ``clock`` is monotonic seconds.
    """

    def __init__(self, bus: Bus, kv: KeyValue, bucket: str, key: str, holder: str, timing: LeaseTiming,
                 clock: Callable[[], float] = time.monotonic, timeout: float | None = None) -> None:
        self.bus, self.kv, self.bucket, self.key, self.holder = bus, kv, bucket, key, holder
        self.timing, self.clock = timing, clock
        self.timeout = timeout if timeout is not None else max(0.5, timing.ttl_s * timing.renew_after)
        self.view = LeaseView()
        self.token: int | None = None
        self.revision: int | None = None
        self._unconfirmed_since: float | None = None  # when an acquisition of unknown outcome was sent
        # Renewals and fenced writes both hinge on the lease key's revision: one at a time, so that a
        # write never checks a revision that a renewal in flight is replacing (a cluster refuses a CAS
        # on a subject with a write in flight: error 10164).
        self._writing = asyncio.Lock()

    @classmethod
    async def open(cls, bus: Bus, bucket: str, key: str, holder: str, ttl_s: float,
                   clock: Callable[[], float] = time.monotonic, within: float = 30.0) -> Lease:
        """A lease on ``key`` of ``bucket`` (the bucket is created at the bus's replicas on first use).

        Looking the bucket up is retried for ``within`` seconds: on a cluster
        a just-created or failing-over stream has no leader to answer for a
        few seconds.
        """
        timing = LeaseTiming(ttl_s)
        deadline = clock() + within
        while True:
            try:
                kv = await bus.kv(bucket, description="Pacer leases: which instance owns what")
                return cls(bus, kv, bucket, key, holder, timing, clock)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
                if clock() > deadline:
                    raise
                await asyncio.sleep(0.2)

    def subject(self, key: str | None = None) -> str:
        return f"$KV.{self.bucket}.{key or self.key}"

    @property
    def held(self) -> bool:
        return self.view.written_at is not None

    def valid(self, now: float | None = None) -> bool:
        """Whether we may still act as owner (held, and our last write is recent enough)."""
        now = self.clock() if now is None else now
        return decide(self.view, self.timing, now) in (LeaseAction.HOLD, LeaseAction.RENEW)

    # ------------------------------------------------------------ IO
    async def _write(self, expected: int, timeout: float | None = None) -> int:
        """CAS-write our name at ``expected`` (0: absent); the new revision.  Raises on refusal/failure."""
        ack = await self.bus.js.publish(
            self.subject(), self.holder.encode(), timeout=timeout or self.timeout,
            headers={_EXPECTED_SEQ: str(expected), "Nats-TTL": self.timing.server_ttl})
        return int(ack.seq)

    async def observe(self) -> bytes | None:
        """Read the key, note its revision (and since when we have seen that one); its value or None."""
        now = self.clock()
        try:
            entry = await self.kv.get(self.key)
            rev, value = int(entry.revision or 0), entry.value
        except nats.js.errors.KeyNotFoundError:  # absent, expired, or deleted (a KeyDeletedError)
            rev, value = 0, None
        if rev != self.view.seen_revision:
            self.view = LeaseView(self.view.written_at, rev, now)
        return value

    async def _deleted_revision(self) -> int:
        """The revision of the key's delete marker if it was released, 0 if absent, -1 if held."""
        try:
            await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError as exc:  # nats-py reports a deleted key so, with its entry
            entry = getattr(exc, "entry", None)
            return int(entry.revision or 0) if entry is not None else 0
        return -1

    async def acquire(self) -> bool:
        """Try once to become the holder (create, or take over a lease left to expire); True if we hold it."""
        if self.held:
            return True
        try:
            return await self._acquire()
        except (nats.errors.Error, TimeoutError) as exc:
            if isinstance(exc, nats.js.errors.BadRequestError):
                raise
            log.warning("lease acquisition: %s", exc, extra={"fields": {"key": self.key}})  # failover: next round
            return False

    async def _acquire(self) -> bool:
        value = await self.observe()
        if self._unconfirmed_since is not None and value == self.holder.encode():
            # Our earlier attempt was stored after all; count from when it was sent.
            self._hold_from(self._unconfirmed_since, self.view.seen_revision)
            return True
        action = decide(self.view, self.timing, self.clock())
        if action is LeaseAction.WAIT and value == self.holder.encode():
            # Our own name, left by an earlier incarnation of this instance (a process restarted under
            # the same PACER_INSTANCE: a container restart in the same pod): it is gone, take it now
            # instead of waiting out its TTL.  Instance names must be unique among live instances.
            action = LeaseAction.TAKE_OVER
        if action is LeaseAction.WAIT:
            return False
        expected = self.view.seen_revision
        if action is LeaseAction.ACQUIRE:
            expected = await self._deleted_revision()
            if expected < 0:
                return False
        sent = self.clock()
        try:
            rev = await self._write(expected)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code not in _WRONG_LAST_SEQUENCE:
                raise
            return False  # someone else was quicker
        except (nats.errors.Error, TimeoutError) as exc:
            # Maybe stored, maybe not: the next attempt reads the key and adopts it if it names us.
            if self._unconfirmed_since is None:
                self._unconfirmed_since = sent
            log.warning("lease acquisition unconfirmed: %s", exc, extra={"fields": {"key": self.key}})
            return False
        self._hold_from(sent, rev)
        return True

    def _hold_from(self, sent: float, rev: int) -> None:
        self.view = LeaseView(sent, rev, sent)
        self.token = self.revision = rev
        self._unconfirmed_since = None
        log.info("lease acquired", extra={"fields": {"key": self.key, "holder": self.holder, "token": rev}})

    async def renew(self) -> bool:
        """Rewrite the lease at our revision; False once it is lost (refused, or unconfirmed for too long).

        A timeout or a failover leaves the outcome unknown: we keep counting
        from our last confirmed write and try again later.  A refusal is
        final unless the key still names us at a newer revision (an earlier
        renewal was stored but its ack was lost): we adopt that revision,
        still counting from the last confirmed write.
        """
        if not self.held:
            return False
        assert self.revision is not None
        if not self.valid():
            self._drop("not renewed in time")
            return False
        async with self._writing:
            if not self.held:  # (a fenced write found the lease gone while we waited)
                return False
            sent = self.clock()
            assert self.view.written_at is not None and self.revision is not None
            # Do not wait for an answer past the moment we would count the lease lost anyway.
            left = self.view.written_at + self.timing.lost_after * self.timing.ttl_s - sent
            try:
                rev = await self._write(self.revision, timeout=max(0.05, min(self.timeout, left)))
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code not in _WRONG_LAST_SEQUENCE:
                    raise
                return await self._after_refusal()
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("lease renewal failed: %s", exc, extra={"fields": {"key": self.key}})
                if not self.valid():
                    self._drop(f"not renewed in time ({type(exc).__name__})")
                    return False
                return True
            self.view = LeaseView(sent, rev, sent)
            self.revision = rev
            return True

    async def _after_refusal(self) -> bool:
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            entry = None
        except (nats.errors.Error, TimeoutError):
            return self.valid()  # unknown: the next renewal will tell
        if entry is not None and entry.value == self.holder.encode() and (entry.revision or 0) >= (self.revision or 0):
            # Still ours: a renewal of ours was stored after all (adopt its revision), or the refusal was
            # about a write still in flight (10164).  Either way we keep counting from our last confirmed write.
            self.revision = int(entry.revision or 0)
            return self.valid()
        self._drop("taken over")
        return False

    def _drop(self, why: str) -> None:
        log.warning("lease lost: %s", why, extra={"fields": {"key": self.key, "holder": self.holder, "token": self.token}})
        self.view = LeaseView(None, self.revision or 0, self.clock())
        self.token = self.revision = None

    async def release(self) -> None:
        """Give the lease up (delete it at our revision) so another holder can take it at once."""
        rev = self.revision
        if not self.held or rev is None:
            return
        self.view, self.token, self.revision = LeaseView(), None, None
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self.kv.delete(self.key, last=rev)

    async def fenced_put(self, key: str, value: bytes) -> int:
        """Write ``key`` of the lease's bucket only if our lease is still at our revision; the new revision.

        The server checks the lease key's last sequence in the same stream
        (``Nats-Expected-Last-Subject-Sequence-Subject``), so a stale owner's
        write is refused (:class:`LeaseLost`) even if it arrives after a
        rival took over.  Serialised with :meth:`renew` (a lock), so the
        owner may write from any task while :func:`hold` renews.
        """
        async with self._writing:
            if not self.held or self.revision is None:
                raise LeaseLost(f"lease {self.key!r} is not held by {self.holder!r}")
            try:
                ack = await self.bus.js.publish(
                    self.subject(key), value, timeout=self.timeout,
                    headers={_EXPECTED_SEQ: str(self.revision), _EXPECTED_SEQ_SUBJECT: self.subject()})
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code not in _WRONG_LAST_SEQUENCE:
                    raise
                raise LeaseLost(f"lease {self.key!r} moved on from revision {self.revision}") from exc
            return int(ack.seq)


class LeaseLost(Exception):
    """A fenced write was refused: the lease is no longer ours."""


Callback = Callable[[int], Awaitable[None]]


async def hold(lease: Lease, stop: asyncio.Event, on_acquired: Callback, on_lost: Callback,
               period: float | None = None) -> None:
    """Hold ``lease`` until ``stop``: acquire, renew, report gains and losses, release at the end.

    ``on_acquired(token)`` runs after we became the holder; ``on_lost(token)``
    as soon as we must stop acting as owner (taken over, not renewed in time,
    or ``stop``) -- at a graceful stop *before* the lease is released, so the
    next holder never overlaps us.  Errors of one round are logged and the
    loop goes on (the lease then simply is not renewed).
    """
    period = period if period is not None else lease.timing.ttl_s * lease.timing.renew_after / 2
    token: int | None = None
    try:
        while not stop.is_set():
            try:
                if token is None:
                    if await lease.acquire():
                        token = lease.token
                        assert token is not None
                        await on_acquired(token)
                else:
                    action = decide(lease.view, lease.timing, lease.clock())
                    if action is LeaseAction.RENEW or action is LeaseAction.LOST:
                        await lease.renew()
                    if not lease.held:
                        lost, token = token, None
                        await on_lost(lost)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("lease round failed", extra={"fields": {"key": lease.key}})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period)
    finally:
        if token is not None:
            with contextlib.suppress(Exception):
                await on_lost(token)
            await lease.release()
