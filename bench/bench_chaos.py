"""``make bench-chaos``: kill -9 during real TensorFlow jobs on a 3-server NATS cluster (issue 13).

Runs ``--runs`` chaos runs (each a fresh stack: 3 clustered nats-servers,
two instances of the controller and the monitor, one job of 2 PS + 2
workers, Wide&Deep on the demo's generated data) with ``--kills`` kills in
total, spread over the runs, plus one fault-free reference job on the same
data (``--no-reference`` skips it: no ``auc_delta`` then).  What a kill is
and when its target counts as back and the job as progressing again:
bench/chaos.py.

Prints a line per kill and per job, then ONE JSON object as its last line:
``kills`` (per kind), ``jobs``, ``jobs_completed``, ``records_lost`` (must
be 0), ``records_duplicated``, ``max_recover_s`` and ``max_back_s`` (per
kind), ``auc`` and ``auc_delta`` (largest |AUC - reference AUC| over the
chaos jobs), ``duplicate_actions`` (relaunches beyond the KILL_RESTART
decisions that asked for them), ``repeated_kill_restarts`` (a node
KILL_RESTARTed twice within the controller's cool-down), ``single_instance`` (services run once).
Exit status 0 when every job completed with 0 records lost, no duplicate
action and ``auc_delta`` within ``--auc-tolerance``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import chaos


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=30, help="kills in total, over all runs")
    ap.add_argument("--runs", type=int, default=3, help="chaos runs (a fresh stack and one job each)")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--interval", type=float, default=8.0, help="seconds from one kill to the next")
    ap.add_argument("--down", type=float, default=1.0, help="seconds a killed NATS server or service stays down")
    ap.add_argument("--rows", type=int, default=60_000, help="training rows of every job")
    ap.add_argument("--step-sleep", type=float, default=0.4, help="injected per-step sleep (s) of the workers")
    ap.add_argument("--batch-size", type=int, default=256, help="global batch of every job (2 workers)")
    ap.add_argument("--auc-tolerance", type=float, default=0.005)
    ap.add_argument("--no-reference", action="store_true", help="skip the fault-free reference job")
    ap.add_argument("--dir", type=Path, default=None, help="working directory (default: a temporary one)")
    args = ap.parse_args(argv)

    work = args.dir or Path(tempfile.mkdtemp(prefix="pacer-chaos-"))
    shutil.rmtree(work, ignore_errors=True)
    base = chaos.ChaosConfig(seed=args.seed, interval_s=args.interval, down_s=args.down, rows=args.rows,
                             step_sleep_s=args.step_sleep, batch_size=args.batch_size)
    t0 = time.monotonic()
    data, test = chaos.generate_data(work / "data", args.rows, seed=7)
    print(f"bench-chaos: {args.rows:,} rows generated in {work / 'data'}", file=sys.stderr)

    reference: float | None = None
    if not args.no_reference:
        print("bench-chaos: the fault-free reference job ...", file=sys.stderr)
        ref = chaos.run_job(work / "reference", "chaos-reference", data, test, base, 0)
        reference = ref.auc
        print(f"bench-chaos: reference {ref.state}, AUC {ref.auc}, {ref.records_done}/{ref.records_total} records, "
              f"{ref.jct_s:.0f}s", file=sys.stderr)

    outcomes: list[chaos.JobOutcome] = []
    per_run = [args.kills // args.runs + (1 if i < args.kills % args.runs else 0) for i in range(args.runs)]
    for i, n in enumerate(per_run):
        cfg = chaos.ChaosConfig(**{**base.__dict__, "seed": args.seed + i})
        print(f"bench-chaos: run {i + 1}/{args.runs}: {n} kills (seed {cfg.seed}) ...", file=sys.stderr)
        o = chaos.run_job(work / f"run-{i}", f"chaos-{i}", data, test, cfg, n)
        outcomes.append(o)
        print(f"bench-chaos: run {i + 1}: {o.state}, AUC {o.auc}, records {o.records_done}/{o.records_total} "
              f"(lost {o.records_lost}, re-served {o.records_duplicated}), failed shards {o.shards_failed}, "
              f"KILL_RESTART decisions {o.kill_restart_decisions} / relaunches asked {o.requested_relaunches}, "
              f"{o.jct_s:.0f}s", file=sys.stderr)
    out = summarize(outcomes, reference, args)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    ok = (out["jobs_completed"] == out["jobs"] and out["records_lost"] == 0 and out["duplicate_actions"] == 0
          and out["repeated_kill_restarts"] == 0
          and (out["auc_delta"] is None or out["auc_delta"] <= args.auc_tolerance))
    return 0 if ok else 1


def summarize(outcomes: list[chaos.JobOutcome], reference: float | None, args: Any) -> dict[str, Any]:
    kills = [k for o in outcomes for k in o.kills]
    kinds = sorted({k.kind for k in kills} | set(chaos.KINDS))

    def worst(attr: str) -> dict[str, float | None]:
        return {kind: max((getattr(k, attr) for k in kills if k.kind == kind and getattr(k, attr) is not None),
                          default=None) for kind in kinds}

    aucs = [o.auc for o in outcomes]
    deltas = [abs(a - reference) for a in aucs if a is not None and reference is not None]
    return {
        "kills": {kind: sum(1 for k in kills if k.kind == kind) for kind in kinds},
        "kills_total": len(kills),
        "unrecovered": sum(1 for k in kills if k.recover_s is None),
        "jobs": len(outcomes),
        "jobs_completed": sum(1 for o in outcomes if o.completed),
        "records_total": sum(o.records_total for o in outcomes),
        "records_lost": sum(o.records_lost for o in outcomes),
        "records_duplicated": sum(o.records_duplicated for o in outcomes),
        "shards_failed": sum(o.shards_failed for o in outcomes),
        "max_back_s": worst("back_s"),
        "max_recover_s": worst("recover_s"),
        "auc_reference": reference,
        "auc": aucs,
        "auc_delta": round(max(deltas), 4) if deltas and len(deltas) == len(aucs) else None,
        "kill_restart_decisions": sum(o.kill_restart_decisions for o in outcomes),
        "requested_relaunches": sum(o.requested_relaunches for o in outcomes),
        "duplicate_actions": sum(o.duplicate_actions for o in outcomes),
        "repeated_kill_restarts": sum(o.repeated_kill_restarts for o in outcomes),
        "node_restarts": sum(o.node_restarts for o in outcomes),
        "single_instance": outcomes[0].single if outcomes else [],
        "instances": dict(chaos.INSTANCES),
        "settings": {"runs": args.runs, "seed": args.seed, "interval_s": args.interval, "down_s": args.down,
                     "rows": args.rows, "step_sleep_s": args.step_sleep, "batch_size": args.batch_size,
                     "relaunch_budget": chaos.ChaosConfig().relaunch_budget},
    }


if __name__ == "__main__":
    # SIGTERM (a CI's timeout, Ctrl-C's sibling) must still stop the stack and reap the pods (finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
