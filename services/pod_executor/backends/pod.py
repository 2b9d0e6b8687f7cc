"""The supervisor of one local pod: a tiny container runtime plus kubelet.

``python -m pacer_services.pod_executor.backends.pod --spec <PodSpec JSON | path> --dir <pod dir>``
is what :class:`~pacer_services.pod_executor.backends.local.LocalBackend` starts for
every pod, in a session of its own so that it outlives the executor.  It

* substitutes ``{pod_dir}`` in the trainer's and agent's argv and env values,
  starts the trainer (``spec.command``) and the agent sidecar (``spec.agent``)
  with their output in ``<dir>/trainer.log`` and ``<dir>/agent.log``, in an
  environment of the spec's variables plus the allowlisted few of its own
  (:func:`pod_base_env`: nothing of a service's settings or secrets);
  both die with the supervisor (``PR_SET_PDEATHSIG``), which is how a lost
  node looks locally;
* enforces the memory limit the way a cgroup would: every tick the RSS of the
  trainer's process tree is summed, and over ``memory_mb`` the tree is
  SIGKILLed and the exit recorded as ``OOMKilled``.  The limit can be raised
  while the pod runs, as Kubernetes' in-place pod resize does: the backend
  writes the new MiB to ``<dir>/resize`` and the supervisor applies it at
  its next tick (``status.json``'s ``memory_mb`` then says so);
* enforces the CPU limit like a CFS quota: per period (100 ms, env
  ``PACER_CPU_PERIOD_MS``) the tree may use ``cpu * period`` of CPU time; the
  excess is a debt, repaid with the tree SIGSTOPped (``PACER_CPU_LIMITS=0``
  turns this off).  Nothing is ever left stopped: SIGCONT precedes every
  SIGTERM/SIGKILL and every exit path;
* injects a CPU straggler when the pod's env has ``PACER_POD_CPU_THROTTLE``
  (``{"cpu": c, "start_s": t}``, set by the launcher from
  ``PACER_INJECT_STRAGGLERS``): from ``t`` s after the trainer started, the
  quota is ``min(cpu, c)`` (even with ``PACER_CPU_LIMITS=0``): a machine
  that turns slow under a running PS or worker;
* keeps ``<dir>/pod.json`` (the spec plus supervisor pid/create_time,
  trainer/agent pids) and ``<dir>/status.json`` (the current
  :class:`~pacer.contracts.executor.PodStatus`), each replaced atomically.

Deletion: SIGTERM to the supervisor.  It reads the grace period (seconds, a
float) from ``<dir>/delete`` if that file exists (the backend writes it just
before the signal; 10 s otherwise), sends SIGTERM to the trainer and the
agent, and SIGKILLs what is left after the grace.  When the trainer ends on
its own, the final status is written at once, then the agent gets SIGTERM
and 5 s before SIGKILL, and the supervisor exits.

Concurrency: single-threaded; the SIGTERM handler only sets a flag that the
supervision loop reads every tick.  Only the supervisor writes
``status.json`` while it lives (the backend writes it once, for ``NodeLost``,
after the supervisor is gone).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
from pacer.codec import from_dict, to_dict
from pacer.contracts.executor import EXIT_REFUSED, PodPhase, PodSpec, PodStatus

THROTTLE_ENV = "PACER_POD_CPU_THROTTLE"  # {"cpu": c, "start_s": t}: an injected CPU straggler
POD_FILE = "pod.json"
STATUS_FILE = "status.json"
DELETE_FILE = "delete"  # holds the grace period (s) of a pending delete
RESIZE_FILE = "resize"  # holds the memory limit (MiB) an in-place resize raised the pod to
DEFAULT_GRACE_S = 10.0
AGENT_GRACE_S = 5.0  # after the trainer ended on its own
OOM_REASON = "OOMKilled"
START_ERROR_REASON = "CreateContainerConfigError"  # the command could not be started (k8s: config error)
EXIT_CANNOT_START = 127  # the shell's "command not found"
TICK_S = 0.1  # memory checks and exit polling, like a kubelet's housekeeping

_PR_SET_PDEATHSIG = 1

# The executor's variables a local pod may see (a Kubernetes pod sees none of the executor's): what a
# Python and TensorFlow process needs to run as the executor does, and the agents' and telemetry
# settings.  An allowlist, never a blocklist: a setting added to a service later stays out of pods.
POD_ENV_ALLOWED = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "PACER_NATS_CA", "PACER_LOG_LEVEL", "PACER_CPU_PERIOD_MS", "PACER_CPU_LIMITS",
    "PACER_AGENT_WORKER_REPORT_S", "PACER_AGENT_REPORT_EVERY_S", "PACER_AGENT_PROBE_EVERY_S",
    "PACER_OTEL_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    # Object storage, which workers read datasets from in place (docs/data.md): the clients' own variables.
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
    "GOOGLE_APPLICATION_CREDENTIALS",
})
POD_ENV_ALLOWED_PREFIXES = ("LC_", "TF_", "OMP_", "MKL_", "KMP_", "AZURE_STORAGE_")


def pod_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a local pod inherits of ``environ`` (the executor's, the supervisor's): the allowlist only."""
    return {k: v for k, v in environ.items()
            if k in POD_ENV_ALLOWED or (k.startswith(POD_ENV_ALLOWED_PREFIXES) and k != "TF_CONFIG")}


