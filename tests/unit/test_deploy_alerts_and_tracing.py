"""Tracing settings and alerting rules: every service (and the training pods' agent) gets the ``OTEL_*``
settings pacer.telemetry reads, under the name the service gives itself; the PrometheusRule of the
prometheus-operator component alerts on what Pacer (or a named exporter) really exports, and each alert
points at its runbook in docs/operations.md.  (How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from .deploy_support import (
    DEPLOY,
    OVERLAYS,
    ROOT,
    SERVICES,
    built_pod,
    env_source,
    needs_kubectl,
    render,
)

SERVICE_MODULE = re.compile(r"pacer_services\.([a-z_]+)\.main")


def service_name(module: str) -> str:
    """The name the service's ``main`` gives pacer.runtime (and so pacer.telemetry): ``main_entry("<name>", ...)``."""
    found = re.findall(r"""main_entry\(\s*["']([a-z-]+)["']""", (ROOT / "services" / module / "main.py").read_text())
    assert len(found) == 1, f"services/{module}/main.py: expected one main_entry call, found {found}"
    return found[0]


def default_otel_name(service: str) -> str:
    """pacer.telemetry's default ``service.name`` (when OTEL_SERVICE_NAME is unset): ``pacer-<service>``."""
    source = (ROOT / "libs" / "pacer" / "telemetry.py").read_text()
    assert 'os.environ.get("OTEL_SERVICE_NAME") or f"pacer-{service}"' in source, \
        "pacer.telemetry names services differently now: teach this test"
    return f"pacer-{service}"


def effective_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: ``envFrom`` ConfigMaps first (in order), then
    ``env`` (which wins).  Secrets and field references are left out (their values are not in the manifests)."""
    out: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" not in source:
            continue
        ref = source["configMapRef"]
        cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["name"]]
        if not cms:
            assert ref.get("optional"), f"{container['name']}: envFrom ConfigMap {ref['name']} is not rendered"
            continue
        out.update({source.get("prefix", "") + k: v for k, v in cms[0].get("data", {}).items()})
    for e in container.get("env", []):
        got = env_source(docs, container, e["name"])
        if got is not None and got[0] == "value":
            out[e["name"]] = got[1]
        else:
            out.pop(e["name"], None)
    return out


def service_containers(docs: list[dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Deployment name -> (its pacer_services module, the container running it)."""
    out = {}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            if m := SERVICE_MODULE.search(" ".join(c.get("command", []))):
                out[d["metadata"]["name"]] = (m.group(1), c)
    return out


def placeholder_endpoint() -> str:
    """The collector address the base ships (base/otel.yaml), to be replaced by the user's."""
    cm = yaml.safe_load((DEPLOY / "base" / "otel.yaml").read_text())
    endpoint: str = cm["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    return endpoint


# ================================================================ tracing


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_service_gets_the_otel_settings_under_its_own_name(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each service Deployment's container resolves OTEL_SERVICE_NAME to the name pacer.telemetry would give
    that service by default, the collector endpoint of the shared settings, and exporters pacer.telemetry
    accepts (it stops the process on an unknown one)."""
    from pacer import telemetry

    docs = render(overlay)
    found = service_containers(docs)
    assert set(found) == {s.deployment for s in SERVICES}, "a service Deployment the test does not know (or lacks)"
    endpoints, names = set(), {}
    for deployment, (module, c) in sorted(found.items()):
        env = effective_env(docs, c)
        otel = {k: v for k, v in env.items() if k.startswith("OTEL_")}
        assert env.get("OTEL_SERVICE_NAME") == default_otel_name(service_name(module)), (deployment, otel)
        names[deployment] = env["OTEL_SERVICE_NAME"]
        assert {"OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"} <= set(otel), \
            (deployment, otel)
        for k in [k for k in os.environ if k.startswith("OTEL_") or k == "PACER_OTEL_EXPORTER"]:
            monkeypatch.delenv(k)
        for k, v in otel.items():
            monkeypatch.setenv(k, v)
        exporters = telemetry.exporters()  # raises on a value pacer.telemetry does not know
        url = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        # pacer.telemetry exports OTLP over HTTP/protobuf: the collector's HTTP port, not gRPC's 4317.
        assert url.scheme in {"http", "https"} and url.hostname and url.port == 4318, (deployment, url)
        if "otlp" in exporters:
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] != placeholder_endpoint(), \
                f"{overlay}/{deployment} exports to the placeholder collector address"
        endpoints.add(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert len(endpoints) == 1, f"the services disagree on the collector: {endpoints}"
    assert len(set(names.values())) == len(names), f"two services share a service.name: {names}"


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_training_pods_agent_gets_the_same_otel_settings(overlay: str) -> None:
    """The agent sidecar the executor builds from the worker template (a Kubernetes pod inherits nothing of the
    executor's environment) reads the same settings as the services, and keeps its default name pacer-agent."""
    docs = render(overlay)
    services = {effective_env(docs, c)["OTEL_EXPORTER_OTLP_ENDPOINT"] for _, c in service_containers(docs).values()}
    pod = built_pod(docs, "worker")
    (agent,) = [c for c in pod["spec"]["containers"] if c["name"] == "agent"]
    env = effective_env(docs, agent)
    assert {env.get("OTEL_EXPORTER_OTLP_ENDPOINT")} == services
    for k in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):
        assert env.get(k) == effective_env(docs, service_containers(docs)["monitor"][1]).get(k), k
    agent_main = (ROOT / "libs" / "pacer" / "agent" / "main.py").read_text()
    assert 'telemetry.setup("agent")' in agent_main
    assert env.get("OTEL_SERVICE_NAME", default_otel_name("agent")) == default_otel_name("agent")


def test_the_readme_names_the_placeholder_collector() -> None:
    """deploy/README.md tells where to point tracing; it must name the address the manifests ship."""
    assert placeholder_endpoint() in (DEPLOY / "README.md").read_text()

