"""Two installs of Pacer in two namespaces: prod and deploy/overlays/second-install render without clashes.

Kustomize's ``namespace:`` moves the namespaced objects; what it cannot reach (cluster-scoped names, and
names with the namespace inside them, like the NATS certificate's DNS names) the second install's
replacements fix.  The rest of the deployment tests run on that overlay too (deploy_support.OVERLAYS).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from .deploy_support import CLUSTER_SCOPED, NAMESPACES, needs_kubectl, one, render

FIRST, SECOND = "prod", "second-install"
# Cluster-scoped objects both installs must share: Kubernetes has one definition of a resource type per
# cluster, so each install applies the same PacerJob CRD (its name is the type's: pacerjobs.pacer.io).
SHARED = {"CustomResourceDefinition"}


def strings(obj: Any) -> Iterator[str]:
    """Every string value in a rendered object (ConfigMap contents included)."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def dns_names_in(ns: str, docs: list[dict[str, Any]]) -> set[str]:
    """Every DNS-like name in the objects that names namespace ``ns`` (x.<ns>, x.<ns>.svc...)."""
    pattern = re.compile(rf"[\w*-]+(?:\.[\w*-]+)*\.{re.escape(ns)}(?:\.svc(?:\.cluster\.local)?)?(?![\w.-])")
    return {m.group(0) for d in docs for s in strings(d) for m in pattern.finditer(s)}


def namespace_fields(obj: Any) -> Iterator[str]:
    """Every value of a field that names a namespace (metadata.namespace, a subject's namespace, a
    namespaceSelector on the namespace's automatic name label), anywhere in an object."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("namespace", "kubernetes.io/metadata.name") and isinstance(v, str):
                yield v
            else:
                yield from namespace_fields(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from namespace_fields(v)


@needs_kubectl
def test_a_second_install_shares_no_cluster_scoped_name_with_the_first() -> None:
    first, second = render(FIRST), render(SECOND)
    names = {ov: {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in CLUSTER_SCOPED - SHARED}
             for ov, docs in ((FIRST, first), (SECOND, second))}
    assert names[FIRST] and len(names[SECOND]) == len(names[FIRST])
    assert not names[FIRST] & names[SECOND], names[FIRST] & names[SECOND]
    # Each install's bindings grant its own roles to its own executor.
    ns = NAMESPACES[SECOND]
    for d in second:
        if d["kind"] in {"ClusterRoleBinding", "RoleBinding"}:
            assert {s["namespace"] for s in d["subjects"]} == {ns}, d
            kind = d["roleRef"]["kind"]
            one(second, kind, d["roleRef"]["name"])
            if kind == "ClusterRole":
                assert (kind, d["roleRef"]["name"]) not in names[FIRST]


@needs_kubectl
def test_a_second_install_names_its_own_namespace_and_never_the_first() -> None:
    first_ns, second_ns = NAMESPACES[FIRST], NAMESPACES[SECOND]
    assert first_ns != second_ns
    # The check sees the first install's names where they are (so it would see them in the second).
    assert {"nats.pacer.svc", "*.nats-headless.pacer"} <= dns_names_in(first_ns, render(FIRST))
    second = render(SECOND)
    assert not dns_names_in(first_ns, second)
    assert first_ns in {v for d in render(FIRST) for v in namespace_fields(d)}
    assert first_ns not in {v for d in second for v in namespace_fields(d)}
    cert = one(second, "Certificate", "nats-server-tls")
    want = {f"{host}.{second_ns}{suffix}" for host in ("nats", "*.nats-headless")
            for suffix in ("", ".svc", ".svc.cluster.local")}
    assert want <= set(cert["spec"]["dnsNames"]), cert["spec"]["dnsNames"]


@needs_kubectl
def test_a_second_install_has_the_first_ones_network_policies_in_its_own_namespace() -> None:
    """test_deploy_network_policies evaluates the first install's policies; the second's are the same."""
    def policies(overlay: str) -> dict[str, Any]:
        out = {}
        for d in render(overlay):
            if d["kind"] == "NetworkPolicy":
                assert d["metadata"]["namespace"] == NAMESPACES[overlay]
                out[d["metadata"]["name"]] = {**d, "metadata": {k: v for k, v in d["metadata"].items()
                                                                if k != "namespace"}}
        return out

    first = policies(FIRST)
    assert first and policies(SECOND) == first


@needs_kubectl
def test_the_installs_share_the_crd_as_one_identical_object() -> None:
    """Applying either install leaves the same PacerJob CRD: neither changes the other's resources' schema."""
    shared = {ov: sorted((d for d in render(ov) if d["kind"] in SHARED), key=lambda d: d["metadata"]["name"])
              for ov in (FIRST, SECOND)}
    assert shared[FIRST] and shared[FIRST] == shared[SECOND]
    assert all("namespace" not in d["metadata"] for d in shared[FIRST])
