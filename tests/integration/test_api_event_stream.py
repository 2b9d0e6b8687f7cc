"""The event stream (SSE): history replayed then live events, controller and brain decisions, resuming with
Last-Event-ID, many clients leaving nothing behind, capped history, garbage on every event subject.
(The peer double, the API service and its client: api_support.)"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import aiohttp
import api_support
import msgpack
import pytest
from api_support import AUTH, Client, api_config, decisions, read_sse, statistics
from conftest import InProcess
from pacer import subjects
from pacer.bus import Bus
from pacer.contracts.brain import BrainRule
from pacer.contracts.jobs import JobEvent, JobState
from pacer.contracts.nodes import NodeEvent
from pacer.embedded import EmbeddedNats
from pacer_services.api.app import ApiService

# The fixtures of api_support (pytest finds them as attributes of this module).
api_service = api_support.api_service
http = api_support.http


pytestmark = pytest.mark.timeout(60)


async def eventually(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ events (SSE)


async def test_sse_replays_history_then_streams_live(http: Client, bus: Bus, api_service: ApiService) -> None:
    now = time.time()
    job = "sse1"
    # History, stored before any client connects (another job's events must not leak in).
    await bus.publish_durable(subjects.job_event(job, "running"),
                              JobEvent(job, JobState.RUNNING, now - 5, "plan applied", JobState.PLANNING))
    await bus.publish_durable(subjects.node_event(job, "created"),
                              NodeEvent(job=job, node="worker-0", kind="created", ts=now - 4, role="worker"))
    await bus.publish_durable(subjects.node_event("other", "created"),
                              NodeEvent(job="other", node="worker-9", kind="created", ts=now - 4))
    await bus.publish_durable(subjects.monitor_statistics(job), statistics(job, 500.0, now - 3))

    async with http.session.get(f"/api/v1/events?job={job}") as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        events = await read_sse(resp, "replayed")
        named = [e for e in events if e[0] != ":"]
        assert [n for n, _ in named] == ["job.running", "node.created", "monitor.statistics", "replayed"]
        assert named[0][1]["state"] == "running" and named[0][1]["previous"] == "planning"
        assert named[1][1]["node"] == "worker-0"
        assert named[2][1]["throughput_samples_per_s"] == 500.0
        assert named[3][1] == {"count": 3, "resumed": False}
        await eventually(lambda: api_service.streams == 1)

        # Live: a node event as the executor publishes it.
        await bus.publish(subjects.node_event(job, "running"),
                          NodeEvent(job=job, node="worker-0", kind="running", ts=time.time(), pending_s=1.5))
        events = await read_sse(resp, "node.running")
        assert events[-1][1]["node"] == "worker-0" and events[-1][1]["pending_s"] == 1.5

        # Garbage on an event subject is counted and skipped; the stream goes on.
        await bus.nc.publish(subjects.node_event(job, "died"), b"\xc1\xc1 not msgpack")
        # A message that is msgpack but not the contract is shown generically.
        await bus.nc.publish(subjects.node_event(job, "died"), msgpack.packb({"foo": b"\x01", "nan": float("nan")}))
        await bus.publish(subjects.job_event(job, "completed"),
                          JobEvent(job, JobState.COMPLETED, time.time(), previous=JobState.RUNNING))
        events = await read_sse(resp, "job.completed")
        tail = [e for e in events if e[0] not in (":",)]
        assert ("node.died", {"foo": "01", "nan": None}) in tail
        assert tail[-1][1]["state"] == "completed"
        assert api_service.counters.snapshot()["bad_events"] == 1

        # Keep-alive comments while nothing happens.
        await read_sse(resp, ":", timeout=3.0)

    # The client went away: its subscription is gone.
    await eventually(lambda: api_service.streams == 0, timeout=5.0)


async def test_sse_replays_controller_and_brain_decisions(http: Client, bus: Bus) -> None:
    job = "dec1"
    idle, acted, brain = decisions(job, time.time() - 10)
    await bus.publish_durable(subjects.node_event(job, "created"),
                              NodeEvent(job=job, node="worker-0", kind="created", ts=idle.ts - 1))
    for d in (idle, acted):
        await bus.publish_durable(subjects.controller_decision(job), d)
    await bus.publish_durable(subjects.brain_decision(job), brain)
    async with http.session.get(f"/api/v1/events?job={job}") as resp:
        events = [e for e in await read_sse(resp, "replayed") if e[0] != ":"]
        assert [n for n, _ in events] == ["node.created", "controller.decision", "controller.decision",
                                          "brain.decision", "replayed"]
        ctl = events[2][1]
        assert ctl["policy"] == "straggler" and ctl["executed"][0]["kind"] == "KILL_RESTART"
        assert ctl["executed"][0]["node"] == "worker-1" and ctl["refused"][0]["reason"] == "cooldown"
        b = events[3][1]
        assert (b["rule"], b["stage"], b["plan"]["workers"], b["previous"]["workers"]) == (
            "optimize", "adjust", brain.plan.workers, brain.previous.workers if brain.previous else -1)
        # Live, decoded by their contracts too.
        await bus.publish_durable(subjects.brain_decision(job), replace(brain, ts=time.time(), rule=BrainRule.OOM))
        events = await read_sse(resp, "brain.decision")
        assert events[-1][1]["rule"] == "oom" and events[-1][1]["predicted_throughput"] == 1400.0


async def test_sse_ids_let_a_client_resume_where_it_left_off(http: Client, bus: Bus) -> None:
    job = "resume1"
    for i in range(3):
        await bus.publish_durable(subjects.node_event(job, "created"),
                                  NodeEvent(job=job, node=f"worker-{i}", kind="created", ts=time.time()))
    ids: list[str | None] = []
    async with http.session.get(f"/api/v1/events?job={job}") as resp:
        events = [e for e in await read_sse(resp, "replayed", ids=ids) if e[0] != ":"]
        assert [d.get("node") for _n, d in events[:3]] == ["worker-0", "worker-1", "worker-2"]
        assert all(i is not None and i.isdigit() for i in ids), ids  # an id on every event, the marker's too
        seqs = [int(i) for i in ids if i is not None]
        assert seqs[:3] == sorted(set(seqs[:3])) and seqs[3] >= seqs[2]
        assert events[3] == ("replayed", {"count": 3, "resumed": False})
        await bus.publish(subjects.node_event(job, "running"),
                          NodeEvent(job=job, node="worker-0", kind="running", ts=time.time()))
        await read_sse(resp, "node.running", ids=ids)
        live_id = int(ids[-1] or 0)
        assert live_id > seqs[2]
    # The connection dropped after worker-1; the browser reconnects with Last-Event-ID.
    ids = []
    async with http.session.get(f"/api/v1/events?job={job}", headers={"Last-Event-ID": str(seqs[1])}) as resp:
        events = [e for e in await read_sse(resp, "replayed", ids=ids) if e[0] != ":"]
    assert [(n, d.get("node")) for n, d in events[:-1]] == [("node.created", "worker-2"), ("node.running", "worker-0")]
    assert events[-1] == ("replayed", {"count": 2, "resumed": True})
    assert [int(i or 0) for i in ids[:2]] == [seqs[2], live_id]
    # Up to date: nothing to replay, live follows.
    async with http.session.get(f"/api/v1/events?job={job}&last_event_id={live_id}") as resp:
        events = [e for e in await read_sse(resp, "replayed") if e[0] != ":"]
        assert events == [("replayed", {"count": 0, "resumed": True})]
        await bus.publish(subjects.node_event(job, "died"),
                          NodeEvent(job=job, node="worker-1", kind="died", ts=time.time()))
        events = await read_sse(resp, "node.died")
        assert events[-1][1]["node"] == "worker-1"
    status, err = await http.call("GET", f"/api/v1/events?job={job}", headers={"Last-Event-ID": "abc"})
    assert status == 400 and "Last-Event-ID" in err["error"]["message"]


async def test_sse_without_replay_and_many_clients_leave_nothing_behind(
    http: Client, bus: Bus, api_service: ApiService
) -> None:
    job = "sse2"
    await bus.publish_durable(subjects.node_event(job, "created"),
                              NodeEvent(job=job, node="worker-0", kind="created", ts=time.time()))
    base = len(bus.nc._subs)  # the API shares the server, not this connection: count the API's own
    api_subs = len(api_service.bus.nc._subs)
    responses = [await http.session.get(f"/api/v1/events?job={job}&replay=0") for _ in range(5)]
    await eventually(lambda: api_service.streams == 5)
    assert len(api_service.bus.nc._subs) == api_subs + 5
    await bus.publish(subjects.node_event(job, "running"),
                      NodeEvent(job=job, node="worker-0", kind="running", ts=time.time()))
    for resp in responses:
        events = await read_sse(resp, "node.running")
        assert [e[0] for e in events if e[0] != ":"] == ["node.running"]  # no history asked for
        resp.close()
    await eventually(lambda: api_service.streams == 0)
    await eventually(lambda: len(api_service.bus.nc._subs) == api_subs)
    assert len(bus.nc._subs) == base


async def test_sse_history_is_capped_at_the_newest(nats_server: EmbeddedNats, bus: Bus) -> None:
    cfg = replace(api_config(), replay_limit=5, replay_series=2)
    runner = InProcess(nats_server.url, lambda b: ApiService(b, cfg))
    svc = await runner.start()
    try:
        job = "cap1"
        for i in range(20):
            await bus.publish_durable(subjects.node_event(job, "created"),
                                      NodeEvent(job=job, node=f"worker-{i}", kind="created", ts=float(i)))
            await bus.publish_durable(subjects.monitor_statistics(job), statistics(job, float(i), float(i)))
        async with aiohttp.ClientSession(f"http://127.0.0.1:{svc.port}", headers=AUTH) as session:
            async with session.get(f"/api/v1/events?job={job}") as resp:
                events = [e for e in await read_sse(resp, "replayed") if e[0] != ":"]
        nodes = [d["node"] for n, d in events if n == "node.created"]
        stats = [d["throughput_samples_per_s"] for n, d in events if n == "monitor.statistics"]
        assert nodes == [f"worker-{i}" for i in range(15, 20)]
        assert stats == [18.0, 19.0]
        assert events[-1] == ("replayed", {"count": 7, "resumed": False})
    finally:
        await runner.stop()


async def test_service_survives_garbage_on_every_event_subject(http: Client, bus: Bus, api_service: ApiService) -> None:
    job = "junk"
    garbage = [b"", b"\xc1", b"\x93\x01\x02", msgpack.packb([1, 2, 3]), b"\xff" * 100]
    for domain, kind in (("job", "running"), ("job", "plan"), ("node", "died"), ("monitor", "statistics"),
                         ("shard", "progress"), ("agent", "metrics"), ("agent", "action"), ("executor", "failed")):
        for data in garbage:
            await bus.js.publish(subjects.event(domain, job, kind), data)
    async with http.session.get(f"/api/v1/events?job={job}") as resp:
        events = [e for e in await read_sse(resp, "replayed") if e[0] != ":"]
        # Only valid msgpack gets through (generically); nothing crashed.
        assert all(isinstance(d, list | int | dict) for n, d in events if n != "replayed")
    status, health = await http.call("GET", "/healthz")
    assert status == 200 and health["counters"]["bad_events"] > 0
