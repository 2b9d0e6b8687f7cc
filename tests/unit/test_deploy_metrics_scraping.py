"""Metrics scraping: every service serves /metrics where its annotations say, and prod's PodMonitor scrapes exactly
the services.  (How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import pytest

from .deploy_support import DEPLOY, OVERLAYS, SERVICES, env_of, needs_kubectl, render, selects


@needs_kubectl
def test_prod_pod_monitor() -> None:
    """The Prometheus Operator scrapes every service where it serves /metrics, and nothing else."""
    docs = render("prod")
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert [m["apiVersion"] for m in monitors] == ["monitoring.coreos.com/v1"]
    spec = monitors[0]["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
    workloads = {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] in {"Deployment",
                                                                                            "StatefulSet"}}
    selected = {n for n, t in workloads.items() if selects(spec["selector"], t["metadata"]["labels"])}
    assert selected == {s.deployment for s in SERVICES}
    # Pacer labels its training job `job` (the Grafana dashboard groups by it): the scrape must keep it.
    dashboard = (DEPLOY / "grafana" / "pacer-dashboard.json").read_text()
    assert "sum by (job)" in dashboard
    for ep in spec["podMetricsEndpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "honorLabels", "scheme"}, set(ep)
        assert ep.get("honorLabels") is True
        for name in selected:
            (c,) = workloads[name]["spec"]["containers"]
            assert ep["port"] in {p.get("name") for p in c["ports"]}, (name, ep["port"])
            assert ep["path"] == workloads[name]["metadata"]["annotations"]["prometheus.io/path"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_serves_metrics_where_its_scrape_annotations_say(overlay: str) -> None:
    """Each service Deployment sets PACER_METRICS_PORT (pacer.metrics), names that container port
    ``metrics`` and announces it to Prometheus in the pod annotations: three places that must agree."""
    deps = [d for d in render(overlay) if d["kind"] == "Deployment"
            and any("pacer_services." in " ".join(c.get("command", [])) for c in
                    d["spec"]["template"]["spec"]["containers"])]
    assert len(deps) >= 8
    for d in deps:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        port = int(env_of(c)["PACER_METRICS_PORT"])
        assert {"name": "metrics", "containerPort": port} in c["ports"], d["metadata"]["name"]
        notes = d["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == port
        assert notes["prometheus.io/path"] == "/metrics"
