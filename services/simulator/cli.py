"""``pacer sim``: run one scenario file and print what happened.

Human lines first, then, as the last line, one JSON object (``--json`` prints
only that line) with ``method``, ``jct_s``, ``ideal_jct_s``, ``actions``,
``shards_done``, ``records_duplicated``, ``steps``, ``restarts``, ``seed``,
``scenario`` and more.  Exit codes: 0 ok, 2 bad scenario or arguments,
1 the simulation failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from pacer.errors import PacerError

from .engine import run
from .scenario import ScenarioError, load


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pacer sim", description="Simulate a training job under a straggler policy.")
    p.add_argument("scenario", help="scenario YAML file (see examples/sim/)")
    p.add_argument("--method", help="straggler policy (default: the scenario's method)")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--no-ideal", action="store_true", help="skip the straggler-free reference run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sc = load(args.scenario)
    except (ScenarioError, OSError) as e:
        print(f"pacer sim: {e}", file=sys.stderr)
        return 2
    if args.seed is not None:
        sc = replace(sc, seed=args.seed)
    wall = time.perf_counter()
    try:
        res = run(sc, args.method, ideal=not args.no_ideal)
    except PacerError as e:
        print(f"pacer sim: {e}", file=sys.stderr)
        return 2 if e.code == "invalid" else 1
    wall = time.perf_counter() - wall
    out = res.to_dict()
    if not args.json:
        c, j = sc.cluster, sc.job
        print(f"scenario {sc.name}: {c.workers} workers, {c.ps} ps, {j.mode}, B={j.global_batch}, "
              f"{j.records} records x {j.epochs} epochs, {len(sc.stragglers)} straggler(s), seed {sc.seed}")
        ideal = "" if res.ideal_jct_s is None else f" (ideal {res.ideal_jct_s:.1f} s, x{res.jct_s / res.ideal_jct_s:.3f})"
        print(f"method {res.method}: JCT {res.jct_s:.1f} s{ideal}")
        for entry in res.timeline:
            print(f"  t={entry['t']:.0f}s  {', '.join(entry['actions'])}")
        acts = ", ".join(f"{k} {v}" for k, v in sorted(res.actions.items())) or "none"
        print(f"actions: {acts}; restarts {res.restarts}; steps {res.steps}")
        print(f"shards {res.shards_done}/{res.shards_total} done; records duplicated {res.records_duplicated}, "
              f"recomputed {res.records_recomputed}, dropped {res.records_dropped}")
        print(f"simulated in {wall:.2f} s wall ({res.events} events, {res.decisions} decisions)")
    out["wall_s"] = round(wall, 3)
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
