"""The auth callout's view of jobs: one read of a job's record for the pods connecting at once, kept a while."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import nats.js.errors
import pytest
from pacer import authjwt
from pacer.codec import encode
from pacer.contracts.jobs import JobRecord, JobState
from pacer.jobs.spec import parse_job_spec
from pacer_services.auth_callout import core
from pacer_services.auth_callout.app import JobViews


class SlowKV:
    """A job bucket whose reads take until released; counts them."""

    def __init__(self, records: dict[str, bytes]) -> None:
        self.records = records
        self.reads: list[str] = []
        self.release = asyncio.Event()

    async def get(self, key: str) -> Any:
        self.reads.append(key)
        await self.release.wait()
        if key not in self.records:
            raise nats.js.errors.KeyNotFoundError
        if self.records[key] == b"boom":
            raise nats.errors.TimeoutError
        return SimpleNamespace(value=self.records[key])


def record(job: str, state: JobState, submitted_at: float, torn_down: bool = False) -> bytes:
    spec = parse_job_spec(f"name: {job}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    return encode(JobRecord(job, spec, state, submitted_at, data_path="/data/train.rec", records=1,
                            torn_down=torn_down))


def views(kv: SlowKV, now: list[float]) -> JobViews:
    v = JobViews(SimpleNamespace(js=None), ttl_s=2.0, clock=lambda: now[0])  # type: ignore[arg-type]
    v.kv = kv  # type: ignore[assignment]
    return v


async def test_concurrent_lookups_share_one_read_and_it_is_kept_for_the_ttl() -> None:
    kv = SlowKV({"a": record("a", JobState.RUNNING, 100.0), "b": record("b", JobState.COMPLETED, 200.0, True),
                 "c": record("c", JobState.COMPLETED, 300.0)})
    now = [0.0]
    jv = views(kv, now)
    pending = [asyncio.create_task(jv.view("a")) for _ in range(20)]
    while not kv.reads:
        await asyncio.sleep(0)
    kv.release.set()
    got = await asyncio.gather(*pending)
    assert got == [core.JobView(authjwt.incarnation(100.0), ended=False)] * 20 and kv.reads == ["a"]
    assert await jv.view("b") == core.JobView(authjwt.incarnation(200.0), ended=True)
    # Completed but its pods not all gone yet (they may still connect to finish): not ended.
    assert await jv.view("c") == core.JobView(authjwt.incarnation(300.0), ended=False)
    assert await jv.view("nobody") is None
    now[0] = 1.5  # within the TTL: no new read, even of a missing job
    assert await jv.view("a") is not None and await jv.view("nobody") is None
    assert kv.reads == ["a", "b", "c", "nobody"]
    kv.records["a"] = record("a", JobState.STOPPED, 100.0, True)
    now[0] = 2.5  # past it: read again, and the job has ended since
    assert await jv.view("a") == core.JobView(authjwt.incarnation(100.0), ended=True)
    assert kv.reads == ["a", "b", "c", "nobody", "a"]


async def test_a_failed_read_is_raised_to_every_waiter_and_not_kept() -> None:
    kv = SlowKV({"a": b"boom"})
    jv = views(kv, [0.0])
    pending = [asyncio.create_task(jv.view("a")) for _ in range(3)]
    while not kv.reads:
        await asyncio.sleep(0)
    kv.release.set()
    for r in await asyncio.gather(*pending, return_exceptions=True):
        assert isinstance(r, nats.errors.TimeoutError)
    kv.records["a"] = record("a", JobState.RUNNING, 1.0)
    assert await jv.view("a") == core.JobView(authjwt.incarnation(1.0), ended=False)
    assert kv.reads == ["a", "a"]


async def test_an_unreadable_record_is_an_error_not_an_admission() -> None:
    kv = SlowKV({"a": b"\x93not a record"})
    kv.release.set()
    with pytest.raises(Exception, match="unreadable"):
        await views(kv, [0.0]).view("a")
