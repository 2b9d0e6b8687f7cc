"""The embedded stack: nats-server plus Pacer's services as local processes.

``pacer up`` runs it in the foreground; ``pacer demo`` and the benchmarks
start it in the background.  Services are separate OS processes (as in a
cluster), each ``python -m <module>`` with ``PACER_NATS_URL`` set and, as the
bus is secured by default, its own NATS user (``PACER_NATS_USER`` /
``PACER_NATS_PASSWORD``, permissions from :mod:`pacer.security`); the pods the
executor starts get a user of their own job (``agent-<job>``, admitted by the
``auth`` service, which a secured stack with an executor always runs) and
``Stack.url`` carries the operator's ``admin`` user.

Each service gets the settings it needs and no other's secrets: the API token
only the API, the agents' token secret only the executor and ``auth``, the
auth callout's issuer seed only ``auth`` (:data:`SECRET_SETTINGS`), whether
they were given to the stack or found in the environment it was started from.

``instances`` runs a service as N processes (``Stack(instances={"controller":
2})``: ``controller-0`` and ``controller-1``, each with ``PACER_INSTANCE`` set,
which :mod:`pacer.ownership` takes as the instance's name); ``kill(key)``
SIGKILLs one process, ``restart(key)`` starts it again, ``supervise()``
restarts every process that exited (bench/chaos.py uses all three).

``start()`` returns once every service answers its health subject with
``ready``: a client that talks to the stack right after (a test, the demo)
never meets a service that is still importing (on a loaded 2-core machine
the brain takes seconds), which would be a NoResponders error or a default
plan instead of the brain's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pacer import security
from pacer.embedded import EmbeddedCluster, EmbeddedNats

# Every service of the embedded stack: name -> module to run.
SERVICES: dict[str, str] = {
    "auth": "pacer_services.auth_callout.main",  # admits each job's agents (auth callout); first: pods need it
    "shard": "pacer_services.shard_service.main",
    "monitor": "pacer_services.monitor.main",
    "jobs": "pacer_services.job_service.main",
    "executor": "pacer_services.pod_executor.main",
    "api": "pacer_services.api.main",
    "controller": "pacer_services.controller.main",
    "policies": "pacer_services.policy_service.main",
    "brain": "pacer_services.brain.main",
}

# Settings that are secrets, and the only services that get them (a service's own NATS password is
# set per service by Stack._credentials).  Anything else in the stack's environment goes to every service.
SECRET_SETTINGS: dict[str, frozenset[str]] = {
    "PACER_API_TOKEN": frozenset({"api"}),
    "PACER_AGENT_TOKEN_SECRET": frozenset({"executor", "auth"}),
    "PACER_AUTH_ISSUER_SEED": frozenset({"auth"}),
}


@dataclass
class Stack:
    data_dir: Path
    port: int = 0
    services: list[str] = field(default_factory=lambda: list(SERVICES))
    nats: EmbeddedNats | EmbeddedCluster | None = None
    # More than 1: that many clustered nats-servers on loopback (issue 13), streams and KV at
    # replicas min(cluster, 3), the services given every server's URL.  ``port`` is then unused.
    cluster: int = 1
    # More than 1 instance of a service (issue 13): ``{"controller": 2}`` runs processes ``controller-0`` and
    # ``controller-1``, each with ``PACER_INSTANCE=<name>-<i>`` (pacer.ownership names the instance by it) and
    # its own log ``<name>-<i>.log``.  A service not named runs once, as ``<name>`` (its process key and log).
    instances: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # process key -> process
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every service
    # Bus security: every service, the pods (role ``agent``) and the operator (``admin``) get a NATS
    # user of their own with the permissions of pacer.security; off, the server admits anyone.
    secure: bool = True
    passwords: dict[str, str] = field(default_factory=dict)  # user (= role) -> password
    # Custom policies admitted with a user of their own, ``policy-<name>`` (role ``policy:<name>``: its
    # decide subject only): give such a policy ``url_as("policy-<name>")``.  PACER_NATS_POLICY_USERS=a,b
    policy_users: list[str] = field(default_factory=lambda: [
        n for n in os.environ.get("PACER_NATS_POLICY_USERS", "").split(",") if n.strip()])
    # TLS with a CA of the stack's own (pacer.tls), made in <data_dir>/nats/tls on the first start; on
    # unless PACER_NATS_TLS=0.
    tls: bool = field(default_factory=lambda: os.environ.get("PACER_NATS_TLS", "1") != "0")
    ca_file: Path | None = None
    # The nats-server's HTTP monitoring port (/varz, /jsz) even when secure: benchmarks read message
    # and storage counters from it.  It is unauthenticated (pacer.embedded), so never in a deployment.
    nats_monitoring: bool = False
    _saved_ca: str | None = field(default=None, repr=False)
    # Per-job agents: the auth callout's issuer account seed and the secret of the agents' tokens
    # (made per start when the ``auth`` service is in the stack; given to it and to the executor only).
    _issuer_seed: str = field(default="", repr=False)
    _agent_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        # Pods connect only as their own job's agent user, which the auth callout admits: a secured
        # stack that runs pods runs it too (there is no user shared by every job's pods).
        if self.secure and "executor" in self.services and security.AUTH_SERVICE not in self.services:
            self.services = [security.AUTH_SERVICE, *self.services]

    @property
    def per_job_agents(self) -> bool:
        """Whether pods get per-job agent users (the bus is secured and the ``auth`` service runs)."""
        return self.secure and security.AUTH_SERVICE in self.services

    @property
    def context_file(self) -> Path:
        """The operator's context (URL, ``admin`` user and password, CA), mode 0600: ``PACER_CONTEXT``."""
        return self.data_dir / "context.json"

    @property
    def url(self) -> str:
        """The operator's URL (with the ``admin`` user's credentials when secure): CLI, tests, demo."""
        return self.url_as("admin")

    @property
    def bare_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    def url_as(self, user: str) -> str:
        """The server's URL carrying ``user``'s credentials (the bare URL when not secure)."""
        if not self.secure:
            return self.bare_url
        return security.with_credentials(self.bare_url, user, self.passwords[user])

    @property
    def api_token(self) -> str:
        """The HTTP API's bearer token: ``PACER_API_TOKEN`` if set, else generated by :meth:`start`."""
        return self.env.get("PACER_API_TOKEN") or os.environ.get("PACER_API_TOKEN", "")

    @property
    def api_token_file(self) -> Path:
        """The API token, mode 0600 (written by :meth:`start`): the dashboard's sign-in takes it, and the
        CLI reads it as ``PACER_API_TOKEN_FILE`` with ``--api``.  A token never goes into a URL."""
        return self.data_dir / "api-token"

    def dashboard_url(self, port: int | str, route: str = "") -> str:
        """The dashboard's URL (``route``: ``#/jobs/<job>``); it asks for the token on its sign-in page."""
        return f"http://127.0.0.1:{port}/" + route

    def start(self, ready_timeout: float = 120.0) -> Stack:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.api_token:  # the API refuses to run without one
            self.env["PACER_API_TOKEN"] = secrets.token_urlsafe(32)
        fd = os.open(self.api_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.api_token + "\n")
        self.api_token_file.chmod(0o600)  # also when it existed with wider rights
        authorization = ""
        if self.secure:
            roles = {role: role for role in security.ROLES}
            roles |= {f"policy-{n.strip()}": f"{security.POLICY_ROLE_PREFIX}{n.strip()}" for n in self.policy_users}
            self.passwords = {u: self.passwords.get(u) or secrets.token_urlsafe(18) for u in roles}
            callout = None
            if self.per_job_agents:
                from pacer.authjwt import PREFIX_ACCOUNT, KeyPair

                issuer = KeyPair.create(PREFIX_ACCOUNT)
                self._issuer_seed, self._agent_secret = issuer.seed, secrets.token_urlsafe(32)
                callout = security.Callout(issuer.public_key)
            authorization = security.render_authorization({u: (self.passwords[u], r) for u, r in roles.items()},
                                                          callout)
        tls = ""
        if self.tls:
            from pacer.tls import ensure_server_tls, server_tls_config

            files = ensure_server_tls(self.data_dir / "nats" / "tls")
            self.ca_file, tls = files.ca, server_tls_config(files)
            # This process's own clients (the readiness probe, `pacer up`'s CLI, a test) verify with it too,
            # until stop() restores what was set before.
            self._saved_ca = os.environ.get("PACER_NATS_CA")
            os.environ["PACER_NATS_CA"] = str(files.ca)
        # A secured server has no monitoring port (it has no authentication of its own: /connz would list
        # every user and subscription to anything on the host); readiness is probed as the operator.
        user, password = ("admin", self.passwords["admin"]) if self.secure else ("", "")
        ca = str(self.ca_file) if self.ca_file is not None else ""
        monitoring = not self.secure or self.nats_monitoring
        if self.cluster > 1:
            self.env.setdefault("PACER_REPLICAS", str(min(self.cluster, 3)))
            self.nats = EmbeddedCluster(
                store_dir=self.data_dir / "nats", size=self.cluster, authorization=authorization, tls=tls,
                monitoring=monitoring, probe_user=user, probe_password=password, probe_ca=ca).start()
        else:
            self.nats = EmbeddedNats(
                store_dir=self.data_dir / "nats", port=self.port, authorization=authorization, tls=tls,
                monitoring=monitoring, probe_user=user, probe_password=password, probe_ca=ca).start()
        if self.ca_file is not None:  # this process's clients of this server: its CA, whatever the env says
            security.trust(self.bare_url, str(self.ca_file))
        security.write_context(self.context_file, security.Context(
            url=self.bare_url, user="admin" if self.secure else "", password=self.passwords.get("admin", ""),
            ca=str(self.ca_file.resolve()) if self.ca_file is not None else ""))
        for name in self.services:
            for key in self.instance_names(name):
                self.start_service(key)
        try:
            self.wait_ready([k for n in self.services for k in self.instance_names(n)], ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, names: list[str], timeout: float = 120.0) -> None:
        """Until each service in ``names`` answers ``pacer.svc.<name>.health`` with ``ready``.

        Raises ``RuntimeError`` naming the service (and the tail of its log)
        if one exits first, ``TimeoutError`` if one is not ready in time.
        Runs its own event loop in a thread, so it works from sync and async
        callers alike.
        """
        errors: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self._await_ready(names, timeout))
            except BaseException as e:  # handed to the caller's thread
                errors.append(e)

        t = threading.Thread(target=run, name="pacer-stack-ready", daemon=True)
        t.start()
        t.join()
        if errors:
            raise errors[0]

    async def _await_ready(self, names: list[str], timeout: float) -> None:
        from pacer import subjects
        from pacer.bus import NO_RETRY, Bus
        from pacer.contracts.common import Health

        deadline = time.monotonic() + timeout
        bus = await Bus.connect(self.url, name="pacer-stack")
        try:
            for key in names:
                name = self.service_of(key)
                while True:
                    for k in ([key] if key != name else self.instance_names(name)):
                        proc = self.procs.get(k)
                        if proc is not None and proc.poll() is not None:
                            raise RuntimeError(f"service {k} exited with code {proc.returncode} while starting:\n"
                                               f"{self.log_tail(k)}")
                    if key != name:  # one instance: its own answer (the others answer the same subject)
                        if await self._instance_ready(bus, name, self.procs[key].pid):
                            break
                    else:
                        try:
                            h = await bus.request(subjects.health(name), None, Health, timeout=1.0, retry=NO_RETRY)
                            if h.status == "ready":
                                break
                        except Exception:  # not listening yet: NoResponders, timeout
                            pass
                    if time.monotonic() > deadline:
                        tail = self.log_tail(key if key != name else self.instance_names(name)[0])
                        raise TimeoutError(f"service {key} not ready within {timeout:.0f} s:\n{tail}")
                    await asyncio.sleep(0.1)
        finally:
            await bus.close()

    @staticmethod
    async def _instance_ready(bus: Any, name: str, pid: int, wait_s: float = 1.0) -> bool:
        """Whether the process ``pid`` is among the instances of ``name`` answering ``ready`` (every answer
        to one health request is read; a service's runtime names itself ``<host>-<pid>``)."""
        from pacer import subjects
        from pacer.codec import decode
        from pacer.contracts.common import Health

        me = f"{socket.gethostname()}-{pid}"
        inbox = bus.nc.new_inbox()
        sub = await bus.nc.subscribe(inbox)
        try:
            await bus.nc.publish(subjects.health(name), b"", reply=inbox)
            deadline = time.monotonic() + wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    m = await sub.next_msg(timeout=left)
                except Exception:  # no (more) answers in time
                    return False
                with contextlib.suppress(Exception):
                    h = decode(Health, m.data)
                    if h.instance == me and h.status == "ready":
                        return True
            return False
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def log_tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join((self.data_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def instance_names(self, name: str) -> list[str]:
        """The process keys of service ``name``: ``[name]`` when it runs once, else ``<name>-0`` ... ``<name>-<n-1>``."""
        n = self.instances.get(name, 1)
        if n < 1:
            raise ValueError(f"instances of {name} must be >= 1, got {n}")
        return [name] if n == 1 else [f"{name}-{i}" for i in range(n)]

    def service_of(self, key: str) -> str:
        """The service a process key belongs to (``controller-1`` -> ``controller``)."""
        if key in SERVICES:
            return key
        name, sep, index = key.rpartition("-")
        if sep and index.isdigit() and name in SERVICES and self.instances.get(name, 1) > int(index):
            return name
        raise KeyError(f"no service or instance {key!r}; services: {sorted(SERVICES)}, instances: {self.instances}")

    def start_service(self, name: str) -> subprocess.Popen[bytes]:
        """Start the process ``name``: a service (run once) or one instance of it (``<service>-<i>``)."""
        key, name = name, self.service_of(name)
        # A stable name per process: restarted by the supervisor under the same name, an instance takes
        # its own leases back at once (pacer.lease) instead of waiting out its dead incarnation's TTL.
        instance = {"PACER_INSTANCE": key}
        cores = str(os.cpu_count() or 2)
        # The brain plans within this machine (C_total = C_max = its cores) unless told otherwise.
        # Local pods start in seconds, not the minutes of a cluster's scheduling and image pulls: the
        # brain's first estimates of a re-plan's pause (DLRover-RM Eq. 8) say so until it measures them.
        # The job service opens dataset files only under where the stack was started (a spec's relative
        # paths, data/train.tsv) and its data dir (the demo's data), unless PACER_DATA_ROOTS says otherwise.
        env = {"PACER_BRAIN_CPU_QUOTA": cores, "PACER_BRAIN_NODE_CPU": cores,
               "PACER_BRAIN_WORKER_PAUSE_S": "5", "PACER_BRAIN_PS_PAUSE_S": "15",
               "PACER_DATA_ROOTS": os.pathsep.join((os.getcwd(), str(self.data_dir.resolve()))),
               **os.environ, "PACER_NATS_URL": self.bare_url, "PACER_DATA_DIR": str(self.data_dir),
               **self.env, **instance}
        for setting, services in SECRET_SETTINGS.items():
            if name not in services:
                env.pop(setting, None)
        env |= self._credentials(name)
        log = open(self.data_dir / f"{key}.log", "ab")
        try:
            proc = subprocess.Popen([sys.executable, "-m", SERVICES[name]], env=env, stdout=log, stderr=log)
        finally:
            log.close()
        self.procs[key] = proc
        return proc

    def kill(self, key: str) -> None:
        """SIGKILL the process ``key`` (a service or one instance), as a crash would, and reap it."""
        proc = self.procs[key]
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def restart(self, key: str, ready_timeout: float = 120.0) -> subprocess.Popen[bytes]:
        """Start the process ``key`` again (killing it first if it still runs); returns once it is ready.

        Ready means: this very process answers its service's health subject
        with ``ready`` (with several instances, its own answer among theirs).
        """
        if key in self.procs:
            self.kill(key)
        proc = self.start_service(key)
        self.wait_ready([key], ready_timeout)
        return proc

    def supervise(self) -> list[str]:
        """Start again every process that exited (what ``pacer up`` does); returns their keys."""
        dead = self.check()
        for key in dead:
            self.start_service(key)
        return dead

    def _credentials(self, name: str) -> dict[str, str]:
        """The service's own user (``PACER_NATS_USER``/``_PASSWORD``); the executor also gets the pods' URL."""
        out = {"PACER_NATS_CA": str(self.ca_file)} if self.ca_file is not None else {}
        if not self.secure:
            return out
        out |= {"PACER_NATS_USER": name, "PACER_NATS_PASSWORD": self.passwords[name]}
        if name == "executor" and self.per_job_agents:  # launch.py gives each job's pods their own user
            out |= {"PACER_POD_NATS_URL": self.bare_url, "PACER_AGENT_TOKEN_SECRET": self._agent_secret}
        if name == security.AUTH_SERVICE and self.per_job_agents:
            out |= {"PACER_AUTH_ISSUER_SEED": self._issuer_seed, "PACER_AGENT_TOKEN_SECRET": self._agent_secret}
        return out

    def check(self) -> list[str]:
        """Process keys (services or ``<service>-<i>`` instances) that exited."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def stop(self, timeout: float = 15.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        if self.nats is not None:
            if self.ca_file is not None:
                security.trust(self.bare_url, None)
            self.nats.stop()
        if self.ca_file is not None and os.environ.get("PACER_NATS_CA") == str(self.ca_file):
            if self._saved_ca is None:
                os.environ.pop("PACER_NATS_CA", None)
            else:
                os.environ["PACER_NATS_CA"] = self._saved_ca

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
