"""A bus connection survives a server that refuses its credentials for a while (a real nats-server).

nats-py closes a connection for good on ``-ERR 'Authorization Violation'``.
A server says that to a connected client when its auth source fails
(with an auth callout: the callout's own server died, as chaos found), and
a service or trainer whose connection closes never talks again.  Here the
server's config is reloaded with the user's password changed (the server
drops the client with that error and refuses its reconnects), then changed
back: the bus must reconnect by itself.

A pod's process gives up instead once it has been refused for long enough
(``give_up_refused_s``: its job was torn down, its token expired): its
service stops and it exits with ``EXIT_REFUSED``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from pacer.bus import GIVE_UP_REFUSED_ENV, Bus
from pacer.contracts.executor import EXIT_REFUSED
from pacer.embedded import find_binary, free_port, http_json
from pacer.runtime import Refused, RuntimeConfig, run_service
from pacer.telemetry import Counters

pytestmark = pytest.mark.timeout(60)


def conf(port: int, monitor: int, password: str) -> str:
    return (f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
            f'authorization {{ users = [ {{ user: "svc", password: "{password}" }} ] }}\n')


async def wait_for(check: object, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[int, Path, asyncio.subprocess.Process]]:
    """A nats-server that accepts the user ``svc`` with the password "right": (port, config, process)."""
    port, monitor = free_port(), free_port()
    path = tmp_path / "nats.conf"
    path.write_text(conf(port, monitor, "right"))
    proc = await asyncio.create_subprocess_exec(find_binary(), "-c", str(path), stdout=subprocess.DEVNULL,
                                                stderr=subprocess.STDOUT)
    try:
        await wait_for(lambda: http_json(f"http://127.0.0.1:{monitor}/healthz")[0] == 200, 20, "server not up")
        yield port, path, proc
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def test_a_connection_refused_on_reconnect_reconnects_once_its_credentials_are_accepted_again(
        server: tuple[int, Path, asyncio.subprocess.Process]) -> None:
    port, path, proc = server
    # A limit longer than the refusals: they are not given up on.
    gave_up: list[bool] = []
    bus = await Bus.connect(f"nats://svc:right@127.0.0.1:{port}", name="reconnect-test",
                            give_up_refused_s=60, on_give_up=lambda: gave_up.append(True))
    try:
        async def echo(msg: Msg) -> None:
            await msg.respond(msg.data)

        await bus.nc.subscribe("echo", cb=echo)
        assert (await bus.nc.request("echo", b"1", timeout=2)).data == b"1"

        # The server now refuses the user: it drops the connection with an authorization violation.
        path.write_text(conf(port, monitor_of(path), "changed"))
        proc.send_signal(signal.SIGHUP)
        await wait_for(lambda: not bus.nc.is_connected, 15, "the server did not drop the client")
        await wait_for(lambda: bus.nc.refused_since is not None, 15, "no refused reconnect")
        assert not bus.nc.is_closed, "the connection was closed for good on an authorization violation"

        # Accepted again: the same connection is back, with its subscription.
        path.write_text(conf(port, monitor_of(path), "right"))
        proc.send_signal(signal.SIGHUP)
        await wait_for(lambda: bus.nc.is_connected, 20, "the bus did not reconnect")
        assert (await bus.nc.request("echo", b"2", timeout=5)).data == b"2"
        assert not gave_up and bus.nc.refused_since is None
    finally:
        await bus.close()


class Idle:
    """A service that does nothing: run_service's own behaviour is under test."""

    name = "idle"

    def __init__(self) -> None:
        self.counters = Counters("idle")
        self.started = asyncio.Event()

    async def start(self, tg: asyncio.TaskGroup) -> None:
        self.started.set()

    async def drain(self) -> None:
        pass


