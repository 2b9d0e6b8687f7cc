"""The NATS configs of deploy/, as rendered by kustomize, run in a real nats-server.

The committed users block is what :mod:`pacer.deploy_conf` generates from
:mod:`pacer.security`; every overlay's config passes ``nats-server -t`` with
its environment filled the way the StatefulSet fills it (test passwords for
the Secret's keys); a missing password stops the server.  Then real servers:
the dev config admits a service with its password and refuses a wrong one,
and the prod config forms a three-server cluster over TLS with route
authentication, which a server with the wrong route password cannot join.
Only paths and ports are rewritten (to a temporary directory and free
loopback ports), and every rewrite must hit, so a change of the config's
shape fails here rather than passing unchecked.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
from pacer import authjwt, deploy_conf, security
from pacer import subjects as S
from pacer.contracts.jobs import JobRecord, JobState
from pacer.embedded import find_binary, free_port
from pacer.jobs.spec import parse_job_spec

from .deploy_support import (
    OVERLAYS,
    configmap,
    env_source,
    nats_container,
    needs_kubectl,
    one,
    render,
)

ROOT = Path(__file__).resolve().parents[2]
USERS_CONF = ROOT / "deploy" / "base" / "nats-users.conf"


def test_committed_users_conf_is_generated() -> None:
    """deploy/base/nats-users.conf is the output of ``python -m pacer.deploy_conf users`` (regenerate it with
    ``make deploy-conf`` when pacer.security changes)."""
    assert USERS_CONF.read_text() == deploy_conf.render_users_conf(deploy_conf.users()), (
        "deploy/base/nats-users.conf is stale: run `make deploy-conf`")


def test_generated_users_have_the_permissions_of_their_roles() -> None:
    """The block is pacer.security's, user by user, only with the passwords turned into variables."""
    roles = deploy_conf.users(["mine"])
    text = deploy_conf.render_users_conf(roles)
    entries = re.findall(r"\{user: (\"[^\"]+\"), password: \$(\w+), permissions: (\{.*\})\}$", text, re.M)
    assert len(entries) == len(roles)
    for user, var, perms in entries:
        name = json.loads(user)
        assert var == deploy_conf.password_env(name)
        assert json.loads(perms) == security.permissions(roles[name], name).to_conf()
    assert roles["policy-mine"] == "policy:mine"


def test_passwords_are_read_back_as_strings() -> None:
    """nats-server parses an all-digit variable as a number and then refuses it as a password."""
    patch = json.loads(deploy_conf.secret_patch(["a", "b", deploy_conf.ROUTE_USER]))["stringData"]
    assert set(patch) == {"a", "b", "route"} and len(set(patch.values())) == 3
    for pw in patch.values():
        assert re.fullmatch(r"[a-z][0-9a-f]{40,}", pw), pw


# --------------------------------------------------------------- the rendered configs


TEST_PASSWORDS: dict[str, str] = {}
TEST_CALLOUT = deploy_conf.callout_keys()  # what `deploy_conf callout-keys` fills pacer-auth-callout with


def secret_value(key: str, secret: str = deploy_conf.SECRET) -> str:
    """The test's stand-in for key ``key`` of the Secret pacer-nats-users (like deploy_conf's: letters+hex),
    or of pacer-auth-callout (fresh keys, as its command makes them)."""
    if secret == deploy_conf.CALLOUT_SECRET:
        return TEST_CALLOUT[key]
    assert secret == deploy_conf.SECRET, secret
    return TEST_PASSWORDS.setdefault(key, f"t{key.replace('-', '')}0{len(TEST_PASSWORDS)}x")


