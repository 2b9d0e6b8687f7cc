"""Tracing settings and alerting rules: every service (and the training pods' agent) gets the ``OTEL_*``
settings pacer.telemetry reads, under the name the service gives itself; the PrometheusRule of the
prometheus-operator component alerts on what Pacer (or a named exporter) really exports, and each alert
points at its runbook in docs/operations.md.  (How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import os
import re
from pathlib import Path
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



# ================================================================ alerting

COMPONENT = DEPLOY / "components" / "prometheus-operator"
OPERATIONS = ROOT / "docs" / "operations.md"
ALERTS = {"PacerJobFailed", "PacerStragglerPersists", "PacerServiceDown", "PacerJetStreamConsumerLag"}
SEVERITIES = {"critical", "warning", "info"}

# Metrics an alert may use that Pacer does not export, each with who does.
EXTERNAL_METRICS = {
    "up": "Prometheus itself, one series per scrape target (the PodMonitor's service pods)",
    "jetstream_consumer_num_pending": "prometheus-nats-exporter run with -jsz=consumers (Pacer exports no consumer gauge)",
}

# A Prometheus duration (the operator's CRD accepts this form for `for`).
DURATION = re.compile(r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?")
_UNIT_S = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


def duration_s(text: str) -> float:
    """Seconds of a Prometheus duration (``1h30m``); ``-1`` if ``text`` is not one (empty included)."""
    m = DURATION.fullmatch(text)
    if not text or m is None:
        return -1
    return sum(int(n) * unit for n, unit in zip(m.groups(), _UNIT_S, strict=True) if n)


def includes_component(overlay: str) -> bool:
    """Whether the overlay's kustomization lists the prometheus-operator component, or an overlay it
    builds on does (second-install: prod)."""
    def lists(here: Path) -> bool:
        kust = yaml.safe_load((here / "kustomization.yaml").read_text())
        if any((here / c).resolve() == COMPONENT.resolve() for c in kust.get("components") or []):
            return True
        return any(lists((here / r).resolve()) for r in kust.get("resources") or []
                   if (here / r).resolve().parent == (DEPLOY / "overlays").resolve())
    return lists(DEPLOY / "overlays" / overlay)


def rules_of(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "PrometheusRule"]


def alerts_of(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            if "alert" in r:
                assert r["alert"] not in out, f"alert {r['alert']} defined twice"
                out[r["alert"]] = r
    return out


def operator_overlays() -> list[str]:
    return [o for o in sorted(OVERLAYS) if includes_component(o)]


# ---------------------------------------------------------------- PromQL, read just enough

_TOKEN = re.compile(r"""
    (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<num>\d[\w.]*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}@])
  | (?P<space>\s+)
""", re.VERBOSE)
# Words followed by a parenthesised list of label names, not an expression.
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_OPERATOR_WORDS = {"and", "or", "unless", "bool", "offset", "atan2"}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                 "quantile", "limitk", "limit_ratio"}


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos, depth = [], 0, 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        assert m, f"cannot read PromQL at {expr[pos:pos + 20]!r} in {expr!r}"
        pos = m.end()
        kind = m.lastgroup or ""
        if kind == "space":
            continue
        if m.group() in "({":
            depth += 1
        elif m.group() in ")}":
            depth -= 1
            assert depth >= 0, f"unbalanced {m.group()} in {expr!r}"
        out.append((kind, m.group()))
    assert depth == 0, f"unbalanced brackets in {expr!r}"
    return out


def _unquote(s: str) -> str:
    if s.startswith("`"):
        return s[1:-1]
    return re.sub(r"\\(.)", r"\1", s[1:-1])


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Every series selector of ``expr``: (metric name, [(label, op, value), ...]).

    Function and aggregation names, keywords, label lists (``by (...)``, ``on (...)``...), ranges and
    strings are not metric names; a selector without a name takes its ``__name__`` matcher's value."""
    toks = _tokens(expr)
    out: list[tuple[str, list[tuple[str, str, str]]]] = []

    def matchers(i: int) -> tuple[list[tuple[str, str, str]], int]:
        found = []
        while toks[i][1] != "}":
            (k1, label), (_, op), (k3, value) = toks[i], toks[i + 1], toks[i + 2]
            assert k1 == "ident" and op in {"=", "!=", "=~", "!~"} and k3 == "str", toks[i:i + 3]
            found.append((label, op, _unquote(value)))
            i += 3
            if toks[i][1] == ",":
                i += 1
        return found, i + 1

    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "ident" and text in _LABEL_LISTS:
            i += 1
            if nxt == "(":
                while toks[i][1] != ")":
                    i += 1
                i += 1
        elif kind == "ident" and (text in _OPERATOR_WORDS or text in _AGGREGATIONS or nxt == "("):
            i += 1
        elif kind == "ident":
            found: list[tuple[str, str, str]] = []
            i += 1
            if nxt == "{":
                found, i = matchers(i + 1)
            out.append((text, found))
        elif text == "{":
            found, i = matchers(i + 1)
            names = [v for label, op, v in found if label == "__name__" and op == "="]
            assert len(names) == 1, f"a selector without a metric name in {expr!r}"
            out.append((names[0], found))
        else:
            i += 1
    return out


