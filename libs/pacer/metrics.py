"""Prometheus metrics: one ``/metrics`` endpoint per service process.

Each service serves the Prometheus text format on ``PACER_METRICS_PORT_<SERVICE>``
(e.g. ``PACER_METRICS_PORT_MONITOR``), else ``PACER_METRICS_PORT``; ``0`` or
unset: no endpoint (the default, so that the embedded stack's processes do
not fight over one port).  In Kubernetes every pod has its own address, so
one ``PACER_METRICS_PORT=9464`` for all is what the manifests set.

The library is ``prometheus-client`` (the Prometheus project's own Python
client: the text format, histograms and custom collectors, and no
exporter pipeline to configure) rather than the OpenTelemetry Prometheus
reader, whose names and units depend on a translation layer.

Metrics (every one labelled ``service`` where a process could be any):

* ``pacer_requests_total{service,op,outcome}`` and
  ``pacer_request_duration_seconds{service,op}``: every request a service
  handles (:func:`pacer.runtime.dispatch_rpc`), ``outcome`` ``ok`` or the error code;
* ``pacer_service_events_total{service,name}``: the service's
  :class:`~pacer.telemetry.Counters` (submitted, relaunches, bad_events...);
* from the monitor's per-job statistics (:class:`JobGauges`), always:
  ``pacer_job_throughput_samples_per_second{job}``,
  ``pacer_job_node_bpt_seconds{job,role,quantile}`` (the median, 99th
  percentile and maximum, ``quantile`` ``0.5``, ``0.99`` and ``1``, of the
  short-window BPT of the job's running nodes with data, per role; linear
  interpolation between the closest ranks), ``pacer_job_stragglers{job,kind}``,
  ``pacer_job_shards{job,state}`` (todo/doing/done/failed, as the shard
  service reported them), ``pacer_job_records_done{job}`` and
  ``pacer_node_series_suppressed`` (1 while the per-node series below are
  not exported, else 0);
* per node, only when :class:`NodeSeries` allows it:
  ``pacer_node_batch_processing_time_seconds{job,node,role,window}``,
  ``pacer_node_speed_samples_per_second{job,node}`` and
  ``pacer_node_restarts{job,node}``.

The per-node series grow with the nodes (four series per node), so
``PACER_METRICS_NODE_SERIES`` bounds them: ``auto`` (the default) exports
them only while the nodes of all the jobs the monitor holds number at most
``PACER_METRICS_NODE_SERIES_MAX`` (default 1000; a job counts until the
monitor forgets it) and drops all of them above that, ``on`` always exports
them, ``off`` never.  Both are read when the endpoint starts
(:func:`serve`); a bad value stops the process with a ``ValueError`` naming
the variable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from pacer.contracts.monitor import Liveness

if TYPE_CHECKING:
    from pacer.contracts.monitor import JobStatistics
    from pacer.telemetry import Counters

log = logging.getLogger("pacer.metrics")

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter("pacer_requests", "Requests handled, by operation and outcome (ok or the error code)",
                   ["service", "op", "outcome"], registry=REGISTRY)
REQUEST_SECONDS = Histogram("pacer_request_duration_seconds", "Time to handle a request, reply included",
                            ["service", "op"], registry=REGISTRY,
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


def observe_request(service: str, op: str, outcome: str, seconds: float) -> None:
    REQUESTS.labels(service, op, outcome).inc()
    REQUEST_SECONDS.labels(service, op).observe(seconds)


class CountersCollector(Collector):
    """A service's :class:`~pacer.telemetry.Counters` as ``pacer_service_events_total{service,name}``."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("pacer_service_events", "Counted events of the service (Counters)",
                                  labels=["service", "name"])
        for name, value in sorted(self.counters.snapshot().items()):
            fam.add_metric([self.counters.service, name], value)
        yield fam


NODE_SERIES_MODES = ("auto", "on", "off")
BPT_QUANTILES = (0.5, 0.99, 1.0)  # of pacer_job_node_bpt_seconds; 1 is the maximum


