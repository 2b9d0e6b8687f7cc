"""Shard-service benchmark: real service process, real nats-server, durability on.

N client processes (default 4) each run a ShardClient doing get+report as fast
as they can over one dataset of S shards (default 20,000); every reply is sent
only after JetStream has stored the records it depends on.  In the same run,
for a side-by-side ratio on this noisy shared machine, the same clients run
in *naive* mode: prefetch 1, one request per shard (what a straightforward
get/report protocol costs).  DLRover 0.6.1's measured anchor (docs/design.md:
~1.1k pairs/s with one client, 1.3-1.9k with four, over its gRPC master) is
printed beside it for reference; it is not re-measured here.

Also measured:
* restart_replay_s: rebuild (``ShardLogStore.load``) of a job whose log holds
  100k transitions, snapshots disabled (the worst case);
* restart_ready_s: SIGKILL of the service process -> restarted process
  serving again (includes Python start-up and the rebuild of every job);
* recover_1000_doing_ms: a node-death event -> 1,000 DOING shards durably
  back in TODO (time until the 1,000th ``requeued`` event).

Usage: python bench/bench_shards.py [--clients 4] [--shards 20000] [--prefetch 4]
The last line of output is one JSON object (keys kept stable over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pacer import subjects
from pacer.bus import Bus
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetSpec, LeaseRequest
from pacer.shards.client import ShardAdmin, ShardClient
from pacer_services.cli.stack import Stack

DLROVER_ANCHOR_PAIRS_PER_S = 1100.0  # docs/design.md: DLRover 0.6.1 gRPC master, one client
RECORDS_PER_SHARD = 100


def _client_proc(url: str, job: str, node: str, prefetch: int, start_at: float, q: Any) -> None:
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run

    async def main() -> None:
        bus = await Bus.connect(url, name=node)
        c = ShardClient(bus, job, "d", node, prefetch=prefetch, timeout=5.0)
        c.timings = []
        await c.start()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        n = 0
        t0 = time.time()
        while (s := await c.next()) is not None:
            c.done(s)
            n += 1
        await c.close()
        t1 = time.time()
        await bus.close()
        q.put({"node": node, "shards": n, "t0": t0, "t1": t1, "requests": c.requests, "timings": c.timings})

    run(main())


def run_clients(url: str, job: str, clients: int, prefetch: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 2.0  # let every process import and connect first
    procs = [ctx.Process(target=_client_proc, args=(url, job, f"w{i}", prefetch, start_at, q)) for i in range(clients)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    t0 = min(r["t0"] for r in results)
    t1 = max(r["t1"] for r in results)
    shards = sum(r["shards"] for r in results)
    timings = [t for r in results for t in r["timings"]]
    gets = sorted(t[0] for t in timings if t[2] > 0)
    reports = sorted(t[0] for t in timings if t[1] > 0)

    def pct(xs: list[float], p: float) -> float:
        return round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 3) if xs else 0.0

    return {
        "shards": shards,
        "seconds": t1 - t0,
        "pairs_per_s": shards / (t1 - t0),
        "requests": sum(r["requests"] for r in results),
        "get_p50_ms": pct(gets, 0.50),
        "get_p99_ms": pct(gets, 0.99),
        "report_p50_ms": pct(reports, 0.50),
        "report_p99_ms": pct(reports, 0.99),
        "mean_shards_per_request": statistics.mean(t[2] for t in timings) if timings else 0.0,
    }


async def register(bus: Bus, job: str, shards: int, **kw: Any) -> None:
    await ShardAdmin(bus).register(
        DatasetSpec(job=job, dataset="d", records=shards * RECORDS_PER_SHARD, batch_size=10,
                    batches_per_shard=RECORDS_PER_SHARD // 10, **kw)
    )


async def replay_bench(bus: Bus, transitions: int) -> float:
    """Write a log of ``transitions`` records the way the service does, then time a rebuild."""
    from pacer_services.shard_service.core import JobShards
    from pacer_services.shard_service.effects import ShardLogStore

    job = "replay"
    store = ShardLogStore(bus.js)
    await store.open()
    core = JobShards(job)
    records: list[list[Any]] = []
    records += core.register(DatasetSpec(job=job, dataset="d", records=transitions // 2 * 100, batch_size=10,
                                         batches_per_shard=10)).records
    nodes = [f"n{i}" for i in range(4)]
    held: dict[str, list[int]] = {n: [] for n in nodes}
    while len(records) < transitions:
        for n in nodes:
            out = core.lease(LeaseRequest(job=job, dataset="d", node=n, want=4, done=held[n]), 0.0)
            held[n] = [s.shard for s in out.reply.shards]
            records += out.records
    records = records[:transitions]
    seq = 0
    for i in range(0, len(records), 32):  # ~ the group-commit batch size under load
        seq = await store.append(job, records[i:i + 32], seq)
    t0 = time.perf_counter()
    state, _, applied = await store.load(job)
    dt = time.perf_counter() - t0
    assert applied == transitions, (applied, transitions)
    assert state.snapshot() == _fold_snapshot(job, records)
    return dt


def _fold_snapshot(job: str, records: list[list[Any]]) -> Any:
    from pacer_services.shard_service.core import fold

    return fold(job, records).snapshot()


async def recover_bench(bus: Bus, n: int = 1000) -> float:
    job = "recover"
    await register(bus, job, 2 * n, lease_s=600.0)
    c = ShardClient(bus, job, "d", "victim", prefetch=64)
    while len(c._held) < n:
        c.prefetch = min(64, n - len(c._held)) or 1
        await c._sync(c.prefetch)
    got = 0
    done = asyncio.Event()

    async def on_requeued(msg: Any) -> None:
        nonlocal got
        got += 1
        if got >= n:
            done.set()

    sub = await bus.nc.subscribe(subjects.event("shard", job, "requeued"), cb=on_requeued)
    t0 = time.perf_counter()
    await bus.publish_durable(subjects.event("node", job, "died"), NodeEvent(job, "victim", "died", time.time(), "killed"))
    await asyncio.wait_for(done.wait(), 30)
    dt = time.perf_counter() - t0
    await sub.unsubscribe()
    return dt * 1000


async def wait_serving(bus: Bus, job: str, timeout: float = 60.0) -> None:
    admin = ShardAdmin(bus)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            await admin.status(job, "d")
            return
        except Exception:
            await asyncio.sleep(0.01)
    raise TimeoutError("service did not come back")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--shards", type=int, default=20_000)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--replay-transitions", type=int, default=100_000)
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp, Stack(Path(tmp), services=["shard", "monitor"]) as stack:
        url = stack.url

        async def setup(job: str, shards: int) -> None:
            bus = await Bus.connect(url)
            await wait_serving_registered(bus, job, shards)
            await bus.close()

        async def wait_serving_registered(bus: Bus, job: str, shards: int) -> None:
            deadline = time.monotonic() + 30
            while True:
                try:
                    await register(bus, job, shards)
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)

        asyncio.run(setup("main", args.shards))
        main_res = run_clients(url, "main", args.clients, args.prefetch)
        print(f"pacer: {main_res['pairs_per_s']:.0f} pairs/s, get p50 {main_res['get_p50_ms']} ms, "
              f"p99 {main_res['get_p99_ms']} ms ({main_res['requests']} requests)", file=sys.stderr)
        naive: dict[str, Any] = {}
        if not args.skip_naive:
            asyncio.run(setup("naive", args.shards // 4))
            naive = run_clients(url, "naive", args.clients, 1)
            print(f"naive (prefetch 1): {naive['pairs_per_s']:.0f} pairs/s", file=sys.stderr)

        async def rest() -> tuple[float, float, float]:
            bus = await Bus.connect(url)
            try:
                replay = await replay_bench(bus, args.replay_transitions)
                recover = await recover_bench(bus)
                stack.procs["shard"].kill()
                stack.procs["shard"].wait()
                t0 = time.perf_counter()
                stack.start_service("shard")
                await wait_serving(bus, "main")
                ready = time.perf_counter() - t0
                st = await ShardAdmin(bus).status("main", "d")
                # Every record done once; near the end shards are split between workers (tail pieces), so
                # there may be more done shards than were registered.
                assert st.finished and st.done >= args.shards and st.records_done == st.records_total, st
                assert st.records_duplicated == 0, st
                return replay, recover, ready
            finally:
                await bus.close()

        replay_s, recover_ms, ready_s = asyncio.run(rest())

    out = {
        "bench": "shards",
        "clients": args.clients,
        "shards": args.shards,
        "prefetch": args.prefetch,
        "pairs_per_s": round(main_res["pairs_per_s"], 1),
        "get_p50_ms": main_res["get_p50_ms"],
        "get_p99_ms": main_res["get_p99_ms"],
        "report_p50_ms": main_res["report_p50_ms"],
        "report_p99_ms": main_res["report_p99_ms"],
        "requests": main_res["requests"],
        "shards_per_request": round(main_res["mean_shards_per_request"], 2),
        "naive_pairs_per_s": round(naive.get("pairs_per_s", 0.0), 1),
        "speedup_vs_naive": round(main_res["pairs_per_s"] / naive["pairs_per_s"], 2) if naive else None,
        "dlrover_anchor_pairs_per_s": DLROVER_ANCHOR_PAIRS_PER_S,
        "ratio_vs_dlrover_anchor": round(main_res["pairs_per_s"] / DLROVER_ANCHOR_PAIRS_PER_S, 2),
        "restart_replay_s": round(replay_s, 3),
        "replay_transitions": args.replay_transitions,
        "restart_ready_s": round(ready_s, 3),
        "recover_1000_doing_ms": round(recover_ms, 1),
        "durable": True,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
