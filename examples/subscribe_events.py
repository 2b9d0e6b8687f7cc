"""Subscribe to Pacer's events, as a dashboard would.

    python examples/subscribe_events.py [NATS_URL] [--job JOB] [--count N]

Against a secured stack, credentials, CA and the user's own reply inbox come
from the same settings the services read (``pacer.security.connect_options``):
after ``pacer up``, its ``export PACER_CONTEXT=...`` line is enough.

Every event is on ``pacer.events.<domain>.<job>.<kind>`` (see
``proto-schemas/README.md`` for each kind's schema) and is kept in the
``PACER_EVENTS`` JetStream stream, so a dashboard that starts late can
replay history with a JetStream consumer instead of a plain subscription.
This example uses a plain subscription and prints one JSON line per event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import msgpack
import nats
from pacer.security import connect_options, default_url


async def main(url: str, job: str, count: int) -> None:
    nc = await nats.connect(**connect_options(url, os.environ))  # servers, user, TLS, inbox prefix
    seen = 0
    done = asyncio.Event()

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        nonlocal seen
        _, _, domain, job_id, kind = msg.subject.split(".", 4)
        body = msgpack.unpackb(msg.data, raw=False)  # schema: proto-schemas/<domain>/...
        print(json.dumps({"domain": domain, "job": job_id, "kind": kind, "event": body}, default=str), flush=True)
        seen += 1
        if count and seen >= count:
            done.set()

    await nc.subscribe(f"pacer.events.*.{job}.*", cb=on_event)
    await nc.flush()
    print(json.dumps({"subscribed": f"pacer.events.*.{job}.*"}), flush=True)
    await done.wait()
    await nc.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("url", nargs="?", default=default_url(os.environ))
    ap.add_argument("--job", default="*")
    ap.add_argument("--count", type=int, default=0, help="exit after N events (0: run forever)")
    a = ap.parse_args()
    try:
        asyncio.run(main(a.url, a.job, a.count))
    except KeyboardInterrupt:
        pass
