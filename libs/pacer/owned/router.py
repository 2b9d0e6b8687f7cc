"""Requests about jobs, routed to the instance that owns the job: one router for every service.

Two or more instances of a service share its jobs by leases
(:class:`pacer.ownership.Ownership`).  A request about job J
(``pacer.rpc.<service>.<J>.<op>``, on a queue group, so any instance gets
it) is:

* answered here when this instance owns J;
* answered here, claiming nothing, when J is unknown to every instance (the
  service's ``unknown`` hook: no owner, no log, no record), so a request for
  a job that does not exist gets ``not_found`` rather than a lease;
* otherwise passed to :meth:`Ownership.route`: claimed here when nobody owns
  J, forwarded to the owner (``pacer.svc.<service>.<instance>.forward``,
  with ``Pacer-Forwarded-By``: a forwarded request is never forwarded
  again), answered here anyway when the service may (``local_ok``), or told
  ``unavailable`` (retry: J is changing owner).

A subject that names no valid job gets its error reply from here; jobs in
``local_jobs`` (e.g. ``_all``) are answered by any instance.  How a request's
work is run is the service's (``run``): inline (the subscription's callback
awaits it), a task of its own (a request that waits for its job must not
hold up other jobs'), or the job's sequential inbox.  Every failure of
routing itself is caught here, counted (``internal_errors``, op ``route``)
and answered ``unavailable``: the client retries, the service goes on.

Services hand their subscriptions to :meth:`Router.on_rpc` and
:meth:`Router.on_forwarded` and define no routing of their own (``make
lint`` checks it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from typing import Any

from nats.aio.msg import Msg

from pacer import subjects
from pacer.bus import Bus
from pacer.errors import PacerError, Unavailable
from pacer.ownership import FORWARDED_BY, Ownership
from pacer.runtime import dispatch_rpc
from pacer.telemetry import Counters

log = logging.getLogger("pacer.owned.router")

Work = Callable[[], Coroutine[Any, Any, None]]
#: How a request's work runs: ``run(job, msg, work)`` (inline by default).
Runner = Callable[[str, Msg, Work], Awaitable[None]]


async def inline(job: str, msg: Msg, work: Work) -> None:
    await work()


def forwarded(msg: Msg) -> bool:
    """Whether another instance passed this request on (it is then never forwarded again)."""
    return bool(msg.headers and msg.headers.get(FORWARDED_BY))


class Router:
    """The routing of one service's job requests (module docstring).

    ``rpc`` maps an op to its handler (:func:`pacer.runtime.dispatch_rpc`).
    Hooks, each optional: ``check_job(job)`` raises a :class:`PacerError` for
    a job id the service cannot own; ``unknown(job, op)`` says the job exists
    nowhere, so the request is answered here without claiming it (asked only
    for requests that were not forwarded); ``before(job)`` runs before
    :meth:`Ownership.route` (e.g. wait for a claim in progress here);
    ``after(job, how)`` after it, with ``handled`` | ``forwarded`` |
    ``unavailable``.
    """

    def __init__(self, bus: Bus, own: Ownership, counters: Counters, rpc: Mapping[str, Any], *,
                 local_ok: bool = False, local_jobs: Collection[str] = (),
                 check_job: Callable[[str], object] | None = None,
                 unknown: Callable[[str, str], Awaitable[bool]] | None = None,
                 before: Callable[[str], Awaitable[None]] | None = None,
                 after: Callable[[str, str], Awaitable[None]] | None = None,
                 run: Runner = inline) -> None:
        self.bus, self.own, self.counters, self.rpc = bus, own, counters, rpc
        self.local_ok, self.local_jobs = local_ok, frozenset(local_jobs)
        self.check_job, self.unknown, self.before, self.after, self.run = check_job, unknown, before, after, run

    async def dispatch(self, msg: Msg) -> None:
        """Answer ``msg`` here (its op's handler, or an error reply)."""
        await dispatch_rpc(self.bus, self.counters, self.rpc, msg)

    async def on_rpc(self, msg: Msg) -> None:
        """A request from the service's queue group."""
        try:
            job, op = subjects.parse_rpc(msg.subject)
            if self.check_job is not None:
                self.check_job(job)
        except PacerError:
            await self.dispatch(msg)  # the error reply, from here
            return
        if job in self.local_jobs:
            await self.dispatch(msg)
            return
        await self.run(job, msg, lambda: self._route(msg, job, op))

    async def on_forwarded(self, msg: Msg) -> None:
        """A request another instance passed us, believing we own its job (the original subject restored)."""
        self.counters.inc("requests_forwarded_in")
        await self.on_rpc(msg)

    async def _route(self, msg: Msg, job: str, op: str) -> None:
        try:
            if self.own.owns(job):
                await self.dispatch(msg)
                return
            passed_on = forwarded(msg)
            if not passed_on and self.unknown is not None and await self.unknown(job, op):
                await self.dispatch(msg)  # not_found (or the like), from here; nothing claimed
                return
            if not passed_on and self.before is not None:
                await self.before(job)
            how = await self.own.route(msg, job, self.dispatch, local_ok=self.local_ok)
            if how != "handled":
                self.counters.inc(f"requests_{how}")  # requests_forwarded | requests_unavailable
            if self.after is not None:
                await self.after(job, how)
        except Exception:  # the loop boundary: the client gets an answer, the service goes on
            self.counters.inc("internal_errors", op="route")
            log.exception("request routing failed", extra={"fields": {"subject": msg.subject}})
            with contextlib.suppress(Exception):
                await self.bus.respond_error(msg, Unavailable(
                    f"{self.own.service}: owner of job {job!r} unknown; retry"))
