"""``bench/bench_stragglers.py --quick``: the simulation part runs and its last line is the documented JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"side", "mode", "intensity", "method", "jct_s", "ideal_jct_s", "speedup_vs_native_pct",
            "records_dropped_pct", "cap_violations", "slower_than_none_pct"}  # issue 22: never hurt


def test_quick_benchmark_prints_tables_and_the_json_last() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_stragglers.py"), "--quick"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert {"table", "decision_ms_1000_workers", "overhead_pct"} <= out.keys()
    assert "### Table III" in proc.stdout and "| SI |" in proc.stdout
    rows = out["table"]
    # 2 sides x (6 BSP methods + 5 ASP methods) at one intensity (pacer-adaptive twice: the paper's monitor
    # settings and the noise-adapted short window)
    assert len(rows) == 22
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["side"] in ("worker", "ps") and r["mode"] in ("bsp", "asp") and r["intensity"] == 0.8
        assert r["jct_s"] > 0 and r["ideal_jct_s"] > 0 and r["jct_s"] >= r["ideal_jct_s"] - 1e-6
    natives = [r for r in rows if r["method"] in ("bsp", "asp")]
    assert len(natives) == 4 and all(r["speedup_vs_native_pct"] == 0.0 for r in natives)
    assert out["decision_ms_1000_workers"] > 0 and out["overhead_pct"] >= 0
    # Issue 15: the best method's worst gap over all rows, never below the physical bound of its row.
    gaps = out["gaps"]
    assert len(gaps) == 4 and out["worst_gap_to_ideal_pct"] == max(g["best_gap_pct"] for g in gaps)
    for g in gaps:
        best = min((r for r in rows if (r["side"], r["mode"], r["intensity"]) == (g["side"], g["mode"], g["intensity"])),
                   key=lambda r: r["jct_s"])
        assert g["best_method"] == best["method"]
        assert 0 < g["bound_gap_pct"] < g["best_gap_pct"]
    assert {(b["side"], b["mode"]) for b in out["bound"]} == {(g["side"], g["mode"]) for g in gaps}
    # Not-tuned-on scenarios: each in BSP and ASP, every method run.  (Their bound is not compared here: in
    # --quick the jobs are a few monitor rounds long and the simulated straggler-free run's own tail of
    # shards is of the size of the stragglers' cost.)
    assert len(out["untuned"]) == 8
    assert all({"none", "antdt-nd", "pacer-adaptive", "pacer-adaptive+aw"} <= u["gap_pct"].keys()
               and u["bound_gap_pct"] >= 0 for u in out["untuned"])
    # What acting costs: each ADJUST_BS charged 0, 2 and 10 s (a pause also moves later rounds, so the JCT
    # need not grow monotonically on a short job).
    costs = out["adjust_bs_cost"]
    for m in ("antdt-nd", "pacer-adaptive", "pacer-adaptive+aw"):
        assert sorted(c["adjust_bs_s"] for c in costs if c["method"] == m) == [0.0, 2.0, 10.0]
    assert all(c["adjust_bs_per_run"] > 0 for c in costs if c["method"] == "pacer-adaptive+aw")
    assert out["monitor_by_method"]["pacer-adaptive+aw"]["window_short_min_s"] > 0
    noise = out["report_noise"]
    assert {(r["report_noise"], r["method"]) for r in noise} == {
        (x, m) for x in (0.0, 0.05, 0.1, 0.2) for m in ("antdt-nd", "pacer-adaptive", "pacer-adaptive+aw")}
    # Issue 22: each row says how much it dropped, whether it broke a cap and how it compares with doing nothing;
    # the JSON has the worst of each over the rows and the generated scenarios, which every policy ran.
    gen = out["generated"]
    assert gen and {r["method"] for r in gen} >= {"antdt-nd", "lb-bsp", "pacer-adaptive"}
    every = [r for r in rows if r["method"] != "asp"] + gen
    assert out["worst_records_dropped_pct"] == max(r["records_dropped_pct"] for r in every)
    assert out["worst_cap_violations"] == max(r["cap_violations"] for r in every)
    assert out["worst_slower_than_none_pct"] == max(r["slower_than_none_pct"] for r in every)
    assert all(r["slower_than_none_pct"] == 0.0 for r in rows if r["method"] in ("bsp", "asp-dds"))  # none itself
