"""``pacer sim`` reaches the simulator and prints its JSON summary last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pacer_services.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_pacer_sim_prints_the_summary_last(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", str(REPO / "examples/sim/antdt-table3-worker.yaml"), "--method", "antdt-nd"])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert rc == 0
    assert summary["method"] == "antdt-nd" and summary["shards_done"] == summary["shards_total"]
    assert summary["ideal_jct_s"] <= summary["jct_s"]
    assert set(summary) >= {"method", "jct_s", "ideal_jct_s", "actions", "shards_done", "records_duplicated"}


def test_pacer_sim_bad_scenario_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncluster: {workers: -2}\n")
    rc = main(["sim", str(bad)])
    assert rc == 2
    assert "cluster.workers" in capsys.readouterr().err
