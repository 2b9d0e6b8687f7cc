"""Bounded work per request (issue 21, findings 5 and 7), against a real nats-server.

* Finding 5: one job's agent registered 1,000,000 one-record shards; the
  shard service built them for 15 s on its event loop while another job's
  status requests waited, and kept stalling afterwards.  Now the register is
  refused before any shard exists, and one job's request that waits on IO
  (a slow checkpoint read) delays that job only: the other job is answered
  while it is still pending.
* Finding 7: a PolicyRequest to ``antdt-dd`` with ``global_batch = 2**64-1``
  raised MemoryError and every built-in policy stopped answering for 19.5 s.
  Now it gets an ``invalid`` reply (counted), and a policy whose decision
  sleeps or allocates without end is stopped by its time or memory limit
  while the built-in policies answer meanwhile.

No wall-clock limits are asserted: "answered meanwhile" is shown by order
(the other request's reply arrives while the heavy one is still pending);
timeouts are generous safety nets only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from conftest import InProcess, InProcessService
from pacer import subjects
from pacer.bus import NO_RETRY, Bus
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats
from pacer.contracts.policy import PolicyDecision, PolicyRequest
from pacer.contracts.shards import (
    CheckpointRequest,
    DatasetRef,
    DatasetSpec,
    DatasetStatus,
    LeaseReply,
    LeaseRequest,
)
from pacer.embedded import EmbeddedNats
from pacer.errors import PacerError, ValidationError
from pacer.policy import serve_policies
from pacer.shards.client import ShardAdmin
from pacer.subjects import ShardOp
from pacer.telemetry import Counters
from pacer_services.controller.policies.registry import BUILTINS
from pacer_services.policy_service.app import PolicyService

SAFETY_S = 60.0  # a safety net, never a measurement


async def ask(bus: Bus, subject: str, msg: Any, cls: type[Any]) -> Any:
    return await bus.request(subject, msg, cls, timeout=SAFETY_S, retry=NO_RETRY)


# ====================================================================== finding 5: the shard service
async def test_a_million_one_record_shards_are_refused_before_any_work(shard_service: InProcessService,
                                                                        bus: Bus) -> None:
    admin = ShardAdmin(bus)
    other = await admin.register(DatasetSpec("alice", "train", 1000, batch_size=10, batches_per_shard=10))
    heavy = asyncio.create_task(ask(bus, subjects.rpc("shard", "mallory", ShardOp.REGISTER),
                                    DatasetSpec("mallory", "train", 1_000_000, batch_size=1, batches_per_shard=1),
                                    DatasetStatus))
    await asyncio.sleep(0)
    status = await ask(bus, subjects.rpc("shard", "alice", ShardOp.STATUS), DatasetRef("alice", "train"),
                       DatasetStatus)
    lease = await ask(bus, subjects.rpc("shard", "alice", ShardOp.LEASE),
                      LeaseRequest("alice", "train", "worker-0", want=2), LeaseReply)
    with pytest.raises(ValidationError) as ei:
        await heavy
    assert ei.value.message.startswith("records:") and "PACER_SHARD_MAX_SHARDS_PER_EPOCH" in ei.value.message
    assert status == other and len(lease.shards) == 2
    svc = shard_service.svc
    assert svc is not None
    assert "mallory" not in svc.jobs or not svc.jobs["mallory"].core.datasets  # nothing was built
    # A lease that reports more ids than one request may carry is refused before any is looked at.
    with pytest.raises(ValidationError, match=r"^done:"):
        await ask(bus, subjects.rpc("shard", "alice", ShardOp.LEASE),
                  LeaseRequest("alice", "train", "worker-0", done=list(range(200_000))), LeaseReply)


async def test_a_job_waiting_on_io_does_not_delay_another_job(shard_service: InProcessService, bus: Bus) -> None:
    """Job A's restore waits for the object store (held here); job B's requests are answered meanwhile,
    and A's later requests wait behind its restore (one job's messages in order)."""
    svc = shard_service.svc
    assert svc is not None
    admin = ShardAdmin(bus)
    await admin.register(DatasetSpec("job-a", "train", 1000, batch_size=10, batches_per_shard=10))
    await admin.register(DatasetSpec("job-b", "train", 1000, batch_size=10, batches_per_shard=10))
    await admin.checkpoint("job-a", "train", "c1")

    gate = asyncio.Event()
    reading = asyncio.Event()
    orig = svc.store.get_checkpoint

    async def slow_store(job: str, dataset: str, ckpt: str) -> dict[str, Any]:
        reading.set()
        await gate.wait()  # the object store is slow for as long as the test says
        return await orig(job, dataset, ckpt)

    svc.store.get_checkpoint = slow_store  # type: ignore[method-assign]
    restore = asyncio.create_task(ask(bus, subjects.rpc("shard", "job-a", ShardOp.RESTORE),
                                      CheckpointRequest("job-a", "train", "c1"), DatasetStatus))
    await asyncio.wait_for(reading.wait(), SAFETY_S)
    a_status = asyncio.create_task(ask(bus, subjects.rpc("shard", "job-a", ShardOp.STATUS),
                                       DatasetRef("job-a", "train"), DatasetStatus))
    for _ in range(3):
        b = await ask(bus, subjects.rpc("shard", "job-b", ShardOp.STATUS), DatasetRef("job-b", "train"), DatasetStatus)
        assert b.job == "job-b"
        lease = await ask(bus, subjects.rpc("shard", "job-b", ShardOp.LEASE),
                          LeaseRequest("job-b", "train", "worker-0", want=1), LeaseReply)
        assert lease.shards
    assert not restore.done() and not a_status.done()  # job A's requests are still waiting, in order
    gate.set()
    assert (await restore).job == "job-a"
    assert (await a_status).job == "job-a"


# ====================================================================== finding 7: the policies
def _stats(job: str, n: int = 4) -> JobStatistics:
    nodes = [NodeStats(node=f"worker-{i}", role="worker", bpt_short_s=0.1 * (1 + i), bpt_long_s=0.1 * (1 + i),
                       speed_samples_per_s=100.0, samples_total=1000, cpu_percent=100.0, rss_bytes=1, last_seen=1.0,
                       state=Liveness.RUNNING, pending_s=0.0, restarts=0, slowdown_short=1.0 + i,
                       slowdown_long=1.0 + i) for i in range(n)]
    return JobStatistics(job=job, ts=100.0, window_short_s=60.0, window_long_s=300.0,
                         throughput_samples_per_s=400.0, nodes=nodes)


def _request(job: str, global_batch: int = 512) -> PolicyRequest:
    return PolicyRequest(job=job, stats=_stats(job), mode="bsp", global_batch=global_batch,
                         device_groups={f"worker-{i}": f"g{i % 2}" for i in range(4)})


async def test_antdt_dd_with_a_global_batch_of_2_64_is_invalid_and_counted(nats_server: EmbeddedNats,
                                                                          bus: Bus) -> None:
    svc = InProcess(nats_server.url, lambda b: PolicyService(b))
    policies = await svc.start()
    try:
        with pytest.raises(ValidationError) as ei:
            await ask(bus, subjects.policy_decide("antdt-dd"), _request("j", 2**64 - 1), PolicyDecision)
        assert ei.value.message.startswith("global_batch:"), ei.value.message
        assert policies.counters.values["invalid_requests"] == 1, policies.counters.snapshot()
        # ... and every built-in still decides.
        for name in BUILTINS:
            d = await ask(bus, subjects.policy_decide(name), _request("j"), PolicyDecision)
            assert d.job == "j" and d.policy == name
    finally:
        await svc.stop()


def _sleeps(req: PolicyRequest) -> PolicyDecision:
    time.sleep(30)  # a decision that does not end in time (blocking: no event loop would get it back)
    return PolicyDecision(req.job, "sleeps")


def _allocates(req: PolicyRequest) -> PolicyDecision:
    # 1.5 GB of address space (calloc'd by bytes(n): barely touched if nothing bounds it), far above the
    # 256 MB this test allows a decision.
    held = [bytes(64 << 20) for _ in range(24)]
    return PolicyDecision(req.job, "allocates", reason=f"{len(held)} blocks")


async def _awaits(req: PolicyRequest) -> PolicyDecision:
    await asyncio.sleep(0.01)  # a coroutine decide runs on its worker's own event loop
    return PolicyDecision(req.job, "awaits", reason=f"async, B={req.global_batch}")


async def test_a_slow_or_huge_decision_is_bounded_while_the_builtins_answer(bus: Bus,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACER_POLICY_DECIDE_TIMEOUT_S", "5")
    monkeypatch.setenv("PACER_POLICY_MEMORY_MB", "256")
    counters = Counters("policies-test")
    server = await serve_policies(bus, {"sleeps": _sleeps, "allocates": _allocates, "awaits": _awaits, **BUILTINS},
                                  counters)
    try:
        slow = asyncio.create_task(ask(bus, subjects.policy_decide("sleeps"), _request("j-slow"), PolicyDecision))
        await asyncio.sleep(0.2)  # let the slow request reach its worker first (not a measurement)
        for name in BUILTINS:  # answered while the slow decision is still running
            d = await asyncio.wait_for(ask(bus, subjects.policy_decide(name), _request("j"), PolicyDecision), 30)
            assert d.policy == name
        assert (await ask(bus, subjects.policy_decide("awaits"), _request("j"), PolicyDecision)).reason == \
            "async, B=512"
        assert not slow.done()
        with pytest.raises(PacerError) as ei:
            await ask(bus, subjects.policy_decide("allocates"), _request("j-fat"), PolicyDecision)
        assert ei.value.code == "limit_exceeded" and "memory" in ei.value.message, ei.value.message
        with pytest.raises(PacerError) as ei:
            await slow
        assert ei.value.code == "limit_exceeded" and "killed" in ei.value.message, ei.value.message
        # Both workers were replaced: the same policies answer again (and fail again, bounded).
        for name in BUILTINS:
            assert (await ask(bus, subjects.policy_decide(name), _request("j2"), PolicyDecision)).policy == name
        assert counters.values["workers_killed"] == 2, counters.snapshot()
    finally:
        await server.close()
