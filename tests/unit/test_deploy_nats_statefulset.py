"""The NATS StatefulSet of each overlay: replicas, Services, JetStream on a PVC, lame duck, routes; prod's anti-affinity.
(How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import re

import pytest

from .deploy_support import (
    OVERLAYS,
    SIDECARS,
    configmap,
    env_of,
    nats_conf_blocks,
    nats_container,
    needs_kubectl,
    one,
    render,
)

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
