"""Prometheus ``/metrics`` of the services during a real job on the embedded stack.

The monitor's endpoint shows the job's throughput gauge with a positive
value while the job trains (and its shard states, BPT per node); the job
service's shows the submit it handled in the request counter and latency
histogram.  Parsed with prometheus-client's own text parser, so a malformed
exposition fails too.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from conftest import job_client, running_stack
from pacer.data.criteo import generate, heldout_path
from pacer.embedded import free_port
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


async def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name of each sample -> [(labels, value)]."""
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def value(samples: dict[str, list[tuple[dict[str, str], float]]], metric: str, **labels: str) -> float | None:
    for have, v in samples.get(metric, []):
        if all(have.get(k) == want for k, want in labels.items()):
            return v
    return None


async def test_metrics_show_the_running_jobs_throughput(tmp_path: Path) -> None:
    data = tmp_path / "train.rec"
    generate(data, 24_000, seed=5)
    generate(heldout_path(data), 2_000, seed=5, stream=1)
    monitor_port, jobs_port = free_port(), free_port()
    env = {"PACER_MONITOR_INTERVAL_S": "1", "PACER_METRICS_PORT_MONITOR": str(monitor_port),
           "PACER_METRICS_PORT_JOBS": str(jobs_port), "PACER_BATCHES_PER_SHARD": "5",
           "PACER_INJECT_STRAGGLERS": json.dumps({"*": {"kind": "persistent", "sleep_s": 0.2}})}
    spec = (f"name: metered\nmodel: wide_deep\ndataset:\n  path: {data}\n  test_path: {heldout_path(data)}\n"
            "batch_size: 512\nresources:\n  workers: 2\n")
    with running_stack(tmp_path / "stack", ["shard", "monitor", "jobs", "executor"], env) as st:
        async with job_client(st.url, "metrics-test") as c:
            await c.submit("metered", spec)
            deadline = time.monotonic() + 180
            tput = None
            while time.monotonic() < deadline:
                m = await scrape(monitor_port)
                tput = value(m, "pacer_job_throughput_samples_per_second", job="metered")
                if tput is not None and tput > 0:
                    break
                await asyncio.sleep(0.5)
            assert tput is not None and tput > 0, f"no positive throughput gauge; last: {m.get('pacer_job_throughput_samples_per_second')}"
            bpt = [v for labels, v in m.get("pacer_node_batch_processing_time_seconds", [])
                   if labels["job"] == "metered" and labels["window"] == "short" and labels["node"].startswith("worker")]
            assert any(v > 0 for v in bpt), m.get("pacer_node_batch_processing_time_seconds")
            for _ in range(60):  # the shard states come with the shard service's next progress report
                m = await scrape(monitor_port)
                if value(m, "pacer_job_shards", job="metered", state="todo") is not None:
                    break
                await asyncio.sleep(0.5)
            states = {labels["state"] for labels, _ in m.get("pacer_job_shards", []) if labels["job"] == "metered"}
            assert states == {"todo", "doing", "done", "failed"}
            await c.stop("metered")
        j = await scrape(jobs_port)
        assert value(j, "pacer_requests_total", service="jobs", op="submit", outcome="ok") == 1
        assert value(j, "pacer_request_duration_seconds_count", service="jobs", op="submit") == 1
        assert (value(j, "pacer_service_events_total", service="jobs", name="submitted") or 0) >= 1
