"""Every overlay's workloads: all in namespace pacer, with resources and probes, mounting only volumes that are rendered;
each service Deployment follows the common pattern (module, bus, probes, hardening); replicated workloads spread over
nodes; prod is bigger than dev.
(How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import re
from typing import Any

import pytest

from .deploy_support import (
    CLUSTER_SCOPED,
    LEASED,
    NAMESPACES,
    OVERLAYS,
    SERVICES,
    SIDECARS,
    Service,
    built_pod,
    claim_under,
    env_of,
    matches,
    needs_kubectl,
    one,
    render,
)

# --------------------------------------------------------------- everything


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_everything_in_the_installs_namespace(overlay: str) -> None:
    docs = render(overlay)
    ns = NAMESPACES[overlay]
    one(docs, "Namespace", ns)
    for d in docs:
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"].get("namespace") == ns, f"{d['kind']}/{d['metadata']['name']}"


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_workloads_have_resources_and_probes(overlay: str) -> None:
    docs = render(overlay)
    workloads = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}]
    assert {(d["kind"], d["metadata"]["name"]) for d in workloads} == {
        ("StatefulSet", "nats"), *(("Deployment", s.deployment) for s in SERVICES),
    }
    for w in workloads:
        for c in w["spec"]["template"]["spec"]["containers"]:
            what = f"{overlay}: {w['kind']}/{w['metadata']['name']} container {c['name']}"
            res = c.get("resources", {})
            assert res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory"), what
            assert res.get("limits", {}).get("memory"), what
            if c["name"] in SIDECARS:
                continue  # serves nothing, so it has nothing to be ready or live for
            assert "livenessProbe" in c and "readinessProbe" in c, what


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_pod_volumes_exist(overlay: str) -> None:
    """Every ConfigMap and PVC a workload mounts is rendered (under its final, hashed name)."""
    docs = render(overlay)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for w in (d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}):
        for v in w["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names, (w["metadata"]["name"], v)
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names, v


HOSTNAME = "kubernetes.io/hostname"


def node_spreading(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(what, label selector) of each rule of ``pod`` that keeps its replicas apart per node: a topology
    spread constraint or a pod anti-affinity term (required or preferred) over ``kubernetes.io/hostname``."""
    rules: list[tuple[str, dict[str, Any]]] = []
    for c in pod.get("topologySpreadConstraints") or []:
        if c["topologyKey"] == HOSTNAME and c.get("labelSelector") is not None:
            assert c["maxSkew"] == 1, c
            assert c["whenUnsatisfiable"] in {"ScheduleAnyway", "DoNotSchedule"}, c
            rules.append(("topologySpreadConstraint", c["labelSelector"]))
    anti = (pod.get("affinity") or {}).get("podAntiAffinity") or {}
    terms = [*anti.get("requiredDuringSchedulingIgnoredDuringExecution", []),
             *(t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", []))]
    for t in terms:
        # Another namespace's pods would say nothing about this workload's own.
        if t["topologyKey"] == HOSTNAME and t.get("labelSelector") is not None \
                and not t.get("namespaces") and t.get("namespaceSelector") is None:
            rules.append(("podAntiAffinity", t["labelSelector"]))
    return rules


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_replicated_workloads_spread_over_nodes(overlay: str) -> None:
    """A workload of several replicas keeps them on different nodes where it can, by a rule that selects its own
    pods and no other workload's (one node's loss then costs one replica, not the service)."""
    docs = render(overlay)
    workloads = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}}
    labels = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in workloads.items()}
    labels.update({f"training {r}": built_pod(docs, r)["metadata"]["labels"] for r in ("worker", "ps")})
    replicated = [name for name, w in workloads.items() if w["spec"].get("replicas", 1) > 1]
    assert len(replicated) >= {"dev": 6, "prod": 10, "second-install": 10}[overlay], replicated  # the count below is not vacuous
    for name in replicated:
        pod = workloads[name]["spec"]["template"]["spec"]
        rules = node_spreading(pod)
        own = [(what, sel) for what, sel in rules if matches(sel, labels[name])]
        assert own, f"{overlay}: {name} ({workloads[name]['spec']['replicas']} replicas) is not spread over nodes"
        for what, sel in own:
            others = [o for o, lab in labels.items() if o != name and matches(sel, lab)]
            assert not others, f"{overlay}: {name}'s {what} {sel} also counts the pods of {others}"


def mem_bytes(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i)?", q)
    assert m, q
    return float(m.group(1)) * units.get(m.group(2) or "", 1)


