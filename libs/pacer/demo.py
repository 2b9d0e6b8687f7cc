"""``pacer demo``: the embedded stack, a dataset, and worker processes consuming it.

What it shows (until the trainer and the executor exist, the demo plays the
executor's part itself):

* the embedded stack starts (nats-server with JetStream + the shard service);
* a dataset is registered and consumed by several worker *processes* through
  the shard client, with a live progress bar from the service's events;
* one worker is a straggler (it takes 3x longer per shard) and simply takes
  fewer shards: dynamic sharding keeps the others busy;
* midway one worker is killed with SIGKILL; a node-death event returns its
  shards at once and a replacement worker starts;
* a summary; its last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pacer import subjects
from pacer.bus import Bus, RetryPolicy
from pacer.codec import decode
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetSpec, DatasetStatus, ProgressEvent
from pacer.shards.client import ShardAdmin, ShardClient

JOB, DATASET = "demo", "train"
RECORD_S = 20e-6  # simulated read+train time per record


def _worker(url: str, node: str, slowdown: float) -> None:
    async def main() -> None:
        bus = await Bus.connect(url, name=node)
        c = ShardClient(bus, JOB, DATASET, node, prefetch=2)
        await c.start()
        while (s := await c.next()) is not None:
            n = s.end - s.start
            for i in range(0, n, 250):  # a "step" of 250 records
                await asyncio.sleep(250 * RECORD_S * slowdown)
                c.progress(s, s.start - s.offset + min(i + 250, n))
            c.done(s)
        await c.close()
        await bus.close()

    asyncio.run(main())


def _bar(st: DatasetStatus, width: int = 32) -> str:
    total = st.todo + st.doing + st.done + st.failed
    frac = st.done / total if total else 0.0
    fill = int(frac * width)
    return (
        f"\r[{'#' * fill}{'.' * (width - fill)}] {100 * frac:5.1f}%  "
        f"done {st.done}/{total}  doing {st.doing}  failed {st.failed}  dup {st.records_duplicated}   "
    )


async def _run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    bus = await Bus.connect(url, name="demo")
    admin = ShardAdmin(bus, retry=RetryPolicy(attempts=50))  # the service may still be starting
    await admin.register(DatasetSpec(job=JOB, dataset=DATASET, records=args.records, batch_size=100,
                                     batches_per_shard=10, epochs=1, lease_s=10.0))
    latest: list[DatasetStatus] = [await admin.status(JOB, DATASET)]

    async def on_progress(msg: Any) -> None:
        latest[0] = decode(ProgressEvent, msg.data).status

    sub = await bus.nc.subscribe(subjects.event("shard", JOB, subjects.ShardEventKind.PROGRESS), cb=on_progress)
    ctx = mp.get_context("spawn")
    procs: dict[str, Any] = {}
    for i in range(args.workers):
        slow = 3.0 if i == args.workers - 1 else 1.0  # the last worker is a straggler
        procs[f"worker-{i}"] = ctx.Process(target=_worker, args=(url, f"worker-{i}", slow), daemon=True)
    for p in procs.values():
        p.start()
    t0 = time.time()
    restarts = 0
    killed = False
    while True:
        st = latest[0]
        print(_bar(st), end="", file=sys.stderr, flush=True)
        if st.finished:
            break
        total = st.todo + st.doing + st.done
        if args.kill_one and not killed and total and st.done >= total // 3:
            killed = True
            victim = "worker-0"
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].join()
            print(f"\nkilled {victim} (SIGKILL) holding {next((n.doing for n in st.nodes if n.node == victim), 0)} "
                  "shards; publishing its death and starting worker-0b", file=sys.stderr)
            await bus.publish_durable(subjects.event("node", JOB, subjects.NodeEventKind.DIED),
                                      NodeEvent(JOB, victim, "died", time.time(), "killed", "worker"))
            procs["worker-0b"] = ctx.Process(target=_worker, args=(url, "worker-0b", 1.0), daemon=True)
            procs["worker-0b"].start()
            restarts += 1
        await asyncio.sleep(0.25)
        if not any(p.is_alive() for p in procs.values()):
            latest[0] = await admin.status(JOB, DATASET)
            if not latest[0].finished:
                raise RuntimeError("every worker exited but the dataset is not finished")
    for p in procs.values():
        p.join(10)
    await sub.unsubscribe()
    st = await admin.status(JOB, DATASET)
    await bus.close()
    print(file=sys.stderr)
    for n in st.nodes:
        print(f"  {n.node:<10} shards {n.shards_done:>4}  records {n.records:>8}", file=sys.stderr)
    return {
        "status": "completed" if st.finished else "incomplete",
        "seconds": round(time.time() - t0, 2),
        "records_total": st.records_total,
        "records_done": st.records_done,
        "shards_total": st.todo + st.doing + st.done + st.failed,
        "shards_done": st.done,
        "shards_failed": st.failed,
        "records_duplicated": st.records_duplicated,
        "node_restarts": restarts,
    }


def main(args: argparse.Namespace) -> int:
    from pacer.stack import Stack

    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)  # every demo starts from a clean store
    print(f"pacer demo: starting the embedded stack in {data} ...", file=sys.stderr)
    with Stack(data) as stack:
        summary = asyncio.run(_run(stack.url, args))
    print("pacer demo summary:", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if summary["status"] == "completed" and summary["records_done"] == summary["records_total"] else 1
