"""Every rendered object, and what the executor creates at run time, validates against the Kubernetes schemas;
dev needs no operator's custom resources.  (How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from .deploy_support import (
    CRD_GROUPS,
    OLDEST_KUBERNETES,
    OVERLAYS,
    built_pod,
    configmap,
    crd_objects,
    needs_kubectl,
    render,
)

# --------------------------------------------------------------- schemas

# Validated offline against the Kubernetes OpenAPI schemas bundled by the
# kubernetes-validate package (dev extras), in strict mode (an unknown or
# misspelt field is an error, as `kubectl apply --validate=strict` would make
# it): the oldest Kubernetes release the manifests support and the newest
# the package knows (OLDEST_KUBERNETES, in deploy_support).


def kubernetes_versions() -> list[str]:
    try:
        import kubernetes_validate
    except ImportError:
        return [OLDEST_KUBERNETES]
    return [OLDEST_KUBERNETES, kubernetes_validate.latest_version()]


def schema_problems(obj: dict[str, Any], version: str) -> str | None:
    """None if ``obj`` is valid for Kubernetes ``version``, else the validator's message."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the dev extras)")
    try:
        kv.validate(obj, version, strict=True)
    except kv.ValidationError as e:
        return str(e).split("\n", 1)[0] + f" (at {'/'.join(str(p) for p in e.path)})"
    return None


def crd_reason(obj: dict[str, Any]) -> str | None:
    group = obj["apiVersion"].rpartition("/")[0]
    return CRD_GROUPS.get(group)


def built_service(docs: list[dict[str, Any]], job: str) -> dict[str, Any]:
    """The headless Service the executor's Kubernetes backend creates for ``job``."""
    import kubernetes.client as k8s
    from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend

    api = k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:9"))  # never called
    svc: dict[str, Any] = KubernetesBackend(api, "pacer", "pacer").service_manifest(job)
    return svc


@needs_kubectl
@pytest.mark.parametrize("version", kubernetes_versions())
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_manifests_match_the_kubernetes_schemas(overlay: str, version: str) -> None:
    """Every rendered object, and the training pods and job Service the executor creates at run time."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the dev extras)")
    docs = render(overlay)
    objects = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}
    for role in ("worker", "ps"):
        objects[f"training pod {role}"] = built_pod(docs, role)
        tpl = yaml.safe_load(configmap(docs, "pacer-pod-templates")["data"][f"{role}.yaml"])
        # A template lacks what the backend fills in (name, image): checked as a pod with those added.
        tpl["metadata"]["name"] = "template"
        for c in tpl["spec"]["containers"]:
            c["image"] = "pacer"
        objects[f"pod template {role}"] = tpl
    objects["job Service"] = built_service(docs, "j")
    problems, skipped = {}, {}
    for name, obj in objects.items():
        if (reason := crd_reason(obj)) is not None:
            skipped[name] = reason
            continue
        try:
            problem = schema_problems(obj, version)
        except kv.SchemaNotFoundError:
            problem = f"no schema for {obj['apiVersion']} {obj['kind']} in Kubernetes {version} (a CRD? list its group)"
        if problem:
            problems[name] = problem
    assert not problems, f"{overlay} on Kubernetes {version}:\n" + "\n".join(f"{k}: {v}" for k, v in problems.items())
    assert len(objects) - len(skipped) >= 25, "validated (almost) nothing"


def test_schema_validation_can_fail() -> None:
    """The validator sees a misspelt field, a wrong type and a removed API (or the test above proves nothing)."""
    pdb: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "x"},
           "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"a": "b"}}}}
    assert schema_problems(pdb, OLDEST_KUBERNETES) is None
    typo = {**pdb, "spec": {**pdb["spec"], "maxUnavailabel": 1}}
    assert "maxUnavailabel" in (schema_problems(typo, OLDEST_KUBERNETES) or "")
    wrong_type = {**pdb, "metadata": {"name": "x", "labels": {"a": 1}}}
    assert schema_problems(wrong_type, OLDEST_KUBERNETES)
    kv = pytest.importorskip("kubernetes_validate")
    with pytest.raises(kv.SchemaNotFoundError):
        schema_problems({**pdb, "apiVersion": "policy/v1beta1"}, OLDEST_KUBERNETES)


@needs_kubectl
def test_dev_needs_no_operator() -> None:
    """Dev applies on a bare cluster: no custom resources (cert-manager, Prometheus Operator)."""
    docs = render("dev")
    assert not [d["kind"] for g in CRD_GROUPS for d in crd_objects(docs, g)]
