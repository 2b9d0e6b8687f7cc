"""The NetworkPolicies of every overlay, evaluated: a small evaluator of the rendered policies (pod and namespace
selectors, IP blocks, ports, policy types) decides a table of flows between the pods the deployment runs (and a few
outside it), which must be allowed or refused.  (How these tests render the overlays: deploy_support.)

The evaluator follows the NetworkPolicy API: a pod no policy selects for a direction is open in that direction; a
pod some policy selects is open only to what one of those policies' rules allows; a flow needs both its source's
egress and its destination's ingress.  Pods outside the namespace ``pacer`` are not governed by these policies (their
own side of a flow is taken as open)."""

from __future__ import annotations

import ipaddress
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest

from .deploy_support import NAMESPACES as INSTALLS
from .deploy_support import OVERLAYS, SERVICES, built_pod, matches, needs_kubectl, one, render

NS = "pacer"
# The overlays installed in NS; the second install's policies are the same objects in its own namespace
# (test_deploy_second_install checks that).
IN_NS = sorted(o for o in OVERLAYS if INSTALLS[o] == NS)
NAME = "kubernetes.io/metadata.name"  # every namespace's automatic label


@dataclass
class Endpoint:
    """One end of a flow: a pod (its namespace, labels and named container ports) or an address outside the
    cluster's pods (namespace None)."""

    name: str
    namespace: str | None
    labels: dict[str, str]
    ip: str
    ports: dict[str, int] = field(default_factory=dict)


def policy_types(policy: dict[str, Any]) -> list[str]:
    """The directions a policy governs; without ``policyTypes``: Ingress, and Egress if it has egress rules."""
    spec = policy["spec"]
    types: list[str] = spec.get("policyTypes") or ["Ingress", *(["Egress"] if spec.get("egress") else [])]
    return types


def peer_matches(peer: dict[str, Any], policy_ns: str, other: Endpoint, namespaces: dict[str, dict[str, str]]) -> bool:
    if "ipBlock" in peer:
        # Meant for addresses outside the cluster; applied to any address here, so a refusal holds either way.
        addr = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return addr in ipaddress.ip_network(block["cidr"]) \
            and not any(addr in ipaddress.ip_network(e) for e in block.get("except", []))
    if other.namespace is None:
        return False  # pod and namespace selectors select pods only
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    in_ns = other.namespace == policy_ns if ns_sel is None else matches(ns_sel, namespaces[other.namespace])
    return in_ns and (pod_sel is None or matches(pod_sel, other.labels))


def port_matches(entry: dict[str, Any], dst: Endpoint, port: int, protocol: str) -> bool:
    if entry.get("protocol", "TCP") != protocol:
        return False
    p = entry.get("port")
    if p is None:
        return True
    if isinstance(p, str):  # a named port: the destination pod's container port of that name
        if p not in dst.ports:
            return False
        p = dst.ports[p]
    return bool(p <= port <= entry.get("endPort", p))


def side_allows(policies: list[dict[str, Any]], subject: Endpoint, other: Endpoint, direction: str, dst: Endpoint,
                port: int, protocol: str, namespaces: dict[str, dict[str, str]]) -> bool:
    """Whether ``subject``'s own policies let the flow out (Egress, ``other`` the destination) or in (Ingress,
    ``other`` the source)."""
    if subject.namespace is None:
        return True
    selecting = [p for p in policies if p["metadata"]["namespace"] == subject.namespace
                 and direction in policy_types(p) and matches(p["spec"]["podSelector"], subject.labels)]
    if not selecting:
        return True
    key, peers_key = ("egress", "to") if direction == "Egress" else ("ingress", "from")
    for policy in selecting:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key) or []
            entries = rule.get("ports") or []
            if (not peers or any(peer_matches(peer, subject.namespace, other, namespaces) for peer in peers)) \
                    and (not entries or any(port_matches(e, dst, port, protocol) for e in entries)):
                return True
    return False


def allowed(policies: list[dict[str, Any]], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP",
            namespaces: dict[str, dict[str, str]] | None = None) -> bool:
    namespaces = namespaces if namespaces is not None else NAMESPACES
    return side_allows(policies, src, dst, "Egress", dst, port, protocol, namespaces) \
        and side_allows(policies, dst, src, "Ingress", dst, port, protocol, namespaces)


# --------------------------------------------------------------- the world around the namespace

NAMESPACES: dict[str, dict[str, str]] = {
    ns: {NAME: ns} for ns in (NS, "kube-system", "monitoring", "observability", "ingress-nginx", "tenant")
}
_ips = (f"10.244.{i // 250}.{i % 250 + 1}" for i in itertools.count())


