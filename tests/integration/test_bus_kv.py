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


async def test_kv_waits_when_a_bucket_being_created_is_not_found_for_a_moment(bus: Bus, monkeypatch) -> None:
    """On a cluster a bucket a peer instance is creating can answer "stream not found" right after the
    create (seen in CI: a controller's start failed on it); ``Bus.kv`` treats that as no leader yet."""
    import nats.js.errors

    made = await bus.kv("pacer-test-404")
    real = bus.js.stream_info
    calls = 0

    async def first_not_found(name: str, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise nats.js.errors.NotFoundError(code=404, err_code=10059, description="stream not found")
        return await real(name, *args, **kwargs)

    async def found(self: Bus, bucket: str, description: str):
        return made

    # The leader check runs only for a replicated bucket, which one embedded server cannot hold:
    # the bucket lookup is given the one made above and the bus believes it runs on a cluster.
    monkeypatch.setattr(Bus, "_kv_once", found)
    monkeypatch.setattr(bus, "replicas", 3)
    monkeypatch.setattr(bus.js, "stream_info", first_not_found)
    kv = await bus.kv("pacer-test-404")
    assert calls == 2
    await kv.put("job-a", b"a")
    assert await bus.kv_items("pacer-test-404") == {"job-a": b"a"}
