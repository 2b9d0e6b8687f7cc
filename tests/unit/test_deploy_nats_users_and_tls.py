"""NATS users, the auth callout's keys and TLS in every overlay: each client logs in as its own user with its Secret's
password, secrets ship empty, prod runs TLS with a cert-manager certificate naming every host.
(How these tests render the overlays: deploy_support.)"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from .deploy_support import (
    OVERLAYS,
    SERVICES,
    built_pod,
    configmap,
    crd_objects,
    env_of,
    env_source,
    nats_conf_blocks,
    nats_container,
    needs_kubectl,
    one,
    render,
)

# --------------------------------------------------------------- NATS users and TLS

USERS_SECRET = "pacer-nats-users"
CALLOUT_SECRET = "pacer-auth-callout"
TLS_SECRET = "nats-server-tls"


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
    their job's user, and its token from the job's own Secret, which the executor makes
    (tests/unit/test_deploy_nats.py runs the token through the callout)."""
    docs = render(overlay)
    users = conf_users(nats_conf_text(docs))
    assert users, "no users in the NATS config"
    seen: dict[str, str] = {}
    for name, (_, c) in nats_clients(docs).items():
        if name.startswith("training"):  # built for job j
            assert env_source(docs, c, "PACER_NATS_CREDS") is None, name
            assert env_source(docs, c, "PACER_NATS_USER") == ("value", "agent-j"), name
            kind, (secret, key) = env_source(docs, c, "PACER_NATS_PASSWORD") or ("", ("", ""))
            assert kind == "secret" and key == "password", name
            assert secret.startswith("j-agent-"), f"{name}: {secret} would serve every job's pods"
            assert not any(d["kind"] == "Secret" and d["metadata"]["name"] == secret for d in docs), secret
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