def pod(name: str, namespace: str, labels: dict[str, str], ports: dict[str, int] | None = None) -> Endpoint:
    return Endpoint(name, namespace, labels, next(_ips), ports or {})


KUBE_DNS = pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, {"dns": 53, "dns-tcp": 53})
PROMETHEUS = pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
SCRAPER = pod("metrics-scraper", NS, {"app.kubernetes.io/component": "metrics-scraper"})
STRANGER = pod("a pod of the namespace without Pacer's labels", NS, {"app.kubernetes.io/name": "someone-else"})
COLLECTOR = pod("otel-collector", "observability", {"app.kubernetes.io/name": "opentelemetry-collector"})
INGRESS = pod("ingress controller", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"})
IMPOSTOR = pod("a pod of another namespace with Pacer's labels", "tenant", {
    "app.kubernetes.io/part-of": "pacer", "app.kubernetes.io/component": "service",
    "app.kubernetes.io/name": "pacer-trainer"})
FAKE_PROMETHEUS = pod("a Prometheus-labelled pod of another namespace", "tenant", {"app.kubernetes.io/name": "prometheus"})
API_SERVER = Endpoint("Kubernetes API server", None, {}, "10.0.0.1")
CLIENT = Endpoint("a browser outside the cluster", None, {}, "203.0.113.7")
S3 = Endpoint("object storage", None, {}, "52.216.8.1")


def container_ports(spec: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", []) if "name" in p}


def pacer_pods(docs: list[dict[str, Any]]) -> dict[str, Endpoint]:
    """Every pod the overlay runs, as rendered: the services, NATS, and training pods (two workers and a PS)."""
    pods = {}
    for d in docs:
        if d["kind"] in {"Deployment", "StatefulSet"}:
            tpl = d["spec"]["template"]
            pods[d["metadata"]["name"]] = pod(d["metadata"]["name"], d["metadata"]["namespace"],
                                              tpl["metadata"]["labels"], container_ports(tpl["spec"]))
    for role in ("worker", "ps"):
        built = built_pod(docs, role)
        pods[role] = pod(role, NS, built["metadata"]["labels"], container_ports(built["spec"]))
    worker1 = dict(pods["worker"].labels, **{"pacer.io/node": "worker-1", "pacer.io/index": "1"})
    pods["worker-1"] = pod("worker-1", NS, worker1, pods["worker"].ports)
    return pods


def network_policies(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policies and all(p["metadata"]["namespace"] == NS for p in policies)
    return policies


# --------------------------------------------------------------- the evaluator itself


def test_the_evaluator_follows_the_networkpolicy_rules() -> None:
    """Hand-made policies, so a wrong evaluator cannot pass the flow tables below by being too lenient."""
    a = pod("a", NS, {"app": "a"}, {"web": 8080})
    b = pod("b", NS, {"app": "b"}, {"web": 8080})
    far = pod("far", "tenant", {"app": "a"})
    meta = {"namespace": NS}

    def policy(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"kind": "NetworkPolicy", "metadata": {**meta, "name": name}, "spec": spec}

    deny = policy("deny", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})
    assert allowed([], a, b, 1)  # no policy: open
    assert not allowed([deny], a, b, 8080)
    assert allowed([deny], far, S3, 443)  # another namespace's pods are not governed by these
    b_in = policy("b-in", {"podSelector": {"matchLabels": {"app": "b"}},
                           "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}],
                                        "ports": [{"port": "web"}]}]})
    assert allowed([b_in], a, b, 8080)  # no policyTypes: Ingress only, egress of a open
    assert not allowed([b_in], a, b, 8081)
    assert not allowed([b_in], a, b, 8080, "UDP")
    assert not allowed([b_in], far, b, 8080)  # a podSelector alone: the policy's namespace only
    assert not allowed([deny, b_in], a, b, 8080)  # a's egress is denied
    a_out = policy("a-out", {"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Egress"],
                             "egress": [{"ports": [{"port": 8000, "endPort": 8090}]}]})
    assert allowed([deny, b_in, a_out], a, b, 8080)
    assert not allowed([deny, b_in, a_out], b, a, 8080)
    # namespaceSelector and podSelector in one peer: both must hold; in two peers: either.
    both = {"namespaceSelector": {"matchLabels": {NAME: "tenant"}}, "podSelector": {"matchLabels": {"app": "x"}}}
    one_peer = policy("and", {"podSelector": {}, "ingress": [{"from": [both]}]})
    assert not allowed([one_peer], far, b, 1)
    either = policy("or", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": both["namespaceSelector"]},
                                                                     {"podSelector": both["podSelector"]}]}]})
    assert allowed([either], far, b, 1)
    blocks = policy("ip", {"podSelector": {}, "policyTypes": ["Egress"],
                           "egress": [{"to": [{"ipBlock": {"cidr": "52.0.0.0/8", "except": ["52.216.0.0/16"]}}]}]})
    assert not allowed([blocks], a, S3, 443)
    assert allowed([blocks], a, Endpoint("elsewhere", None, {}, "52.1.2.3"), 443)
    expr = policy("expr", {"podSelector": {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["a"]}]},
                           "policyTypes": ["Ingress"]})
    assert not allowed([expr], a, b, 1) and allowed([expr], b, a, 1)


