"""The auth callout responder as a service: ``python -m pacer_services.auth_callout.main``.

Subscribes to ``$SYS.REQ.USER.AUTH`` (queue group ``pacer-auth``: replicas
share the requests) with the NATS user ``auth``, which the server lets
bypass the callout, and answers each request with :func:`core.decide`.
Keys come from the environment, never from the bus:

* ``PACER_AUTH_ISSUER_SEED``: the seed (``SA...``) of the account whose
  public key is the ``issuer`` of the server's ``auth_callout`` block;
* ``PACER_AGENT_TOKEN_SECRET``: the secret the executor derives each job's
  agent password from (:func:`pacer.authjwt.agent_token`).

A token whose MAC and expiry are right is checked against the job's record
(:class:`JobViews`): one stream-message get of key ``<job>`` in the KV
bucket ``pacer-jobs`` (the only JetStream API the ``auth`` user may call,
:mod:`pacer.security`), kept ``PACER_AUTH_JOB_CACHE_S`` (2 s) so the pods of
a job connecting at once cost one read.  A job ended or replaced is refused
that long after at the latest; a record that cannot be read refuses the
connection (the agent retries).

Why a service of its own rather than a task in the executor: it must be up
for any agent to connect, holds the only key that can mint NATS users
(the executor never needs it), and its failure must not take the pods'
supervisor with it; it is small and stateless, so it runs as replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from pacer import authjwt, security, subjects
from pacer.bus import Bus
from pacer.codec import decode
from pacer.contracts.jobs import JobRecord
from pacer.errors import ValidationError
from pacer.jobs.lifecycle import TERMINAL
from pacer.runtime import RuntimeConfig
from pacer.telemetry import Counters
from pacer_services.auth_callout import core

log = logging.getLogger("pacer.auth_callout")
QUEUE = "pacer-auth"


JOB_CACHE_S = 2.0
JOB_CACHE_MAX = 4096


class JobViews:
    """Each job's :class:`core.JobView`, read from its record in ``pacer-jobs`` and kept ``ttl_s``.

    Concurrent lookups of one job share one read; ``None`` is cached too (no
    such record).  A read that fails raises (the caller refuses), and is not
    cached.
    """

    def __init__(self, bus: Bus, ttl_s: float = JOB_CACHE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = KeyValue(name=subjects.JOB_BUCKET, stream=f"KV_{subjects.JOB_BUCKET}",
                           pre=f"$KV.{subjects.JOB_BUCKET}.", js=bus.js, direct=False)
        self.ttl_s = ttl_s
        self.clock = clock
        self._cache: dict[str, tuple[float, core.JobView | None]] = {}
        self._reading: dict[str, asyncio.Future[core.JobView | None]] = {}
        self.reads = 0

    async def view(self, job: str) -> core.JobView | None:
        hit = self._cache.get(job)
        if hit is not None and self.clock() - hit[0] < self.ttl_s:
            return hit[1]
        if job in self._reading:
            return await asyncio.shield(self._reading[job])
        fut: asyncio.Future[core.JobView | None] = asyncio.get_running_loop().create_future()
        self._reading[job] = fut
        try:
            v = await self._read(job)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            del self._reading[job]
        fut.set_result(v)
        if len(self._cache) >= JOB_CACHE_MAX:
            self._cache.pop(next(iter(self._cache)))
        self._cache[job] = (self.clock(), v)
        return v

    async def _read(self, job: str) -> core.JobView | None:
        self.reads += 1
        try:
            entry = await self.kv.get(job)
        except nats.js.errors.KeyNotFoundError:  # also a deleted or purged key
            return None
        if not entry.value:
            return None
        try:
            rec = decode(JobRecord, entry.value)
        except Exception as exc:  # a record this version cannot read: no admission on it
            raise ValidationError(f"job {job!r}: unreadable record: {exc!r}") from exc
        # Ended means torn down: a completed job's pods still finish (the chief's result, a last report)
        # and may need a new connection until the executor has removed them.
        return core.JobView(authjwt.incarnation(rec.submitted_at), rec.state in TERMINAL and rec.torn_down)


class AuthCalloutService:
    name = security.AUTH_SERVICE

    def __init__(self, bus: Bus, keys: core.CalloutKeys, job_cache_s: float = JOB_CACHE_S) -> None:
        self.bus = bus
        self.keys = keys
        self.counters = Counters(self.name)
        self.sub: Subscription | None = None
        self.jobs = JobViews(bus, job_cache_s)

    async def start(self, tg: asyncio.TaskGroup) -> None:
        self.sub = await self.bus.nc.subscribe(security.AUTH_CALLOUT_SUBJECT, queue=QUEUE, cb=self.handle)

    async def handle(self, msg: Msg) -> None:
        try:
            step = core.check(msg.data.decode(errors="replace"), self.keys, int(time.time()))
            if isinstance(step, core.Pending):
                try:
                    job = await self.jobs.view(step.job)
                except (nats.errors.Error, ValidationError, TimeoutError) as exc:
                    self.counters.inc("auth_job_lookup_failures")
                    verdict = core.refuse(step, self.keys, int(time.time()), f"job record unreadable: {exc!r}")
                else:
                    verdict = core.conclude(step, self.keys, int(time.time()), job)
            else:
                verdict = step
        except Exception:  # a loop boundary: one bad request never stops the responder
            log.exception("auth callout request failed")
            self.counters.inc("auth_errors")
            return
        self.counters.inc("auth_requests", outcome=verdict.outcome)
        if verdict.outcome != "admitted":
            log.warning("connection refused: %s", verdict.reason, extra={"fields": {"user": verdict.user}})
        if verdict.response is not None and msg.reply:
            await self.bus.nc.publish(msg.reply, verdict.response.encode())

    async def drain(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()


def keys_from_env(env: dict[str, str] | None = None) -> core.CalloutKeys:
    """The issuer key pair and agent secret from ``PACER_AUTH_ISSUER_SEED`` / ``PACER_AGENT_TOKEN_SECRET``."""
    env = dict(os.environ) if env is None else env
    seed, secret = env.get("PACER_AUTH_ISSUER_SEED", ""), env.get("PACER_AGENT_TOKEN_SECRET", "")
    if not seed or not secret:
        raise ValidationError("the auth callout needs PACER_AUTH_ISSUER_SEED and PACER_AGENT_TOKEN_SECRET")
    issuer = authjwt.KeyPair.from_seed(seed)
    if issuer.prefix != authjwt.PREFIX_ACCOUNT:
        raise ValidationError("PACER_AUTH_ISSUER_SEED must be an account seed (SA...)")
    return core.CalloutKeys(issuer, secret)


async def create(bus: Bus, rc: RuntimeConfig) -> AuthCalloutService:
    """App factory."""
    return AuthCalloutService(bus, keys_from_env(),
                              float(os.environ.get("PACER_AUTH_JOB_CACHE_S", str(JOB_CACHE_S))))
