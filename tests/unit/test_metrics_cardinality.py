"""pacer.metrics: PACER_METRICS_NODE_SERIES bounds the per-node series; the per-job BPT quantiles always stay."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest
from pacer import metrics
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, StragglerKind
from pacer.telemetry import Counters
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

PER_NODE = ("pacer_node_batch_processing_time_seconds", "pacer_node_speed_samples_per_second",
            "pacer_node_restarts")
Samples = dict[str, list[tuple[dict[str, str], float]]]


def node(i: int, bpt: float, role: str = "worker", state: Liveness = Liveness.RUNNING) -> NodeStats:
    return NodeStats(f"{role}-{i}", role, bpt, bpt * 1.1, 10.0 / bpt if bpt else 0.0, 100 * i, 90.0, 1 << 20,
                     1.0, state, 0.0, i % 3, 1.0, 1.0,
                     StragglerKind.TRANSIENT if i % 50 == 0 else StragglerKind.NONE)


def job(name: str, bpts: list[float], role: str = "worker") -> JobStatistics:
    nodes = [node(i, b, role) for i, b in enumerate(bpts)]
    return JobStatistics(name, 1.0, 30.0, 300.0, sum(n.speed_samples_per_s for n in nodes), nodes)


def scrape(gauges: metrics.JobGauges) -> Samples:
    """Every sample of ``gauges`` as /metrics renders it: name -> [(labels, value)]."""
    registry = CollectorRegistry()
    registry.register(gauges)
    out: Samples = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def big_jobs(rng: random.Random) -> dict[str, list[float]]:
    """3 jobs of 400 nodes (1,200 in all) with random short-window BPTs."""
    return {f"job-{j}": [round(rng.uniform(0.05, 0.5), 4) for _ in range(400)] for j in range(3)}


def suppressed(samples: Samples) -> float:
    [(labels, value)] = samples["pacer_node_series_suppressed"]
    assert labels == {}
    return value


def test_auto_drops_every_per_node_series_above_the_max_and_keeps_the_job_quantiles() -> None:
    bpts = big_jobs(random.Random(7))
    gauges = metrics.JobGauges()  # the defaults: auto, at most 1000 nodes
    for name, values in bpts.items():
        gauges.set(job(name, values))
    samples = scrape(gauges)

    assert not [n for n in samples if n.startswith("pacer_node_") and n != "pacer_node_series_suppressed"]
    assert suppressed(samples) == 1
    assert {labels["job"] for labels, _ in samples["pacer_job_throughput_samples_per_second"]} == set(bpts)
    assert sum(v for labels, v in samples["pacer_job_stragglers"] if labels["kind"] == "transient") == 3 * 8

    got = {(labels["job"], labels["role"], labels["quantile"]): v
           for labels, v in samples["pacer_job_node_bpt_seconds"]}
    assert len(got) == 3 * 3
    for name, values in bpts.items():
        assert got[(name, "worker", "0.5")] == pytest.approx(statistics.median(values))
        assert got[(name, "worker", "0.99")] == pytest.approx(
            statistics.quantiles(values, n=100, method="inclusive")[98])
        assert got[(name, "worker", "1")] == max(values)


def test_the_job_quantiles_skip_nodes_not_running_or_without_data_and_split_roles() -> None:
    nodes = [node(0, 0.2), node(1, 0.4), node(2, 0.9), node(3, 5.0, state=Liveness.DEAD),
             node(4, 7.0, state=Liveness.PENDING), node(5, 0.0), node(0, 0.01, role="ps"), node(1, 0.03, role="ps")]
    gauges = metrics.JobGauges()
    gauges.set(JobStatistics("j", 1.0, 30.0, 300.0, 1.0, nodes))
    got = {(labels["role"], labels["quantile"]): v for labels, v in scrape(gauges)["pacer_job_node_bpt_seconds"]}
    assert got == pytest.approx({("worker", "0.5"): 0.4, ("worker", "0.99"): 0.4 + 0.98 * 0.5, ("worker", "1"): 0.9,
                                 ("ps", "0.5"): 0.02, ("ps", "0.99"): 0.01 + 0.99 * 0.02, ("ps", "1"): 0.03})


def test_on_exports_every_per_node_series_however_many_nodes() -> None:
    bpts = big_jobs(random.Random(8))
    gauges = metrics.JobGauges(metrics.NodeSeries("on"))
    for name, values in bpts.items():
        gauges.set(job(name, values))
    samples = scrape(gauges)

    assert suppressed(samples) == 0
    expected = {(name, f"worker-{i}") for name, values in bpts.items() for i in range(len(values))}
    for metric in PER_NODE:
        assert {(labels["job"], labels["node"]) for labels, _ in samples[metric]} == expected, metric
    assert len(samples["pacer_node_batch_processing_time_seconds"]) == 2 * 1200  # short and long windows
    short = {(labels["job"], labels["node"]): v for labels, v in samples["pacer_node_batch_processing_time_seconds"]
             if labels["window"] == "short"}
    assert short[("job-1", "worker-17")] == bpts["job-1"][17]
    assert len(samples["pacer_job_node_bpt_seconds"]) == 3 * 3


def test_off_exports_no_per_node_series_even_for_a_tiny_job() -> None:
    gauges = metrics.JobGauges(metrics.NodeSeries("off"))
    gauges.set(job("tiny", [0.1, 0.2]))
    samples = scrape(gauges)
    assert not set(PER_NODE) & set(samples)
    assert suppressed(samples) == 1
    assert len(samples["pacer_job_node_bpt_seconds"]) == 3


def test_auto_exports_per_node_series_of_small_jobs() -> None:
    gauges = metrics.JobGauges()
    for name in ("a", "b"):
        gauges.set(job(name, [0.1 + i / 100 for i in range(10)]))
    samples = scrape(gauges)
    assert suppressed(samples) == 0
    for metric in PER_NODE:
        assert len({(labels["job"], labels["node"]) for labels, _ in samples[metric]}) == 20, metric


def test_auto_counts_nodes_across_jobs_and_the_series_come_back_when_a_job_is_forgotten() -> None:
    gauges = metrics.JobGauges(metrics.NodeSeries("auto", max_nodes=25))
    gauges.set(job("a", [0.1] * 10))
    gauges.set(job("b", [0.2] * 15))
    assert suppressed(samples := scrape(gauges)) == 0  # 25 nodes: at the max, still exported
    assert len(samples["pacer_node_restarts"]) == 25

    gauges.set(job("c", [0.3]))
    samples = scrape(gauges)
    assert suppressed(samples) == 1 and not set(PER_NODE) & set(samples)
    assert {labels["job"] for labels, _ in samples["pacer_job_node_bpt_seconds"]} == {"a", "b", "c"}

    gauges.forget("b")  # what the monitor does with a job silent for long
    samples = scrape(gauges)
    assert suppressed(samples) == 0
    assert {labels["job"] for labels, _ in samples["pacer_node_restarts"]} == {"a", "c"}

    gauges.set(job("a", [0.1] * 30))  # a job's newest statistics replace its old ones: it grew
    assert suppressed(scrape(gauges)) == 1


@pytest.mark.parametrize(("env", "expected"), [
    ({}, metrics.NodeSeries("auto", 1000)),
    ({"PACER_METRICS_NODE_SERIES": "", "PACER_METRICS_NODE_SERIES_MAX": " "}, metrics.NodeSeries("auto", 1000)),
    ({"PACER_METRICS_NODE_SERIES": " ON ", "PACER_METRICS_NODE_SERIES_MAX": "5"}, metrics.NodeSeries("on", 5)),
    ({"PACER_METRICS_NODE_SERIES": "off"}, metrics.NodeSeries("off", 1000)),
    ({"PACER_METRICS_NODE_SERIES_MAX": "0"}, metrics.NodeSeries("auto", 0)),
])
def test_the_setting_is_read_from_the_environment(env: dict[str, str], expected: metrics.NodeSeries) -> None:
    assert metrics.NodeSeries.from_env(env) == expected


@pytest.mark.parametrize(("env", "variable"), [
    ({"PACER_METRICS_NODE_SERIES": "yes"}, "PACER_METRICS_NODE_SERIES:"),
    ({"PACER_METRICS_NODE_SERIES": "true"}, "PACER_METRICS_NODE_SERIES:"),
    ({"PACER_METRICS_NODE_SERIES_MAX": "1k"}, "PACER_METRICS_NODE_SERIES_MAX:"),
    ({"PACER_METRICS_NODE_SERIES_MAX": "2.5"}, "PACER_METRICS_NODE_SERIES_MAX:"),
    ({"PACER_METRICS_NODE_SERIES_MAX": "-1"}, "PACER_METRICS_NODE_SERIES_MAX:"),
])
def test_a_bad_value_raises_naming_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ValueError, match=variable):
        metrics.NodeSeries.from_env(env)


def test_serve_reads_the_setting_and_refuses_a_bad_value_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACER_METRICS_NODE_SERIES", "sometimes")
    before = set(metrics.REGISTRY._collector_to_names)
    with pytest.raises(ValueError, match=r"PACER_METRICS_NODE_SERIES: .*'sometimes'"):
        asyncio.run(metrics.serve(Counters("monitor"), 0))
    assert set(metrics.REGISTRY._collector_to_names) == before  # nothing registered, nothing served