# --------------------------------------------------------------- the flows


def services(pods: dict[str, Endpoint]) -> list[Endpoint]:
    return [pods[s.deployment] for s in SERVICES]


def trainers(pods: dict[str, Endpoint]) -> list[Endpoint]:
    return [pods["worker"], pods["worker-1"], pods["ps"]]


def metrics_ports(docs: list[dict[str, Any]], pods: dict[str, Endpoint]) -> list[tuple[Endpoint, int]]:
    """(pod, port) of everything scraped: each service's `metrics` container port, the prometheus.io/port of
    annotated pods and, where the overlay has it, each port the PodMonitor names on each pod it selects."""
    out = []
    for s in SERVICES:
        dep = one(docs, "Deployment", s.deployment)
        out.append((pods[s.deployment], pods[s.deployment].ports["metrics"]))
        ann = dep["spec"]["template"]["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") == "true":
            out.append((pods[s.deployment], int(ann["prometheus.io/port"])))
    for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
        selected = [p for p in pods.values() if matches(monitor["spec"]["selector"], p.labels)]
        assert {p.name for p in selected} == {s.deployment for s in SERVICES}, [p.name for p in selected]
        for p, ep in itertools.product(selected, monitor["spec"]["podMetricsEndpoints"]):
            out.append((p, p.ports[ep["port"]]))
    return out


def allowed_flows(docs: list[dict[str, Any]], pods: dict[str, Endpoint]) -> list[tuple[Endpoint, Endpoint, int, str]]:
    nats, api = pods["nats"], pods["pacer-api"]
    flows = []
    for p in [*services(pods), *trainers(pods)]:
        flows.append((p, nats, 4222, "TCP"))  # the bus
        flows.append((p, COLLECTOR, 4318, "TCP"))  # OTLP
    for p in [*services(pods), *trainers(pods), nats, SCRAPER]:
        flows += [(p, KUBE_DNS, 53, "UDP"), (p, KUBE_DNS, 53, "TCP")]
    flows.append((nats, nats, 6222, "TCP"))  # routes
    flows.append((SCRAPER, nats, 8222, "TCP"))
    for p, port in metrics_ports(docs, pods):
        flows += [(PROMETHEUS, p, port, "TCP"), (SCRAPER, p, port, "TCP")]
    for a, b in itertools.permutations(trainers(pods), 2):
        flows.append((a, b, 2222, "TCP"))  # TF gRPC, PS <-> workers and between workers
    # The API's HTTP port, as its Service targets it, from outside the cluster and from an Ingress controller.
    target = one(docs, "Service", "pacer-api")["spec"]["ports"][0]["targetPort"]
    http = api.ports[target] if isinstance(target, str) else target
    flows += [(CLIENT, api, http, "TCP"), (INGRESS, api, http, "TCP")]
    for kube_client in ("pod-executor", "pacer-operator"):  # pods; PacerJobs
        flows += [(pods[kube_client], API_SERVER, 443, "TCP"), (pods[kube_client], API_SERVER, 6443, "TCP")]
    flows += [(pods["worker"], S3, 443, "TCP"), (pods["job-service"], S3, 443, "TCP")]
    return flows


