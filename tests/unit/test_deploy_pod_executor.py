"""The pod-executor's Deployment, its RBAC (exactly what its Kubernetes backend calls) and the training pod templates.
(How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from .deploy_support import (
    NAMESPACES,
    OVERLAYS,
    ROOT,
    built_pod,
    claim_under,
    configmap,
    env_of,
    needs_kubectl,
    one,
    render,
)

EXECUTOR_K8S = ROOT / "services" / "pod_executor" / "backends" / "kubernetes.py"

POD_VERBS = {"create", "get", "list", "watch", "delete"}

# The overlays that include components/cluster-placement (the ClusterRole of the machine report).
CLUSTER_PLACEMENT = {"prod", "second-install"}


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
    ckpt_dir = chief_checkpoint_dir(trainer)
    assert ckpt_dir == env["PACER_CHECKPOINT_ROOT"] + "/j"
    claim, _ = claim_under(worker["spec"], trainer, ckpt_dir)
    assert claim == "pacer-checkpoints"
    assert one(docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    assert not any(m.get("readOnly") for m in trainer["volumeMounts"] if m["name"] not in {"data", "nats-ca"})


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
@pytest.mark.parametrize("role", ["worker", "ps"])
def test_a_pods_bus_password_is_a_secret_reference_never_a_literal(overlay: str, role: str) -> None:
    """The job's agent token reaches its pods through a Secret (``valueFrom.secretKeyRef``): ``kubectl get
    pod -o yaml`` and anyone who may read pods in the namespace see its name, not the password."""
    from pacer import authjwt

    docs = render(overlay)
    pod = built_pod(docs, role, "team-a")
    refs = set()
    for c in pod["spec"]["containers"]:
        by_name = {e["name"]: e for e in c["env"]}
        assert by_name["PACER_NATS_USER"]["value"] == "agent-team-a"
        pw = by_name["PACER_NATS_PASSWORD"]
        assert "value" not in pw, c["name"]
        ref = pw["valueFrom"]["secretKeyRef"]
        assert ref["key"] == "password" and not ref.get("optional")
        refs.add(ref["name"])
        # Nothing in the container's spec holds a token of the job (env values, command lines).
        text = json.dumps(c)
        assert not any(authjwt.parse_token(w) for w in re.findall(r"[0-9a-f.~A-Za-z_-]{40,}", text)), c["name"]
    (name,) = refs  # trainer and agent share the job's Secret, named after the job
    assert name.startswith("team-a-agent-")
    assert built_pod(docs, role, "team-b")["spec"]["containers"][0]["env"] != pod["spec"]["containers"][0]["env"]


def chief_checkpoint_dir(trainer: dict[str, Any]) -> str:
    """The checkpoint directory in the chief's WorkerConfig (its ``--config`` argument)."""
    argv = trainer["command"]
    config = json.loads(argv[argv.index("--config") + 1])
    return str(config["checkpoint_dir"])


def checkpoint_views(pod: dict[str, Any]) -> set[tuple[str, str]]:
    """(mount path, directory of the checkpoint PVC it shows) of every mount of that PVC in the pod."""
    claims = {v["name"] for v in pod["spec"]["volumes"]
              if v.get("persistentVolumeClaim", {}).get("claimName") == "pacer-checkpoints"}
    return {(m["mountPath"], m.get("subPath", "")) for c in pod["spec"]["containers"]
            for m in c.get("volumeMounts", []) if m["name"] in claims}


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_each_job_sees_only_its_own_checkpoints(overlay: str) -> None:
    """A job's pods mount only <job> of the checkpoint PVC, at <root>/<job>: never the volume's root,
    so no job can read or overwrite another's checkpoints (nor list which jobs exist)."""
    docs = render(overlay)
    root = env_of(one(docs, "Deployment", "pod-executor")["spec"]["template"]["spec"]["containers"][0])[
        "PACER_CHECKPOINT_ROOT"]
    pods = {job: built_pod(docs, "worker", job) for job in ("team-a", "team-b")}
    for job, pod in pods.items():
        views = checkpoint_views(pod)
        assert views == {(f"{root}/{job}", job)}, views  # the trainer's one mount, the job's directory only
        trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
        assert chief_checkpoint_dir(trainer) == f"{root}/{job}"
        assert claim_under(pod["spec"], trainer, f"{root}/{job}/flash")[0] == "pacer-checkpoints"
        # The other job's directory is on no volume of this pod: the path does not reach the PVC.
        other = next(j for j in pods if j != job)
        with pytest.raises(AssertionError, match="on no"):
            claim_under(pod["spec"], trainer, f"{root}/{other}")
        with pytest.raises(AssertionError, match="on no"):
            claim_under(pod["spec"], trainer, root)
    # A PS writes no checkpoint: it mounts no part of the volume.
    assert checkpoint_views(built_pod(docs, "ps", "team-a")) == set()


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


