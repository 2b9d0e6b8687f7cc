"""The service runtime: how every Pacer service starts, runs and stops.

One root ``asyncio.TaskGroup`` per service.  SIGTERM/SIGINT set a stop event;
shutdown then (1) stops consuming, (2) lets the service drain in-flight work
within ``drain_s``, (3) cancels what is left, (4) drains and closes the bus.
Long-lived loops run inside :func:`guard`, which logs an unexpected exit and
restarts the loop after a pause instead of letting one bad cycle kill the
service; ``CancelledError`` is always re-raised.

Every service answers ``pacer.svc.<service>.health`` with a ``Health`` reply,
and serves Prometheus ``/metrics`` when ``PACER_METRICS_PORT`` is set
(:mod:`pacer.metrics`).  Every request a service handles through
:func:`dispatch_rpc` is a ``SERVER`` span continuing the caller's trace and
counts into ``pacer_requests_total`` / ``pacer_request_duration_seconds``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import signal
import socket
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import nats.errors
from aiohttp import web
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from pacer import metrics, subjects, telemetry, tracing
from pacer.bus import Bus
from pacer.consumer import TRANSPORT_ERRORS
from pacer.contracts.common import Health
from pacer.errors import NotFound, PacerError, Unavailable

log = logging.getLogger("pacer.runtime")


class Service(Protocol):
    """What the runtime needs of a service's app object."""

    name: str
    counters: telemetry.Counters

    async def start(self, tg: asyncio.TaskGroup) -> None:
        """Subscribe and spawn loops in ``tg``; return once the service is ready."""

    async def drain(self) -> None:
        """Stop taking new work and finish what is in flight."""


@dataclass
class RuntimeConfig:
    nats_url: str = field(default_factory=lambda: os.environ.get("PACER_NATS_URL", "nats://127.0.0.1:4222"))
    replicas: int = field(default_factory=lambda: int(os.environ.get("PACER_REPLICAS", "1")))
    drain_s: float = 10.0
    instance: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # > 0: when the bus has refused this process's credentials for this long (every attempt, connecting or
    # reconnecting), the service stops and run_service raises Refused (a pod's agent: EXIT_REFUSED).
    give_up_refused_s: float = 0.0


class Refused(Exception):
    """The bus refused this process's credentials for ``RuntimeConfig.give_up_refused_s``."""


async def guard(name: str, loop: Callable[[], Awaitable[None]], pause: float = 1.0) -> None:
    """Run a long-lived loop forever; log and restart it if it ever exits or raises."""
    while True:
        try:
            await loop()
            log.error("loop %s exited unexpectedly; restarting", name)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("loop %s crashed; restarting in %.1fs", name, pause)
        await asyncio.sleep(pause)


RpcHandler = Callable[[str, Msg], Awaitable[None]]


async def dispatch_rpc(bus: Bus, counters: telemetry.Counters, handlers: Mapping[str, RpcHandler], msg: Msg) -> None:
    """Route ``pacer.rpc.<service>.<job>.<op>`` to ``handlers[op](job, msg)``.

    The loop boundary of every service's requests: a :class:`PacerError`
    becomes an error reply and an ``errors`` count; anything else is logged,
    counted as ``internal_errors`` and answered too, and never kills the
    subscription.
    """
    parts = msg.subject.split(".")
    op = parts[4] if len(parts) == 5 and parts[4] in handlers else "?"  # a bounded label: known ops only
    outcome = "ok"
    t0 = time.perf_counter()
    with tracing.span(f"handle {counters.service}.{op}", SpanKind.SERVER, msg.subject, msg.headers):
        try:
            job, op_ = subjects.parse_rpc(msg.subject)
            handler = handlers.get(op_)
            if handler is None:
                raise NotFound(f"unknown operation {op_!r}; one of {sorted(handlers)}")
            counters.inc("requests", op=op)
            await handler(job, msg)
        except PacerError as exc:
            outcome = exc.code
            tracing.fail(exc, exc.message)
            counters.inc("errors", code=exc.code, op=op)
            log.debug("request refused: %s", exc.message)
            await bus.respond_error(msg, exc)
        except TRANSPORT_ERRORS as exc:
            # The bus failed under the handler (a JetStream leader election on a cluster): temporary,
            # the client retries, instead of an "internal error" it would not retry.
            outcome = "unavailable"
            tracing.fail(exc)
            counters.inc("errors", code="unavailable", op=op)
            log.warning("request hit a bus failure: %s", type(exc).__name__)
            await bus.respond_error(msg, Unavailable(f"the bus is failing over ({type(exc).__name__}); retry"))
        except Exception as exc:
            outcome = "internal"
            tracing.fail(exc)
            counters.inc("internal_errors", op=op)
            log.exception("request failed")
            await bus.respond_error(msg, PacerError(f"internal error: {type(exc).__name__}"))
        finally:
            metrics.observe_request(counters.service, op, outcome, time.perf_counter() - t0)