def exported_names() -> set[str]:
    """Every series name Pacer's /metrics can show: the families of pacer.metrics' registry (the request
    metrics and the monitor's job gauges), the per-node ones and a service's counters, named as the
    Prometheus text format names their samples."""
    from pacer import metrics
    from pacer.telemetry import Counters
    from prometheus_client import CollectorRegistry

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count"), "untyped": ("",), "unknown": ("",)}
    extra = CollectorRegistry()
    extra.register(metrics.JobGauges(metrics.NodeSeries("on")))  # the per-node families too
    extra.register(metrics.CountersCollector(Counters("jobs")))
    names: set[str] = set()
    for registry in (metrics.REGISTRY, extra):
        for fam in registry.collect():
            names |= {s.name for s in fam.samples}
            names |= {fam.name + s for s in suffixes[fam.type]}
    return names


def counted_events(module: str) -> set[str]:
    """The counter names a service's code increments (``counters.inc("name"...)``, literal names only):
    its own package and the library it shares with the others."""
    out: set[str] = set()
    for d in (ROOT / "services" / module, ROOT / "libs" / "pacer"):
        for p in d.rglob("*.py"):
            out |= set(re.findall(r"""\.inc\(\s*["']([a-z0-9_]+)["']""", p.read_text()))
    return out


def heading_anchors(markdown: str) -> dict[str, str]:
    """GitHub's anchor of each heading (outside code blocks) -> the heading's text."""
    out, fenced = {}, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*$", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            out[slug] = m.group(1)
    return out


def test_promql_reader_finds_every_metric_and_matcher() -> None:
    """The reader the checks below rely on: names (recording-rule names too) but no functions, aggregations,
    keywords, label lists, ranges or strings; and the matchers of each."""
    expr = ('sum by (job) (rate(foo_total{a="x", b=~"y|z"}[5m] offset 1h)) > on(job) group_left(c) bar:ratio '
            'and absent({__name__="baz", d!="e"}) or topk(3, qux) unless count without (f) (quux == bool 2)')
    found = selectors(expr)
    assert [n for n, _ in found] == ["foo_total", "bar:ratio", "baz", "qux", "quux"]
    assert found[0][1] == [("a", "=", "x"), ("b", "=~", "y|z")]
    assert found[2][1] == [("__name__", "=", "baz"), ("d", "!=", "e")]
    with pytest.raises(AssertionError):
        selectors("sum(foo{a=\"x\"}")
    assert [duration_s(d) for d in ("1h30m", "15m", "0s", "", "5 m")] == [5400, 900, 0, -1, -1]
    # and a misspelt metric is not one Pacer exports
    assert "pacer_job_straggler" not in exported_names() and "pacer_job_stragglers" in exported_names()


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_rule_renders_exactly_where_the_prometheus_operator_component_is(overlay: str) -> None:
    docs = render(overlay)
    rules = rules_of(docs)
    if not includes_component(overlay):
        assert rules == []
        return
    (rule,) = rules
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert rule["metadata"].get("namespace") == monitor["metadata"].get("namespace")


def test_some_overlay_carries_the_alerts() -> None:
    assert operator_overlays(), "no overlay includes components/prometheus-operator: the alert tests check nothing"


@needs_kubectl
@pytest.mark.parametrize("overlay", operator_overlays())
def test_the_rule_has_only_fields_of_the_operator_crd(overlay: str) -> None:
    """kubernetes-validate has no schema for the operator's custom resources (CRD_GROUPS in deploy_support):
    the PrometheusRule is checked field by field instead, strict like the schema test (an unknown or
    misspelt field is an error), against the fields of monitoring.coreos.com/v1 PrometheusRule."""
    (rule,) = rules_of(render(overlay))
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(rule["metadata"]) <= {"name", "namespace", "labels", "annotations"}
    assert set(rule["spec"]) == {"groups"}
    group_names = [g["name"] for g in rule["spec"]["groups"]]
    assert len(group_names) == len(set(group_names)) and all(group_names), group_names
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit", "partial_response_strategy", "query_offset",
                              "labels"}, set(group)
        assert group["rules"], group["name"]
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}, set(r)
            assert ("alert" in r) != ("record" in r), r
            assert isinstance(r["expr"], str) and r["expr"].strip()
            selectors(r["expr"])  # reads as PromQL: known tokens, balanced brackets, well-formed matchers
            for key in ("for", "keep_firing_for"):
                if key in r:
                    assert isinstance(r[key], str) and duration_s(r[key]) >= 0, (key, r[key])
            for key in ("labels", "annotations"):
                assert all(isinstance(k, str) and isinstance(v, str) for k, v in r.get(key, {}).items()), r[key]


