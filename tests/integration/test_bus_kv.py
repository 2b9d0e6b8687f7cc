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


async def test_replay_reads_every_kept_message_of_a_subject_in_order(bus: Bus) -> None:
    """``Bus.replay``: a whole history (more than one fetch batch), only the subject asked, nothing when empty."""
    from pacer import subjects
    from pacer.codec import decode
    from pacer.contracts.jobs import JobEvent, JobState

    await bus.ensure_streams()
    assert await bus.replay(subjects.job_event("replay-none", "running")) == []
    for i in range(700):
        event = JobEvent(job="replay-a", state=JobState.RUNNING, ts=float(i), reason=str(i))
        await bus.publish_durable(subjects.job_event("replay-a", "running"), event)
        if i % 100 == 0:
            other = JobEvent(job="replay-b", state=JobState.RUNNING, ts=float(i))
            await bus.publish_durable(subjects.job_event("replay-b", "running"), other)
    got = [decode(JobEvent, m.data) for m in await bus.replay(subjects.job_event("replay-a", "running"))]
    assert [e.reason for e in got] == [str(i) for i in range(700)]
    assert len(await bus.replay(subjects.job_event("replay-b", ">"))) == 7


async def test_kv_items_starts_over_when_its_consumer_does_not_serve_yet(bus: Bus, monkeypatch) -> None:
    """A 503 on the pull (a cluster consumer between leaders; seen in CI when an executor started
    right after its peer was killed) is retried with a new consumer instead of failing the service's start."""
    import nats.js.errors

    kv = await bus.kv("pacer-test-503")
    await kv.put("job-a", b"a")
    real = Bus._kv_items_once
    calls = 0

    async def first_unavailable(self: Bus, bucket: str, batch: int) -> dict[str, bytes]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise nats.js.errors.ServiceUnavailableError
        return await real(self, bucket, batch)

    monkeypatch.setattr(Bus, "_kv_items_once", first_unavailable)
    assert await bus.kv_items("pacer-test-503") == {"job-a": b"a"}
    assert calls == 2
