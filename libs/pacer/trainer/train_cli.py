"""``pacer train local``: watch a small Wide&Deep (or xDeepFM, DCN) job train here.

Uses a running stack (``--url`` or ``$PACER_NATS_URL``) or the embedded one
that the CLI (``pacer_services.cli``) hands in; generates Criteo-like data
if none is given; prints progress and a JSON summary (AUC on the held-out
split) as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pacer.trainer.local import LocalJob, LocalJobSpec
from pacer.trainer.straggler import PatternKind, StragglerSpec


def _stragglers(items: list[str]) -> dict[int, StragglerSpec]:
    out = {}
    for item in items:
        parts = item.split(":")
        kind = PatternKind(parts[2] if len(parts) > 2 else "persistent")
        out[int(parts[0])] = StragglerSpec(kind=kind, sleep_s=float(parts[1]), period_s=60.0, on_s=30.0)
    return out


def _status(url: str, job: str) -> Any:
    from pacer.bus import Bus
    from pacer.shards.client import ShardAdmin

    async def go() -> Any:
        bus = await Bus.connect(url)
        try:
            return await ShardAdmin(bus).status(job, "train")
        finally:
            await bus.close()

    return asyncio.run(go())


class RunningStack(Protocol):
    """A NATS with the shard service and the monitor (the CLI's embedded stack; libs cannot import it)."""

    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


def main(args: argparse.Namespace, start_stack: Callable[[Path], RunningStack] | None = None) -> int:
    """Run the job; ``start_stack(dir)`` gives it a stack when neither ``--url`` nor ``$PACER_NATS_URL`` is set."""
    from pacer.data.criteo import generate, heldout_path

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else work / f"train-{args.rows}.rec"
    if not data.exists():
        print(f"generating {args.rows} Criteo-like rows into {data} ...", file=sys.stderr)
        generate(data, args.rows, seed=1)
        generate(heldout_path(data), max(20_000, args.rows // 10), seed=1, stream=1)
    eval_data = args.eval_data or str(heldout_path(data))
    stack = None
    url = args.url or os.environ.get("PACER_NATS_URL")
    if not url:
        if start_stack is None:
            print("pacer train local: no NATS: give --url or set PACER_NATS_URL", file=sys.stderr)
            return 2
        stack = start_stack(work / "stack")
        url = stack.url
    job_id = f"{args.job}-{int(time.time())}"
    spec = LocalJobSpec(job=job_id, data=str(data), eval_data=eval_data, nats_url=url, model=args.model,
                        num_ps=args.ps, workers=args.workers, mode=args.mode, batch_size=args.batch_size,
                        backup_workers=args.backup_workers, epochs=args.epochs, agents=args.agents,
                        stragglers=_stragglers(args.straggler), work_dir=str(work / job_id))
    t0 = time.time()
    try:
        with LocalJob(spec) as job:
            print(f"job {job_id}: {args.ps} PS + {args.workers} workers ({args.mode}); logs in {job.work}",
                  file=sys.stderr)
            while any(p.poll() is None for p in job.workers.values()):
                try:
                    st = _status(url, job_id)
                    total = st.todo + st.doing + st.done
                    print(f"\r  shards {st.done}/{total} done, {st.doing} in flight, "
                          f"{st.records_done} records  ({time.time() - t0:.0f}s)", end="", file=sys.stderr)
                except Exception:
                    pass
                time.sleep(1.0)
            results = job.wait(timeout=60)
        print(file=sys.stderr)
        chief = results.get(0, {})
        summary = {"job": job_id, "status": "completed" if chief.get("exit") == 0 else "failed",
                   "seconds": round(time.time() - t0, 1), "auc": chief.get("auc"),
                   "global_step": chief.get("global_step"),
                   "samples": sum(r.get("samples", 0) for r in results.values()),
                   "node_restarts": sum(job.restarts.values()),
                   "workers": {job.node(i): {"steps": r.get("local_steps"), "samples": r.get("samples")}
                               for i, r in results.items()}}
        print(json.dumps(summary))
        return 0 if summary["status"] == "completed" else 1
    finally:
        if stack is not None:
            stack.stop()
