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
the load.  A request that cannot be decoded, whose numbers are outside their
sane ranges (:func:`~pacer.contracts.policy.validate_request`: an
``invalid`` error reply, counted), or a ``decide`` that raises, gets an
error reply (the controller then falls back to ``none`` for that round and
says so in its decision event); the service keeps running.  See
``examples/policies/``.

What runs where (bounded decisions, :class:`DecisionLimits`)
-----------------------------------------------------------
The serving process only receives, relays and answers.  Each policy has
its own pool of worker processes (``workers``, default 1), forked from the
serving process when it starts serving, and ``decide`` runs there:

* a decision that takes longer than ``timeout_s`` (default 4 s, below the
  controller's 5 s wait) gets a ``limit_exceeded`` error reply; its worker
  is killed (SIGKILL) and a fresh one forked in its place;
* a worker may grow its address space by at most ``memory_mb`` (default
  1024 MB) over its size at fork (``RLIMIT_AS``): a decision that allocates
  more fails with ``MemoryError`` (a ``limit_exceeded`` reply) or dies, and
  its worker is replaced;
* pools are independent, so a slow or huge decision of one policy never
  delays another policy's answers, and the serving event loop never runs a
  decision itself (a worker also decodes and validates the request).

``decide`` therefore sees the memory of the serving process as it was at
the fork: module globals and closures work, and what a decision changes
stays in its worker (kept from one decision to the next, lost when the
worker is replaced; with ``workers`` > 1 each worker has its own).  Its
return value (or exception) goes back to the serving process; nothing else
does.  A coroutine function works too: it runs on the worker's own event
loop, so it may open connections of its own but must not use the serving
process's bus.  ``workers=0`` decides in the serving process as before,
unbounded.  What the bounding costs per decision is in docs/policies.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgpack
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode, encode
from pacer.contracts.common import clip
from pacer.contracts.policy import PolicyDecision, PolicyRequest, validate_request
from pacer.errors import DecodeError, LimitExceeded, PacerError, Unavailable, ValidationError
from pacer.telemetry import Counters

log = logging.getLogger("pacer.policy")

Decide = Callable[[PolicyRequest], PolicyDecision | Awaitable[PolicyDecision]]

_FRAME = 4  # bytes of the big-endian length before every message between the server and a worker


@dataclass(frozen=True, slots=True)
class DecisionLimits:
    """How each policy's decisions are bounded (module docstring); from ``PACER_POLICY_*``."""

    timeout_s: float = 4.0  # PACER_POLICY_DECIDE_TIMEOUT_S
    memory_mb: int = 1024  # PACER_POLICY_MEMORY_MB (0: no address-space limit)
    workers: int = 1  # PACER_POLICY_WORKERS, per policy (0: decide in the serving process, unbounded)
    queued: int = 64  # requests per policy waiting for a worker; more get a temporary error

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DecisionLimits:
        env = os.environ if env is None else env
        d = cls()

        def get(name: str, conv: Callable[[str], Any], default: Any, lo: float) -> Any:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = conv(raw)
            except ValueError:
                raise ValueError(f"{name}: expected a number, got {raw!r}") from None
            if not value >= lo:
                raise ValueError(f"{name}: must be >= {lo:g}, got {raw}")
            return value

        return cls(timeout_s=get("PACER_POLICY_DECIDE_TIMEOUT_S", float, d.timeout_s, 0.001),
                   memory_mb=get("PACER_POLICY_MEMORY_MB", int, d.memory_mb, 0),
                   workers=get("PACER_POLICY_WORKERS", int, d.workers, 0),
                   queued=d.queued)


class PolicyServer(list[Subscription]):
    """What :func:`serve_policies` returns: its subscriptions (a list, as before), plus :meth:`close`,
    which also stops the worker processes (they end by themselves once this process exits)."""

    def __init__(self) -> None:
        super().__init__()
        self.pools: dict[str, DecisionPool] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        for sub in self:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for pool in self.pools.values():
            pool.closed = True  # a decision cancelled now kills its worker without forking another
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5.0)
        for pool in self.pools.values():
            await pool.close()


async def serve_policies(bus: Bus, policies: Mapping[str, Decide], counters: Counters | None = None,
                         limits: DecisionLimits | None = None) -> PolicyServer:
    """Answer ``pacer.policy.<name>.decide`` for every policy, each with its own worker pool."""
    counters = counters or Counters("policy")
    limits = limits or DecisionLimits.from_env()
    server = PolicyServer()
    for name, decide in policies.items():
        pool = DecisionPool(name, decide, limits, counters)
        await pool.start()
        server.pools[name] = pool
        server.append(await bus.nc.subscribe(subjects.policy_decide(name), queue=f"policy-{name}",
                                             cb=_handler(bus, name, pool, counters, server.tasks)))
    await bus.nc.flush()
    return server


