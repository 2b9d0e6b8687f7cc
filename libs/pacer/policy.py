"""Write a straggler policy as a service: a function from a job's statistics window to actions.

A policy is any process that answers ``pacer.policy.<name>.decide``
(:class:`~pacer.contracts.policy.PolicyRequest` ->
:class:`~pacer.contracts.policy.PolicyDecision`).  This module is all a
policy author needs::

    from pacer.contracts.agent import ActionKind
    from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest
    from pacer.policy import run_policy

    def decide(req: PolicyRequest) -> PolicyDecision:
        slow = [n.node for n in req.stats.nodes if n.slowdown_short >= 2.0]
        acts = [PolicyAction(ActionKind.KILL_RESTART, node=n, reason="2x slower") for n in slow]
        return PolicyDecision(req.job, "my-policy", acts, reason=f"{len(slow)} slow")

    run_policy("my-policy", decide)          # serves until SIGTERM / Ctrl-C

A job names it in its spec (``policies: {straggler: my-policy}``).  Every
instance joins the queue group ``policy-<name>``, so several instances share
the load.  A request that cannot be decoded, or a ``decide`` that raises,
gets an error reply (the controller then falls back to ``none`` for that
round and says so in its decision event); the service keeps running.
``decide`` may be a coroutine function.  See ``examples/policies/``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode
from pacer.contracts.policy import PolicyDecision, PolicyRequest
from pacer.errors import PacerError
from pacer.telemetry import Counters

log = logging.getLogger("pacer.policy")

Decide = Callable[[PolicyRequest], PolicyDecision | Awaitable[PolicyDecision]]


async def serve_policies(bus: Bus, policies: Mapping[str, Decide], counters: Counters | None = None) -> list[Subscription]:
    """Answer ``pacer.policy.<name>.decide`` for every policy; returns the subscriptions."""
    counters = counters or Counters("policy")
    subs = []
    for name, decide in policies.items():
        subs.append(await bus.nc.subscribe(subjects.policy_decide(name), queue=f"policy-{name}",
                                           cb=_handler(bus, name, decide, counters)))
    await bus.nc.flush()
    return subs


def _handler(bus: Bus, name: str, decide: Decide, counters: Counters) -> Callable[[Msg], Awaitable[None]]:
    async def on_request(msg: Msg) -> None:
        try:
            req = decode(PolicyRequest, msg.data)
            t0 = time.perf_counter()
            out = decide(req)
            if inspect.isawaitable(out):
                out = await out
            if not isinstance(out, PolicyDecision):
                raise PacerError(f"policy {name}: decide returned {type(out).__name__}, not a PolicyDecision")
            if not out.decision_ms:
                out = replace(out, decision_ms=(time.perf_counter() - t0) * 1e3)
            counters.inc("decisions", policy=name)
            await bus.respond(msg, out)
        except PacerError as exc:
            counters.inc("errors", policy=name, code=exc.code)
            await bus.respond_error(msg, exc)
        except Exception as exc:  # a bug in decide: answer, count, keep serving
            counters.inc("errors", policy=name, code="internal")
            log.exception("policy %s failed", name)
            await bus.respond_error(msg, PacerError(f"policy {name} failed: {type(exc).__name__}: {exc}"))

    return on_request


def run_policy(name: str, decide: Decide, nats_url: str | None = None) -> None:
    """Serve one policy until SIGTERM or Ctrl-C (``PACER_NATS_URL`` says where the bus is)."""
    url = nats_url or os.environ.get("PACER_NATS_URL", "nats://127.0.0.1:4222")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        bus = await Bus.connect(url, name=f"policy-{name}")
        try:
            await serve_policies(bus, {name: decide})
            log.info("policy %s serving on %s", name, subjects.policy_decide(name))
            print(f"policy {name} ready on {subjects.policy_decide(name)}", flush=True)
            await stop.wait()
        finally:
            await bus.close()

    asyncio.run(main())
