"""The embedded stack: nats-server plus Pacer's services as local processes.

``pacer up`` runs it in the foreground; ``pacer demo`` and the benchmarks
start it in the background.  Services are separate OS processes (as in a
cluster), each ``python -m <module>`` with ``PACER_NATS_URL`` set.

``start()`` returns once every service answers its health subject with
``ready``: a client that talks to the stack right after (a test, the demo)
never meets a service that is still importing (on a loaded 2-core machine
the brain takes seconds), which would be a NoResponders error or a default
plan instead of the brain's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pacer.embedded import EmbeddedNats

# Every service of the embedded stack: name -> module to run.
SERVICES: dict[str, str] = {
    "shard": "pacer_services.shard_service.main",
    "monitor": "pacer_services.monitor.main",
    "jobs": "pacer_services.job_service.main",
    "executor": "pacer_services.pod_executor.main",
    "api": "pacer_services.api.main",
    "controller": "pacer_services.controller.main",
    "policies": "pacer_services.policy_service.main",
    "brain": "pacer_services.brain.main",
}


@dataclass
class Stack:
    data_dir: Path
    port: int = 0
    services: list[str] = field(default_factory=lambda: list(SERVICES))
    nats: EmbeddedNats | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every service

    @property
    def url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    def start(self, ready_timeout: float = 120.0) -> Stack:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.nats = EmbeddedNats(store_dir=self.data_dir / "nats", port=self.port).start()
        for name in self.services:
            self.start_service(name)
        try:
            self.wait_ready(self.services, ready_timeout)
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
            for name in names:
                while True:
                    proc = self.procs.get(name)
                    if proc is not None and proc.poll() is not None:
                        raise RuntimeError(f"service {name} exited with code {proc.returncode} while starting:\n"
                                           f"{self.log_tail(name)}")
                    try:
                        h = await bus.request(subjects.health(name), None, Health, timeout=1.0, retry=NO_RETRY)
                        if h.status == "ready":
                            break
                    except Exception:  # not listening yet: NoResponders, timeout
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"service {name} not ready within {timeout:.0f} s:\n{self.log_tail(name)}")
                    await asyncio.sleep(0.1)
        finally:
            await bus.close()

    def log_tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join((self.data_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start_service(self, name: str) -> subprocess.Popen[bytes]:
        cores = str(os.cpu_count() or 2)
        # The brain plans within this machine (C_total = C_max = its cores) unless told otherwise.
        # Local pods start in seconds, not the minutes of a cluster's scheduling and image pulls: the
        # brain's first estimates of a re-plan's pause (DLRover-RM Eq. 8) say so until it measures them.
        env = {"PACER_BRAIN_CPU_QUOTA": cores, "PACER_BRAIN_NODE_CPU": cores,
               "PACER_BRAIN_WORKER_PAUSE_S": "5", "PACER_BRAIN_PS_PAUSE_S": "15",
               **os.environ, "PACER_NATS_URL": self.url, "PACER_DATA_DIR": str(self.data_dir), **self.env}
        log = open(self.data_dir / f"{name}.log", "ab")
        try:
            proc = subprocess.Popen([sys.executable, "-m", SERVICES[name]], env=env, stdout=log, stderr=log)
        finally:
            log.close()
        self.procs[name] = proc
        return proc

    def check(self) -> list[str]:
        """Names of services that exited."""
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
            self.nats.stop()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