def not_dumpable() -> None:
    """Make this process's memory and environment unreadable to other processes of its Unix user.

    A local pod runs user code as the stack's user; a service's secrets (its NATS password, the
    agents' token secret, the API token) sit in its environment and memory, which any process of
    the same user could read through ``/proc/<pid>/environ`` or ``ptrace``.  A process that is not
    dumpable (``prctl(PR_SET_DUMPABLE, 0)``) has its ``/proc`` files owned by root and refuses
    ptrace to everyone without CAP_SYS_PTRACE.  Its children are dumpable again after ``exec``.
    Linux only; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_dumpable = 4
    if libc.prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed: errno %d", ctypes.get_errno())


async def run_service(
    factory: Callable[[Bus, RuntimeConfig], Awaitable[Service]],
    cfg: RuntimeConfig,
    stop: asyncio.Event | None = None,
    install_signals: bool = True,
) -> None:
    """Connect, build the service with ``factory``, run until ``stop`` or a signal."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if install_signals:  # a service's own process (not one run inside a test's)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        not_dumpable()
    refused = asyncio.Event()

    def on_give_up() -> None:
        refused.set()
        stop.set()

    bus = await _connect(cfg, on_give_up)
    uptime = telemetry.Stopwatch()
    status = "starting"
    svc: Service | None = None
    metrics_runner: web.AppRunner | None = None

    async def on_health(msg: Msg) -> None:
        counters = svc.counters.snapshot() if svc else {}
        name = svc.name if svc else "?"
        await bus.respond(msg, Health(name, cfg.instance, status, uptime.elapsed(), counters))

    owner = object()  # this run's identity: tasks created under it are this service's (_cancel_service_tasks)
    _track_owners(loop)
    token = _OWNER.set(owner)
    try:
        async with asyncio.TaskGroup() as tg:
            svc = await factory(bus, cfg)
            if port := metrics.port_for(svc.name):
                metrics_runner = await metrics.serve(svc.counters, port)
            health_sub = await bus.nc.subscribe(subjects.health(svc.name), cb=on_health)
            await svc.start(tg)
            status = "ready"
            log.info("service ready", extra={"fields": {"service": svc.name, "instance": cfg.instance}})
            await stop.wait()
            status = "draining"
            log.info("service draining", extra={"fields": {"service": svc.name}})
            try:
                if not refused.is_set():  # a bus that refused us for good is closed: nothing to drain into
                    await asyncio.wait_for(svc.drain(), cfg.drain_s)
            except TimeoutError:
                log.warning("drain deadline passed; cancelling in-flight work")
            if not bus.nc.is_closed:
                await health_sub.unsubscribe()
            await _cancel_service_tasks(owner)
    finally:
        _OWNER.reset(token)
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await bus.close()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    if refused.is_set():
        raise Refused(f"the bus refused {cfg.instance}'s credentials for {cfg.give_up_refused_s:g} s")


async def _connect(cfg: RuntimeConfig, on_give_up: Callable[[], None]) -> Bus:
    """The service's bus; :class:`Refused` when its first connect was refused for ``cfg.give_up_refused_s``."""
    try:
        return await Bus.connect(cfg.nats_url, name=cfg.instance, replicas=cfg.replicas,
                                 give_up_refused_s=cfg.give_up_refused_s, on_give_up=on_give_up)
    except nats.errors.AuthorizationError as exc:
        raise Refused(f"the bus refused {cfg.instance}'s credentials for {cfg.give_up_refused_s:g} s") from exc


# Which run_service created a task (directly or from one of its tasks: a task's context is copied at
# creation, so the owner follows).  Two services in one process (tests: two instances of a service)
# then stop without cancelling each other's tasks.  Task.get_context() would do it on Python 3.12+.
_OWNER: contextvars.ContextVar[object | None] = contextvars.ContextVar("pacer_service_owner", default=None)
_TASK_OWNER: weakref.WeakKeyDictionary[asyncio.Task[Any], object] = weakref.WeakKeyDictionary()


def _track_owners(loop: asyncio.AbstractEventLoop) -> None:
    """Install (once per loop) a task factory that records each new task's owning service run."""
    previous = loop.get_task_factory()
    if getattr(previous, "_pacer_owners", False):
        return

    def factory(lp: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        task = previous(lp, coro, **kwargs) if previous else asyncio.Task(coro, loop=lp, **kwargs)
        owner = _OWNER.get()
        if owner is not None and isinstance(task, asyncio.Task):
            _TASK_OWNER[task] = owner
        return task

    factory._pacer_owners = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


async def _cancel_service_tasks(owner: object, rounds: int = 20, wait_s: float = 0.5) -> None:
    """Cancel the service's long-lived tasks (named ``pacer:...``, created under ``owner``) and see that they end.

    A cancellation can be lost: on Python 3.11 ``asyncio.wait_for`` swallows
    one that arrives as its inner future completes (fixed in 3.12), and
    nats-py's ``fetch`` waits that way; the task then carries on (a consumer
    parks for good) and the task group never exits.  So tasks still running
    after ``wait_s`` are cancelled again, up to ``rounds`` times.
    """
    pending = {t for t in asyncio.all_tasks()
               if t is not asyncio.current_task() and t.get_name().startswith("pacer:")
               and _TASK_OWNER.get(t) is owner}
    for _ in range(rounds):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=wait_s)
    if pending:
        log.error("tasks did not end after cancellation: %s", sorted(t.get_name() for t in pending))


def main_entry(name: str, factory: Callable[[Bus, RuntimeConfig], Awaitable[Service]]) -> None:
    """What a service's ``main`` calls: telemetry, uvloop when available, run."""
    telemetry.setup(name)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(run_service(factory, RuntimeConfig()))
    else:
        uvloop.run(run_service(factory, RuntimeConfig()))