def refused_flows(docs: list[dict[str, Any]], pods: dict[str, Endpoint]) -> list[tuple[Endpoint, Endpoint, int, str]]:
    nats, api, monitor = pods["nats"], pods["pacer-api"], pods["monitor"]
    flows = []
    for p in [*services(pods), *trainers(pods), PROMETHEUS, STRANGER, CLIENT]:
        flows.append((p, nats, 8222, "TCP"))  # no authentication there: the scraper of the namespace only
    for p in [*services(pods), *trainers(pods), STRANGER]:
        flows.append((p, nats, 6222, "TCP"))  # routes: NATS only
    for p in (STRANGER, IMPOSTOR, CLIENT, SCRAPER, PROMETHEUS):
        flows.append((p, nats, 4222, "TCP"))  # the bus: Pacer's pods of this namespace only
    # A training pod runs a user's code: it reaches no service, on any port.
    monitor_ports = sorted({*monitor.ports.values(), 8750, 2222, 4222, 80, 443})
    for t in trainers(pods):
        flows += [(t, monitor, port, "TCP") for port in monitor_ports]
        flows += [(t, s, s.ports["metrics"], "TCP") for s in services(pods)]
        flows.append((t, api, api.ports["http"], "TCP"))
        flows.append((t, API_SERVER, 6443, "TCP"))
    # No service reaches a training pod, nor another service directly.
    for s in services(pods):
        flows.append((s, pods["worker"], 2222, "TCP"))
        flows.append((s, monitor if s is not monitor else api, 9464, "TCP"))
    # The API server: the pod-executor's and the Pacer operator's alone (the job service's 443 is for object
    # storage).
    for s in services(pods):
        if s.name not in {"pod-executor", "pacer-operator"}:
            flows.append((s, API_SERVER, 6443, "TCP"))
            if s.name != "job-service":
                flows.append((s, API_SERVER, 443, "TCP"))
                flows.append((s, S3, 443, "TCP"))
    # From outside: only the API's HTTP port.
    for p in (*services(pods), nats):
        flows += [(CLIENT, p, port, "TCP") for port in p.ports.values() if p is not api or port != api.ports["http"]]
    flows += [(CLIENT, pods["worker"], 2222, "TCP"), (S3, pods["worker"], 2222, "TCP")]
    flows += [(PROMETHEUS, pods["worker"], 2222, "TCP"), (FAKE_PROMETHEUS, monitor, 9464, "TCP")]
    # A pod without Pacer's labels may do nothing, not even resolve names.
    flows += [(STRANGER, KUBE_DNS, 53, "UDP"), (STRANGER, S3, 443, "TCP"), (STRANGER, monitor, 9464, "TCP")]
    # NATS itself reaches only its peers and DNS.
    flows += [(nats, S3, 443, "TCP"), (nats, COLLECTOR, 4318, "TCP"), (nats, pods["worker"], 2222, "TCP")]
    return flows


def describe(flow: tuple[Endpoint, Endpoint, int, str]) -> str:
    src, dst, port, protocol = flow
    return f"{src.name} -> {dst.name}:{port}/{protocol}"


@needs_kubectl
@pytest.mark.parametrize("overlay", IN_NS)
def test_allowed_flows(overlay: str) -> None:
    docs = render(overlay)
    policies, pods = network_policies(docs), pacer_pods(docs)
    refused = [describe(f) for f in allowed_flows(docs, pods) if not allowed(policies, *f)]
    assert not refused, f"{overlay}: refused, but Pacer needs them:\n" + "\n".join(refused)


@needs_kubectl
@pytest.mark.parametrize("overlay", IN_NS)
def test_refused_flows(overlay: str) -> None:
    docs = render(overlay)
    policies, pods = network_policies(docs), pacer_pods(docs)
    flows = refused_flows(docs, pods)
    assert len(flows) > 100
    let_through = [describe(f) for f in flows if allowed(policies, *f)]
    assert not let_through, f"{overlay}: allowed, but should be refused:\n" + "\n".join(let_through)


@needs_kubectl
@pytest.mark.parametrize("overlay", IN_NS)
def test_both_ends_refuse_on_their_own(overlay: str) -> None:
    """Between Pacer's own pods, the source's egress and the destination's ingress each refuse what must not pass,
    so loosening one policy does not open the flow."""
    docs = render(overlay)
    policies, pods = network_policies(docs), pacer_pods(docs)
    nats = pods["nats"]
    flows = []
    for s in services(pods):
        flows += [(s, pods["worker"], 2222), (s, pods["ps"], 2222), (s, nats, 8222), (s, nats, 6222)]
    for t in trainers(pods):
        flows += [(t, s, s.ports["metrics"]) for s in services(pods)]
        flows += [(t, nats, 8222), (t, nats, 6222)]
    flows += [(nats, pods["worker"], 2222)]
    for src, dst, port in flows:
        what = describe((src, dst, port, "TCP"))
        assert not side_allows(policies, src, dst, "Egress", dst, port, "TCP", NAMESPACES), f"{overlay}: egress {what}"
        assert not side_allows(policies, dst, src, "Ingress", dst, port, "TCP", NAMESPACES), f"{overlay}: ingress {what}"


@needs_kubectl
@pytest.mark.parametrize("overlay", IN_NS)
def test_every_pod_of_the_namespace_is_denied_by_default(overlay: str) -> None:
    """Whatever its labels, a pod of the namespace is under a policy in both directions: nothing unlisted is open."""
    docs = render(overlay)
    policies = network_policies(docs)
    for p in [*pacer_pods(docs).values(), STRANGER, SCRAPER]:
        for direction in ("Ingress", "Egress"):
            assert any(direction in policy_types(pol) and matches(pol["spec"]["podSelector"], p.labels)
                       for pol in policies), f"{overlay}: {p.name} is open to every {direction.lower()}"
