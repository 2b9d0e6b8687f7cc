"""Pod hardening in every overlay: seccomp, service account tokens, a locked-down and pinned NATS, disruption budgets
and the NetworkPolicy in front of NATS.  (How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from .deploy_support import (
    DEPLOY,
    OVERLAYS,
    SERVICES,
    built_pod,
    configmap,
    needs_kubectl,
    one,
    render,
    selects,
)

# --------------------------------------------------------------- hardening


def all_pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod spec the deployment runs: each workload's template and the training pods the executor builds."""
    pods = {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in {"Deployment", "StatefulSet"}}
    for role in ("worker", "ps"):
        pods[f"training {role}"] = built_pod(docs, role)["spec"]
    return pods


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_pod_runs_the_runtime_default_seccomp_profile(overlay: str) -> None:
    pods = all_pods(render(overlay))
    assert len(pods) == len(SERVICES) + 3  # the services, NATS, worker and ps
    for name, pod in pods.items():
        profile = pod.get("securityContext", {}).get("seccompProfile", {})
        assert profile.get("type") == "RuntimeDefault", f"{overlay}: {name} has no RuntimeDefault seccomp"
        for c in pod["containers"]:
            override = c.get("securityContext", {}).get("seccompProfile")
            assert override in (None, {"type": "RuntimeDefault"}), f"{name}/{c['name']} overrides it: {override}"


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_only_the_executor_mounts_a_service_account_token(overlay: str) -> None:
    """Only the pod-executor calls the Kubernetes API; any other pod with a token is a credential to steal."""
    docs = render(overlay)
    sas = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    with_token = set()
    for name, pod in all_pods(docs).items():
        sa = sas.get(pod.get("serviceAccountName", "default"), {})
        # The pod's own field wins over its ServiceAccount's; Kubernetes' default is to mount.
        mounts = pod.get("automountServiceAccountToken", sa.get("automountServiceAccountToken", True))
        if mounts:
            with_token.add(name)
    assert with_token == {"Deployment/pod-executor"}


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_nats_container_is_locked_down(overlay: str) -> None:
    pod = one(render(overlay), "StatefulSet", "nats")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert "add" not in sc["capabilities"], c["name"]
        # With a read-only root, everything NATS writes lives on a volume: the JetStream store and the pid file.
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        conf = configmap(render(overlay), "nats-config")["data"]["nats.conf"]
        pid = re.search(r"^\s*pid_file\s*[:=]\s*(\S+)", conf, re.M)
        assert pid and any(pid.group(1).startswith(m.rstrip("/") + "/") for m in mounts), "pid file on the read-only root"


def test_nats_image_is_pinned_offline() -> None:
    """Rendered below with kubectl; this checks the pin's form on the base kustomization alone."""
    kust = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    (nats,) = [i for i in kust["images"] if i["name"] == "nats"]
    assert re.fullmatch(r"\d+\.\d+\.\d+(-alpine)?", nats["newTag"]), nats


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_nats_image_is_pinned(overlay: str) -> None:
    """An exact release (and, where set, a digest), never a moving tag like ``2.10-alpine`` or ``latest``."""
    for c in one(render(overlay), "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"]:
        assert re.fullmatch(r"nats:\d+\.\d+\.\d+(-alpine)?(@sha256:[0-9a-f]{64})?", c["image"]), c["image"]


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_disruption_budgets(overlay: str) -> None:
    """Every workload with more than one replica (in either overlay) has a budget; API and policies by name."""
    docs = render(overlay)
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert {"pacer-api", "policies", "nats"} <= {d["metadata"]["name"] for d in pdbs}
    for w in (d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}):
        name = w["metadata"]["name"]
        replicas = max(one(render(o), w["kind"], name)["spec"].get("replicas", 1) for o in OVERLAYS)
        covering = [p for p in pdbs if selects(p["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        if replicas > 1:
            assert len(covering) == 1, f"{overlay}: {w['kind']}/{name} ({replicas} replicas) has {len(covering)} PDBs"
            spec = covering[0]["spec"]
            # maxUnavailable 1: a drain proceeds even where the overlay runs a single replica.
            assert spec.get("maxUnavailable") == 1 and "minAvailable" not in spec, spec
        else:
            assert not covering, f"a budget on single-instance {name} could only block drains"


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_network_policy_admits_nats_clients_only_from_pacer_pods(overlay: str) -> None:
    docs = render(overlay)
    nats_labels = one(docs, "StatefulSet", "nats")["spec"]["template"]["metadata"]["labels"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and selects(d["spec"]["podSelector"], nats_labels)]
    assert len(policies) == 1, "no (or several) NetworkPolicy on the NATS pods"
    spec = policies[0]["spec"]
    assert "Ingress" in spec["policyTypes"]
    # Which pods each rule admits to which ports; a rule without `from` or `ports` admits everything.
    admitted: dict[int, list[dict[str, Any]]] = {}
    for rule in spec["ingress"]:
        assert rule.get("from"), f"a rule open to every source: {rule}"
        assert rule.get("ports"), f"a rule open on every port: {rule}"
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"only pods of this namespace: {peer}"
            for port in rule["ports"]:
                admitted.setdefault(port["port"], []).append(peer["podSelector"])
    assert set(admitted) <= {4222, 6222, 8222}, admitted
    # Routes: only between the NATS servers.
    assert all(selects(s, nats_labels) for s in admitted.get(6222, [])), admitted[6222]
    assert all(s["matchLabels"].get("app.kubernetes.io/name") == "nats" for s in admitted.get(6222, []))
    # Clients: Pacer's pods (services and training pods) are admitted ...
    clients = admitted[4222]
    pacer_pods = {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["metadata"]["labels"]
                  for d in docs if d["kind"] == "Deployment"}
    pacer_pods.update({f"training {r}": built_pod(docs, r)["metadata"]["labels"] for r in ("worker", "ps")})
    for name, labels in pacer_pods.items():
        assert any(selects(s, labels) for s in clients), f"{name} may not reach NATS"
    # ... and a pod that is not Pacer's is not.
    assert not any(selects(s, {"app.kubernetes.io/name": "someone-else"}) for s in clients)
    # The monitoring port (no authentication: /connz lists every user) admits the metrics scraper, and no
    # Pacer pod: a training pod runs a user's code.
    monitor = admitted.get(8222, [])
    assert any(selects(s, {"app.kubernetes.io/component": "metrics-scraper"}) for s in monitor), monitor
    for name, labels in pacer_pods.items():
        assert not any(selects(s, labels) for s in monitor), f"{name} may reach the NATS monitoring port"
