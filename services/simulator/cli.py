"""``pacer sim``: run one scenario file and print what happened.

A straggler scenario (:mod:`.stragglers.scenario`) runs one job under a
straggler policy.  Human lines first, then, as the last line, one JSON object (``--json`` prints
only that line) with ``method``, ``jct_s``, ``ideal_jct_s``, ``actions``,
``shards_done``, ``records_duplicated``, ``steps``, ``restarts``, ``seed``,
``scenario`` and more.  Exit codes: 0 ok, 2 bad scenario or arguments,
1 the simulation failed.

A scenario with a top-level ``autoscale`` key is an autoscaling run instead
(:mod:`.autoscale.scenario`): ``--scaler`` picks the scaler (default the
scenario's) and the JSON line carries ``scaler``, ``jct_s``,
``oracle_jct_s``, ``jct_vs_oracle_pct`` and the run's figures (or, for a
cluster scenario, ``mean_jct_s``, ``makespan_s`` and per-job results).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pacer.errors import PacerError

from .autoscale import ClusterRun, time_to_fraction_of
from .autoscale import scenario as autoscale_scenario
from .fields import ScenarioError
from .stragglers import load, run
from .stragglers.policy import Policy


class PolicyLoadError(Exception):
    """``--policy`` names nothing callable."""


def load_policy(ref: str) -> tuple[str, Policy]:
    """``module:function`` or ``path/to/file.py:function`` -> (the policy's name, the function).

    The name is the module's ``NAME`` if it has one (as a policy service
    registers it), else the function's qualified name.  The function runs
    in-process, exactly as the simulator runs the built-ins: the controller
    core still reviews every decision it returns.
    """
    where, sep, attr = ref.rpartition(":")
    if not sep or not where or not attr:
        raise PolicyLoadError(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {ref!r}")
    try:
        if where.endswith(".py") or os.sep in where:
            path = Path(where)
            spec = importlib.util.spec_from_file_location(f"pacer_user_policy_{path.stem}", path)
            if spec is None or spec.loader is None or not path.is_file():
                raise PolicyLoadError(f"no Python file {where!r}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except PolicyLoadError:
        raise
    except Exception as e:  # the user's module failed to import: say why, do not crash
        raise PolicyLoadError(f"cannot import {where!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PolicyLoadError(f"{where!r} has no function {attr!r}")
    name = getattr(module, "NAME", None)
    return (name if isinstance(name, str) and name else f"{module.__name__}.{attr}"), fn


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pacer sim", description="Simulate a training job under a straggler policy.")
    p.add_argument("scenario", help="scenario YAML file (see examples/sim/)")
    p.add_argument("--method", help="straggler policy (default: the scenario's method)")
    p.add_argument("--policy", metavar="MODULE:FUNCTION",
                   help="your own straggler policy, decide(PolicyRequest) -> PolicyDecision: a module "
                        "(my_pkg.policies:decide) or a file (examples/policies/restart_slowest.py:decide)")
    p.add_argument("--scaler", help="autoscale scenarios: the resource scaler (default: the scenario's)")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--no-ideal", action="store_true", help="skip the straggler-free reference run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if autoscale_scenario.is_autoscale(args.scenario):
        return _main_autoscale(args)
    try:
        sc = load(args.scenario)
    except (ScenarioError, OSError) as e:
        print(f"pacer sim: {e}", file=sys.stderr)
        return 2
    if args.seed is not None:
        sc = replace(sc, seed=args.seed)
    try:
        name, policy = load_policy(args.policy) if args.policy else (args.method, None)
    except PolicyLoadError as e:
        print(f"pacer sim: --policy: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter()
    try:
        res = run(sc, name, policy=policy, ideal=not args.no_ideal)
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



def _main_autoscale(args: argparse.Namespace) -> int:
    try:
        sc = autoscale_scenario.load(args.scenario)
        if args.seed is not None:
            sc = replace(sc, seed=args.seed)
        wall = time.perf_counter()
        res, ref = autoscale_scenario.run(sc, args.scaler)
    except (ScenarioError, OSError) as e:
        print(f"pacer sim: {e}", file=sys.stderr)
        return 2
    except PacerError as e:
        print(f"pacer sim: {e}", file=sys.stderr)
        return 2 if e.code == "invalid" else 1
    wall = time.perf_counter() - wall
    out = res.to_dict()
    out.update(scenario=sc.name, seed=sc.seed)
    if isinstance(res, ClusterRun):
        if not args.json:
            c = sc.cluster
            assert c is not None
            print(f"scenario {sc.name}: {c.jobs} jobs on {c.cpu:g} CPU, arrivals every {c.arrival_mean_s:g} s "
                  f"on average, seed {sc.seed}")
            mean = "-" if res.mean_jct_s is None else f"{res.mean_jct_s / 3600:.2f} h"
            print(f"scaler {res.scaler}: mean JCT {mean}, makespan {res.makespan_s / 3600:.2f} h, "
                  f"CPU allocated {res.cpu_allocated_util:.0%} used {res.cpu_used_util:.0%}, "
                  f"{res.rejected} plan(s) rejected, {res.unfinished} unfinished")
    else:
        oracle = None if ref is None else ref.jct_s
        out["oracle_jct_s"] = oracle
        out["jct_vs_oracle_pct"] = (None if oracle is None or res.jct_s is None
                                    else round((res.jct_s / oracle - 1.0) * 100.0, 2))
        best = max((psi for _, psi, _ in (ref.timeline if ref else [])), default=0.0)
        out["time_to_95pct_oracle_s"] = time_to_fraction_of(res.timeline, best) if best else None
        if not args.json:
            print(f"scenario {sc.name}: {sc.profile}, {sc.samples_total} samples, quota {sc.config.quota_cpu:g} CPU, "
                  f"seed {sc.seed}")
            jct = "unfinished" if res.jct_s is None else f"{res.jct_s / 3600:.2f} h"
            pct = out["jct_vs_oracle_pct"]
            vs = "" if pct is None or oracle is None else f" ({pct:+.1f} % vs oracle {oracle / 3600:.2f} h)"
            print(f"scaler {res.scaler}: JCT {jct}{vs}")
            for t, psi, plan in res.timeline:
                print(f"  t={t:.0f}s  {psi:.0f} samples/s  {plan}")
            util = res.cpu_core_hours_used / res.cpu_core_hours_allocated if res.cpu_core_hours_allocated else 0.0
            print(f"scalings {res.scalings}, OOM failures {res.oom_failures}, paused {res.pause_s:.0f} s, "
                  f"rejected {res.rejected}; CPU {res.cpu_core_hours_allocated:.0f} core-h allocated, "
                  f"{util:.0%} used")
    if not args.json:
        print(f"simulated in {wall:.2f} s wall")
    out["wall_s"] = round(wall, 3)
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
