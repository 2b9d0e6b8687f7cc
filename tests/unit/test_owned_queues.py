"""Per-job serialisation (pacer.owned.queues): one job's work in order, different jobs in parallel,
errors at the boundary, bounded queues, and per-job locks that never deadlock and are forgotten."""

from __future__ import annotations

import asyncio

import pytest
from pacer.errors import NotFound
from pacer.owned.queues import JobLocks, JobQueues, QueueFull
from pacer.telemetry import Counters

pytestmark = pytest.mark.timeout(20)


async def test_work_of_one_job_runs_in_order_and_other_jobs_do_not_wait() -> None:
    async with asyncio.TaskGroup() as tg:
        queues = JobQueues(lambda coro, name: tg.create_task(coro, name=name), Counters("test"), name="t", idle_s=0.2)
        gate = asyncio.Event()
        done: list[str] = []

        async def step(tag: str, wait: bool = False) -> str:
            if wait:
                await gate.wait()  # a backend call that hangs
            done.append(tag)
            return tag

        slow = asyncio.ensure_future(queues.run("a", lambda: step("a1", wait=True)))
        await asyncio.sleep(0.05)  # a1 is submitted and its worker waits in it
        queues.post("a", lambda: step("a2"))
        assert await asyncio.wait_for(queues.run("b", lambda: step("b1")), 2.0) == "b1"  # b is not held up
        assert done == ["b1"] and not slow.done()
        gate.set()
        assert await slow == "a1"
        assert await queues.join(2.0)
        assert done == ["b1", "a1", "a2"]  # a2 waited for a1
        await asyncio.sleep(0.4)
        assert not queues._queues  # idle workers ended; the next submission starts a new one
        assert await queues.run("a", lambda: step("a3")) == "a3"


async def test_errors_go_back_to_the_caller_or_are_counted_and_the_worker_goes_on() -> None:
    counters = Counters("test")
    async with asyncio.TaskGroup() as tg:
        queues = JobQueues(lambda coro, name: tg.create_task(coro, name=name), counters, name="t", idle_s=0.2)

        async def missing() -> None:
            raise NotFound("no such node")

        async def bug() -> None:
            raise RuntimeError("a bug")

        async def fine() -> str:
            return "ok"

        with pytest.raises(NotFound):
            await queues.run("a", missing)
        queues.post("a", missing, "command")
        queues.post("a", bug, "pod")
        assert await queues.run("a", fine) == "ok"
        snap = counters.snapshot()
        assert snap.get("errors") == 1 and snap.get("internal_errors") == 1
        assert await queues.join(2.0)


async def test_a_bounded_queue_refuses_beyond_its_limit_and_an_idle_worker_ends_at_once() -> None:
    """The shard service's inbox: at most ``max_queued`` waiting per job; others are unaffected."""
    async with asyncio.TaskGroup() as tg:
        queues = JobQueues(lambda coro, name: tg.create_task(coro, name=name), Counters("test"), name="t",
                           idle_s=0, max_queued=2)
        gate = asyncio.Event()
        done: list[str] = []

        async def step(tag: str) -> None:
            await gate.wait()
            done.append(tag)

        assert queues.post("a", lambda: step("a1"))
        await asyncio.sleep(0)  # the worker takes a1 and waits in it: the queue is empty again
        assert queues.post("a", lambda: step("a2")) and queues.post("a", lambda: step("a3"))
        assert not queues.post("a", lambda: step("a4"))  # full: refused, not queued
        with pytest.raises(QueueFull):
            await queues.run("a", lambda: step("a5"))
        assert queues.post("b", lambda: step("b1"))  # another job's queue is its own
        assert queues.pending() == 4 and queues.pending("a") == 2
        gate.set()
        assert await queues.join(2.0)
        assert [t for t in done if t[0] == "a"] == ["a1", "a2", "a3"] and "b1" in done
        await asyncio.sleep(0)
        assert not queues.busy("a") and not queues.busy("b")  # idle_s=0: the workers ended with their queues


async def test_job_locks_serialise_one_job_leave_others_free_and_are_forgotten() -> None:
    locks = JobLocks()
    order: list[str] = []
    release = asyncio.Event()

    async def hold(tag: str, *jobs: str, wait: bool = False) -> None:
        async with locks.hold(*jobs):
            order.append(f"{tag}+")
            if wait:
                await release.wait()
            order.append(f"{tag}-")

    first = asyncio.ensure_future(hold("a1", "a", wait=True))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(hold("a2", "a"))
    await asyncio.wait_for(hold("b1", "b"), 2.0)  # job b does not wait for job a
    assert order == ["a1+", "b1+", "b1-"] and locks.held("a") and not locks.held("b")
    release.set()
    await asyncio.wait_for(asyncio.gather(first, second), 2.0)
    assert order[3:] == ["a1-", "a2+", "a2-"]  # a2 waited for a1, in arrival order
    assert len(locks) == 0  # nobody holds or waits: nothing kept


async def test_job_locks_over_overlapping_sets_never_deadlock() -> None:
    """Two cluster rounds asking for overlapping jobs in opposite orders both finish."""
    locks = JobLocks()
    done = 0

    async def round_(jobs: tuple[str, ...]) -> None:
        nonlocal done
        for _ in range(50):
            async with locks.hold(*jobs):
                await asyncio.sleep(0)
                done += 1

    await asyncio.wait_for(asyncio.gather(round_(("a", "b", "c")), round_(("c", "b", "a")), round_(("b", "d"))), 5.0)
    assert done == 150 and len(locks) == 0
    await asyncio.wait_for(locks.idle(), 1.0)
