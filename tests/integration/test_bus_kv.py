"""``Bus.kv_items``: a KV bucket's live entries, as a restarting service rebuilds its state from them."""

from __future__ import annotations

from pacer.bus import Bus


async def test_kv_items_reads_every_live_key(bus: Bus) -> None:
    kv = await bus.kv("pacer-test-items")
    assert await bus.kv_items("pacer-test-items") == {}
    for i in range(600):  # more than one fetch batch
        await kv.put(f"job-{i}", f"v{i}".encode())
    await kv.put("job-7", b"newer")  # only the last value of a key counts
    await kv.delete("job-8")
    await kv.purge("job-9")
    items = await bus.kv_items("pacer-test-items")
    assert "job-8" not in items and "job-9" not in items
    assert items["job-7"] == b"newer" and items["job-599"] == b"v599"
    assert len(items) == 598
