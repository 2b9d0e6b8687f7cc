"""The auth callout responder as a service: ``python -m pacer_services.auth_callout.main``.

Subscribes to ``$SYS.REQ.USER.AUTH`` (queue group ``pacer-auth``: replicas
share the requests) with the NATS user ``auth``, which the server lets
bypass the callout, and answers each request with :func:`core.decide`.
Keys come from the environment, never from the bus:

* ``PACER_AUTH_ISSUER_SEED``: the seed (``SA...``) of the account whose
  public key is the ``issuer`` of the server's ``auth_callout`` block;
* ``PACER_AGENT_TOKEN_SECRET``: the secret the executor derives each job's
  agent password from (:func:`pacer.authjwt.agent_token`).

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

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pacer import authjwt, security
from pacer.bus import Bus
from pacer.errors import ValidationError
from pacer.runtime import RuntimeConfig
from pacer.telemetry import Counters
from pacer_services.auth_callout import core

log = logging.getLogger("pacer.auth_callout")
QUEUE = "pacer-auth"


class AuthCalloutService:
    name = security.AUTH_SERVICE

    def __init__(self, bus: Bus, keys: core.CalloutKeys) -> None:
        self.bus = bus
        self.keys = keys
        self.counters = Counters(self.name)
        self.sub: Subscription | None = None

    async def start(self, tg: asyncio.TaskGroup) -> None:
        self.sub = await self.bus.nc.subscribe(security.AUTH_CALLOUT_SUBJECT, queue=QUEUE, cb=self.handle)

    async def handle(self, msg: Msg) -> None:
        try:
            verdict = core.decide(msg.data.decode(errors="replace"), self.keys, int(time.time()))
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
    return AuthCalloutService(bus, keys_from_env())
