"""Generated straggler scenarios of every class, for properties every built-in policy must keep.

A scenario is drawn through a :class:`Draw`: a seeded NumPy generator
(:class:`SeededDraw`, what ``make bench-stragglers`` uses for many
scenarios) or, in the tests, hypothesis' ``st.data()`` behind the same four
calls, so a failing scenario shrinks to a small one.  Every class the
policies meet in the field can come out:

* 4 to ``max_workers`` workers (1,000 at most), 1 to 8 PS, BSP or ASP;
* persistent, transient and moving (one node slow after another) worker
  stragglers, PS stragglers, several at once, or none at all;
* device groups of different speeds, each with its memory cap (AntDT-DD),
  the even split always within every cap (the job as the user submitted it
  runs; what a policy asks of it must too);
* short jobs (a few short windows long) and long ones, with restarts that
  cost a minute or twenty, on an idle or a busy cluster.

The properties themselves (no record dropped, no batch above a device's cap
or below the floor, every record trained, never more than 5 % slower than
``none``) are checked by :func:`check`, the same for the tests and the
benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .result import Result
from .scenario import Scenario, parse

#: Built-in policies checked against ``none`` (the controller's registry names).
POLICIES = ("antdt-nd", "antdt-dd", "lb-bsp", "backup-workers", "pacer-adaptive")
SLOWER_THAN_NONE_MAX_PCT = 5.0
RECORDS_DROPPED_MAX_PCT = 1.0


class Draw(Protocol):
    """Where a scenario's choices come from."""

    def integer(self, lo: int, hi: int) -> int: ...  # lo <= x <= hi

    def real(self, lo: float, hi: float) -> float: ...

    def choice(self, options: tuple[Any, ...]) -> Any: ...

    def flip(self, p: float) -> bool: ...