@dataclass(frozen=True, slots=True)
class NodeSeries:
    """When the per-node series are exported (module docstring); from ``PACER_METRICS_NODE_SERIES*``."""

    mode: str = "auto"  # PACER_METRICS_NODE_SERIES: auto | on | off
    max_nodes: int = 1000  # PACER_METRICS_NODE_SERIES_MAX: the most nodes ``auto`` exports series for

    def __post_init__(self) -> None:
        if self.mode not in NODE_SERIES_MODES:
            raise ValueError(f"PACER_METRICS_NODE_SERIES: expected one of {', '.join(NODE_SERIES_MODES)}, "
                             f"got {self.mode!r}")
        if self.max_nodes < 0:
            raise ValueError(f"PACER_METRICS_NODE_SERIES_MAX: must be >= 0, got {self.max_nodes}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeSeries:
        """The setting in ``env`` (default ``os.environ``); empty counts as unset."""
        env = os.environ if env is None else env
        d = cls()
        mode = env.get("PACER_METRICS_NODE_SERIES", "").strip().lower() or d.mode
        raw = env.get("PACER_METRICS_NODE_SERIES_MAX", "").strip()
        try:
            max_nodes = int(raw) if raw else d.max_nodes
        except ValueError:
            raise ValueError(f"PACER_METRICS_NODE_SERIES_MAX: expected an integer, got {raw!r}") from None
        return cls(mode, max_nodes)

    def exported(self, nodes: int) -> bool:
        """Whether the per-node series of ``nodes`` nodes in all are exported."""
        return self.mode == "on" or (self.mode == "auto" and nodes <= self.max_nodes)


def quantile(sorted_values: list[float], q: float) -> float:
    """The ``q``-quantile of non-empty ``sorted_values``, interpolating linearly between the closest ranks."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    if lo + 1 >= len(sorted_values):
        return sorted_values[-1]
    return sorted_values[lo] + (sorted_values[lo + 1] - sorted_values[lo]) * (pos - lo)


class JobGauges(Collector):
    """The newest :class:`JobStatistics` of every job the monitor follows, as gauges."""

    def __init__(self, node_series: NodeSeries | None = None) -> None:
        self.latest: dict[str, JobStatistics] = {}
        self.node_series = node_series or NodeSeries()

    def set(self, stats: JobStatistics) -> None:
        self.latest[stats.job] = stats

    def forget(self, job: str) -> None:
        self.latest.pop(job, None)

    def collect(self) -> Iterator[Metric]:
        per_node = self.node_series.exported(sum(len(s.nodes) for s in self.latest.values()))
        tput = GaugeMetricFamily("pacer_job_throughput_samples_per_second",
                                 "Samples per second of the job's live workers (short window)", labels=["job"])
        job_bpt = GaugeMetricFamily("pacer_job_node_bpt_seconds",
                                    "Median, 99th percentile and maximum (quantile 1) of the short-window batch "
                                    "processing time of the job's running nodes, by role",
                                    labels=["job", "role", "quantile"])
        bpt = GaugeMetricFamily("pacer_node_batch_processing_time_seconds",
                                "Mean batch processing time of a node over the short or long window",
                                labels=["job", "node", "role", "window"])
        speed = GaugeMetricFamily("pacer_node_speed_samples_per_second", "Samples per second of one node",
                                  labels=["job", "node"])
        restarts = GaugeMetricFamily("pacer_node_restarts", "Times the node came back after it died",
                                     labels=["job", "node"])
        suppressed = GaugeMetricFamily("pacer_node_series_suppressed",
                                       "1 while the per-node series are not exported (PACER_METRICS_NODE_SERIES)",
                                       value=0 if per_node else 1)
        stragglers = GaugeMetricFamily("pacer_job_stragglers", "Nodes of the job flagged as stragglers, by kind",
                                       labels=["job", "kind"])
        shards = GaugeMetricFamily("pacer_job_shards", "Shards of the job by state", labels=["job", "state"])
        records = GaugeMetricFamily("pacer_job_records_done", "Records trained so far", labels=["job"])
        for job, s in sorted(self.latest.items()):
            tput.add_metric([job], s.throughput_samples_per_s)
            kinds = {"transient": 0, "persistent": 0}
            by_role: dict[str, list[float]] = {}
            for n in s.nodes:
                if per_node:
                    bpt.add_metric([job, n.node, n.role, "short"], n.bpt_short_s)
                    bpt.add_metric([job, n.node, n.role, "long"], n.bpt_long_s)
                    speed.add_metric([job, n.node], n.speed_samples_per_s)
                    restarts.add_metric([job, n.node], n.restarts)
                if n.state is Liveness.RUNNING and n.bpt_short_s > 0:
                    by_role.setdefault(n.role, []).append(n.bpt_short_s)
                if n.straggler.value in kinds:
                    kinds[n.straggler.value] += 1
            for role, values in sorted(by_role.items()):
                values.sort()
                for q in BPT_QUANTILES:
                    job_bpt.add_metric([job, role, f"{q:g}"], quantile(values, q))
            for kind, count in kinds.items():
                stragglers.add_metric([job, kind], count)
            if s.shards is not None:
                for state in ("todo", "doing", "done", "failed"):
                    shards.add_metric([job, state], getattr(s.shards, state))
                records.add_metric([job], s.shards.records_done)
        yield from (tput, job_bpt, stragglers, shards, records, suppressed)
        if per_node:
            yield from (bpt, speed, restarts)


JOBS = JobGauges()
REGISTRY.register(JOBS)


def port_for(service: str) -> int:
    """The ``/metrics`` port of ``service`` from the environment; 0: none."""
    key = f"PACER_METRICS_PORT_{service.upper().replace('-', '_')}"
    return int(os.environ.get(key) or os.environ.get("PACER_METRICS_PORT") or 0)


async def serve(counters: Counters, port: int, host: str = "0.0.0.0") -> web.AppRunner:
    """Serve ``/metrics`` on ``port``; the caller cleans the returned runner up.

    Reads :class:`NodeSeries` from the environment first: a bad value raises before anything is served.
    """
    JOBS.node_series = NodeSeries.from_env()
    REGISTRY.register(CountersCollector(counters))

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("metrics endpoint", extra={"fields": {"port": port, "service": counters.service}})
    return runner
