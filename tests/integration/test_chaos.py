"""Chaos during a real TensorFlow job (issue 13): the short run of bench/chaos.py inside ``make test``.

The real stack on a 3-server NATS cluster (TLS, per-service users,
JetStream at replicas 3), two instances of the controller and the monitor,
one Wide&Deep job of 2 PS + 2 workers on generated data, and six SIGKILLs
while it trains, one of each kind at least (a nats-server, a service
process or instance, a worker's and a PS's TensorFlow process), each
restarted (NATS, services) or relaunched by the executor (worker, PS).
What must hold afterwards is read from the durable record, not from the
harness: the shard service's status of the dataset (every record trained,
no shard failed), the job's record (completed, with the chief's AUC), the
controller's decisions against the executor's relaunch counts (no
KILL_RESTART carried out twice).  The bench (``make bench-chaos``) runs
more kills and compares the AUC with a fault-free run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import chaos  # bench/ holds scripts, not a package: its directory is put on sys.path above

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # 430 s on a quiet 2-core machine

KILLS = 6


def test_six_kills_of_every_kind_lose_no_record(tmp_path: Path) -> None:
    cfg = chaos.ChaosConfig(kills=KILLS, interval_s=6.0, seed=5, rows=32_000)
    data, test = chaos.generate_data(tmp_path / "data", cfg.rows)
    out = chaos.run_job(tmp_path / "stack", "chaos-test", data, test, cfg, KILLS)
    report = chaos.outcome_dict(out)

    assert {k.kind for k in out.kills} == set(chaos.KINDS), report  # every kind was killed at least once
    assert len(out.kills) >= KILLS - 1, report  # the last may find the job already finished
    assert all(k.back_s is not None for k in out.kills), report
    assert out.completed, report
    assert out.records_total == cfg.rows and out.records_done == out.records_total, report
    assert out.records_lost == 0 and out.shards_failed == 0, report
    assert out.duplicate_actions == 0 and out.repeated_kill_restarts == 0, report
    assert out.auc is not None and 0.5 < out.auc <= 1.0, report  # the chief evaluated the held-out data


async def test_a_service_runs_as_two_instances_each_killed_and_restarted_alone(tmp_path: Path) -> None:
    """``Stack(instances=...)``: two controller processes, each answering health as itself; a SIGKILLed one
    comes back by ``restart`` (ready as itself) or by ``supervise``, the other untouched."""
    import asyncio
    import os
    import signal

    from pacer.bus import Bus
    from pacer_services.cli.stack import Stack

    stack = Stack(tmp_path / "stack", services=["controller"], instances={"controller": 2})
    await asyncio.to_thread(stack.start)
    try:
        assert sorted(stack.procs) == ["controller-0", "controller-1"]
        bus = await Bus.connect(stack.url, name="test-instances")
        try:
            for key in ("controller-0", "controller-1"):
                assert await stack._instance_ready(bus, "controller", stack.procs[key].pid), key
            other = stack.procs["controller-0"].pid
            old = stack.procs["controller-1"].pid
            stack.kill("controller-1")
            assert not await stack._instance_ready(bus, "controller", old)
            await asyncio.to_thread(stack.restart, "controller-1")
            new = stack.procs["controller-1"].pid
            assert new != old and await stack._instance_ready(bus, "controller", new)
            os.kill(new, signal.SIGKILL)
            stack.procs["controller-1"].wait()
            assert stack.supervise() == ["controller-1"]
            await asyncio.to_thread(stack.wait_ready, ["controller-1"])
            assert await stack._instance_ready(bus, "controller", stack.procs["controller-1"].pid)
            assert stack.procs["controller-0"].pid == other and stack.procs["controller-0"].poll() is None
        finally:
            await bus.close()
    finally:
        await asyncio.to_thread(stack.stop)