async def test_a_service_refused_for_its_give_up_time_after_connecting_stops_and_raises_refused(
        server: tuple[int, Path, asyncio.subprocess.Process]) -> None:
    port, path, proc = server
    svc = Idle()
    buses: list[Bus] = []

    async def factory(bus: Bus, _: RuntimeConfig) -> Idle:
        buses.append(bus)
        return svc

    cfg = RuntimeConfig(nats_url=f"nats://svc:right@127.0.0.1:{port}", instance="pod-x", give_up_refused_s=2.0)
    run = asyncio.create_task(run_service(factory, cfg, install_signals=False))
    await asyncio.wait_for(svc.started.wait(), 20)
    path.write_text(conf(port, monitor_of(path), "changed"))  # the pod's job is gone: refused from now on
    proc.send_signal(signal.SIGHUP)
    with pytest.raises(Refused):
        await asyncio.wait_for(run, 30)
    assert buses[0].nc.is_closed
    assert buses[0].nc.refused_since is not None


async def test_a_refused_first_connect_is_tried_again_until_the_give_up_time_then_refused(
        server: tuple[int, Path, asyncio.subprocess.Process]) -> None:
    port, _, _ = server
    started = time.monotonic()
    cfg = RuntimeConfig(nats_url=f"nats://svc:wrong@127.0.0.1:{port}", instance="pod-y", give_up_refused_s=2.0)
    with pytest.raises(Refused):
        await asyncio.wait_for(run_service(lambda bus, _: _never(), cfg, install_signals=False), 30)
    assert time.monotonic() - started >= 2.0  # it tried for its give-up time, not once


async def _never() -> Idle:
    raise AssertionError("a refused connection reached the service's factory")


def monitor_of(path: Path) -> int:
    """The monitoring port written in the config at ``path``."""
    return int(path.read_text().split("http: 127.0.0.1:")[1].split()[0])


TRAINER = """
import sys, time
from pacer.shards.client import BlockingShardClient
BlockingShardClient(sys.argv[1], "j", "train", "worker-0")
print("connected", flush=True)
time.sleep(120)
"""


async def trainer(url: str, log: Path) -> asyncio.subprocess.Process:
    """A trainer's shard client in its own process, giving up after 1 s of refusals.  Its stderr goes to
    ``log``: a pipe nobody reads fills with the refusals it logs, and the process then blocks writing."""
    env = {**os.environ, GIVE_UP_REFUSED_ENV: "1"}
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        return await asyncio.create_subprocess_exec(sys.executable, "-c", TRAINER, url, env=env,
                                                    stdout=subprocess.PIPE, stderr=fd)
    finally:
        os.close(fd)  # the child has its own copy


async def exit_code(t: asyncio.subprocess.Process, within: float = 30.0) -> int:
    """The trainer's exit code; killed (and the wait fails) if it has not exited ``within`` seconds."""
    try:
        return await asyncio.wait_for(t.wait(), within)
    finally:
        if t.returncode is None:
            t.kill()
            await t.wait()


async def test_a_trainer_refused_for_good_after_connecting_exits_with_exit_refused(
        server: tuple[int, Path, asyncio.subprocess.Process], tmp_path: Path) -> None:
    """On Kubernetes no pod supervisor stops a trainer whose agent gave up: its own shard client must."""
    port, path, proc = server
    t = await trainer(f"nats://svc:right@127.0.0.1:{port}", tmp_path / "trainer.log")
    assert t.stdout is not None
    assert await asyncio.wait_for(t.stdout.readline(), 30) == b"connected\n"
    path.write_text(conf(port, monitor_of(path), "changed"))
    proc.send_signal(signal.SIGHUP)
    code = await exit_code(t)
    assert code == EXIT_REFUSED, (tmp_path / "trainer.log").read_text()[-2000:]


async def test_a_trainer_refused_from_its_first_connect_exits_with_exit_refused(
        server: tuple[int, Path, asyncio.subprocess.Process], tmp_path: Path) -> None:
    port, _, _ = server
    t = await trainer(f"nats://svc:wrong@127.0.0.1:{port}", tmp_path / "trainer.log")
    assert t.stdout is not None
    code = await exit_code(t)
    assert code == EXIT_REFUSED, (tmp_path / "trainer.log").read_text()[-2000:]
    assert await t.stdout.read() == b""  # it never got a client
