"""The local-process backend: every pod is a supervisor process on this machine.

Pods live in ``<root>/<job>/<pod name>/``, each directory readable by its
owner only (0700; ``spec.json`` and ``pod.json`` hold the job's bus
credentials and are 0600).  :meth:`LocalBackend.create`
writes ``spec.json`` there and starts ``python -m
pacer_services.pod_executor.backends.pod`` (see :mod:`.pod`) in a new session, so
pods outlive the executor: a new :class:`LocalBackend` over the same root
adopts them, because everything it knows is read back from the pod
directories (``pod.json``, ``status.json``), never kept only in memory.

A pod whose supervisor is gone without a final status was killed from
outside (the local picture of a lost node): it is reported ``exited`` with
reason ``NodeLost`` and signal 9, and that status is written to its
directory so that it stays stable.

Concurrency: the methods are coroutines of one event loop; directory scans
and psutil calls run in a worker thread (``asyncio.to_thread``).  Several
``watch`` generators may run at once; each polls every ``poll_s``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
from pacer.codec import from_dict, to_dict
from pacer.contracts.executor import MachineInfo, PodPhase, PodSpec, PodStatus
from pacer.errors import Conflict, DecodeError, NotFound, PacerError, Unavailable
from pacer.trainer.cluster import ClusterDesc
from pacer_services.pod_executor.backends.pod import (
    DELETE_FILE,
    POD_FILE,
    RESIZE_FILE,
    STATUS_FILE,
    pod_base_env,
    read_json,
    write_json,
)

log = logging.getLogger(__name__)

SPEC_FILE = "spec.json"
SUPERVISOR_LOG = "supervisor.log"
NODE_LOST = "NodeLost"
START_TIMEOUT_S = 30.0  # a supervisor writes pod.json within ~0.2 s
STALE_CREATE_S = 60.0  # a dir with spec.json but no pod.json this old: its create was interrupted
CONTAINERS = ("trainer", "agent")


class LocalBackend:
    """Pods as local supervisor processes under ``root`` (see the module docstring)."""

    name = "local"
    reserves_capacity = False

    def __init__(self, root: Path, poll_s: float = 0.2) -> None:
        self.root = Path(root)
        self.poll_s = poll_s
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        self._children: dict[str, subprocess.Popen[bytes]] = {}  # supervisors we started, to reap

    # ------------------------------------------------------------ pods
    async def create(self, pod: PodSpec) -> None:
        d = self._dir(pod)
        if self._find(pod.name) is not None:
            raise Conflict(f"pod {pod.name} exists")
        try:
            d.parent.mkdir(mode=0o700, exist_ok=True)
            d.mkdir(mode=0o700)
        except FileExistsError:
            raise Conflict(f"pod {pod.name} exists") from None
        write_json(d / SPEC_FILE, to_dict(pod))
        proc = await asyncio.to_thread(_spawn_supervisor, d)
        self._children[pod.name] = proc
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (d / POD_FILE).exists():
            if proc.poll() is not None:
                text = _tail(d / SUPERVISOR_LOG, 20)
                shutil.rmtree(d, ignore_errors=True)
                self._children.pop(pod.name, None)
                raise PacerError(f"pod {pod.name}: the supervisor exited with {proc.returncode}: {text}")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                shutil.rmtree(d, ignore_errors=True)
                self._children.pop(pod.name, None)
                raise Unavailable(f"pod {pod.name}: the supervisor did not start within {START_TIMEOUT_S}s")
            await asyncio.sleep(0.02)

    async def delete(self, name: str, grace_s: float = 10.0) -> None:
        """Write the grace to ``<pod dir>/delete``, then SIGTERM the supervisor."""
        d = self._find(name)
        if d is None:
            return
        meta = read_json(d / POD_FILE)
        st = read_json(d / STATUS_FILE)
        if meta is None or (st is not None and st.get("phase") == PodPhase.EXITED.value):
            return
        sup = _supervisor(meta)
        if sup is None:
            return
        _write_text(d / DELETE_FILE, str(grace_s))
        with contextlib.suppress(psutil.Error):
            sup.send_signal(signal.SIGTERM)

    async def resize(self, name: str, memory_mb: int) -> None:
        """Write the new limit to ``<pod dir>/resize`` and wait until the supervisor applied it.

        The supervisor reads it at its next tick, as a kubelet applies a pod
        resize (:mod:`.pod`); an exited pod (or one whose supervisor is gone)
        cannot grow: :class:`~pacer.errors.Conflict`.
        """
        if memory_mb <= 0:
            raise Conflict(f"pod {name}: memory must be positive, not {memory_mb} MiB")
        d = self._find(name)
        if d is None:
            raise NotFound(f"pod {name} does not exist")
        deadline = time.monotonic() + START_TIMEOUT_S
        _write_text(d / RESIZE_FILE, str(int(memory_mb)))
        while True:
            st = await asyncio.to_thread(self._status, d)
            if st is None or st.phase is PodPhase.EXITED:
                raise Conflict(f"pod {name} has exited: its memory cannot grow")
            if st.memory_mb == memory_mb and st.phase is PodPhase.RUNNING:
                return
            if time.monotonic() > deadline:
                raise Unavailable(f"pod {name}: the resize to {memory_mb} MiB was not applied "
                                  f"within {START_TIMEOUT_S}s")
            await asyncio.sleep(0.05)

    async def list(self, job: str | None = None) -> builtins.list[PodStatus]:
        return await asyncio.to_thread(self._scan, job)

    async def watch(self) -> AsyncIterator[PodStatus]:
        """Every known pod once, then each change of (phase, exit); polls every ``poll_s``."""
        seen: dict[str, tuple[Any, ...]] = {}
        while True:
            try:
                statuses = await self.list()
            except asyncio.CancelledError:
                raise
            except Exception:  # loop boundary: a bad scan must not end the watch
                log.exception("local backend: listing pods failed")
                await asyncio.sleep(self.poll_s)
                continue
            names = set()
            for st in statuses:
                names.add(st.name)
                key = (st.phase, st.exit_code, st.signal, st.reason, st.oom)
                if seen.get(st.name) != key:
                    seen[st.name] = key
                    yield st
            for gone in set(seen) - names:
                del seen[gone]
            await asyncio.sleep(self.poll_s)

    async def logs(self, name: str, tail: int = 200, container: str = "trainer") -> str:
        if container not in CONTAINERS:
            raise PacerError(f"unknown container {container!r} (trainer | agent)", code="invalid")
        d = self._find(name)
        if d is None:
            return ""
        return await asyncio.to_thread(_tail, d / f"{container}.log", tail)

    async def forget(self, name: str) -> None:
        """Remove an exited pod's directory; unknown names are ignored; a live pod is a Conflict."""
        d = self._find(name)
        if d is None:
            return
        st = await asyncio.to_thread(self._status, d)
        if st is not None and st.phase is not PodPhase.EXITED:
            raise Conflict(f"pod {name} is {st.phase.value}; delete it first")
        meta = read_json(d / POD_FILE)
        sup = _supervisor(meta) if meta is not None else None
        if sup is not None:  # still stopping the agent: its children die with it (PDEATHSIG)
            with contextlib.suppress(psutil.Error):
                sup.kill()
        proc = self._children.pop(name, None)
        if proc is not None:
            await asyncio.to_thread(proc.wait)
        await asyncio.to_thread(shutil.rmtree, d, True)

    # ------------------------------------------------------------ cluster
    def cluster(self, job: str, num_ps: int, max_workers: int) -> ClusterDesc:
        """Free loopback ports, picked now: the executor keeps them in its job record."""
        return ClusterDesc.local(num_ps, max_workers)

    def pod_port(self, cluster: ClusterDesc, role: str, index: int) -> int:
        addrs = cluster.ps if role == "ps" else cluster.workers
        return int(addrs[index].rsplit(":", 1)[1])

    async def release(self, job: str, shm: Path = Path("/dev/shm")) -> None:
        """Remove the job's flash checkpoints from shared memory (RAM); their disk copies stay.

        The chief's checkpointer is named ``<job>-chief`` (pacer.trainer.worker), its
        slots ``pacer-flash-<job>-chief.A|B`` (pacer.trainer.flashckpt).
        """
        def remove() -> None:
            for f in shm.glob(f"pacer-flash-{job}-chief.*"):
                with contextlib.suppress(OSError):
                    f.unlink()

        await asyncio.to_thread(remove)

    def capacity(self) -> tuple[float, int]:
        """This machine's CPUs and memory: every local pod shares them."""
        return float(os.cpu_count() or 1), int(psutil.virtual_memory().total // (1 << 20))

    async def machines(self) -> builtins.list[MachineInfo]:
        """This host, whole: local pods' limits reserve nothing, so everything counts as free.

        ``held_*`` still says what each job's live pods are limited to here.  Placement is
        ignored locally (:attr:`PodSpec.machine`): with one machine there is nothing to choose.
        """
        try:
            pods = await self.list()
        except Exception:  # a failed scan leaves the machine without its jobs, not unknown
            log.exception("local backend: listing pods for the machine report failed")
            pods = []
        held_cpu: dict[str, float] = {}
        held_mem: dict[str, int] = {}
        for p in pods:
            if p.phase is not PodPhase.EXITED:
                held_cpu[p.job] = held_cpu.get(p.job, 0.0) + p.cpu
                held_mem[p.job] = held_mem.get(p.job, 0) + p.memory_mb
        cpu, mem = self.capacity()
        return [MachineInfo(socket.gethostname(), cpu, mem, cpu, mem, held_cpu, held_mem)]

    async def close(self) -> None:
        """Forget the supervisor handles (pods keep running; Python reaps them later)."""
        for name, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[name]
        self._children.clear()

    # ------------------------------------------------------------ internals
    def _dir(self, pod: PodSpec) -> Path:
        return self.root / pod.job / pod.name

    def _find(self, name: str) -> Path | None:
        for job in self._jobs():
            d = job / name
            if d.is_dir():
                return d
        return None

    def _jobs(self) -> builtins.list[Path]:
        try:
            return [p for p in self.root.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return []

    def _scan(self, job: str | None) -> builtins.list[PodStatus]:
        for name, proc in list(self._children.items()):  # reap exited supervisors (no zombies)
            if proc.poll() is not None:
                del self._children[name]
        jobs = [self.root / job] if job is not None else self._jobs()
        out: builtins.list[PodStatus] = []
        for j in jobs:
            try:
                dirs = sorted(p for p in j.iterdir() if p.is_dir())
            except (FileNotFoundError, NotADirectoryError):
                continue
            for d in dirs:
                try:
                    st = self._status(d)
                except (DecodeError, OSError) as exc:
                    log.warning("local backend: unreadable pod dir %s: %s", d, exc)
                    continue
                if st is not None:
                    out.append(st)
        return out

    def _status(self, d: Path) -> PodStatus | None:
        """One pod's status from its directory (see the module docstring for NodeLost)."""
        meta = read_json(d / POD_FILE)
        if meta is None:
            return self._unstarted(d)
        raw = read_json(d / STATUS_FILE)
        st = from_dict(PodStatus, raw) if raw is not None else _pending(from_dict(PodSpec, meta), meta)
        if st.phase is PodPhase.EXITED:
            return st
        if _supervisor(meta) is not None:
            return st
        # The supervisor is gone: its last words may have landed since we read them.
        raw = read_json(d / STATUS_FILE)
        if raw is not None:
            st = from_dict(PodStatus, raw)
            if st.phase is PodPhase.EXITED:
                return st
        lost = replace(st, phase=PodPhase.EXITED, exit_code=None, signal=signal.SIGKILL,
                       reason=NODE_LOST, finished_at=time.time())
        write_json(d / STATUS_FILE, to_dict(lost))
        return lost

    def _unstarted(self, d: Path) -> PodStatus | None:
        """A pod being created (spec.json, no pod.json yet), or one whose create was interrupted."""
        raw = read_json(d / SPEC_FILE)
        if raw is None:
            return None
        spec = from_dict(PodSpec, raw)
        try:
            created = (d / SPEC_FILE).stat().st_mtime
        except FileNotFoundError:
            return None
        st = _pending(spec, {"created_at": created})
        if spec.name in self._children or time.time() - created < STALE_CREATE_S:
            return st
        return replace(st, phase=PodPhase.EXITED, signal=signal.SIGKILL, reason=NODE_LOST,
                       finished_at=time.time())


def _spawn_supervisor(d: Path) -> subprocess.Popen[bytes]:
    """``pod.py`` in a session of its own: it must outlive us (and our process group's signals)."""
    with open(d / SUPERVISOR_LOG, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pacer_services.pod_executor.backends.pod",
             "--spec", str(d / SPEC_FILE), "--dir", str(d)],
            env=pod_base_env(os.environ),  # nothing of the executor's settings and secrets
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _pending(spec: PodSpec, meta: dict[str, Any]) -> PodStatus:
    return PodStatus(
        name=spec.name, job=spec.job, node=spec.node, role=spec.role, generation=spec.generation,
        phase=PodPhase.PENDING, created_at=float(meta.get("created_at") or 0.0), cpu=spec.cpu,
        memory_mb=spec.memory_mb, host=socket.gethostname())


def _supervisor(meta: dict[str, Any]) -> psutil.Process | None:
    """The pod's supervisor if it still runs (same pid *and* start time; a zombie is dead)."""
    try:
        p = psutil.Process(int(meta["supervisor_pid"]))
        if abs(p.create_time() - float(meta["supervisor_create_time"])) > 0.05:
            return None  # the pid was reused
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.Error, KeyError, TypeError, ValueError):
        return None


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a text file (read from the end: logs can be large)."""
    if lines <= 0:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            block = 64 * 1024
            pos = end
            data = b""
            while pos > 0 and data.count(b"\n") <= lines:
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace")
    parts = text.splitlines(keepends=True)
    return "".join(parts[-lines:])


def reap_pods(root: str | os.PathLike[str]) -> int:
    """Kill every local pod (supervisor and trainer) whose command names a path under ``root``; how many.

    A local pod lives in a session of its own so that it outlives the
    executor (crash safety); a test or a chaos run that ends before its job
    is torn down would otherwise leave TensorFlow processes running.
    """
    import psutil

    where, reaped = os.fspath(root), 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "pacer_services.pod_executor.backends.pod" not in cmd or not any(where in a for a in cmd):
            continue
        with contextlib.suppress(psutil.Error):
            for child in p.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            p.kill()
            reaped += 1
    return reaped
