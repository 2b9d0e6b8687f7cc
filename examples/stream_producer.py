"""Publish an ads click log to a JetStream stream, one sample per message, for online learning.

    python examples/stream_producer.py NATS_URL --stream ADS --rows N --rate R [--seed S] [--split K]

Creates the stream ``ADS`` (subject ``ADS.samples``, ``allow_direct`` on) if it is missing, then
publishes ``N`` rows of :func:`pacer.data.formats.ads_table` (split ``K`` of seed ``S``: every
split of one seed has the same click signal, so a later split is new traffic) at about ``R``
rows per second (0: as fast as the server acks), each as a msgpack map
``{column: value}`` (the format :mod:`pacer.data.stream` reads).  Prints one
JSON line at the end: ``{"published": N, "first_seq": .., "last_seq": ..}`` --
the sequences a streaming dataset ``jetstream://ADS`` maps its records to
(record ``i`` is sequence ``first_seq + i``).

Credentials, CA and inbox prefix come from the same settings the services read
(``pacer.security.connect_options``), as in ``subscribe_events.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import msgpack
import nats
from nats.js.errors import NotFoundError
from pacer.data.formats import ads_table
from pacer.security import connect_options


async def main(url: str, stream: str, rows: int, rate: float, seed: int, split: int = 0) -> dict[str, int]:
    nc = await nats.connect(**connect_options(url, os.environ))  # type: ignore[arg-type]  # servers, creds, TLS
    js = nc.jetstream()
    subject = f"{stream}.samples"
    try:
        await js.stream_info(stream)
    except NotFoundError:  # a stream that holds only samples: every sequence is a record;
        # allow_direct: Pacer's workers read exactly their sequences by direct get (docs/data.md)
        await js.add_stream(name=stream, subjects=[subject], allow_direct=True)

    samples = ads_table(rows, seed, split).to_pylist()  # [{"click": 0, "price": 2.7, "tags": ["t3"], ...}, ...]
    first = last = 0
    start = time.monotonic()
    window = 256 if rate <= 0 else max(1, min(256, int(rate / 10)))  # publishes in flight before their acks
    for lo in range(0, rows, window):
        batch = samples[lo:lo + window]
        acks = await asyncio.gather(*(js.publish(subject, msgpack.packb(s, use_bin_type=True)) for s in batch))
        first = first or acks[0].seq
        last = acks[-1].seq
        if rate > 0:  # pace: the (lo + len(batch))-th row is due at that many / rate seconds
            await asyncio.sleep(max(0.0, start + (lo + len(batch)) / rate - time.monotonic()))
    await nc.close()
    return {"published": rows, "first_seq": first, "last_seq": last}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", help="NATS URL, e.g. nats://127.0.0.1:4222")
    ap.add_argument("--stream", default="ADS")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=0.0, help="rows per second; 0 = as fast as possible")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", type=int, default=0, help="which rows of the seed's traffic (same signal)")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.url, args.stream, args.rows, args.rate, args.seed, args.split))),
          flush=True)