def k8s_custom_calls() -> dict[str, set[tuple[str, str]]]:
    """API group -> (resource, verb) of every CustomObjectsApi call of the backend (its PodGroup constants)."""
    src = EXECUTOR_K8S.read_text()
    group = re.search(r'PODGROUP_GROUP, PODGROUP_VERSION, PODGROUP_PLURAL = "([^"]+)", "[^"]+", "([^"]+)"', src)
    assert group, "the PodGroup's API group and plural are no longer where this test reads them"
    calls: dict[str, set[tuple[str, str]]] = {}
    for verb in re.findall(r"self\.custom\.(create|get|list|delete|patch|replace)_namespaced_custom_object\b", src):
        verb = {"replace": "update"}.get(verb, verb)
        calls.setdefault(group.group(1), set()).add((group.group(2), verb))
    return calls


def test_k8s_calls_are_read_from_the_backend() -> None:
    """The parser above sees what kubernetes.py does (or this test would pass vacuously)."""
    assert k8s_calls() >= {
        ("pods", "create"), ("pods", "list"), ("pods", "watch"), ("pods", "delete"),
        ("pods/log", "get"), ("pods/resize", "patch"), ("services", "create"), ("secrets", "create"),
    }
    assert k8s_cluster_calls() == {("nodes", "list"), ("pods", "list")}
    assert k8s_custom_calls() == {"scheduling.volcano.sh": {("podgroups", "create"), ("podgroups", "patch")}}


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_pod_executor_rbac(overlay: str) -> None:
    docs = render(overlay)
    one(docs, "ServiceAccount", "pod-executor")
    role = one(docs, "Role", "pod-executor")
    grants: dict[str, set[str]] = {}
    apps: dict[str, set[str]] = {}
    custom: dict[str, set[tuple[str, str]]] = {}  # API group -> (resource, verb): Volcano's PodGroups
    for rule in role["rules"]:
        if rule["apiGroups"] not in ([""], ["apps"]):
            assert len(rule["apiGroups"]) == 1, rule
            custom.setdefault(rule["apiGroups"][0], set()).update(
                (res, verb) for res in rule["resources"] for verb in rule["verbs"])
            continue
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
    # ... and nothing outside the few resources it has a reason to touch (no wildcards).
    assert set(grants) <= {"pods", "pods/log", "pods/resize", "events", "services", "secrets"}
    # Secrets: create only (the pods' bus passwords; the Service owns them), never read any.
    assert grants["secrets"] == {"create"}
    assert not any("*" in verbs for verbs in grants.values())
    # Custom resources: exactly what the backend calls (create PodGroups), nothing more.
    assert custom == k8s_custom_calls()
    binding = one(docs, "RoleBinding", "pod-executor")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-executor"}
    ns = NAMESPACES[overlay]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pod-executor", "namespace": ns}]
    # Cluster-wide: only with the component cluster-placement (prod, and the second install copied from it),
    # and then exactly the read-only lists the machine report needs (nodes; every tenant's pods), with the
    # setting that makes the executor use them.  Without it (dev), no right outside the namespace and no
    # setting: an executor asked to list machines it may not list would only log 403s.
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    cluster_bindings = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    executor_env = env_of(one(docs, "Deployment", "pod-executor")["spec"]["template"]["spec"]["containers"][0])
    if overlay not in CLUSTER_PLACEMENT:
        assert cluster_roles == [] and cluster_bindings == []
        assert executor_env.get("PACER_CLUSTER_MACHINES", "") in ("", "0")
        return
    assert executor_env["PACER_CLUSTER_MACHINES"] == "1"
    # Cluster-scoped names start with the namespace, so a second install's do not clash with the first's.
    assert [r["metadata"]["name"] for r in cluster_roles] == [f"{ns}-pod-executor-machines"]
    cluster_grants: set[tuple[str, str]] = set()
    for rule in cluster_roles[0]["rules"]:
        assert rule["apiGroups"] == [""]
        cluster_grants |= {(res, verb) for res in rule["resources"] for verb in rule["verbs"]}
    assert cluster_grants == k8s_cluster_calls()
    cbinding = one(docs, "ClusterRoleBinding", f"{ns}-pod-executor-machines")
    assert cbinding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                   "name": f"{ns}-pod-executor-machines"}
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
    assert set(containers) == {"trainer", "agent"}  # every PS has its agent too (launch.py)
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
    assert set(built) == {"trainer", "agent"}
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