# ---------------------------------------------------------------- files


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Replace ``path`` atomically: readers see the old or the new content, never a part.

    Readable by its owner only: a pod's spec holds its job's bus credentials.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None if it does not exist (yet) or is not an object."""
    try:
        obj = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def load_spec(arg: str) -> PodSpec:
    """``--spec``: the PodSpec as JSON, or the path of a file that holds it."""
    text = arg if arg.lstrip().startswith("{") else Path(arg).read_text()
    return from_dict(PodSpec, json.loads(text))


def substitute(value: str, pod_dir: Path) -> str:
    return value.replace("{pod_dir}", str(pod_dir))


def resolve_argv(argv: Iterable[str], pod_dir: Path) -> list[str]:
    """Substitute ``{pod_dir}``; a leading ``python`` is this interpreter (the pod's image)."""
    out = [substitute(a, pod_dir) for a in argv]
    if out and out[0] == "python":
        out[0] = sys.executable
    return out


# ---------------------------------------------------------------- process trees


def _die_with_parent(parent: int) -> Callable[[], None]:
    """preexec_fn: SIGKILL the child when the supervisor dies (a lost node loses its containers)."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class Tree:
    """The live processes of one container: its main process and all descendants."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.procs: dict[int, psutil.Process] = {pid: self.root}
        self._cpu: dict[tuple[int, float], float] = {}  # (pid, create_time) -> CPU seconds seen

    def refresh(self) -> list[psutil.Process]:
        procs: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            for p in [self.root, *self.root.children(recursive=True)]:
                procs[p.pid] = p
        # Keep processes seen before (e.g. orphaned grandchildren) while they live.
        for pid, p in self.procs.items():
            if pid not in procs and _alive(p):
                procs[pid] = p
        self.procs = procs
        return list(procs.values())

    def rss(self) -> int:
        total = 0
        for p in self.procs.values():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def cpu_used(self) -> float:
        """CPU seconds the tree used since the last call (processes that ended take theirs along)."""
        used = 0.0
        seen: dict[tuple[int, float], float] = {}
        for p in self.procs.values():
            try:
                key = (p.pid, p.create_time())
                t = p.cpu_times()
            except psutil.Error:
                continue
            now = t.user + t.system
            used += max(0.0, now - self._cpu.get(key, 0.0))
            seen[key] = now
        self._cpu = seen
        return used

    def signal(self, sig: int) -> None:
        for p in self.procs.values():
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL everything; SIGCONT first so that nothing stays stopped."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)


def _alive(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


@dataclass(slots=True)
class CpuQuota:
    """A CFS-like quota: ``cpu`` CPU-seconds per second, enforced per period by SIGSTOP/SIGCONT.

    Unused quota does not carry over (debt never goes below 0), as in CFS.
    """

    cpu: float
    debt_s: float = 0.0
    stopped_at: float | None = None
    throttled_s: float = 0.0

    def step(self, used_s: float, elapsed_s: float, now: float) -> bool | None:
        """Account one period; True: stop the tree, False: continue it, None: no change."""
        self.debt_s = max(0.0, self.debt_s + used_s - self.cpu * elapsed_s)
        if self.debt_s > 0 and self.stopped_at is None:
            self.stopped_at = now
            return True
        if self.debt_s <= 0 and self.stopped_at is not None:
            self.release(now)
            return False
        return None

    def release(self, now: float) -> None:
        if self.stopped_at is not None:
            self.throttled_s += now - self.stopped_at
            self.stopped_at = None

    def current_s(self, now: float) -> float:
        return self.throttled_s + (now - self.stopped_at if self.stopped_at is not None else 0.0)


# ---------------------------------------------------------------- supervisor


@dataclass(slots=True)
class Supervisor:
    spec: PodSpec
    dir: Path
    cpu_limits: bool = True
    cpu_period_s: float = 0.1
    term_requested: bool = False
    created_at: float = field(default_factory=time.time)
    status: PodStatus | None = None
    trainer: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    _quota: CpuQuota | None = None  # the trainer's CPU quota (the final status reports its throttled time)

    # ------------------------------------------------------------ records
    def _set_status(self, st: PodStatus) -> None:
        self.status = st
        write_json(self.dir / STATUS_FILE, to_dict(st))

    def _write_pod(self) -> None:
        me = psutil.Process()
        write_json(self.dir / POD_FILE, {
            **to_dict(self.spec),
            "supervisor_pid": me.pid,
            "supervisor_create_time": me.create_time(),
            "created_at": self.created_at,
            "trainer_pid": self.trainer.pid if self.trainer else None,
            "agent_pid": self.agent.pid if self.agent else None,
        })

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        self.term_requested = True

    def _grace_s(self) -> float:
        try:
            return max(0.0, float((self.dir / DELETE_FILE).read_text().strip()))
        except (OSError, ValueError):
            return DEFAULT_GRACE_S

    # ------------------------------------------------------------ containers
    def _start(self, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        env = {**pod_base_env(os.environ), **{k: substitute(v, self.dir) for k, v in self.spec.env.items()}}
        with open(self.dir / log_name, "ab") as log:
            return subprocess.Popen(
                resolve_argv(argv, self.dir), env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent(os.getpid()))

    def _stop_agent(self) -> None:
        if self.agent is None or self.agent.poll() is not None:
            return
        tree = Tree(self.agent.pid) if _alive_pid(self.agent.pid) else None
        with contextlib.suppress(ProcessLookupError):
            self.agent.send_signal(signal.SIGCONT)
            self.agent.send_signal(signal.SIGTERM)
        try:
            self.agent.wait(AGENT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        if tree is not None:
            tree.refresh()
            tree.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.agent.wait(AGENT_GRACE_S)

    # ------------------------------------------------------------ main
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        spec = self.spec
        base = PodStatus(
            name=spec.name, job=spec.job, node=spec.node, role=spec.role, generation=spec.generation,
            phase=PodPhase.PENDING, created_at=self.created_at, cpu=spec.cpu, memory_mb=spec.memory_mb,
            host=socket.gethostname())
        self._set_status(base)
        self._write_pod()
        if self.term_requested:  # deleted before it started
            self._set_status(replace(base, phase=PodPhase.EXITED, signal=signal.SIGTERM, finished_at=time.time()))
            return 0
        try:
            self.trainer = self._start(spec.command, "trainer.log")
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            with open(self.dir / "trainer.log", "a") as log:
                log.write(f"pod: cannot start the trainer {spec.command!r}: {exc}\n")
            self._set_status(replace(base, phase=PodPhase.EXITED, exit_code=EXIT_CANNOT_START,
                                     reason=START_ERROR_REASON, finished_at=time.time()))
            return 0
        started_at = time.time()
        if spec.agent:
            try:
                self.agent = self._start(spec.agent, "agent.log")
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                with open(self.dir / "agent.log", "a") as log:
                    log.write(f"pod: cannot start the agent {spec.agent!r}: {exc}\n")
        self._write_pod()
        self._set_status(replace(base, phase=PodPhase.RUNNING, started_at=started_at))
        tree = Tree(self.trainer.pid)
        quota = self._quota = CpuQuota(spec.cpu) if self._limit_cpu() else None
        try:
            rc, oom, peak = self._supervise(self.trainer, tree, quota)
        finally:
            tree.signal(signal.SIGCONT)
        quota = self._quota  # an injected throttle may have made one
        now = time.time()
        tree.refresh()
        tree.kill()  # the trainer's leftover descendants: its container is gone
        self._set_status(replace(
            self.status or base, phase=PodPhase.EXITED, finished_at=now,
            exit_code=rc if rc >= 0 else None, signal=-rc if rc < 0 else None,
            oom=oom, reason=OOM_REASON if oom else "", peak_rss_bytes=peak,
            cpu_throttled_s=round(quota.current_s(time.monotonic()), 3) if quota else 0.0))
        self._stop_agent()
        return 0

    def _limit_cpu(self) -> bool:
        return self.cpu_limits and 0 < self.spec.cpu < (os.cpu_count() or 1)

    def _throttle(self) -> tuple[float, float] | None:
        """(cpu, start_s) of an injected CPU straggler (:data:`THROTTLE_ENV`), or None."""
        text = self.spec.env.get(THROTTLE_ENV, "")
        if not text:
            return None
        try:
            raw = json.loads(text)
            cpu, start = float(raw["cpu"]), float(raw.get("start_s", 0.0))
        except (ValueError, KeyError, TypeError):
            print(f"pod: ignoring a bad {THROTTLE_ENV}: {text!r}", file=sys.stderr, flush=True)
            return None
        return (cpu, max(0.0, start)) if cpu > 0 else None

    def _supervise(self, trainer: subprocess.Popen[bytes], tree: Tree,
                   quota: CpuQuota | None) -> tuple[int, bool, int]:
        """Until the trainer ends: memory and CPU limits, deletion.  -> (returncode, oom, peak RSS)."""
        limit = self.spec.memory_mb * 1024 * 1024
        resized = 0.0  # mtime of the resize file last applied
        oom = False
        peak = 0
        kill_at: float | None = None
        tick = min(TICK_S, self.cpu_period_s)
        period_start = time.monotonic()
        throttle = self._throttle()
        throttle_at = period_start + throttle[1] if throttle is not None else None
        tree.cpu_used()
        refused = False  # the agent exited EXIT_REFUSED: the pod's credentials are refused for good
        while True:
            rc = trainer.poll()
            if rc is not None:
                return (EXIT_REFUSED if refused and rc != 0 else rc), oom, peak
            now = time.monotonic()
            if not refused and self.agent is not None and self.agent.poll() == EXIT_REFUSED:
                # The trainer's own connection is refused as well: it would wait for the bus for ever.
                print("pod: the agent's bus credentials were refused for good: stopping the trainer",
                      file=sys.stderr, flush=True)
                refused = True
            if throttle is not None and throttle_at is not None and now >= throttle_at and kill_at is None:
                throttle_at = None  # once: the machine has turned slow
                if quota is None:
                    quota = CpuQuota(throttle[0])
                    self._quota = quota
                    tree.cpu_used()
                    period_start = now
                quota.cpu = min(quota.cpu, throttle[0])
            if (self.term_requested or refused) and kill_at is None:
                kill_at = now + self._grace_s()
                if quota is not None:  # no throttling during the grace: let it shut down
                    quota.release(now)
                    quota = None
                tree.signal(signal.SIGCONT)
                with contextlib.suppress(ProcessLookupError):
                    trainer.send_signal(signal.SIGTERM)
                if self.agent is not None and self.agent.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        self.agent.send_signal(signal.SIGTERM)
            grown = self._resized(resized)
            if grown is not None:
                resized, mb = grown
                limit = mb * 1024 * 1024
                if self.status is not None:
                    self._set_status(replace(self.status, memory_mb=mb))
            tree.refresh()
            if kill_at is not None and now >= kill_at:
                tree.kill()
                if self.agent is not None and self.agent.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        self.agent.kill()
            rss = tree.rss()
            peak = max(peak, rss)
            if limit > 0 and rss > limit and not oom:
                oom = True
                tree.kill()
                if quota is not None:
                    quota.release(now)
                    quota = None
            if quota is not None and now - period_start >= self.cpu_period_s * 0.99:
                change = quota.step(tree.cpu_used(), now - period_start, now)
                period_start = now
                if change is True:
                    tree.signal(signal.SIGSTOP)
                elif change is False:
                    tree.signal(signal.SIGCONT)
                self._publish_throttled(quota, now)
            time.sleep(tick)

    def _resized(self, seen: float) -> tuple[float, int] | None:
        """(mtime, MiB) of an in-place resize newer than ``seen`` (:data:`RESIZE_FILE`), or None."""
        path = self.dir / RESIZE_FILE
        try:
            mtime = path.stat().st_mtime
            if mtime == seen:
                return None
            mb = int(path.read_text().strip())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            print(f"pod: ignoring a bad {RESIZE_FILE} file: {exc}", file=sys.stderr, flush=True)
            return None
        return (mtime, mb) if mb > 0 else None

    def _publish_throttled(self, quota: CpuQuota, now: float) -> None:
        """Update status.json when the throttled time grew by a second (observability while running)."""
        value = round(quota.current_s(now), 1)
        if self.status is not None and value - self.status.cpu_throttled_s >= 1.0:
            self._set_status(replace(self.status, cpu_throttled_s=value))


def _alive_pid(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pacer-pod", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--spec", required=True, help="the PodSpec as JSON, or a path to a file holding it")
    ap.add_argument("--dir", required=True, type=Path, help="the pod's directory ({pod_dir})")
    args = ap.parse_args(argv)
    period_ms = float(os.environ.get("PACER_CPU_PERIOD_MS", "100"))
    sup = Supervisor(
        spec=load_spec(args.spec), dir=args.dir.resolve(),
        cpu_limits=os.environ.get("PACER_CPU_LIMITS", "1") != "0",
        cpu_period_s=max(0.01, period_ms / 1000.0))
    sup.dir.mkdir(parents=True, exist_ok=True)
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