def container_env(docs: list[dict[str, Any]], c: dict[str, Any], pod_name: str = "") -> dict[str, str]:
    """A container's environment as the kubelet would make it: fieldRefs (the pod's name, namespace), Secret keys (test
    values), ConfigMap keys and ``$(VAR)`` expansion of earlier variables."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        src = env_source(docs, c, e["name"])
        if src is None:  # an optional ConfigMap key that is not there
            continue
        kind, value = src
        if kind == "field":
            fields = {"metadata.name": pod_name, "metadata.namespace": "pacer"}
            assert value in fields, value
            env[e["name"]] = fields[value]
        elif kind == "secret":
            env[e["name"]] = secret_value(value[1], value[0])
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)
    return env


def nats_env(docs: list[dict[str, Any]], pod_name: str) -> dict[str, str]:
    """The NATS container's environment as the kubelet would make it: fieldRefs, Secret keys (test values)
    and ``$(VAR)`` expansion of earlier variables."""
    c = nats_container(one(docs, "StatefulSet", "nats"))
    env = container_env(docs, c, pod_name)
    assert set(env) == {e["name"] for e in c["env"]}, "a variable of the NATS container did not resolve"
    return env


def rewrite(text: str, pattern: str, repl: str) -> str:
    out, n = re.subn(pattern, repl, text, flags=re.M)
    assert n >= 1, f"the config no longer has {pattern!r}: update this test"
    return out


def write_conf(docs: list[dict[str, Any]], where: Path, ports: dict[str, int], tls_dir: Path | None = None) -> Path:
    """The rendered nats-config in ``where``, with ports and paths moved there."""
    where.mkdir(parents=True, exist_ok=True)
    data = configmap(docs, "nats-config")["data"]
    for name, text in data.items():
        if name == "nats.conf":
            text = rewrite(text, r"^port: 4222$", f"port: {ports['client']}")
            text = rewrite(text, r"^http_port: 8222$", f"http_port: {ports['monitor']}")
            text = rewrite(text, r"/var/run/nats/", f"{where}/")
            text = rewrite(text, r"store_dir: /data/jetstream", f"store_dir: {where}/jetstream")
            if "cluster" in ports:
                text = rewrite(text, r"listen: 0\.0\.0\.0:6222", f"listen: 127.0.0.1:{ports['cluster']}")
            if tls_dir is not None:
                text = rewrite(text, r"/etc/nats-tls/", f"{tls_dir}/")
        (where / name).write_text(text)
    return where / "nats.conf"


def config_test(conf: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_binary(), "-c", str(conf), "-t"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def make_certs(directory: Path, days: int = 1) -> Path:
    """ca.crt, tls.crt, tls.key as cert-manager writes them into nats-server-tls, for 127.0.0.1 and localhost,
    with server and client auth (routes are mutual TLS), like deploy/components/nats-tls-cert-manager."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    (directory / "tls.key").chmod(0o600)
    return directory


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_rendered_config_passes_nats_server_config_test(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    ports = {"client": 4222, "monitor": 8222, "cluster": 6222} if OVERLAYS[overlay] > 1 else {
        "client": 4222, "monitor": 8222}
    # Certificates where the overlay's config turns TLS on (prod and its second install).
    tls_on = "/etc/nats-tls/" in "".join(configmap(docs, "nats-config")["data"].values())
    tls = make_certs(tmp_path / "tls") if tls_on else None
    conf = write_conf(docs, tmp_path / "conf", ports, tls)
    env = nats_env(docs, "nats-0")
    ok = config_test(conf, env)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    # A password the Secret lacks stops the server (the StatefulSet would not even start the container).
    missing = config_test(conf, {k: v for k, v in env.items() if k != deploy_conf.password_env("shard")})
    assert missing.returncode != 0
    assert deploy_conf.password_env("shard") in missing.stderr + missing.stdout
    # So does a missing callout issuer, and one that is not an account's public key (a seed, say).
    no_issuer = config_test(conf, {k: v for k, v in env.items() if k != deploy_conf.ISSUER_ENV})
    assert no_issuer.returncode != 0 and deploy_conf.ISSUER_ENV in no_issuer.stderr + no_issuer.stdout
    seed = config_test(conf, {**env, deploy_conf.ISSUER_ENV: TEST_CALLOUT[deploy_conf.SEED_KEY]})
    assert seed.returncode != 0 and "account nkey" in seed.stderr + seed.stdout, seed.stderr + seed.stdout


@contextmanager
def nats_servers(confs: list[tuple[Path, dict[str, str]]], logs: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = []
    try:
        for i, (conf, env) in enumerate(confs):
            LOGS.paths.append(logs / f"nats-{i}.log")
            with open(logs / f"nats-{i}.log", "wb") as log:
                procs.append(subprocess.Popen([find_binary(), "-c", str(conf)], env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def monitor(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def wait_for(check: Any, what: str, within: float = 120.0) -> Any:
    """Poll ``check`` until it is truthy; ``within`` only keeps a broken setup from hanging (a loaded
    machine starts a Python service in far more than its usual seconds), the test's timeout bounds it."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as e:  # not listening yet
            last = e
        time.sleep(0.2)
    raise AssertionError(f"{what}: last {last!r}\n{LOGS.tails()}")


class _Logs:
    """The nats-server logs of the running test, for failure messages (a port taken by another process
    between free_port() and the server's bind shows up there)."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def tails(self, lines: int = 15) -> str:
        out = []
        for p in self.paths:
            text = p.read_text(errors="replace").splitlines() if p.exists() else ["(no log)"]
            out.append(f"--- {p}:\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


LOGS = _Logs()


@pytest.fixture(autouse=True)
def _fresh_logs() -> None:
    LOGS.paths = []


async def round_trip(url: str, env: dict[str, str]) -> bytes:
    """Connect as a service does (pacer.security.connect_options), publish to its health subject and get it."""
    opts = security.connect_options(url, env)
    nc = await nats.connect(**opts, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)  # type: ignore[arg-type]
    try:
        sub = await nc.subscribe(S.health("shard"))
        await nc.publish(S.health("shard"), b"ping")
        msg = await sub.next_msg(timeout=5)
        return bytes(msg.data)
    finally:
        await nc.close()


async def store_record(url: str, rec: Any) -> None:
    """Put a job record into ``pacer-jobs`` as the job service does (``url`` carries its user)."""
    from pacer.bus import Bus
    from pacer.codec import encode

    bus = await Bus.connect(url)
    try:
        await (await bus.kv(S.JOB_BUCKET)).put(rec.job, encode(rec))
    finally:
        await bus.close()


async def refused(url: str, env: dict[str, str]) -> str:
    async def quiet(_: Exception) -> None:
        return None

    opts = security.connect_options(url, env)
    with pytest.raises(Exception) as err:
        nc = await nats.connect(**opts, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,  # type: ignore[arg-type]
                                error_cb=quiet)
        await nc.close()
    return str(err.value).lower()


@needs_kubectl
def test_dev_config_admits_a_service_with_its_password_only(tmp_path: Path) -> None:
    docs = render("dev")
    ports = {"client": free_port(), "monitor": free_port()}
    conf = write_conf(docs, tmp_path / "conf", ports)
    url = f"nats://127.0.0.1:{ports['client']}"
    with nats_servers([(conf, nats_env(docs, "nats-0"))], tmp_path):
        wait_for(lambda: monitor(ports["monitor"], "/healthz").get("status") == "ok", "nats-server healthy")
        good = {"PACER_NATS_USER": "shard", "PACER_NATS_PASSWORD": secret_value("shard")}
        assert asyncio.run(round_trip(url, good)) == b"ping"
        bad = {**good, "PACER_NATS_PASSWORD": secret_value("shard") + "x"}
        assert "authorization" in asyncio.run(refused(url, bad))
        # Another user's password is no key to this one.
        assert "authorization" in asyncio.run(refused(url, {**good, "PACER_NATS_PASSWORD": secret_value("brain")}))
        assert "authorization" in asyncio.run(refused(url, {}))


@needs_kubectl
def test_prod_config_clusters_over_tls_with_route_auth(tmp_path: Path) -> None:
    """Three servers of the prod config: TLS clients, routes between them authenticated and encrypted; a
    fourth server with the wrong route password is refused by all of them."""
    docs = render("prod")
    tls = make_certs(tmp_path / "tls")
    n = OVERLAYS["prod"]
    ports = [{"client": free_port(), "monitor": free_port(), "cluster": free_port()} for _ in range(n + 1)]
    confs = []
    for i, p in enumerate(ports):
        env = nats_env(docs, f"nats-{i}")
        for j in range(n):  # the peers' DNS names, here loopback ports
            env[f"PACER_NATS_ROUTE_{j}"] = rewrite(env[f"PACER_NATS_ROUTE_{j}"], rf"@nats-{j}\.nats-headless:6222$",
                                                   f"@127.0.0.1:{ports[j]['cluster']}")
        if i == n:  # the intruder: right client config, wrong route password
            env = {k: (re.sub(r"route:[^@]+@", "route:wrong@", v) if k.startswith("PACER_NATS_ROUTE") else v)
                   for k, v in env.items()}
        confs.append((write_conf(docs, tmp_path / f"nats-{i}", p, tls), env))
    with nats_servers(confs[:n], tmp_path):
        for p in ports[:n]:
            wait_for(lambda p=p: {r["remote_name"] for r in monitor(p["monitor"], "/routez")["routes"]}
                     == {f"nats-{j}" for j in range(n)} - {f"nats-{ports.index(p)}"}, "routes formed")
        # Routes only over TLS, both ends verified against the CA (not set in the config: nats-server's rule).
        cluster = monitor(ports[0]["monitor"], "/varz")["cluster"]
        assert cluster["tls_required"] is True and cluster["tls_verify"] is True, cluster
        wait_for(lambda: monitor(ports[0]["monitor"], "/healthz?js-enabled-only=true").get("status") == "ok",
                 "JetStream up")
        client = {"PACER_NATS_USER": "shard", "PACER_NATS_PASSWORD": secret_value("shard"),
                  "PACER_NATS_CA": str(tls / "ca.crt")}
        url = f"nats://127.0.0.1:{ports[1]['client']}"
        assert asyncio.run(round_trip(url, client)) == b"ping"
        # Without the CA the client does not speak TLS, and the server wants nothing else.
        assert asyncio.run(refused(url, {k: v for k, v in client.items() if k != "PACER_NATS_CA"}))
        log = tmp_path / "nats-0.log"
        before = len(log.read_bytes())

        def refusals() -> int:
            text = log.read_bytes()[before:].decode(errors="replace").lower()
            return text.count("authentication error") + text.count("authorization violation")

        with nats_servers(confs[n:], tmp_path / f"nats-{n}"):
            wait_for(lambda: monitor(ports[n]["monitor"], "/varz")["server_name"] == f"nats-{n}", "intruder up")
            wait_for(refusals, "the wrong route password refused by nats-0")
            assert "nats-3" not in {r["remote_name"] for r in monitor(ports[0]["monitor"], "/routez")["routes"]}
            assert monitor(ports[n]["monitor"], "/routez")["num_routes"] == 0


def test_cli_writes_the_block_and_fills_every_key_of_the_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``users --policy`` adds that policy's user; ``passwords`` covers every user the block names plus the routes."""
    out = tmp_path / "users.conf"
    assert deploy_conf.main(["users", "--policy", "mine", "-o", str(out)]) == 0
    named = set(re.findall(r'\{user: "([^"]+)"', out.read_text()))
    assert "policy-mine" in named and set(security.ROLES) <= named
    assert deploy_conf.main(["passwords", "--policy", "mine"]) == 0
    keys = set(json.loads(capsys.readouterr().out)["stringData"])
    assert keys == named | {deploy_conf.ROUTE_USER}


@needs_kubectl
def test_prod_cert_reloader_reloads_nats_when_the_certificate_is_renewed(tmp_path: Path) -> None:
    """The prod NATS pods' cert-reloader script, run as rendered (paths, its period and the binary's path
    rewritten), makes a running nats-server of the prod config serve a renewed certificate.  The renewal is
    made the way the kubelet updates a Secret volume: the directory is a symlink swapped in one step."""
    docs = render("prod")
    sts = one(docs, "StatefulSet", "nats")
    (reloader,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "cert-reloader"]
    assert reloader["command"][:2] == ["sh", "-c"]
    tls = tmp_path / "tls"
    make_certs(tmp_path / "tls-1", days=1)
    tls.symlink_to(tmp_path / "tls-1")
    ports = {"client": free_port(), "monitor": free_port(), "cluster": free_port()}
    conf = write_conf(docs, tmp_path / "conf", ports, tls)
    env = nats_env(docs, "nats-0")
    for j in range(OVERLAYS["prod"]):  # peers that are not there: this test needs one server
        env[f"PACER_NATS_ROUTE_{j}"] = f"nats://route:x@127.0.0.1:{free_port()}"
    script = reloader["command"][2]
    script = rewrite(script, r"/etc/nats-tls/", f"{tls}/")
    script = rewrite(script, r"/var/run/nats/", f"{tmp_path / 'conf'}/")
    script = rewrite(script, r"\bsleep 10\b", "sleep 0.2")
    script = rewrite(script, r"\bnats-server --signal", f"{find_binary()} --signal")
    with nats_servers([(conf, env)], tmp_path):
        before = wait_for(lambda: monitor(ports["monitor"], "/varz").get("tls_cert_not_after"), "nats-server up")
        with open(tmp_path / "reloader.log", "wb") as log:
            proc = subprocess.Popen(["sh", "-c", script], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            time.sleep(0.5)  # a few unchanged rounds: no reload without a change
            assert "reloaded" not in (tmp_path / "reloader.log").read_text()
            make_certs(tmp_path / "tls-2", days=3)
            (tmp_path / "tls-new").symlink_to(tmp_path / "tls-2")
            os.replace(tmp_path / "tls-new", tls)
            after = wait_for(lambda: (v := monitor(ports["monitor"], "/varz").get("tls_cert_not_after")) != before
                             and v, "the renewed certificate served")
            assert after > before
            assert "reloaded" in (tmp_path / "reloader.log").read_text()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        # And clients verify against the renewed CA.
        client = {"PACER_NATS_USER": "shard", "PACER_NATS_PASSWORD": secret_value("shard"),
                  "PACER_NATS_CA": str(tls / "ca.crt")}
        assert asyncio.run(round_trip(f"nats://127.0.0.1:{ports['client']}", client)) == b"ping"


# --------------------------------------------------------------- the auth callout


async def as_pod(url: str, job: str, other: str) -> tuple[bytes, list[str]]:
    """Connect with a pod's URL (its user and token in it, nothing else), round-trip a heartbeat of ``job``
    and try to forge one of ``other``: the heartbeat and the permission errors the server sent."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    opts = security.connect_options(url, {})
    nc = await nats.connect(**opts, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,  # type: ignore[arg-type]
                            error_cb=on_error)
    try:
        sub = await nc.subscribe(S.agent_heartbeat(job))
        await nc.publish(S.agent_heartbeat(job), b"hb")
        msg = await sub.next_msg(timeout=20)
        await nc.publish(S.agent_heartbeat(other), b"forged")
        await nc.flush()
        for _ in range(400):  # the server's -ERR comes back asynchronously: wait for it, not for a time
            if any("permissions violation" in e for e in errors):
                break
            await asyncio.sleep(0.05)
        return bytes(msg.data), errors
    finally:
        await nc.close()


@needs_kubectl
def test_dev_config_and_the_auth_callout_service_admit_a_jobs_pods_only(tmp_path: Path) -> None:
    """The rendered dev config in a real nats-server, the auth callout service as its Deployment runs it (its
    command and env, Secret keys filled like `deploy_conf callout-keys`), and the pod URL the executor builds
    from its own rendered env: job j1's pods are admitted as agent-j1 with j1's subjects only; a wrong token,
    another job's token and a user that is no job's agent are refused; a static service bypasses the callout."""
    from pacer_services.pod_executor import config as executor_config
    from pacer_services.pod_executor import launch

    docs = render("dev")
    ports = {"client": free_port(), "monitor": free_port()}
    conf = write_conf(docs, tmp_path / "conf", ports)
    url = f"nats://127.0.0.1:{ports['client']}"

    def service_env(deployment: str) -> dict[str, str]:
        (c,) = one(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
        env = container_env(docs, c, f"{deployment}-0")
        assert env["PACER_NATS_URL"] == "nats://nats:4222"
        return {**env, "PACER_NATS_URL": url}

    (auth_c,) = one(docs, "Deployment", "auth-callout")["spec"]["template"]["spec"]["containers"]
    assert auth_c["command"][:2] == ["python", "-m"]
    auth_env = {**os.environ, **service_env("auth-callout"), "PACER_METRICS_PORT": "0"}
    for k in ("PACER_CONTEXT", "PACER_NATS_CA", "PACER_NATS_CREDS"):
        auth_env.pop(k, None)
    # The executor, configured from its Deployment's env, builds job j1's pod URL.
    exec_env = service_env("pod-executor")
    pod_url = exec_env["PACER_POD_NATS_URL"].replace("nats://nats:4222", url)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in exec_env.items():
            mp.setenv(k, v)
        cfg = executor_config.ExecutorConfig.from_env()
    pod_cfg = launch.LaunchConfig(pod_url, agent_secret=cfg.agent_secret)
    spec = parse_job_spec("name: j1\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    rec = JobRecord("j1", spec, JobState.RUNNING, time.time(), data_path="/data/train.rec", records=10)
    creds = launch.pod_credentials(pod_cfg, rec)
    assert creds["PACER_NATS_USER"] == security.agent_user("j1")
    j1_url = security.with_credentials(launch.pod_nats_url(pod_cfg), creds["PACER_NATS_USER"],
                                       creds["PACER_NATS_PASSWORD"])

    with nats_servers([(conf, nats_env(docs, "nats-0"))], tmp_path):
        wait_for(lambda: monitor(ports["monitor"], "/healthz").get("status") == "ok", "nats-server healthy")
        # The job service's part: j1's record, which the callout checks the token's incarnation against.
        asyncio.run(store_record(security.with_credentials(url, "jobs", secret_value("jobs")), rec))
        # Without the callout service no agent gets in (nobody answers the server's request).
        assert "authorization" in asyncio.run(refused(j1_url, {}))
        LOGS.paths.append(tmp_path / "auth.log")
        with open(tmp_path / "auth.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, *auth_c["command"][1:]], env=auth_env, stdout=log,
                                    stderr=subprocess.STDOUT)
        try:
            def admitted() -> bytes | None:
                try:
                    return asyncio.run(as_pod(j1_url, "j1", "j2"))[0]
                except Exception:  # not yet subscribed: the server's request times out
                    return None

            assert wait_for(admitted, "agent-j1 admitted through the callout service") == b"hb"
            hb, errors = asyncio.run(as_pod(j1_url, "j1", "j2"))
            assert hb == b"hb"
            assert any("permissions violation" in e and S.agent_heartbeat("j2").lower() in e for e in errors), errors
            token = creds["PACER_NATS_PASSWORD"]
            claims = authjwt.parse_token(token)
            assert claims is not None and token in j1_url
            # the executor's secret is the callout's: a token of the same claims made with another is refused
            inc, exp = claims.incarnation, claims.expires
            wrong = j1_url.replace(token, authjwt.agent_token("another secret", "j1", incarnation=inc, expires=exp))
            assert "authorization" in asyncio.run(refused(wrong, {}))
            j2_token = j1_url.replace(token, authjwt.agent_token(
                TEST_CALLOUT[deploy_conf.AGENT_SECRET_KEY], "j2", incarnation=inc, expires=exp))
            assert "authorization" in asyncio.run(refused(j2_token, {}))
            assert "authorization" in asyncio.run(refused(security.with_credentials(url, "someone", token), {}))
            # A service logs in with its static password, the callout not asked.
            shard = {"PACER_NATS_USER": "shard", "PACER_NATS_PASSWORD": secret_value("shard")}
            assert asyncio.run(round_trip(url, shard)) == b"ping"
            assert proc.poll() is None, LOGS.tails()
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_callout_keys_fill_the_secret_with_a_matching_fresh_key_pair(capsys: pytest.CaptureFixture[str]) -> None:
    """``callout-keys``: the seed is an account's, the issuer NATS is given is that seed's public key, and each
    run makes new keys (a shipped or shared key would let anyone mint users)."""
    runs = []
    for _ in range(2):
        assert deploy_conf.main(["callout-keys"]) == 0
        runs.append(json.loads(capsys.readouterr().out)["stringData"])
    for keys in runs:
        assert set(keys) == {deploy_conf.SEED_KEY, deploy_conf.ISSUER_KEY, deploy_conf.AGENT_SECRET_KEY}
        pair = authjwt.KeyPair.from_seed(keys[deploy_conf.SEED_KEY])
        assert pair.prefix == authjwt.PREFIX_ACCOUNT and pair.public_key == keys[deploy_conf.ISSUER_KEY]
        assert len(keys[deploy_conf.AGENT_SECRET_KEY]) >= 32
    assert all(runs[0][k] != runs[1][k] for k in runs[0])
