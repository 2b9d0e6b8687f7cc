"""deploy/grafana/pacer-dashboard.json: valid JSON, and every metric a panel queries is one Pacer exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pacer import metrics
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, ShardSummary
from pacer.telemetry import Counters
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pacer-dashboard.json"


def exposed_names() -> set[str]:
    """Every sample name /metrics shows once a request was handled and the monitor published a job."""
    metrics.observe_request("jobs", "submit", "ok", 0.01)
    node = NodeStats("worker-0", "worker", 0.1, 0.1, 50.0, 100, 90.0, 1 << 20, 1.0, Liveness.RUNNING, 0.0, 1, 1.0, 1.0)
    gauges = metrics.JobGauges()
    gauges.set(JobStatistics("j", 1.0, 30.0, 300.0, 50.0, [node], shards=ShardSummary(1, 1, 1, 0, 10)))
    registry = CollectorRegistry()
    registry.register(gauges)
    registry.register(metrics.CountersCollector(Counters("jobs")))
    text = (generate_latest(metrics.REGISTRY) + generate_latest(registry)).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_dashboard_is_valid_and_queries_only_existing_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"]
    names = exposed_names()
    queried: set[str] = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"\bpacer_[a-z_]+\b", target["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            queried |= set(re.findall(r"\bpacer_[a-z_]+\b", var["definition"]))
    assert queried, "no panel queries a Pacer metric"
    missing = queried - names
    assert not missing, f"panels query metrics nobody exposes: {sorted(missing)}"
    # the ones the issue asks for are on the dashboard
    assert {"pacer_job_throughput_samples_per_second", "pacer_node_batch_processing_time_seconds",
            "pacer_job_shards", "pacer_request_duration_seconds_bucket"} <= queried
