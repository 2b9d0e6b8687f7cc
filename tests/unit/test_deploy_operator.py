"""The Pacer operator's deployment: the CRD each overlay renders is the generated one, and the operator's API
rights are exactly what it does with PacerJobs, in its install's namespace.  (How these tests render the
overlays: deploy_support.)"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from pacer import k8s_crd

from .deploy_support import NAMESPACES, OVERLAYS, ROOT, needs_kubectl, one, render


def test_the_base_kustomization_lists_the_crd() -> None:
    kust = yaml.safe_load((ROOT / "deploy" / "base" / "kustomization.yaml").read_text())
    assert k8s_crd.CRD_FILE.name in kust["resources"]
    assert ROOT / "deploy" / "base" / k8s_crd.CRD_FILE.name == ROOT / k8s_crd.CRD_FILE


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_overlay_renders_the_generated_crd(overlay: str) -> None:
    rendered = copy.deepcopy(one(render(overlay), "CustomResourceDefinition", k8s_crd.CRD_NAME))
    labels = rendered["metadata"].pop("labels")
    assert labels == {"app.kubernetes.io/part-of": "pacer"}  # the kustomization's label, nothing else changed
    assert rendered == k8s_crd.crd()


def rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_operator_may_read_and_patch_pacerjobs_of_its_namespace_and_nothing_else(overlay: str) -> None:
    docs = render(overlay)
    ns = NAMESPACES[overlay]
    pod = one(docs, "Deployment", "pacer-operator")["spec"]["template"]["spec"]
    sa = pod["serviceAccountName"]
    bindings = [d for d in docs if d["kind"] in {"RoleBinding", "ClusterRoleBinding"}
                and any(s.get("kind") == "ServiceAccount" and s["name"] == sa for s in d["subjects"])]
    assert [(b["kind"], b["metadata"]["namespace"]) for b in bindings] == [("RoleBinding", ns)]
    (binding,) = bindings
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
    assert binding["roleRef"]["kind"] == "Role"
    role = one(docs, "Role", binding["roleRef"]["name"])
    g, plural = k8s_crd.GROUP, k8s_crd.PLURAL
    # list + watch: the watch; patch: its finalizer; status patch: what it writes.  get: a read list grants.
    assert rules(role) == {(g, plural, "get"), (g, plural, "list"), (g, plural, "watch"), (g, plural, "patch"),
                           (g, f"{plural}/status", "patch")}
    # Where PacerJobs are watched: unset means its own namespace, the one its Role is in.
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert "PACER_OPERATOR_NAMESPACES" not in env
