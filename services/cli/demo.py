"""``pacer demo``: a whole Wide&Deep job on the embedded stack, from nothing.

What it does:

* starts the embedded stack: nats-server with JetStream, the shard service,
  the monitor, the job service, the pod-executor (local processes) and the
  HTTP API with its dashboard (the URL is printed at once);
* generates a Criteo-like dataset with a planted signal, plus held-out data;
* submits a Wide&Deep job with **no resource fields**: the executor applies
  the documented default plan (:func:`pacer.jobs.spec.default_plan`);
* midway, kills one worker's TensorFlow process with SIGKILL (``--no-kill``
  to skip): the executor classifies the death, the shard service returns
  the worker's shards at once, and the worker is relaunched;
* shows progress, then a summary whose last line is one JSON object with
  ``status``, ``jct_s``, ``auc``, ``shards_total``, ``shards_done``,
  ``shards_failed``, ``records_duplicated``, ``node_restarts`` (and more).

Exit status 0 when the job completed with every shard done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from pacer.bus import Bus
from pacer.contracts.jobs import JobRecord, JobState
from pacer.jobs.client import JobClient
from pacer_services.cli.progress import Progress

JOB = "demo-wide-deep"
TERMINAL = (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED)


def _spec(data: Path, test: Path) -> str:
    return (f"# A Wide&Deep job with no resources: Pacer decides.\n"
            f"name: {JOB}\nmodel: wide_deep\n"
            f"dataset:\n  path: {data}\n  test_path: {test}\n"
            f"epochs: 1\nbatch_size: 512\nmode: asp\n")


def _kill_trainer(job: str, node: str) -> bool:
    """SIGKILL the TensorFlow process of one node, as a failing machine would."""
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "pacer.trainer.worker" in cmd and f'"job": "{job}"' in cmd and f'"node": "{node}"' in cmd:
            os.kill(p.info["pid"], signal.SIGKILL)
            return True
    return False


async def _follow(url: str, spec: str, kill: bool, timeout: float) -> JobRecord:
    bus = await Bus.connect(url, name="pacer-demo")
    try:
        client = JobClient(bus, timeout=30.0)
        rec = await client.submit(JOB, spec)
        plan = rec.plan
        if plan is not None:
            print(f"pacer demo: job {JOB} submitted; plan ({plan.source.value}): {plan.workers} workers x "
                  f"{plan.worker_cpu:g} CPU/{plan.worker_memory_mb} MiB, {plan.ps} PS x "
                  f"{plan.ps_cpu:g} CPU/{plan.ps_memory_mb} MiB", file=sys.stderr)
        killed = not kill
        deadline = time.monotonic() + timeout
        with Progress(interval=5.0) as bar:
            while not (rec.state in TERMINAL and rec.torn_down):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {JOB} did not finish within {timeout:.0f}s")
                await asyncio.sleep(0.5)
                rec = await client.get(JOB)
                p = rec.progress
                bar.update(p.shards_done, p.shards_total, rec.state.value,
                           f"restarts {rec.node_restarts}  dup {p.records_duplicated}")
                if not killed and p.shards_total and p.shards_done >= p.shards_total // 3:
                    killed = _kill_trainer(JOB, "worker-1")
                    if killed:
                        print("\npacer demo: killed worker-1's TensorFlow process (SIGKILL)", file=sys.stderr)
        return rec
    finally:
        await bus.close()


def summary(rec: JobRecord) -> dict[str, Any]:
    p = rec.progress
    auc = rec.result.get("auc")
    return {
        "status": rec.state.value,
        "reason": rec.reason,
        "jct_s": round(rec.finished_at - rec.submitted_at, 2) if rec.finished_at else None,
        "auc": round(float(auc), 4) if isinstance(auc, int | float) else None,
        "shards_total": p.shards_total,
        "shards_done": p.shards_done,
        "shards_failed": p.shards_failed,
        "records_total": p.records_total,
        "records_done": p.records_done,
        "records_duplicated": p.records_duplicated,
        "node_restarts": rec.node_restarts,
        "plan": None if rec.plan is None else {"workers": rec.plan.workers, "ps": rec.plan.ps,
                                               "source": rec.plan.source.value},
    }


def main(args: argparse.Namespace) -> int:
    from pacer.data.criteo import generate, heldout_path
    from pacer.embedded import free_port
    from pacer_services.cli.stack import Stack

    data_dir = Path(args.data_dir)
    shutil.rmtree(data_dir, ignore_errors=True)  # every demo starts from a clean store
    port = args.api_port or free_port()
    print(f"pacer demo: starting the embedded stack in {data_dir} ...", file=sys.stderr)
    with Stack(data_dir, env={"PACER_API_PORT": str(port)}) as stack:
        print(f"pacer demo: dashboard at {stack.dashboard_url(port)}  (jobs, live throughput, nodes, shards; "
              f"sign in with the token in {stack.api_token_file})", file=sys.stderr)
        data = data_dir / "data" / "train.rec"
        data.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        generate(data, args.rows, seed=args.seed)
        generate(heldout_path(data), max(10_000, args.rows // 10), seed=args.seed, stream=1)
        print(f"pacer demo: generated {args.rows:,} training rows in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        rec = asyncio.run(_follow(stack.url, _spec(data, heldout_path(data)), args.kill_one, args.timeout))
        out = summary(rec)
        if args.keep:
            print(f"pacer demo: the stack keeps running; dashboard at {stack.dashboard_url(port)} "
                  "(Ctrl-C to stop)", file=sys.stderr)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    print("pacer demo summary:", file=sys.stderr)
    print(json.dumps(out))
    ok = out["status"] == "completed" and out["shards_done"] == out["shards_total"] and out["shards_failed"] == 0
    return 0 if ok else 1