def _handler(bus: Bus, name: str, pool: DecisionPool, counters: Counters,
             tasks: set[asyncio.Task[None]]) -> Callable[[Msg], Awaitable[None]]:
    async def answer(msg: Msg) -> None:
        try:
            out = await pool.decide(msg.data)
            counters.inc("decisions", policy=name)
            await bus.respond(msg, out)
        except PacerError as exc:
            counters.inc("errors", policy=name, code=exc.code)
            if isinstance(exc, ValidationError):
                counters.inc("invalid_requests", policy=name)
            await bus.respond_error(msg, exc)
        except Exception as exc:  # a bug in decide (in-process) or here: answer, count, keep serving
            counters.inc("errors", policy=name, code="internal")
            log.exception("policy %s failed", name)
            await bus.respond_error(msg, PacerError(f"policy {name} failed: {type(exc).__name__}: {exc}"))
        finally:
            pool.waiting -= 1

    async def on_request(msg: Msg) -> None:
        # The subscription's callbacks run one at a time: each request gets a task of its own, so the
        # pool's workers decide side by side, and the callback never waits on a decision.
        if pool.waiting >= pool.limits.queued:
            counters.inc("errors", policy=name, code="unavailable")
            await bus.respond_error(msg, Unavailable(f"policy {name}: {pool.waiting} decisions waiting; retry"))
            return
        pool.waiting += 1
        task = asyncio.get_running_loop().create_task(answer(msg), name=f"pacer:policy:{name}")
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return on_request


class DecisionPool:
    """The worker processes of one policy (module docstring); decisions of other policies never wait here."""

    def __init__(self, name: str, decide: Decide, limits: DecisionLimits, counters: Counters) -> None:
        self.name = name
        self.decide_fn = decide
        self.limits = limits
        self.counters = counters
        self.idle: list[_Worker] = []
        self.waiting = 0  # requests taken and not answered yet (kept by the subscription's handler)
        self.closed = False
        self._slots = asyncio.Semaphore(max(1, limits.workers))

    async def start(self) -> None:
        """Fork the first worker now, before the first request (and before this process starts threads)."""
        if self.limits.workers > 0:
            self.idle.append(self._fork())

    async def close(self) -> None:
        self.closed = True
        while self.idle:
            await self.idle.pop().kill()

    async def decide(self, data: bytes) -> PolicyDecision:
        """The decision on the request ``data`` (its wire form).  A worker decodes and validates it: the
        serving process only relays bytes, so bounding costs it no second decode of a large window."""
        if self.limits.workers <= 0:
            return await _decide_here(self.name, self.decide_fn, _request(data))
        async with self._slots:
            return await self._in_worker(data)

    async def _in_worker(self, data: bytes) -> PolicyDecision:
        worker = self.idle.pop() if self.idle else self._fork()
        keep = False
        try:
            try:
                reply = await worker.ask(data, self.limits.timeout_s)
            except TimeoutError:
                self.counters.inc("workers_killed", policy=self.name, why="timeout")
                raise LimitExceeded(f"policy {self.name}: no decision within {self.limits.timeout_s:g} s "
                                    "(PACER_POLICY_DECIDE_TIMEOUT_S); its worker was killed and replaced") from None
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                self.counters.inc("workers_killed", policy=self.name, why="died")
                raise LimitExceeded(f"policy {self.name}: its worker died while deciding (over its "
                                    f"{self.limits.memory_mb} MB memory limit, PACER_POLICY_MEMORY_MB?); "
                                    "replaced") from None
            if reply[0] == "ok":
                keep = True
                return decode(PolicyDecision, reply[1])
            _, code, message, temporary, retire = reply
            keep = not retire
            if retire:
                self.counters.inc("workers_killed", policy=self.name, why="memory")
            raise _error(code, message, temporary)
        finally:
            if keep:
                self.idle.append(worker)
            else:
                await worker.kill()
                if not self.closed:
                    self.idle.append(self._fork())  # replaced at once: the next decision finds it ready

    def _fork(self) -> _Worker:
        return _Worker.fork(self.name, self.decide_fn, self.limits.memory_mb)


def _error(code: str, message: str, temporary: bool) -> PacerError:
    for cls in (LimitExceeded, ValidationError, DecodeError):
        if code == cls.code:
            return cls(message, temporary=temporary)
    return PacerError(message, code=code, temporary=temporary)


