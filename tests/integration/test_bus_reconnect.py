"""A bus connection survives a server that refuses its credentials for a while (a real nats-server).

nats-py closes a connection for good on ``-ERR 'Authorization Violation'``.
A server says that to a connected client when its auth source fails
(with an auth callout: the callout's own server died, as chaos found), and
a service or trainer whose connection closes never talks again.  Here the
server's config is reloaded with the user's password changed (the server
drops the client with that error and refuses its reconnects), then changed
back: the bus must reconnect by itself.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from pacer.bus import Bus
from pacer.embedded import find_binary, free_port, http_json

pytestmark = pytest.mark.timeout(60)


def conf(port: int, monitor: int, password: str) -> str:
    return (f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
            f'authorization {{ users = [ {{ user: "svc", password: "{password}" }} ] }}\n')


async def wait_for(check: object, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_connection_refused_on_reconnect_reconnects_once_its_credentials_are_accepted_again(
        tmp_path: Path) -> None:
    port, monitor = free_port(), free_port()
    path = tmp_path / "nats.conf"
    path.write_text(conf(port, monitor, "right"))
    server = await asyncio.create_subprocess_exec(find_binary(), "-c", str(path), stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.STDOUT)
    try:
        await wait_for(lambda: http_json(f"http://127.0.0.1:{monitor}/healthz")[0] == 200, 20, "server not up")
        bus = await Bus.connect(f"nats://svc:right@127.0.0.1:{port}", name="reconnect-test")
        try:
            async def echo(msg: Msg) -> None:
                await msg.respond(msg.data)

            await bus.nc.subscribe("echo", cb=echo)
            assert (await bus.nc.request("echo", b"1", timeout=2)).data == b"1"

            # The server now refuses the user: it drops the connection with an authorization violation.
            path.write_text(conf(port, monitor, "changed"))
            server.send_signal(signal.SIGHUP)
            await wait_for(lambda: not bus.nc.is_connected, 15, "the server did not drop the client")
            await asyncio.sleep(1.0)  # a few refused reconnects
            assert not bus.nc.is_closed, "the connection was closed for good on an authorization violation"

            # Accepted again: the same connection is back, with its subscription.
            path.write_text(conf(port, monitor, "right"))
            server.send_signal(signal.SIGHUP)
            await wait_for(lambda: bus.nc.is_connected, 20, "the bus did not reconnect")
            assert (await bus.nc.request("echo", b"2", timeout=5)).data == b"2"
        finally:
            await bus.close()
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), 10)
