"""The agent sidecar service: reports its trainer, elects a primary, runs synchronised actions.

One agent runs beside each TF PS/worker process (its *trainer*) and talks to
it through :mod:`pacer.agent.ipc`.  Every agent:

* publishes :class:`AgentMetrics` every k trainer steps (exact windows of k
  step records; fewer when k take longer than ``worker_report_s`` at the
  last BPT, and a window open that long closes with the steps it has:
  :mod:`pacer.agent.reporting`), and a :class:`Heartbeat` when it has said nothing else for
  ``heartbeat_s`` or its trainer's liveness or the primary flag changed
  (:func:`pacer.agent.reporting.heartbeat_due`): peers and the monitor take
  any message of an agent as a sign of life, so each is heard at least every
  ``heartbeat_s`` with fewer messages than a fixed beat (half, for an agent
  that reports every 2 s; none while windows come every second or faster);
* answers the two-phase barrier of global actions (``pacer.agent.<job>.
  prepare|commit|abort``) by arming, committing or releasing the barrier in
  its trainer's IPC;
* serves node commands addressed to it (``pacer.rpc.agent.<job>.<node>.
  command``): the action is written for the trainer's next iteration, no
  barrier.

One agent per job is *primary* (AntDT section V-F): it holds the JetStream
KV key ``<job>.primary`` in bucket ``pacer-agents`` (compare-and-set with a
per-message TTL rounded up to whole seconds, refreshed every TTL/3; others
try to create it every TTL/3, so a dead primary is replaced within ~1.3 TTL;
a primary that cannot refresh for 2/3 TTL steps down) and alone subscribes
to ``pacer.rpc.agent.<job>.global_action``.  For each global action it picks
a target iteration T ahead of every live worker, prepares everyone, commits
if all vote yes and otherwise aborts and retries with a larger T.

Concurrency contract: everything runs on one event loop.  Global actions are
run one at a time (a lock on the primary).  NATS callbacks only decode, touch
the IPC (microseconds, plus a 1 ms settle in ``prepare``) and reply; the
loops (poll, heartbeat, election) run under :func:`pacer.runtime.guard`.
The pure decisions (target iteration, membership) are the functions at the
top of this module.

Servers (role ``ps``): a TF parameter server runs no Python per request,
so it has no step records and no hook to time what it serves.  Its agent
measures it from outside instead: every ``probe_every_s`` it sends the PS
one small real TF RPC (``tensorflow.WorkerService/GetStatus`` over gRPC, to
``--probe host:port``) and times the answer, which waits behind whatever
the server is doing and for every moment it is throttled off its CPU.  Every
``report_every_s`` it publishes an :class:`AgentMetrics` with ``role="ps"``
whose ``bpt_s`` is the mean probe latency over the report (``steps`` = the
probes answered; a probe that times out counts as the timeout), plus the PS
process's CPU and RSS; ``samples_per_s`` is 0 (a PS trains no samples).  A
PS agent takes no part in the election or the barrier (it has nothing that
iterates).  The PS process is the pid in the IPC file (the built-in PS
attaches only to write it) or else the process listening on the probe's
port, so a user's ``ps_command`` that never attaches is still measured, and
its agent heart-beats whatever happens (``trainer_alive`` then says whether
that process was found).  Without ``grpcio`` (an image without the
``[trainer]`` extra) or without ``--probe`` only CPU and RSS are reported
(``bpt_s`` 0: nothing for the monitor to compare).

The agent finds its trainer's liveness, CPU and RSS through the pid the
trainer writes into the IPC file, so on Kubernetes the pod needs
``shareProcessNamespace: true`` (the IPC file itself goes on a shared
``emptyDir`` with ``medium: Memory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import nats.errors
import nats.js.errors
import psutil
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind

from pacer import subjects, tracing
from pacer.agent import bucket
from pacer.agent.ipc import PAYLOAD_CAP, AgentIPC, IPCError, StepRecord
from pacer.agent.reporting import heartbeat_due, window_overdue, window_steps
from pacer.bus import Bus
from pacer.codec import decode, encode
from pacer.contracts.agent import (
    GLOBAL_KINDS,
    Abort,
    Ack,
    ActionKind,
    ActionResult,
    AgentMetrics,
    Commit,
    GlobalAction,
    Heartbeat,
    NodeCommand,
    Prepare,
    PrimaryRecord,
    Vote,
)
from pacer.errors import DecodeError, PacerError, ValidationError
from pacer.runtime import guard
from pacer.telemetry import Counters

log = logging.getLogger("pacer.agent")
T = TypeVar("T")

#: Roles whose trainers iterate and therefore take part in global actions.
STEPPING_ROLES = frozenset({"worker", "chief"})
_WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream codes of a failed compare-and-set (10164: 2.12+, a cluster)


# ====================================================================== pure decisions


def margin_iterations(min_bpt_s: float, lead_s: float, min_margin: int = 3) -> int:
    """Iterations between the fastest worker and T: enough for ``lead_s`` of its steps.

    ``ceil(lead_s / min_bpt) + 2``, at least ``min_margin``; an unknown BPT
    (<= 0) is taken as 1 ms (a fast trainer: a generous margin).
    """
    bpt = min_bpt_s if min_bpt_s > 0 else 0.001
    return max(min_margin, math.ceil(lead_s / bpt) + 2)


def estimate_iteration(reported: int, age_s: float, bpt_s: float) -> int:
    """Where a trainer that reported ``reported`` ``age_s`` ago is now, stepping every ``bpt_s``."""
    if bpt_s <= 0 or age_s <= 0:
        return reported
    return reported + int(age_s / bpt_s)


def pick_target(
    estimates: Mapping[str, int], bpts: Iterable[float], lead_s: float, attempt: int, floor: int = -1, min_margin: int = 3,
    committed: int = -1,
) -> int:
    """Target iteration T of a two-phase attempt (1-based); doubles the margin on each retry.

    T = max(max(estimated iterations, ``floor``) + margin * 2**(attempt-1), ``committed``), where
    ``floor`` is the highest iteration seen in the previous attempt's votes and ``committed`` the
    highest T the primary committed before.  The estimates are extrapolated (a fresh heartbeat can
    lower them) and the margin shrinks as steps slow down, so without ``committed`` a later action
    could land before an earlier one; the trainers apply by (T, arrival), so an older ADJUST_BS
    would then undo a newer one.
    """
    known = [b for b in bpts if b > 0]
    margin = margin_iterations(min(known) if known else 0.0, lead_s, min_margin)
    base = max([*estimates.values(), floor, 0])
    return max(base + (margin << (attempt - 1)), committed)


@dataclass
class Member:
    """What the agents of a job know of one another (from heartbeats and metrics)."""

    node: str
    role: str
    seen: float  # monotonic time of the newest message
    iteration: int = -1
    bpt_s: float = 0.0
    at: float = 0.0  # monotonic time the iteration was reported
    trainer_alive: bool = False
    primary: bool = False


def participants(members: Mapping[str, Member], now: float, ttl_s: float, exclude: Iterable[str] = ()) -> list[str]:
    """Nodes that take part in a global action: stepping roles, heard within ``ttl_s``, trainer alive."""
    ex = set(exclude)
    return sorted(
        m.node
        for m in members.values()
        if m.role in STEPPING_ROLES and m.trainer_alive and now - m.seen <= ttl_s and m.node not in ex
    )


def _beat_state(hb: Heartbeat) -> tuple[bool, int, bool]:
    """What only a heartbeat says (a change of it is sent at once: heartbeat_due)."""
    return hb.trainer_alive, hb.trainer_pid, hb.primary


def window_metrics(window: list[StepRecord], before: StepRecord | None) -> tuple[float, float]:
    """(mean BPT, samples/s) of k consecutive step records; ``before`` is the record preceding them."""
    bpt = sum(r.bpt_s for r in window) / len(window)
    samples = sum(r.samples for r in window)
    if before is not None and window[-1].wall_ts > before.wall_ts:
        span = window[-1].wall_ts - before.wall_ts
    else:
        span = sum(r.bpt_s for r in window)
    return bpt, (samples / span if span > 0 else 0.0)


def _host_port(target: str) -> tuple[str, int] | None:
    host, _, port = target.rpartition(":")
    return (host, int(port)) if host and port.isdigit() and 0 < int(port) < 65536 else None


@dataclass(frozen=True, slots=True)
class ProbeWindow:
    """What a PS agent saw between two reports (pure: :meth:`ServerProbe.take` makes one)."""

    latency_s: float  # mean over the answered probes (0: none answered)
    answered: int
    failed: int  # not answered at all (the server was not up): not a latency


def probe_window(latencies: list[float], failed: int) -> ProbeWindow:
    return ProbeWindow(sum(latencies) / len(latencies) if latencies else 0.0, len(latencies), failed)


class ServerProbe:
    """Times one small TF RPC to a parameter server (blocking: call it from a thread).

    ``GetStatus`` is the cheapest call every TF server answers (it lists the
    server's devices); its bytes are neither built nor parsed here, so the
    probe needs ``grpcio`` but not TensorFlow.
    """

    METHOD = "/tensorflow.WorkerService/GetStatus"

    def __init__(self, target: str, timeout_s: float) -> None:
        import grpc  # an optional dependency (the [trainer] extra); the caller handles ImportError

        self._grpc = grpc
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(target)
        self._call = self._channel.unary_unary(self.METHOD, request_serializer=None, response_deserializer=None)

    def once(self) -> float | None:
        """Seconds the server took to answer; the timeout if it did not in time; None if it is not up."""
        t0 = time.perf_counter()
        try:
            self._call(b"", timeout=self.timeout_s)
        except self._grpc.RpcError as exc:
            if exc.code() is self._grpc.StatusCode.DEADLINE_EXCEEDED:
                return self.timeout_s  # at least this slow: a stopped server must not look fast
            return None
        return time.perf_counter() - t0

    def close(self) -> None:
        self._channel.close()


def listener_pid(port: int) -> int:
    """The pid of a process of ours listening on TCP ``port`` (0: none found)."""
    try:
        conns = psutil.net_connections("tcp")
    except (psutil.Error, OSError):
        return 0
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return 0


# ====================================================================== service


@dataclass
class AgentConfig:
    job: str
    node: str
    ipc_path: Path
    role: str = "worker"
    k: int = 10  # publish AgentMetrics every k trainer steps (AntDT: every 10 iterations) ...
    worker_report_s: float = 4.0  # ... or fewer steps when k take longer than this; never open longer
    election_ttl_s: float = 3.0
    heartbeat_s: float = 1.0
    member_ttl_s: float = 3.0  # an agent not heard for this long leaves the barrier membership
    poll_s: float = 0.005  # how often the IPC is looked at
    prepare_lead_s: float = 0.5  # time the prepare gets to reach every agent before the fastest hits T
    min_margin: int = 3
    vote_timeout_s: float = 1.0
    commit_timeout_s: float = 1.0
    max_attempts: int = 4
    prepare_hold_s: float = 5.0  # a yes-voted prepare with no decision is released after this
    # Servers (role ps, see the module docstring): the PS address probed, how often, when to report.
    probe: str = ""  # host:port of the TF server; "": no latency probe
    # A user's own PS (trainer.ps_command) speaks its own protocol, not TF's gRPC: its address only
    # finds its process (CPU, RSS); no RPC is sent to it (a TF probe crashed the example's PS).
    probe_rpc: bool = True
    probe_every_s: float = 0.25
    probe_timeout_s: float = 2.0
    report_every_s: float = 2.0
    instance: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    def __post_init__(self) -> None:
        subjects.agent_command(self.job, self.node)  # validates both ids
        if self.k < 1:
            raise ValueError("k must be >= 1")
        if self.worker_report_s <= 0:
            raise ValueError("worker_report_s must be > 0")
        if self.election_ttl_s < 1.0:
            raise ValueError("election TTL must be >= 1 s (JetStream per-message TTL granularity)")
        if self.probe_every_s <= 0 or self.probe_timeout_s <= 0 or self.report_every_s <= 0:
            raise ValueError("probe_every_s, probe_timeout_s and report_every_s must be > 0")
        if self.probe and not _host_port(self.probe):
            raise ValueError(f"probe: {self.probe!r} is not host:port")

    @property
    def stepping(self) -> bool:
        """Whether the trainer iterates (a worker) or serves (a PS: measured from outside)."""
        return self.role in STEPPING_ROLES


@dataclass
class _Local:
    """This agent's view of one global action it was asked to prepare."""

    seq: int
    target: int
    state: str  # pending | committed | aborted | refused | expired | superseded
    since: float


class AgentService:
    """The agent of one node (implements :class:`pacer.runtime.Service`)."""

    name = subjects.AGENT_SERVICE

    def __init__(self, bus: Bus, cfg: AgentConfig) -> None:
        self.bus = bus
        self.cfg = cfg
        self.counters = Counters("agent")
        self.ipc: AgentIPC | None = None
        self.is_primary = False
        self.members: dict[str, Member] = {}
        self._listening_since = 0.0  # set by start(), when the heartbeat subscriptions begin
        self._subs: list[Subscription] = []
        self._ga_sub: Subscription | None = None
        self._ga_lock = asyncio.Lock()
        self._committed_target = -1  # the highest T this primary committed (pick_target: actions stay in order)
        self._kv: KeyValue | None = None
        self._rev = 0
        self._local: OrderedDict[str, _Local] = OrderedDict()
        self._results: OrderedDict[str, ActionResult] = OrderedDict()
        self._seq_ids: dict[int, str] = {}
        self._next_boundary = 0
        self._window = self.cfg.k  # steps in the metrics window that ends at _next_boundary
        self._window_opened = 0.0  # monotonic time the open window began (the last one was published)
        self._window_planned = math.inf  # ... and the seconds it should take at the last BPT (inf: unknown)
        self._sent_at = -math.inf  # monotonic time of this agent's last heartbeat or metrics (heartbeat_due)
        self._beat_state: tuple[bool, int, bool] | None = None  # what the last heartbeat alone said
        self._incarnation = -1
        self._proc: psutil.Process | None = None
        self._last_open_try = 0.0
        self._stopping = False
        # Servers: probe latencies since the last report, the PS pid found by its port.
        self._probe: ServerProbe | None = None
        self._latencies: list[float] = []
        self._probe_failed = 0
        self._probes_total = 0
        self._recent_latency = 0.0
        self._port_pid = 0
        self._port_looked = 0.0

    # ------------------------------------------------------------ lifecycle
    async def start(self, tg: asyncio.TaskGroup) -> None:
        nc, job = self.bus.nc, self.cfg.job
        # Heartbeats and metrics are not traced: periodic, from no request, every one would be a trace.
        self._subs = [
            await nc.subscribe(subjects.agent_heartbeat(job), cb=self._on_heartbeat),
            await nc.subscribe(subjects.agent_metrics(job), cb=self._on_metrics),
            await nc.subscribe(subjects.agent_phase(job, subjects.AgentPhase.PREPARE),
                               cb=tracing.traced("handle agent.prepare", self._on_prepare, SpanKind.SERVER)),
            await nc.subscribe(subjects.agent_phase(job, subjects.AgentPhase.COMMIT),
                               cb=tracing.traced("handle agent.commit", self._on_commit, SpanKind.SERVER)),
            await nc.subscribe(subjects.agent_phase(job, subjects.AgentPhase.ABORT),
                               cb=tracing.traced("consume agent.abort", self._on_abort)),
            await nc.subscribe(subjects.agent_command(job, self.cfg.node),
                               cb=tracing.traced("handle agent.command", self._on_command, SpanKind.SERVER)),
        ]
        self._listening_since = time.monotonic()  # heartbeats heard from here on (run_global_action waits on it)
        self._attach()
        if self.cfg.stepping:
            self._kv = self._bucket()
            tg.create_task(guard("agent-poll", self._poll_loop, pause=0.2), name="pacer:agent-poll")
            tg.create_task(guard("agent-election", self._election_loop), name="pacer:agent-election")
        else:  # a server: measured from outside, no barrier, never primary
            self._start_probe()
            tg.create_task(guard("agent-server", self._server_loop, pause=0.5), name="pacer:agent-server")
        tg.create_task(guard("agent-heartbeat", self._heartbeat_loop), name="pacer:agent-heartbeat")
        log.info("agent started", extra={"fields": self._fields(ipc=str(self.cfg.ipc_path))})

    async def drain(self) -> None:
        self._stopping = True
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        await self._step_down("stopping", release=True)
        if self.ipc is not None:
            for loc in self._local.values():  # do not leave our trainer waiting at a barrier
                if loc.state == "pending":
                    self.ipc.abort(loc.seq)
            self.ipc.close()
            self.ipc = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    def _fields(self, **kw: Any) -> dict[str, Any]:
        return {"job": self.cfg.job, "node": self.cfg.node, **kw}

    # ------------------------------------------------------------ IPC attach
    def _attach(self) -> None:
        now = time.monotonic()
        if self.ipc is not None:
            if not self.ipc.replaced():
                return
            log.info("trainer re-created the IPC file; reattaching", extra={"fields": self._fields()})
            self.ipc.close()
            self.ipc = None
        if now - self._last_open_try < 0.1:
            return
        self._last_open_try = now
        self.ipc = AgentIPC.try_open(self.cfg.ipc_path)
        if self.ipc is not None:
            self._incarnation = -1
            log.info("attached to trainer IPC", extra={"fields": self._fields(ipc=str(self.cfg.ipc_path))})

    def _trainer_alive(self, pid: int, exiting: bool) -> bool:
        if pid <= 0 or exiting:
            return False
        try:
            if self._proc is None or self._proc.pid != pid:
                self._proc = psutil.Process(pid)
                self._proc.cpu_percent(None)  # the first call only starts the measurement
            return bool(self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    def _proc_usage(self, pid: int) -> tuple[float, int]:
        try:
            if self._proc is None or self._proc.pid != pid:
                self._proc = psutil.Process(pid)
                self._proc.cpu_percent(None)
            with self._proc.oneshot():
                return float(self._proc.cpu_percent(None)), int(self._proc.memory_info().rss)
        except psutil.Error:
            return 0.0, 0

    # ------------------------------------------------------------ metrics
    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.poll_s)
            self._attach()
            ipc = self.ipc
            if ipc is None:
                continue
            self._expire_prepares(ipc)
            n = ipc.steps_total()  # one int64 read; the ring is copied only at a window boundary
            k, nb = self.cfg.k, self._next_boundary
            lo = nb - self._window
            if (nb and self.cfg.stepping and lo <= n < nb
                    and window_overdue(n - lo, time.monotonic() - self._window_opened, self._window_planned,
                                       self.cfg.worker_report_s)):
                self._window, self._next_boundary = n - lo, n  # closes now, with the steps it has
                nb = n
            if not nb or n >= nb or n < nb - k:  # first look, a full window, or a restarted trainer
                try:
                    await self._publish_metrics(ipc)
                except IPCError as exc:  # the trainer died mid-write: nothing to report until it is back
                    self.counters.inc("agent_ipc_errors")
                    log.debug("metrics: %s", exc)

    async def _publish_metrics(self, ipc: AgentIPC) -> None:
        k = self.cfg.k
        snap = ipc.snapshot()
        if snap.incarnation != self._incarnation or self._next_boundary > snap.steps_total + k:
            # New trainer (or first look): start at the newest full window still in the ring.
            self._incarnation = snap.incarnation
            self._next_boundary = max(k, (snap.steps_total // k) * k)
            self._window = k
            self._window_opened, self._window_planned = time.monotonic(), math.inf
        first = snap.steps[0].number if snap.steps else 0
        if self._next_boundary - self._window < first:  # fell behind the ring: skip to what is there
            self._next_boundary = ((first + k - 1) // k) * k + k
            self._window = k
            self._window_opened, self._window_planned = time.monotonic(), math.inf
        by_index = {r.number: r for r in snap.steps}
        cpu, rss = -1.0, -1
        while snap.steps_total >= self._next_boundary:
            w = self._window
            lo = self._next_boundary - w
            window = [by_index[i] for i in range(lo, self._next_boundary) if i in by_index]
            if len(window) != w:
                self._next_boundary += w
                continue
            if cpu < 0:
                cpu, rss = self._proc_usage(snap.pid)
            bpt, rate = window_metrics(window, by_index.get(lo - 1))
            last = window[-1]
            m = AgentMetrics(
                job=self.cfg.job,
                node=self.cfg.node,
                role=self.cfg.role,
                ts=last.wall_ts,
                local_step=last.local_step,
                iteration=last.iteration,
                bpt_s=bpt,
                batch_size=last.batch_size,
                samples_per_s=rate,
                samples_total=snap.samples_total,
                cpu_percent=cpu,
                rss_bytes=rss,
                last_action_seq=snap.applied_seq,
                last_action_iteration=snap.applied_iteration,
                primary=self.is_primary,
                last_action_id=self._seq_ids.get(snap.applied_seq, ""),
                steps=w,
                steps_total=last.number + 1,
                incarnation=snap.incarnation,
                exiting=snap.exiting,
            )
            await self._send_metrics(m)
            self._window = window_steps(k, bpt, self.cfg.worker_report_s) if self.cfg.role != "ps" else k
            self._next_boundary += self._window
            self._window_opened, self._window_planned = time.monotonic(), self._window * bpt

    # ------------------------------------------------------------ servers (role ps)
    def _start_probe(self) -> None:
        if not self.cfg.probe or not self.cfg.probe_rpc:
            return
        try:
            self._probe = ServerProbe(self.cfg.probe, self.cfg.probe_timeout_s)
        except ImportError:
            log.warning("no grpcio: the PS is measured by CPU and RSS only", extra={"fields": self._fields()})

    def _server_pid(self) -> int:
        """The PS process: the pid in the IPC file, else the listener on the probe's port (0: unknown)."""
        if self.ipc is not None:
            try:
                snap = self.ipc.snapshot()
            except IPCError:
                snap = None
            if snap is not None and self._trainer_alive(snap.pid, snap.exiting):
                return snap.pid
        hp = _host_port(self.cfg.probe) if self.cfg.probe else None
        if hp is None:
            return 0
        now = time.monotonic()
        if self._port_pid and self._trainer_alive(self._port_pid, False):
            return self._port_pid
        if now - self._port_looked >= 2.0:  # a scan of every socket: not on every tick
            self._port_looked = now
            self._port_pid = listener_pid(hp[1])
        return self._port_pid if self._port_pid and self._trainer_alive(self._port_pid, False) else 0

    async def _server_loop(self) -> None:
        next_report = time.monotonic() + self.cfg.report_every_s
        while True:
            t0 = time.monotonic()
            self._attach()
            if self._probe is not None:
                lat = await asyncio.to_thread(self._probe.once)
                self._probes_total += 1
                if lat is None:
                    self._probe_failed += 1
                else:
                    self._latencies.append(lat)
            now = time.monotonic()
            if now >= next_report:
                next_report = now + self.cfg.report_every_s
                await self._publish_server_metrics()
            await asyncio.sleep(max(0.0, self.cfg.probe_every_s - (time.monotonic() - t0)))

    async def _publish_server_metrics(self) -> None:
        w = probe_window(self._latencies, self._probe_failed)
        self._latencies, self._probe_failed = [], 0
        if w.answered:
            self._recent_latency = w.latency_s
        pid = self._server_pid()
        cpu, rss = self._proc_usage(pid) if pid else (0.0, 0)
        m = AgentMetrics(
            job=self.cfg.job, node=self.cfg.node, role=self.cfg.role, ts=time.time(),
            local_step=self._probes_total, iteration=-1, bpt_s=w.latency_s, batch_size=0, samples_per_s=0.0,
            samples_total=0, cpu_percent=cpu, rss_bytes=rss, last_action_seq=0, last_action_iteration=-1,
            primary=False, steps=w.answered, steps_total=self._probes_total,
        )
        await self._send_metrics(m)
        if w.failed:
            self.counters.inc("agent_probes_failed", w.failed)

    # ------------------------------------------------------------ heartbeat and membership
    async def _send_metrics(self, m: AgentMetrics) -> None:
        await self.bus.publish(subjects.agent_metrics(self.cfg.job), m)
        self._sent_at = time.monotonic()  # peers and the monitor take it as a heartbeat too
        self.counters.inc("agent_metrics_published")

    async def _send_heartbeat(self, hb: Heartbeat) -> None:
        await self.bus.publish(subjects.agent_heartbeat(self.cfg.job), hb)
        self._sent_at = time.monotonic()
        self._beat_state = _beat_state(hb)

    async def _heartbeat_loop(self) -> None:
        """A heartbeat when the job has heard nothing else from us for heartbeat_s, or when the trainer's
        liveness or the primary flag changed (:func:`pacer.agent.reporting.heartbeat_due`)."""
        while True:
            hb = self._heartbeat()
            changed = _beat_state(hb) != self._beat_state
            if heartbeat_due(time.monotonic() - self._sent_at, self.cfg.heartbeat_s, changed):
                await self._send_heartbeat(hb)
            else:
                self.counters.inc("agent_heartbeats_skipped")
            await asyncio.sleep(max(0.05, self._sent_at + self.cfg.heartbeat_s - time.monotonic()))

    def _heartbeat(self) -> Heartbeat:
        alive, it, bpt, pid = False, -1, 0.0, 0
        if not self.cfg.stepping:
            pid = self._server_pid()
            alive, bpt = pid > 0, self._recent_latency
        elif self.ipc is not None:
            try:
                snap = self.ipc.snapshot()
            except IPCError:
                snap = None
            if snap is not None:
                pid = snap.pid
                alive = self._trainer_alive(snap.pid, snap.exiting)
                it = snap.iteration
                recent = snap.steps[-self.cfg.k :]
                bpt = sum(r.bpt_s for r in recent) / len(recent) if recent else 0.0
        return Heartbeat(
            job=self.cfg.job,
            node=self.cfg.node,
            role=self.cfg.role,
            ts=time.time(),
            instance=self.cfg.instance,
            primary=self.is_primary,
            trainer_alive=alive,
            iteration=it,
            bpt_s=bpt,
            trainer_pid=pid,
        )

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = decode(Heartbeat, msg.data)
        except DecodeError:
            self.counters.inc("agent_bad_messages")
            return
        now = time.monotonic()
        m = self.members.get(hb.node)
        if m is None:
            m = self.members[hb.node] = Member(hb.node, hb.role, now)
        m.role, m.seen, m.trainer_alive, m.primary = hb.role, now, hb.trainer_alive, hb.primary
        if hb.iteration >= 0 and (hb.iteration >= m.iteration or now - m.at > 2 * self.cfg.heartbeat_s):
            m.iteration, m.at = hb.iteration, now
            if hb.bpt_s > 0:
                m.bpt_s = hb.bpt_s

    async def _on_metrics(self, msg: Msg) -> None:
        try:
            am = decode(AgentMetrics, msg.data)
        except DecodeError:
            self.counters.inc("agent_bad_messages")
            return
        now = time.monotonic()
        m = self.members.get(am.node)
        if m is None:
            # A member first heard by its metrics (its heartbeats are sent only when it is otherwise quiet,
            # heartbeat_due): a window of steps says its trainer runs; a later heartbeat says otherwise.
            m = self.members[am.node] = Member(am.node, am.role, now)
            m.trainer_alive, m.primary = am.steps > 0 and not am.exiting, am.primary
        m.seen = now
        if am.iteration >= m.iteration:
            m.iteration, m.bpt_s, m.at = am.iteration, am.bpt_s, now

    # ------------------------------------------------------------ election
    def _bucket(self) -> KeyValue:
        """The agents' bucket as this pod may use it: no JetStream API call (pacer.agent.bucket)."""
        return bucket.handle(self.bus.js)

    async def _make_bucket(self) -> None:
        """The bucket is missing: the executor makes it before any pod, so this is an agent run by hand
        (``pacer train local``, an open bus), which may make it; a pod's user is refused, and says so."""
        try:
            await bucket.ensure(self.bus.js, self.bus.replicas)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("election: the agents' bucket %s is missing and could not be made: %s", bucket.STREAM,
                        exc, extra={"fields": self._fields()})

    async def _cas_put(self, last: int) -> int:
        """Write our PrimaryRecord if the key's revision is still ``last`` (0: absent); the new revision."""
        rec = PrimaryRecord(self.cfg.job, self.cfg.node, self.cfg.instance, time.time())
        key = subjects.agent_primary_key(self.cfg.job)
        # nats-server keeps per-message TTLs in whole seconds (1500ms behaves as 1s): round up.
        ttl = max(1, math.ceil(self.cfg.election_ttl_s))
        ack = await self.bus.js.publish(
            f"$KV.{subjects.AGENT_BUCKET}.{key}",
            encode(rec),
            headers={"Nats-Expected-Last-Subject-Sequence": str(last), "Nats-TTL": f"{ttl}s"},
            timeout=max(0.5, self.cfg.election_ttl_s / 3),
        )
        return int(ack.seq)

    async def _try_acquire(self) -> int:
        """Become primary if nobody is: the revision, or 0 if someone else holds the key."""
        try:
            return await self._cas_put(0)
        except nats.js.errors.NoStreamResponseError:
            await self._make_bucket()
            return 0  # next round
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code not in _WRONG_LAST_SEQUENCE:
                raise
        assert self._kv is not None
        try:
            await self._kv.get(subjects.agent_primary_key(self.cfg.job))
            return 0  # a live primary holds it
        except nats.js.errors.KeyNotFoundError as exc:
            entry = getattr(exc, "entry", None)
            if entry is None or not entry.revision:
                return 0  # expired between our two calls: next round
            try:
                return await self._cas_put(int(entry.revision))  # the key was deleted (a graceful step-down)
            except nats.js.errors.BadRequestError:
                return 0

    async def _election_loop(self) -> None:
        period = self.cfg.election_ttl_s / 3
        last_ok = 0.0
        while not self._stopping:
            if not self.is_primary:
                try:
                    rev = await self._try_acquire()
                except (TimeoutError, nats.errors.Error) as exc:
                    log.warning("election: %s", exc, extra={"fields": self._fields()})
                    rev = 0
                if rev and not self._stopping:
                    self._rev, last_ok = rev, time.monotonic()
                    await self._become_primary()
            else:
                try:
                    self._rev = await self._cas_put(self._rev)
                    last_ok = time.monotonic()
                except nats.js.errors.BadRequestError as exc:
                    if exc.err_code in _WRONG_LAST_SEQUENCE:
                        await self._step_down("lost the key")
                    else:
                        raise
                except (TimeoutError, nats.errors.Error) as exc:
                    if time.monotonic() - last_ok > self.cfg.election_ttl_s * 2 / 3:
                        # The key may expire before we can refresh it: stop acting as primary now.
                        await self._step_down(f"cannot refresh: {exc}")
            await asyncio.sleep(period)

    async def _become_primary(self) -> None:
        self.is_primary = True
        self.counters.inc("agent_elected")
        self._ga_sub = await self.bus.nc.subscribe(
            subjects.agent_global_action(self.cfg.job), queue="primary",
            cb=tracing.traced("handle agent.global_action", self._on_global_action, SpanKind.SERVER),
        )
        log.info("elected primary", extra={"fields": self._fields(revision=self._rev)})
        await self._send_heartbeat(self._heartbeat())

    async def _step_down(self, why: str, release: bool = False) -> None:
        if not self.is_primary:
            return
        self.is_primary = False
        self.counters.inc("agent_stepped_down")
        if self._ga_sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._ga_sub.unsubscribe()
            self._ga_sub = None
        if release and self._kv is not None:
            with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
                await self._kv.delete(subjects.agent_primary_key(self.cfg.job), last=self._rev)
        log.info("stepped down: %s", why, extra={"fields": self._fields()})

    # ------------------------------------------------------------ primary: global actions
    async def _on_global_action(self, msg: Msg) -> None:
        try:
            ga = decode(GlobalAction, msg.data)
            if ga.job != self.cfg.job:
                raise ValidationError(f"job {ga.job!r} sent to the agents of {self.cfg.job!r}")
        except PacerError as exc:
            self.counters.inc("agent_bad_messages")
            tracing.fail(exc, exc.message)
            await self.bus.respond_error(msg, exc)
            return
        async with self._ga_lock:
            result = await self.run_global_action(ga)
        await self.bus.respond(msg, result)
        await self.bus.publish(subjects.agent_action(self.cfg.job), result)

    def _remember(self, result: ActionResult) -> ActionResult:
        self._results[result.action_id] = result
        while len(self._results) > 256:
            self._results.popitem(last=False)
        return result

    async def run_global_action(self, ga: GlobalAction) -> ActionResult:
        """Two-phase: prepare all live workers at T, commit if all vote yes, else abort and retry."""
        action_id = ga.action_id or uuid.uuid4().hex
        if action_id in self._results:
            return self._results[action_id]
        self.counters.inc("agent_global_actions")

        def result(applied: bool, target: int = -1, nodes: Iterable[str] = (), detail: str = "", attempts: int = 0) -> ActionResult:
            return self._remember(
                ActionResult(action_id, applied, target, sorted(nodes), detail, self.cfg.job, ga.kind, attempts, time.time())
            )

        if ga.kind is ActionKind.NONE:
            return result(True)
        if ga.kind not in GLOBAL_KINDS:
            return result(False, detail=f"{ga.kind.value} is a node action: send a NodeCommand to each node")
        if len(msgpack.packb(ga.payload, use_bin_type=True)) > PAYLOAD_CAP:
            return result(False, detail=f"payload over {PAYLOAD_CAP} bytes")
        # A primary learns the membership from heartbeats and metrics: until it has listened for a heartbeat
        # period and a half, a live worker it has not heard yet would be left out of the action (elected a
        # moment after its own start, an agent can be asked before every other agent's next message arrived).
        settle = self._listening_since + 1.5 * self.cfg.heartbeat_s - time.monotonic()
        if settle > 0:
            await asyncio.sleep(settle)
        floor, suspects, why = -1, set[str](), ""
        for attempt in range(1, self.cfg.max_attempts + 1):
            now = time.monotonic()
            nodes = participants(self.members, now, self.cfg.member_ttl_s, suspects)
            if not nodes:
                return result(False, detail="no live worker agents", attempts=attempt - 1)
            ms = [self.members[n] for n in nodes]
            est = {m.node: estimate_iteration(m.iteration, now - m.at, m.bpt_s) for m in ms}
            target = pick_target(est, [m.bpt_s for m in ms], self.cfg.prepare_lead_s, attempt, floor, self.cfg.min_margin,
                                 self._committed_target)
            prep = Prepare(self.cfg.job, action_id, target, ga.kind, nodes, self.cfg.instance, attempt)
            votes = await self._gather(subjects.AgentPhase.PREPARE, prep, set(nodes), Vote, self.cfg.vote_timeout_s)
            if len(votes) == len(nodes) and all(v.yes for v in votes.values()):
                acked, missing = await self._commit(
                    Commit(self.cfg.job, action_id, target, ga.kind, ga.payload, nodes), set(nodes)
                )
                self.counters.inc("agent_commits")
                self._committed_target = max(self._committed_target, target)
                err = f"no commit ack from {sorted(missing)}" if missing else ""
                log.info(
                    "global action committed",
                    extra={"fields": self._fields(action_id=action_id, kind=ga.kind.value, target=target, nodes=nodes, attempt=attempt)},
                )
                return result(True, target, acked, err, attempt)
            await self.bus.publish(
                subjects.agent_phase(self.cfg.job, subjects.AgentPhase.ABORT), Abort(self.cfg.job, action_id, "not all voted yes")
            )
            self.counters.inc("agent_aborts")
            no = sorted(n for n, v in votes.items() if not v.yes)
            silent = sorted(set(nodes) - votes.keys())
            why = f"attempt {attempt} at T={target}: no from {no}, silent {silent}"
            log.info("global action aborted", extra={"fields": self._fields(action_id=action_id, why=why)})
            floor = max([floor, *(v.iteration for v in votes.values())])
            # A silent agent that has also stopped heart-beating is probably dead: leave it out.
            now = time.monotonic()
            suspects |= {n for n in silent if now - self.members[n].seen > 1.5 * self.cfg.heartbeat_s}
        return result(False, detail=f"gave up after {self.cfg.max_attempts} attempts; last: {why}", attempts=self.cfg.max_attempts)

    async def _gather(self, phase: str, msg: Any, expect: set[str], reply_cls: type[T], wait_s: float) -> dict[str, T]:
        """Publish ``msg`` on ``pacer.agent.<job>.<phase>`` and collect one reply per expected node."""
        got: dict[str, T] = {}
        done = asyncio.Event()

        async def on_reply(m: Msg) -> None:
            try:
                r = decode(reply_cls, m.data)
            except DecodeError:
                return
            node = getattr(r, "node", "")
            if getattr(r, "action_id", None) == msg.action_id and node in expect:
                got[node] = r
                if expect <= got.keys():
                    done.set()

        nc = self.bus.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=on_reply)
        try:
            # The global action's trace goes on to every agent's prepare / commit.
            await nc.publish(subjects.agent_phase(self.cfg.job, phase), encode(msg), reply=inbox,
                             headers=tracing.inject())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), wait_s)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        return got

    async def _commit(self, commit: Commit, nodes: set[str]) -> tuple[set[str], set[str]]:
        """Send the commit, re-sending to agents that did not ack; (acked, missing)."""
        acked: set[str] = set()
        missing = set(nodes)
        for _ in range(3):
            msg = Commit(commit.job, commit.action_id, commit.target_iteration, commit.kind, commit.payload, sorted(missing))
            acks = await self._gather(subjects.AgentPhase.COMMIT, msg, missing, Ack, self.cfg.commit_timeout_s / 3)
            acked |= {n for n, a in acks.items() if a.ok}
            missing -= acks.keys()
            if not missing:
                break
        return acked, missing

    # ------------------------------------------------------------ every agent: the barrier
    async def _on_prepare(self, msg: Msg) -> None:
        try:
            p = decode(Prepare, msg.data)
        except DecodeError:
            self.counters.inc("agent_bad_messages")
            return
        if self.cfg.node not in p.nodes or p.job != self.cfg.job:
            return
        yes, reason, it = False, "", -1
        try:
            yes, reason, it = self._prepare_local(p)
        except IPCError as exc:
            yes, reason = False, f"ipc: {exc}"
        self.counters.inc("agent_votes_yes" if yes else "agent_votes_no")
        await self.bus.respond(msg, Vote(self.cfg.job, p.action_id, self.cfg.node, yes, it, reason))

    def _prepare_local(self, p: Prepare) -> tuple[bool, str, int]:
        """Arm our trainer's barrier for ``p``: (vote, reason, trainer iteration)."""
        ipc = self.ipc
        if ipc is None:
            return False, "no_trainer", -1
        loc = self._local.get(p.action_id)
        if loc is not None and loc.target == p.target_iteration and loc.state == "pending":
            return True, "", ipc.current_iteration()  # a duplicate of the prepare we hold
        for other in self._local.values():
            if other.state == "pending":
                other.state = "superseded"  # a new prepare replaces it in the IPC
        snap = ipc.snapshot()
        if not self._trainer_alive(snap.pid, snap.exiting):
            return False, "no_trainer", snap.iteration
        seq = ipc.next_seq()
        yes = ipc.prepare(p.target_iteration, seq)
        self._local[p.action_id] = _Local(seq, p.target_iteration, "pending" if yes else "refused", time.monotonic())
        while len(self._local) > 64:
            self._local.popitem(last=False)
        return yes, "" if yes else "too_late", ipc.current_iteration()

    async def _on_commit(self, msg: Msg) -> None:
        try:
            c = decode(Commit, msg.data)
        except DecodeError:
            self.counters.inc("agent_bad_messages")
            return
        if self.cfg.node not in c.nodes or c.job != self.cfg.job:
            return
        loc = self._local.get(c.action_id)
        ok, err = False, ""
        if loc is None or self.ipc is None:
            err = "not prepared here"
        elif loc.state == "committed":
            ok = True
        elif loc.state in ("pending", "expired", "superseded"):
            try:
                self.ipc.commit(loc.seq, c.target_iteration, c.kind, c.payload)
                self._seq_ids[loc.seq] = c.action_id
                if loc.state != "pending":
                    err = f"committed after the local barrier was {loc.state}: may apply late"
                loc.state, ok = "committed", True
            except IPCError as exc:
                err = str(exc)
        else:
            err = f"prepare was {loc.state}"
        if ok:
            self.counters.inc("agent_committed")
        await self.bus.respond(msg, Ack(self.cfg.job, c.action_id, self.cfg.node, ok, err))

    async def _on_abort(self, msg: Msg) -> None:
        try:
            a = decode(Abort, msg.data)
        except DecodeError:
            self.counters.inc("agent_bad_messages")
            return
        loc = self._local.get(a.action_id)
        if loc is not None and loc.state == "pending" and self.ipc is not None:
            self.ipc.abort(loc.seq)
            loc.state = "aborted"

    def _expire_prepares(self, ipc: AgentIPC) -> None:
        now = time.monotonic()
        for action_id, loc in self._local.items():
            if loc.state == "pending" and now - loc.since > self.cfg.prepare_hold_s:
                ipc.abort(loc.seq)
                loc.state = "expired"
                log.warning("prepare expired without a decision", extra={"fields": self._fields(action_id=action_id)})

    # ------------------------------------------------------------ every agent: node commands
    async def _on_command(self, msg: Msg) -> None:
        try:
            cmd = decode(NodeCommand, msg.data)
            if cmd.job != self.cfg.job or cmd.node != self.cfg.node:
                raise ValidationError(f"command for {cmd.job}/{cmd.node} reached {self.cfg.job}/{self.cfg.node}")
        except PacerError as exc:
            self.counters.inc("agent_bad_messages")
            tracing.fail(exc, exc.message)
            await self.bus.respond_error(msg, exc)
            return
        result = self.run_command(cmd)
        await self.bus.respond(msg, result)
        await self.bus.publish(subjects.agent_action(self.cfg.job), result)

    def run_command(self, cmd: NodeCommand) -> ActionResult:
        """Write a node action for the trainer's next iteration (no barrier).

        The reply's target is the earliest iteration the trainer can take it
        at; a trainer that checks that iteration while the agent writes takes
        it one check later, flagged ``late`` (nothing waits, nothing is lost).
        """
        cid = cmd.command_id or uuid.uuid4().hex
        if cid in self._results:
            return self._results[cid]
        self.counters.inc("agent_commands")

        def result(applied: bool, target: int = -1, detail: str = "") -> ActionResult:
            nodes = [self.cfg.node] if applied else []
            return self._remember(ActionResult(cid, applied, target, nodes, detail, self.cfg.job, cmd.kind, 0, time.time()))

        if cmd.kind is ActionKind.NONE:
            return result(True)
        if self.ipc is None:
            return result(False, detail="no trainer attached")
        try:
            seq = self.ipc.next_seq()
            target = self.ipc.current_iteration() + 1
            self.ipc.commit(seq, target, cmd.kind, cmd.payload, immediate=True)
        except IPCError as exc:
            return result(False, detail=str(exc))
        self._seq_ids[seq] = cid
        log.info("node command delivered", extra={"fields": self._fields(kind=cmd.kind.value, target=target, command_id=cid)})
        return result(True, target)

