"""The executor's per-job workers: one job's work in order, different jobs in parallel, errors at the boundary."""

from __future__ import annotations

import asyncio

import pytest
from pacer.errors import NotFound
from pacer.telemetry import Counters
from pacer_services.pod_executor.queueing import JobQueues

pytestmark = pytest.mark.timeout(20)


async def test_work_of_one_job_runs_in_order_and_other_jobs_do_not_wait() -> None:
    async with asyncio.TaskGroup() as tg:
        queues = JobQueues(lambda coro, name: tg.create_task(coro, name=name), Counters("test"), idle_s=0.2)
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
        queues = JobQueues(lambda coro, name: tg.create_task(coro, name=name), counters, idle_s=0.2)

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