class SeededDraw:
    """A :class:`Draw` from a seeded NumPy generator: scenario ``seed`` is the same scenario every time."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng([seed, 0x73636E])  # "scn"

    def integer(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def real(self, lo: float, hi: float) -> float:
        return float(self.rng.uniform(lo, hi))

    def choice(self, options: tuple[Any, ...]) -> Any:
        return options[int(self.rng.integers(0, len(options)))]

    def flip(self, p: float) -> bool:
        return bool(self.rng.random() < p)


def _workers(d: Draw, max_workers: int) -> int:
    # Most scenarios small (they run in the suite), some large: the shape of the field.
    if max_workers > 64 and d.flip(0.15):
        return d.integer(65, max_workers)
    return d.integer(4, min(max_workers, 64))


def draw_scenario(d: Draw, seed: int = 0, max_workers: int = 1000) -> Scenario:
    """One generated scenario (module docstring)."""
    n = _workers(d, max_workers)
    ps = d.integer(1, min(8, max(1, n // 2)))
    speed = d.choice((1000.0, 2560.0, 4096.0))
    per = d.choice((128, 256, 512, 1024))  # the even split B / n
    mode = d.choice(("bsp", "bsp", "asp"))
    cluster: dict[str, Any] = {
        "workers": n, "ps": ps, "worker_speed": speed, "ps_time_s": d.real(0.01, 0.2), "comm_s": d.real(0.01, 0.2),
        "pending_s": d.choice((20.0, 60.0, 300.0)), "init_s": d.choice((60.0, 100.0, 600.0, 1200.0)),
        "busy": d.flip(0.2), "report_noise": d.choice((0.0, 0.05, 0.1)),
        "ps_migration": d.choice(("restart", "seamless")),
    }
    if mode == "bsp" and d.flip(0.3):  # a heterogeneous (dedicated) cluster: AntDT-DD's case
        k = d.integer(2, min(3, n))
        counts = [n // k] * k
        counts[0] += n - sum(counts)
        cluster["device_groups"] = [
            {"name": f"g{i}", "count": c, "speed": speed / (1.0 + i * d.real(0.3, 1.5)),
             "max_batch": per + d.integer(0, per)}  # each device holds the even split, some more
            for i, c in enumerate(counts)]
    step = per / speed + cluster["ps_time_s"] + cluster["comm_s"]  # a healthy step's time
    window = d.choice((60.0, 120.0, 300.0))
    steps = d.choice((20, 50, 100))  # batches per shard
    # Short: a few short windows long; long: dozens (the job's healthy length, in steps of `step`).
    length_s = d.choice((4.0, 10.0, 40.0)) * window
    shard = per * steps
    # At least a shard per worker, at most 5,000 shards (the shard core's work, and the simulation's, grows with them).
    records = min(max(n * shard, int(length_s / step) * n * per), 5000 * shard)
    stragglers: list[dict[str, Any]] = []
    kind = d.choice(("none", "persistent", "transient", "moving", "ps", "mixed"))
    sleep = step * d.choice((1.0, 3.0, 10.0))  # a slow node's extra time per step, in healthy steps
    if kind in ("persistent", "mixed"):
        for _ in range(d.integer(1, max(1, min(3, n // 4)))):
            stragglers.append({"node": f"worker-{d.integer(0, n - 1)}", "sleep_s": sleep,
                               "intensity": d.real(0.2, 1.0), "start_s": d.choice((0.0, length_s / 3))})
    if kind in ("transient", "mixed"):
        for _ in range(d.integer(1, max(1, n // 4))):
            stragglers.append({"node": f"worker-{d.integer(0, n - 1)}", "pattern": "transient", "sleep_s": sleep,
                               "intensity": d.real(0.2, 1.0), "period_s": 4 * window, "on_s": 2 * window,
                               "probability": d.real(0.1, 0.6)})
    if kind == "moving":
        hop = d.choice((1.0, 2.0, 4.0)) * window
        for i in range(min(n, 20)):
            stragglers.append({"node": f"worker-{i}", "pattern": "transient", "sleep_s": sleep, "intensity": 0.8,
                               "start_s": i * hop, "period_s": 20 * hop, "on_s": hop, "probability": 1.0})
    if kind in ("ps", "mixed"):
        stragglers.append({"node": f"ps-{d.integer(0, ps - 1)}", "sleep_s": d.choice((0.2, 1.5)),
                           "intensity": d.real(0.1, 1.0), "start_s": d.choice((0.0, length_s / 3))})
    seen: set[str] = set()
    unique = []
    for s in stragglers:  # one pattern per node and kind: two persistent ones on a node are one
        key = f"{s['node']}:{s.get('pattern', 'persistent')}"
        if key not in seen:
            seen.add(key)
            unique.append(s)
    doc = {
        "name": f"generated-{seed}-{n}w-{mode}-{kind}{'-groups' if 'device_groups' in cluster else ''}",
        "seed": seed, "cluster": cluster,
        "job": {"mode": mode, "global_batch": per * n, "records": records, "batches_per_shard": steps},
        "stragglers": unique,
        "monitor": {"interval_s": window, "window_short_s": window, "window_long_s": 2 * window,
                    "stats_s": min(window, 60.0)},
    }
    return parse(doc)


def applicable(sc: Scenario) -> tuple[str, ...]:
    """The built-in policies that apply to ``sc``: AntDT-DD needs device groups, backup workers BSP."""
    return tuple(m for m in POLICIES if not (m == "antdt-dd" and not sc.cluster.device_groups)
                 and not (m == "backup-workers" and sc.job.mode != "bsp"))


@dataclass(frozen=True, slots=True)
class Verdict:
    """One policy's run of one scenario, against ``none`` on the same scenario (the JSON row's keys)."""

    scenario: str
    method: str
    jct_s: float
    none_jct_s: float
    slower_than_none_pct: float
    records_dropped_pct: float
    cap_violations: int
    floor_violations: int
    records_missing: int  # records of the dataset never trained (0 when every record was)

    def problems(self) -> list[str]:
        out = []
        if self.slower_than_none_pct > SLOWER_THAN_NONE_MAX_PCT:
            out.append(f"{self.slower_than_none_pct:.1f} % slower than none")
        if self.records_dropped_pct > RECORDS_DROPPED_MAX_PCT:
            out.append(f"{self.records_dropped_pct:.2f} % of the records dropped")
        if self.cap_violations:
            out.append(f"{self.cap_violations} batch(es) above a device's cap")
        if self.floor_violations:
            out.append(f"{self.floor_violations} batch(es) below the floor")
        if self.records_missing:
            out.append(f"{self.records_missing} records never trained")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "method": self.method, "jct_s": round(self.jct_s, 1),
                "none_jct_s": round(self.none_jct_s, 1), "slower_than_none_pct": round(self.slower_than_none_pct, 2),
                "records_dropped_pct": round(self.records_dropped_pct, 3), "cap_violations": self.cap_violations,
                "floor_violations": self.floor_violations, "records_missing": self.records_missing}


def check(sc: Scenario, res: Result, none: Result) -> Verdict:
    """The properties of one run (``res``) against ``none``'s run of the same scenario."""
    records = sc.job.records * sc.job.epochs
    return Verdict(
        scenario=sc.name, method=res.method, jct_s=res.jct_s, none_jct_s=none.jct_s,
        slower_than_none_pct=(res.jct_s / none.jct_s - 1.0) * 100.0,
        records_dropped_pct=res.records_dropped / records * 100.0,
        cap_violations=res.cap_violations, floor_violations=res.floor_violations,
        records_missing=max(0, records - res.records_done),
    )


__all__ = ["POLICIES", "RECORDS_DROPPED_MAX_PCT", "SLOWER_THAN_NONE_MAX_PCT", "Draw", "SeededDraw", "Verdict",
           "applicable", "check", "draw_scenario"]