def _request(data: bytes) -> PolicyRequest:
    req = decode(PolicyRequest, data)
    validate_request(req)  # before any work: an out-of-range number never reaches a policy
    return req


async def _decide_here(name: str, decide: Decide, req: PolicyRequest) -> PolicyDecision:
    """``workers=0``: decide on the serving event loop (unbounded, as before bounding existed)."""
    t0 = time.perf_counter()
    out = decide(req)
    if inspect.isawaitable(out):
        out = await out
    return _checked(name, out, t0)


def _checked(name: str, out: Any, t0: float) -> PolicyDecision:
    if not isinstance(out, PolicyDecision):
        raise PacerError(f"policy {name}: decide returned {type(out).__name__}, not a PolicyDecision")
    if not out.decision_ms:
        return replace(out, decision_ms=(time.perf_counter() - t0) * 1e3)
    return out


class _Worker:
    """One forked worker process and the socket to it."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    @classmethod
    def fork(cls, name: str, decide: Decide, memory_mb: int) -> _Worker:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            code = 0
            try:
                ours.close()
                _worker_main(theirs, name, decide, memory_mb)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, ours)

    async def ask(self, data: bytes, timeout_s: float) -> list[Any]:
        if self._streams is None:
            self._streams = await asyncio.open_unix_connection(sock=self.sock)
        reader, writer = self._streams
        writer.write(len(data).to_bytes(_FRAME, "big") + data)
        async with asyncio.timeout(timeout_s):
            await writer.drain()
            size = int.from_bytes(await reader.readexactly(_FRAME), "big")
            reply: list[Any] = msgpack.unpackb(await reader.readexactly(size), raw=False)
        return reply

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self._streams is not None:
            self._streams[1].close()
        else:
            self.sock.close()
        # Reap it (no zombie left): a SIGKILLed process is gone within milliseconds.
        for _ in range(200):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(self.pid, os.WNOHANG)[0] == 0:  # noqa: ASYNC222 - WNOHANG never blocks
                    await asyncio.sleep(0.005)
                    continue
            return


# ---------------------------------------------------------------- inside a worker process
def _worker_main(sock: socket.socket, name: str, decide: Decide, memory_mb: int) -> None:
    """Serve decisions over ``sock`` until the server closes it (or dies)."""
    signal.set_wakeup_fd(-1)  # the server's event loop's, inherited: our signals are not its
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server; it stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    asyncio.events._set_running_loop(None)  # the server's loop is not ours to run
    if memory_mb > 0:
        _limit_address_space(memory_mb * 1024 * 1024)
    loop: asyncio.AbstractEventLoop | None = None
    sock.setblocking(True)
    while True:
        head = _recv(sock, _FRAME)
        if head is None:
            return
        data = _recv(sock, int.from_bytes(head, "big"))
        if data is None:
            return
        retire = False
        try:
            req = _request(data)
            t0 = time.perf_counter()
            out = decide(req)
            if inspect.isawaitable(out):
                if loop is None:
                    loop = asyncio.new_event_loop()
                out = loop.run_until_complete(_awaited(out))
            reply: list[Any] = ["ok", encode(_checked(name, out, t0))]
        except MemoryError:
            retire = True  # a heap that ran into its limit may be left in any state: start afresh
            reply = ["err", LimitExceeded.code, f"policy {name}: the decision ran out of its {memory_mb} MB "
                     "memory limit (PACER_POLICY_MEMORY_MB); its worker was replaced", False, retire]
        except PacerError as exc:
            reply = ["err", exc.code, clip(exc.message), exc.temporary, retire]
        except Exception as exc:  # a bug in decide: answered as an error, the worker goes on
            reply = ["err", "internal", clip(f"policy {name} failed: {type(exc).__name__}: {exc}"), False, retire]
        body = msgpack.packb(reply, use_bin_type=True)
        sock.sendall(len(body).to_bytes(_FRAME, "big") + body)
        if retire:
            return


async def _awaited(aw: Awaitable[Any]) -> Any:
    return await aw


def _recv(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _limit_address_space(extra: int) -> None:
    """RLIMIT_AS = this process's size now (a fork shares the server's) + ``extra`` bytes.  Linux only
    (where /proc/self/statm tells the size); elsewhere the time limit alone bounds a decision."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


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
            server = await serve_policies(bus, {name: decide})
            log.info("policy %s serving on %s", name, subjects.policy_decide(name))
            print(f"policy {name} ready on {subjects.policy_decide(name)}", flush=True)
            await stop.wait()
            await server.close()
        finally:
            await bus.close()

    asyncio.run(main())
