"""The examples in the README are files; this runs them against a real stack."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from pacer.bus import Bus
from pacer.contracts.shards import DatasetSpec
from pacer.embedded import EmbeddedNats
from pacer.shards.client import ShardAdmin, ShardClient

ROOT = Path(__file__).resolve().parents[2]


async def test_subscribe_events_example_sees_a_dataset_run(
    nats_server: EmbeddedNats, bus: Bus, shard_service: object
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / "subscribe_events.py"), nats_server.url,
        "--job", "ex", "--count", "3",
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
    assert first == {"subscribed": "pacer.events.*.ex.*"}
    await ShardAdmin(bus).register(DatasetSpec(job="ex", dataset="d", records=1000, batch_size=10, batches_per_shard=10))
    c = ShardClient(bus, "ex", "d", "n1")
    while (s := await c.next()) is not None:
        c.done(s)
    await c.close()
    out, _ = await asyncio.wait_for(proc.communicate(), 20)
    events = [json.loads(line) for line in out.decode().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "registered", kinds
    assert "finished" in kinds, kinds
    assert all(e["job"] == "ex" and e["domain"] == "shard" for e in events)
    assert proc.returncode == 0
