#!/usr/bin/env python3
"""Kubernetes exec probe for a Pacer service: ``pacer-healthcheck SERVICE [--live]``.

Every service answers ``pacer.svc.<service>.health`` with a ``Health`` reply
whose ``instance`` is ``<hostname>-<pid>`` (pacer.runtime).  The probe sends
one request on that subject, collects every reply for ``--wait`` seconds and
looks for the reply of *this pod* (instance starting with this hostname), so
another replica's answer can never make a dead pod look healthy.

* readiness (default): exit 0 only if this pod's instance says ``ready``.
* liveness (``--live``): exit 1 only if NATS is reachable and this pod's
  instance does not answer at all (its event loop is stuck or it never came
  up).  If NATS itself is unreachable the probe passes: restarting every
  service because the bus is down would only add a restart storm to the
  outage; readiness already takes the pod out meanwhile.

Only nats-py and msgpack, no Pacer import, so it stays cheap (well under 1 s).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import socket
import ssl
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

import msgpack
import nats


def auth_options(url: str, env: Mapping[str, str]) -> dict[str, Any]:
    """The settings ``Bus.connect`` reads (pacer.security.connect_options), repeated without a Pacer import:
    ``PACER_NATS_USER``/``PACER_NATS_PASSWORD`` (unless the URL has ``user:pass@``), ``PACER_NATS_CREDS``,
    ``PACER_NATS_CA``.  The service's own user may publish its health subject and gets the reply."""
    out: dict[str, Any] = {}
    if not urlsplit(url).username and env.get("PACER_NATS_USER"):
        out["user"], out["password"] = env["PACER_NATS_USER"], env.get("PACER_NATS_PASSWORD", "")
    user = unquote(urlsplit(url).username or "") or env.get("PACER_NATS_USER", "")
    if user:  # a user reads replies only under its own inbox prefix (pacer.security.inbox_prefix)
        safe = re.fullmatch(r"[A-Za-z0-9_-]{1,64}", user)
        out["inbox_prefix"] = "_INBOX_" + (user if safe else "h" + hashlib.sha256(user.encode()).hexdigest()[:24])
    if env.get("PACER_NATS_CREDS"):
        out["user_credentials"] = env["PACER_NATS_CREDS"]
    if env.get("PACER_NATS_CA"):
        out["tls"] = ssl.create_default_context(cafile=env["PACER_NATS_CA"])
    return out


async def probe(service: str, url: str, wait: float, live: bool) -> int:
    async def quiet(_: Exception) -> None:  # nats-py logs every failed attempt otherwise
        return None

    try:
        # nats-py keeps retrying the first connect on its own: bound it here.
        nc = await asyncio.wait_for(
            nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0, error_cb=quiet,
                         **auth_options(url, os.environ)),
            timeout=3,
        )
    except Exception as exc:  # any failure to reach the bus (TimeoutError included)
        print(f"nats unreachable at {url}: {exc!r}", file=sys.stderr)
        return 0 if live else 1
    host = socket.gethostname()
    mine: list[dict[str, object]] = []
    try:
        inbox = nc.new_inbox()

        async def on_reply(msg: nats.aio.msg.Msg) -> None:
            try:
                body = msgpack.unpackb(msg.data, raw=False)
            except Exception:  # not ours to judge
                return
            if isinstance(body, dict) and str(body.get("instance", "")).startswith(f"{host}-"):
                mine.append(body)

        sub = await nc.subscribe(inbox, cb=on_reply)
        await nc.publish(f"pacer.svc.{service}.health", b"", reply=inbox)
        await nc.flush()
        deadline = asyncio.get_running_loop().time() + wait
        while not mine and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await sub.unsubscribe()
    finally:
        await nc.close()
    if not mine:
        print(f"no health reply from {service} on {host}", file=sys.stderr)
        return 1
    status = mine[0].get("status")
    if live or status == "ready":
        return 0
    print(f"{service} on {host} is {status}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pacer-healthcheck")
    ap.add_argument("service", help="service name as in pacer.svc.<service>.health: shard, jobs, executor, monitor or api")
    ap.add_argument("--live", action="store_true", help="liveness mode (see module doc)")
    ap.add_argument("--url", default=os.environ.get("PACER_NATS_URL", "nats://127.0.0.1:4222"))
    ap.add_argument("--wait", type=float, default=2.0, help="seconds to wait for this pod's reply")
    a = ap.parse_args(argv)
    return asyncio.run(probe(a.service, a.url, a.wait, a.live))


if __name__ == "__main__":
    sys.exit(main())