@needs_kubectl
@pytest.mark.parametrize("overlay", operator_overlays())
def test_each_alert_has_a_for_a_severity_a_summary_and_a_runbook(overlay: str) -> None:
    (rule,) = rules_of(render(overlay))
    alerts = alerts_of(rule)
    assert set(alerts) == ALERTS
    anchors = heading_anchors(OPERATIONS.read_text())
    runbooks = set()
    for name, r in alerts.items():
        assert duration_s(r.get("for", "")) > 0, (name, r.get("for"))  # one bad scrape never pages
        assert r.get("labels", {}).get("severity") in SEVERITIES, name
        notes = r.get("annotations", {})
        assert notes.get("summary", "").strip() and notes.get("description", "").strip(), name
        path, _, anchor = notes.get("runbook_url", "").partition("#")
        assert path == "docs/operations.md" and (ROOT / path).is_file(), (name, notes.get("runbook_url"))
        assert anchors.get(anchor) == name, f"{name}: no section '{name}' of docs/operations.md at #{anchor}"
        runbooks.add(anchor)
    assert len(runbooks) == len(alerts)


@needs_kubectl
@pytest.mark.parametrize("overlay", operator_overlays())
def test_alerts_use_only_metrics_that_exist(overlay: str) -> None:
    """Every metric an alert reads is one Pacer's /metrics shows, or an external one named above with who
    exports it; and the label values the alerts select on are ones Pacer really writes."""
    from pacer import subjects
    from pacer.contracts.monitor import StragglerKind

    docs = render(overlay)
    (rule,) = rules_of(docs)
    known = exported_names()
    used = {name: selectors(r["expr"]) for name, r in alerts_of(rule).items()}
    unknown = {(a, n) for a, sels in used.items() for n, _ in sels if n not in known and n not in EXTERNAL_METRICS}
    assert not unknown, f"alerts read metrics nobody exports: {sorted(unknown)}"

    modules = {service_name(m): m for m, _ in service_containers(docs).values()}
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    scrape_job = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    scraped = {c["name"] for d in docs if d["kind"] == "Deployment"
               and all(d["spec"]["template"]["metadata"]["labels"].get(k) == v
                       for k, v in monitor["spec"]["selector"]["matchLabels"].items())
               for c in d["spec"]["template"]["spec"]["containers"]}
    for alert, sels in used.items():
        for metric, matchers in sels:
            eq = {label: v for label, op, v in matchers if op == "="}
            if metric == "pacer_service_events_total":
                assert eq.get("service") in modules, (alert, eq)
                if "name" in eq:
                    assert eq["name"] in counted_events(modules[eq["service"]]), \
                        f"{alert}: the {eq['service']} service counts no {eq['name']!r}"
            if metric == "pacer_job_stragglers" and "kind" in eq:
                assert eq["kind"] in {k.value for k in StragglerKind if k.value}, (alert, eq)
            for label, op, v in matchers:
                if metric == "up" and label == "job":
                    assert op in {"=", "=~"} and re.fullmatch(v if op == "=~" else re.escape(v), scrape_job), \
                        f"{alert}: job {op}{v!r} does not select the PodMonitor's scrape job {scrape_job}"
                if metric.startswith("jetstream_") and label == "stream_name" and op == "=~":
                    for stream in (subjects.EVENTS_STREAM, subjects.SHARD_LOG_STREAM):
                        assert re.fullmatch(v, stream), (alert, v, stream)
    # "Service down" covers every service the PodMonitor scrapes, by its container, and nothing else.
    down = {v for metric, matchers in used["PacerServiceDown"] if metric == "up"
            for label, op, v in matchers if label == "container" and op == "="}
    assert down == scraped, f"PacerServiceDown: missing {sorted(scraped - down)}, unknown {sorted(down - scraped)}"


def test_the_runbooks_describe_every_alert() -> None:
    """docs/operations.md "Alerts" has one section per alert of the rule file (rendered or not)."""
    rule = yaml.safe_load((COMPONENT / "prometheus-rule.yaml").read_text())
    anchors = heading_anchors(OPERATIONS.read_text())
    assert "alerts" in anchors
    missing = {a for a in alerts_of(rule) if a.lower() not in anchors}
    assert not missing, f"docs/operations.md has no section for {sorted(missing)}"