@needs_kubectl
def test_prod_is_bigger_than_dev() -> None:
    workloads = [("StatefulSet", "nats"), *(("Deployment", s.deployment) for s in SERVICES)]
    for kind, name in workloads:
        dev, prod = (
            one(render(o), kind, name)["spec"]["template"]["spec"]["containers"][0]["resources"]
            for o in ("dev", "prod")
        )
        assert mem_bytes(prod["requests"]["memory"]) > mem_bytes(dev["requests"]["memory"]), name
    # The stateless API runs one instance in dev and scales out in prod.
    dev_api, prod_api = (one(render(o), "Deployment", "pacer-api")["spec"]["replicas"] for o in ("dev", "prod"))
    assert (dev_api, prod_api) == (1, 2)
    for claim in ("pacer-data", "pacer-checkpoints"):
        dev_pvc, prod_pvc = (
            one(render(o), "PersistentVolumeClaim", claim)["spec"]["resources"]["requests"]["storage"]
            for o in ("dev", "prod")
        )
        assert mem_bytes(prod_pvc) > mem_bytes(dev_pvc), claim


# --------------------------------------------------------------- services


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
@pytest.mark.parametrize("svc", SERVICES, ids=[s.deployment for s in SERVICES])
def test_service_deployment(overlay: str, svc: Service) -> None:
    """The pattern every service follows (shard-service.yaml): module, bus, probes, hardening."""
    docs = render(overlay)
    dep = one(docs, "Deployment", svc.deployment)
    if svc.single:
        # One active instance; no overlap during rollouts (see each manifest's header).
        assert dep["spec"]["replicas"] == 1
        assert dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (c,) = pod["containers"]
    if svc.health in LEASED:
        # Several instances share the jobs by leases: each pod holds them under its own name.
        (inst,) = [e for e in c["env"] if e["name"] == "PACER_INSTANCE"]
        assert inst["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", inst
    assert c["image"] == "pacer:0.1.0"
    assert c["command"] == ["python", "-m", f"pacer_services.{svc.module}.main"]
    env = env_of(c)
    assert env["PACER_NATS_URL"] == "nats://nats:4222"
    # Every service may create the streams (Bus.ensure_streams): all with the overlay's replica count.
    assert env["PACER_REPLICAS"] == str(OVERLAYS[overlay])
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names)), f"duplicate env: {names}"
    for name, value in svc.env.items():
        assert env.get(name) == value, name

    probe = ["pacer-healthcheck", svc.health]
    assert c["startupProbe"]["exec"]["command"] == probe
    assert c["livenessProbe"]["exec"]["command"] == [*probe, "--live"]
    if svc.deployment != "pacer-api":
        assert c["readinessProbe"]["exec"]["command"] == probe

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts.get("tmp") == "/tmp"
    assert pod["terminationGracePeriodSeconds"] >= 20


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_shard_service(overlay: str) -> None:
    dep = one(render(overlay), "Deployment", "shard-service")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert [e["name"] for e in c["env"]].count("PACER_REPLICAS") == 1


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_job_service_and_workers_share_the_data_volume(overlay: str) -> None:
    """A dataset path the job service checks is the path the workers open: same PVC, same mount path."""
    docs = render(overlay)
    pod = one(docs, "Deployment", "job-service")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    data_dir = env_of(c)["PACER_DATA_DIR"]
    claim, path = claim_under(pod, c, data_dir)
    assert claim == "pacer-data"
    pvc = one(docs, "PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "storageClassName" not in pvc["spec"], "the storage class is the user's choice (base/storage.yaml)"

    worker = built_pod(docs, "worker")
    trainer = next(c for c in worker["spec"]["containers"] if c["name"] == "trainer")
    assert claim_under(worker["spec"], trainer, data_dir) == (claim, path)


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_api_service(overlay: str) -> None:
    docs = render(overlay)
    dep = one(docs, "Deployment", "pacer-api")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    port = int(env_of(c)["PACER_API_PORT"])
    assert env_of(c)["PACER_API_HOST"] == "0.0.0.0"
    (cport,) = [p for p in c["ports"] if p["name"] == "http"]
    assert cport["containerPort"] == port
    ready = c["readinessProbe"]["httpGet"]
    assert ready["path"] == "/healthz"
    assert ready["port"] in {port, cport["name"]}

    svc = one(docs, "Service", "pacer-api")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    # The Service selects exactly the api pods (not NATS, not the other services).
    selector = svc["spec"]["selector"]
    selected = [
        d["metadata"]["name"] for d in docs
        if d["kind"] in {"Deployment", "StatefulSet"}
        and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert selected == ["pacer-api"]
    (sport,) = svc["spec"]["ports"]
    assert sport["port"] == 80
    assert sport["targetPort"] in {port, cport["name"]}
