"""Pod hardening in every overlay: the namespace's Pod Security level and every pod meeting it, seccomp, service
account tokens, a locked-down and pinned NATS, disruption budgets (the NetworkPolicies: test_deploy_network_policies).
(How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from .deploy_support import (
    DEPLOY,
    NAMESPACES,
    OLDEST_KUBERNETES,
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


# --------------------------------------------------------------- Pod Security Standards
# The rules of the Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards/),
# as the admission controller applies them to a pod: ``baseline`` forbids the known privilege escalations,
# ``restricted`` adds the hardening best practices.  Written out here so that a pod that would be refused
# in the namespace fails this test before it fails a job on a cluster.

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
LEVELS = ("privileged", "baseline", "restricted")


def pod_security_violations(meta: dict[str, Any], spec: dict[str, Any], level: str) -> list[str]:
    """What keeps a pod (its metadata and spec) from the Pod Security ``level``; empty if it meets it."""
    assert level in LEVELS, level
    bad: list[str] = []
    if level == "privileged":
        return bad
    psc = spec.get("securityContext") or {}
    containers = [*spec.get("initContainers", []), *spec["containers"], *spec.get("ephemeralContainers", [])]
    csc = {c["name"]: c.get("securityContext") or {} for c in containers}
    # baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            bad.append(field)
    for where, sc in [("pod", psc), *csc.items()]:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{where}: hostProcess")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            bad.append(f"{where}: seccomp Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            bad.append(f"{where}: appArmorProfile {sc['appArmorProfile']}")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            bad.append(f"{where}: seLinuxOptions {se}")
    for name, sc in csc.items():
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount {sc['procMount']}")
        if set((sc.get("capabilities") or {}).get("add", [])) - BASELINE_CAPABILITIES:
            bad.append(f"{name}: adds capabilities {sc['capabilities']['add']}")
    for c in containers:
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{c['name']}: hostPort")
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") \
                and value != "runtime/default" and not value.startswith("localhost/"):
            bad.append(f"AppArmor annotation {key}={value}")
    if set(s["name"] for s in psc.get("sysctls", [])) - SAFE_SYSCTLS:
        bad.append(f"unsafe sysctls {psc['sysctls']}")
    for v in spec.get("volumes", []):
        if "hostPath" in v:
            bad.append(f"hostPath volume {v['name']}")
    if level == "baseline":
        return bad
    # restricted
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']} of type {sorted(kinds)}")
    for name, sc in csc.items():
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: does not drop ALL capabilities")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities {caps['add']}")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            bad.append(f"{name}: runAsNonRoot is not true (pod or container)")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp} (pod or container)")
    return bad


def every_pod(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """(metadata, spec) of every pod the namespace admits: each workload's template, the pod templates as the
    ConfigMap holds them, and the training pods the executor builds from them."""
    pods = {f"{d['kind']}/{d['metadata']['name']}": (d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"])
            for d in docs if d["kind"] in {"Deployment", "StatefulSet"}}
    for role in ("worker", "ps"):
        tpl = yaml.safe_load(configmap(docs, "pacer-pod-templates")["data"][f"{role}.yaml"])
        pods[f"pod template {role}"] = (tpl["metadata"], tpl["spec"])
        built = built_pod(docs, role)
        pods[f"training {role}"] = (built["metadata"], built["spec"])
    return pods


def test_pod_security_rules_refuse_what_they_should() -> None:
    """The checker itself: a hardened pod passes restricted, and each departure from it is caught."""
    good = {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "t", "emptyDir": {}}]}
    assert pod_security_violations({}, good, "restricted") == []

    def changed(change: Any) -> dict[str, Any]:
        pod = yaml.safe_load(yaml.safe_dump(good))
        change(pod)
        return pod

    c0 = "containers"
    baseline_breaks = [
        lambda p: p.update(hostNetwork=True),
        lambda p: p[c0][0]["securityContext"].update(privileged=True),
        lambda p: p[c0][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
        lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        lambda p: p[c0][0].update(ports=[{"containerPort": 80, "hostPort": 80}]),
        lambda p: p["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    ]
    restricted_breaks = [
        lambda p: p[c0][0]["securityContext"].pop("allowPrivilegeEscalation"),
        lambda p: p[c0][0]["securityContext"].update(capabilities={}),
        lambda p: p["securityContext"].pop("runAsNonRoot"),
        lambda p: p[c0][0]["securityContext"].update(runAsNonRoot=False),
        lambda p: p["securityContext"].update(runAsUser=0),
        lambda p: p["securityContext"].pop("seccompProfile"),
        lambda p: p["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}}),
        lambda p: p[c0].append({"name": "bare"}),
    ]
    for i, brk in enumerate(baseline_breaks):
        assert pod_security_violations({}, changed(brk), "baseline"), f"baseline break {i} not caught"
    for i, brk in enumerate(restricted_breaks):
        pod = changed(brk)
        assert pod_security_violations({}, pod, "restricted"), f"restricted break {i} not caught"
        assert not pod_security_violations({}, pod, "baseline"), f"restricted break {i} is no baseline break"


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_namespace_enforces_pod_security_and_every_pod_meets_it(overlay: str) -> None:
    """The namespace enforces ``restricted`` (pinned to the oldest supported release) and warns and audits against
    the newest rules; every pod the deployment runs (or the executor builds) meets the enforced level, so none is
    refused."""
    docs = render(overlay)
    labels = one(docs, "Namespace", NAMESPACES[overlay])["metadata"].get("labels", {})
    psa = "pod-security.kubernetes.io/"
    for mode in ("enforce", "warn", "audit"):
        assert labels.get(psa + mode) in LEVELS, f"no {psa}{mode} level: {labels}"
        assert re.fullmatch(r"latest|v1\.\d+", labels.get(f"{psa}{mode}-version", "")), f"{mode}-version: {labels}"
    level = labels[psa + "enforce"]
    assert level == "restricted", "every pod can meet restricted: enforce it"
    major_minor = ".".join(OLDEST_KUBERNETES.split(".")[:2])
    assert labels[psa + "enforce-version"] == f"v{major_minor}", "enforcement pinned, not moved by an upgrade"
    for mode in ("warn", "audit"):
        assert LEVELS.index(labels[psa + mode]) >= LEVELS.index(level), f"{mode} laxer than enforce"
        assert labels[psa + mode + "-version"] == "latest", f"{mode}: report what newer rules would refuse"
    pods = every_pod(docs)
    assert len(pods) == len(SERVICES) + 5  # the services, NATS, two templates and the two pods built from them
    for name, (meta, spec) in pods.items():
        assert pod_security_violations(meta, spec, level) == [], f"{overlay}: {name} would be refused"


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
def test_only_the_executor_and_the_operator_mount_a_service_account_token(overlay: str) -> None:
    """Only the pod-executor (pods) and the Pacer operator (PacerJobs) call the Kubernetes API; any other pod
    with a token is a credential to steal."""
    docs = render(overlay)
    sas = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    with_token = set()
    for name, pod in all_pods(docs).items():
        sa = sas.get(pod.get("serviceAccountName", "default"), {})
        # The pod's own field wins over its ServiceAccount's; Kubernetes' default is to mount.
        mounts = pod.get("automountServiceAccountToken", sa.get("automountServiceAccountToken", True))
        if mounts:
            with_token.add(name)
    assert with_token == {"Deployment/pod-executor", "Deployment/pacer-operator"}


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
