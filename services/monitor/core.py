"""Pure core of the monitor: sliding windows over node, application and cluster state.

AntDT section V-D (Monitor) gathers three kinds of information, and this
module folds each into per-job state:

* application state (batch processing time, batch size): :class:`AgentMetrics`
  -> per-node samples in a window (:meth:`MonitorCore.observe_metrics`);
* node state (termination notifications, relaunches): :class:`NodeEvent`
  -> pending / running / dead, restarts, pending time
  (:meth:`MonitorCore.observe_node_event`);
* third-party information: the shard service's :class:`DatasetStatus` and the
  cluster scheduler's queue ("job pending time ... for the awareness of
  whether the cluster is busy or idle") (:meth:`MonitorCore.observe_shards`,
  :meth:`MonitorCore.observe_cluster`).

:meth:`MonitorCore.statistics` turns that state into a
:class:`~pacer.contracts.monitor.JobStatistics`, including AntDT-ND's
straggler signal (section VI-A, step 2 "Collecting Statistics via Monitor",
step 3 "Solving Transient Stragglers", step 5 "Solving Persistent
Stragglers"; servers likewise in VI-A "AntDT-ND Solution for Server
Stragglers"):

    T_i^trans = mean BPT of node i over the short window L_trans (default 5 min)
    T_i^per   = mean BPT of node i over the long  window L_per   (default 10 min)
    slow in a window  <=>  T_i >= lambda * T_peers           (lambda default 1.5)

Two deliberate departures from the paper's text, both about the reference
BPT: it is the *median* of the *other* live nodes of the *same role*, not
the mean over all nodes.  Excluding the node itself keeps one big straggler
from dragging the reference up (with two workers, a mean that includes the
straggler can never reach lambda = 2); the median keeps two stragglers from
hiding each other; and PS and workers do different work, so their BPTs are
never compared (the paper treats worker and server stragglers separately too).

Servers: a PS has no steps; its agent reports as ``bpt_s`` the mean latency
of a small TF RPC it times against the PS (``pacer.agent.agent``,
"Servers"), so T_i of a PS is its answer time and it is compared with the
other PS only.  Healthy answers take well under a millisecond, where noise
alone can make one PS look 1.5x another: the reference of a PS is therefore
at least ``ps_latency_floor_s`` (default 20 ms: a loaded machine delays a healthy
answer by a few ms now and then), so only a PS that answers in
>= lambda x max(median of its peers, the floor) counts as slow.  (The
workers' time per PS is not measured: one TF session run touches every PS
at once.)

L_trans adapts to the job's noise when ``window_short_min_s`` is set
(:meth:`JobWindows.short_window`): a quiet job's BPT mean is already exact
over a few reports, so its short window shrinks towards that minimum and a
straggler that appears or ends is seen within a report or two instead of a
diluted 5-min mean; a noisy job keeps the full L_trans.  A worker's
adapted short window also starts no earlier than its newest batch size (an
ADJUST_BS changes its BPT on purpose; a mean over both sizes describes
neither).  The statistics
carry the window used (``JobStatistics.window_short_s``).  The persistence
test below keeps the configured L_trans as its span.

A node is ``persistent`` if it is slow over L_per *and* its samples reach
back further than L_trans (otherwise the long window holds no more evidence
than the short one, and a node that has been slow for two minutes would
already look persistent); else ``transient`` if it is slow over L_trans.

No IO, no clock: time comes in as ``now`` (monitor time, unix seconds).
Deterministic: the same calls give the same statistics.  Memory is bounded:
samples older than the long window are evicted on every call that touches a
job, and each node keeps at most ``max_samples`` of them.  Not thread-safe.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from pacer.contracts.agent import AgentMetrics, Heartbeat
from pacer.contracts.monitor import (
    JobStatistics,
    Liveness,
    NodeStats,
    ShardSummary,
    StragglerKind,
)
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetStatus
from pacer.errors import NotFound, ValidationError

# Node-event kinds (``NodeEvent.kind``) and the state they put a node in.
# Unknown kinds are ignored (a newer executor may publish more).
PENDING_KINDS = frozenset({"pending", "created", "scheduled", "started", "restarting", "relaunched"})
RUNNING_KINDS = frozenset({"running"})
DEAD_KINDS = frozenset({"died", "failed", "killed", "evicted", "deleted", "oom", "succeeded", "finished"})

PS_ROLE = "ps"


@dataclass(frozen=True, slots=True)
class MonitorConfig:
    """Knobs of the monitor; the defaults are AntDT's experimental settings (section VII-A)."""

    window_short_s: float = 300.0  # L_trans = 5 min
    window_long_s: float = 600.0  # L_per = 10 min
    slowness_ratio: float = 1.5  # lambda
    heartbeat_timeout_s: float = 120.0  # silent longer than this -> dead
    # Persistent only if the node's samples reach back at least this far (None: window_short_s).
    persistent_min_span_s: float | None = None
    max_samples: int = 4096  # per node, whatever the window holds
    # A PS's reference answer time is at least this (s): sub-millisecond noise is no straggler.
    ps_latency_floor_s: float = 0.020
    # Cluster busy when at least this many pods are queued in the cluster ...
    busy_pending_pods: int = 1
    # ... or less than this fraction of the cluster's capacity is free ...
    busy_free_fraction: float = 0.05
    # ... or a node of the job has been pending for this long (the paper's "job pending time").
    busy_pending_s: float = 300.0
    # Cluster information older than this is ignored (not busy by default).
    cluster_stale_s: float = 600.0
    # Noise-adapted short window (None: always window_short_s).  When set, each job's short window is
    # the shortest in [window_short_min_s, window_short_s] whose step-weighted mean BPT has a relative
    # standard error <= window_short_rel_error, from the job's measured report-to-report noise (see
    # JobWindows.short_window); persistence keeps the configured window_short_s as its span.  3.5 %:
    # a node 5 % slower than its peers (pacer-adaptive's tightest lambda) stands 1.5 standard errors out.
    window_short_min_s: float | None = None
    window_short_rel_error: float = 0.035

    def __post_init__(self) -> None:
        if not 0 < self.window_short_s <= self.window_long_s:
            raise ValidationError("need 0 < window_short_s <= window_long_s")
        if self.slowness_ratio <= 0:
            raise ValidationError("slowness_ratio must be > 0")
        if self.heartbeat_timeout_s <= 0 or self.max_samples <= 0:
            raise ValidationError("heartbeat_timeout_s and max_samples must be > 0")
        if self.ps_latency_floor_s < 0:
            raise ValidationError("ps_latency_floor_s must be >= 0")
        if self.window_short_min_s is not None and self.window_short_min_s <= 0:
            raise ValidationError("window_short_min_s must be > 0 (or None: a fixed short window)")
        if self.window_short_rel_error <= 0:
            raise ValidationError("window_short_rel_error must be > 0")

    @property
    def min_span_s(self) -> float:
        return self.window_short_s if self.persistent_min_span_s is None else self.persistent_min_span_s


@dataclass(frozen=True, slots=True)
class Sample:
    """One AgentMetrics report: k steps ending at ``t``."""

    t: float
    bpt_s: float
    steps: int  # weight: the report covers this many steps (>= 1)
    samples_per_s: float
    batch: int = 0  # the node's B_i when it reported (0: unknown, a PS)


@dataclass(frozen=True, slots=True)
class WindowStats:
    """Aggregates of one node's samples inside one window."""

    bpt_s: float = 0.0  # step-weighted mean BPT (0: no samples)
    speed: float = 0.0  # samples per second over the window's training time
    oldest: float | None = None  # time of the oldest sample in the window

    @property
    def has_data(self) -> bool:
        return self.oldest is not None


@dataclass(slots=True)
class NodeWindow:
    """Mutable per-node state of one job."""

    node: str
    role: str = ""
    samples: deque[Sample] = field(default_factory=deque)
    samples_total: int = 0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    last_seen: float = 0.0  # monitor time of the last report (0: never)
    lifecycle: Liveness = Liveness.RUNNING  # from node events; RUNNING until told otherwise
    died_at: float | None = None  # executor time of the last death (NodeEvent.ts)
    pending_since: float | None = None  # monitor time the current pending interval began
    pending_s: float = 0.0  # length of the last finished pending interval
    restarts: int = 0
    running_ts: float | None = None  # node-event time its pod last ran, until its trainer's first step is seen
    init_s: float = 0.0  # the last measured start-up: pod running -> the trainer's first step (0: never measured)

    def evict(self, horizon: float) -> None:
        while self.samples and self.samples[0].t < horizon:
            self.samples.popleft()

    def window(self, start: float) -> WindowStats:
        """Step-weighted aggregates of the samples with ``t >= start``."""
        steps = 0
        busy = 0.0  # seconds of training: sum of bpt * steps
        trained = 0.0  # samples trained: sum of samples_per_s * bpt * steps
        oldest: float | None = None
        for s in self.samples:  # oldest first; the window is a suffix
            if s.t < start:
                continue
            if oldest is None:
                oldest = s.t
            steps += s.steps
            busy += s.bpt_s * s.steps
            trained += s.samples_per_s * s.bpt_s * s.steps
        if oldest is None:
            return WindowStats()
        return WindowStats(bpt_s=busy / steps, speed=trained / busy if busy > 0 else 0.0, oldest=oldest)

    def level_since(self, shift: float, floor: float = 0.0) -> float | None:
        """Time of the oldest sample of the node's current level, or None when it has no confirmed one.

        A worker's BPT changes on purpose with an ADJUST_BS, and by its delay
        when a straggler starts or ends: a mean over two levels describes
        neither.  The current level:

        * only samples at the newest batch size count, and of those, when an
          older sample at another size exists, not the first (a report covers
          the steps since the previous one, so it may still hold steps at the
          old size) unless it is the only one;
        * among them, the newest run whose BPTs lie within ``shift``
          (relative, against at least ``floor``) of the run's mean, once two
          samples agree on it (one odd report is no change).

        None: nothing changed within the samples held, or a BPT change is not
        confirmed yet (the caller keeps its usual window).
        """
        if not self.samples:
            return None
        newest = self.samples[-1]
        same = list(itertools.takewhile(lambda x: x.batch == newest.batch, reversed(self.samples)))
        resized = len(same) < len(self.samples)
        if resized and len(same) >= 2:
            same.pop()  # the first report at the new size may hold steps at the old one
        total, count = 0.0, 0
        for smp in same:  # newest first
            if count:
                mean = total / count
                if abs(smp.bpt_s - mean) > shift * max(mean, floor):
                    if count >= 2:
                        return same[count - 1].t
                    break  # one report at a new level: not confirmed
            total, count = total + smp.bpt_s, count + 1
        else:
            return same[-1].t if resized else None
        return same[-1].t if resized else None

    def begin_pending(self, now: float) -> None:
        if self.pending_since is None:
            self.pending_since = now
        self.lifecycle = Liveness.PENDING

    def end_pending(self, now: float) -> None:
        if self.pending_since is not None:
            self.pending_s = max(0.0, now - self.pending_since)
            self.pending_since = None

    def revive(self) -> None:
        """A dead node is back (relaunched): count it once."""
        if self.lifecycle is Liveness.DEAD:
            self.restarts += 1
            self.died_at = None


@dataclass(slots=True)
class ClusterInfo:
    """The newest cluster-scheduler information."""

    pending_pods: int
    free_fraction: float | None
    at: float  # monitor time


@dataclass(slots=True)
class JobWindows:
    """Sliding windows of one job: its nodes, and its datasets' shard counts."""

    job: str
    cfg: MonitorConfig
    nodes: dict[str, NodeWindow] = field(default_factory=dict)
    datasets: dict[str, tuple[DatasetStatus, float]] = field(default_factory=dict)

    def node(self, node: str, role: str = "") -> NodeWindow:
        nw = self.nodes.get(node)
        if nw is None:
            nw = self.nodes[node] = NodeWindow(node)
        if role:
            nw.role = role
        return nw

    def evict(self, now: float) -> None:
        horizon = now - self.cfg.window_long_s
        for nw in self.nodes.values():
            nw.evict(horizon)

    # ------------------------------------------------------------ observe

    def observe_metrics(self, m: AgentMetrics, now: float) -> None:
        nw = self.node(m.node, m.role)
        if not self._alive(nw, m.ts, now):
            return
        # The sample sits where the agent says the steps happened (so that a
        # replayed history lands in the past and is evicted), but never in
        # the monitor's future (clock skew).
        t = min(m.ts, now)
        if m.bpt_s > 0 and t >= now - self.cfg.window_long_s:
            nw.samples.append(Sample(t, m.bpt_s, max(m.steps, 1), max(m.samples_per_s, 0.0), max(m.batch_size, 0)))
            # Out-of-order reports: keep the deque sorted so eviction stays a prefix pop.
            if len(nw.samples) > 1 and nw.samples[-2].t > t:
                nw.samples = deque(sorted(nw.samples, key=lambda s: s.t))
            while len(nw.samples) > self.cfg.max_samples:
                nw.samples.popleft()
        if nw.running_ts is not None and m.steps > 0 and m.bpt_s > 0:
            # The start-up a relaunch costs (AntDT §V-E2's "rebuilding"), measured on this job: from
            # the pod running to the first step of this report's window (a PS: its first answer).
            first = m.ts - (m.steps * m.bpt_s if nw.role != PS_ROLE else 0.0)
            nw.init_s, nw.running_ts = max(0.0, first - nw.running_ts), None
        nw.samples_total = m.samples_total
        nw.cpu_percent = m.cpu_percent
        nw.rss_bytes = m.rss_bytes
        nw.evict(now - self.cfg.window_long_s)  # this node only: O(1) per report (statistics evicts all)

    def observe_heartbeat(self, hb: Heartbeat, now: float) -> None:
        """Liveness only: the agent is up (its BPT comes with the metrics)."""
        nw = self.node(hb.node, hb.role)
        if self._alive(nw, hb.ts, now):
            nw.evict(now - self.cfg.window_long_s)

    @staticmethod
    def _alive(nw: NodeWindow, ts: float, now: float) -> bool:
        """A report sent at ``ts`` says the node runs; False if it is a dead trainer's late message.

        A report of a step taken before the executor saw the death is a late
        message of the dead trainer; a later one means the node is back.
        """
        if nw.lifecycle is Liveness.DEAD:
            if nw.died_at is not None and ts <= nw.died_at:
                return False
            nw.revive()
        nw.end_pending(now)
        nw.lifecycle = Liveness.RUNNING
        nw.last_seen = max(nw.last_seen, now)
        return True

    def observe_node_event(self, ev: NodeEvent, now: float) -> None:
        kind = ev.kind.lower()
        if kind not in PENDING_KINDS | RUNNING_KINDS | DEAD_KINDS:
            return
        nw = self.node(ev.node, ev.role)
        if kind in DEAD_KINDS:
            if nw.lifecycle is not Liveness.DEAD:
                nw.end_pending(now)
                nw.lifecycle = Liveness.DEAD
            nw.died_at = ev.ts if nw.died_at is None else max(nw.died_at, ev.ts)
            # The relaunched node may land on another machine (that is the
            # point of KILL_RESTART): its old BPTs say nothing about it, and
            # the dead process's CPU and RSS must not pass for the new one's
            # until it reports (the brain would calibrate on them).
            nw.samples.clear()
            nw.cpu_percent, nw.rss_bytes = 0.0, 0
            nw.running_ts = None
        elif kind in PENDING_KINDS:
            nw.revive()
            nw.begin_pending(now)
        else:  # running
            nw.revive()
            if not (nw.samples and nw.samples[-1].t >= ev.ts):  # its trainer reported already (events raced)
                nw.running_ts = ev.ts
            nw.end_pending(now)
            nw.lifecycle = Liveness.RUNNING
            nw.last_seen = max(nw.last_seen, now)
        self.evict(now)

    def observe_shards(self, st: DatasetStatus, now: float) -> None:
        self.datasets[st.dataset] = (st, now)
        self.evict(now)

    # ------------------------------------------------------------ derive

    def _short_start(self, nw: NodeWindow, start: float, shift: float) -> float:
        """Where a node's short window starts: ``start``; with the adapted window, not before the node's
        current level (:meth:`NodeWindow.level_since`)."""
        if self.cfg.window_short_min_s is None or not nw.samples or math.isinf(shift):
            return start
        floor = self.cfg.ps_latency_floor_s if nw.role == PS_ROLE else 0.0
        since = nw.level_since(shift, floor)
        return start if since is None else max(start, since)

    def short_window(self) -> tuple[float, dict[str, float]]:
        """The short window this job's statistics use: L_trans, or shorter when the BPTs are quiet enough.

        With ``window_short_min_s`` unset: ``window_short_s``.  Else, from the
        samples held (the long window): sigma, the robust relative noise of one
        report's BPT (1.4826 x the median of |b_k - b_k-1| / mean over
        consecutive reports of a node, / sqrt 2: the spread of a difference of
        two independent reports), and dt, the median time between a node's
        reports.  A window of n reports has a mean whose relative standard
        error is sigma / sqrt n, so the window is n x dt with n = (sigma /
        ``window_short_rel_error``)^2, at least 2 reports, clamped to
        [``window_short_min_s``, ``window_short_s``].  The median of the
        differences ignores the few large steps where a node turns slow or fast
        (those are the signal).  A PS's answer time is measured against at
        least ``ps_latency_floor_s`` (sub-millisecond jitter is no noise the
        slowness test would see).  Fewer than 8 differences: ``window_short_s``.

        Workers and PS are measured apart (a PS's answer time against the
        floor is far quieter than a worker's BPT and would hide its noise):
        the window is the longest any role needs, and a role with fewer than 8
        differences keeps ``window_short_s`` for all.

        Returns (the window, the level shift per role): a node's short window
        starts at its current level (:meth:`NodeWindow.level_since`), a level
        being samples within max(4 sigma, 2.5 x ``window_short_rel_error``) of
        each other (sigma of its role), so a change beyond the noise is seen
        by the first two reports after it.
        """
        cfg = self.cfg
        lo = cfg.window_short_min_s
        floor_shift = 2.5 * cfg.window_short_rel_error
        if lo is None or lo >= cfg.window_short_s:
            return cfg.window_short_s, {}
        rel: dict[str, list[float]] = {}
        gaps: dict[str, list[float]] = {}
        for nw in self.nodes.values():
            floor = cfg.ps_latency_floor_s if nw.role == PS_ROLE else 0.0
            r, g = rel.setdefault(nw.role, []), gaps.setdefault(nw.role, [])
            prev: Sample | None = None
            for smp in nw.samples:
                if prev is not None:
                    mean = max(floor, (prev.bpt_s + smp.bpt_s) / 2)
                    if mean > 0:
                        r.append(abs(smp.bpt_s - prev.bpt_s) / mean)
                        g.append(smp.t - prev.t)
                prev = smp
        # Per role (workers and PS report different things at different rates): the window is the longest
        # any role needs, and a role with too few reports to tell its noise keeps L_trans.
        window, shifts = lo, {}
        for role, diffs in rel.items():
            if len(diffs) < 8:
                return cfg.window_short_s, {}
            sigma = 1.4826 * statistics.median(diffs) / math.sqrt(2)
            n = max(2.0, (sigma / cfg.window_short_rel_error) ** 2)
            window = max(window, n * statistics.median(gaps[role]))
            shifts[role] = max(4 * sigma, floor_shift)
        return min(cfg.window_short_s, window), shifts

    def state_of(self, nw: NodeWindow, now: float) -> Liveness:
        if nw.lifecycle is Liveness.RUNNING and now - nw.last_seen > self.cfg.heartbeat_timeout_s:
            return Liveness.DEAD
        return nw.lifecycle

    def shard_summary(self) -> ShardSummary | None:
        if not self.datasets:
            return None
        items = [self.datasets[k] for k in sorted(self.datasets)]
        return ShardSummary(
            todo=sum(s.todo for s, _ in items),
            doing=sum(s.doing for s, _ in items),
            done=sum(s.done for s, _ in items),
            failed=sum(s.failed for s, _ in items),
            records_done=sum(s.records_done for s, _ in items),
            records_total=sum(s.records_total for s, _ in items),
            datasets=len(items),
            finished=all(s.finished for s, _ in items),
            updated=max(t for _, t in items),
        )

    def statistics(self, now: float, cluster_busy: bool) -> JobStatistics:
        cfg = self.cfg
        self.evict(now)
        names = sorted(self.nodes)
        states = {n: self.state_of(self.nodes[n], now) for n in names}
        window_short, shifts = self.short_window()
        short = {n: self.nodes[n].window(self._short_start(self.nodes[n], now - window_short,
                                                            shifts.get(self.nodes[n].role, math.inf)))
                 for n in names}
        long = {n: self.nodes[n].window(now - cfg.window_long_s) for n in names}
        live = [n for n in names if states[n] is Liveness.RUNNING]

        # Per role, the sorted BPTs of the live nodes with data: the median of a node's peers is
        # read off this list with the node's own entry skipped, O(log n) per node instead of O(n).
        by_role: dict[tuple[int, str], list[float]] = {}
        for which, win in ((0, short), (1, long)):
            for p in live:
                if win[p].has_data:
                    by_role.setdefault((which, self.nodes[p].role), []).append(win[p].bpt_s)
        for vals in by_role.values():
            vals.sort()

        def slowdown(n: str, win: dict[str, WindowStats]) -> float:
            """BPT of n over the median BPT of its live same-role peers (AntDT-ND: T_i / T)."""
            if not win[n].has_data:
                return 0.0
            role = self.nodes[n].role
            vals = by_role.get((0 if win is short else 1, role), [])
            ref = _median_without(vals, win[n].bpt_s)
            if role == PS_ROLE and ref > 0:
                ref = max(ref, cfg.ps_latency_floor_s)
            return win[n].bpt_s / ref if ref > 0 else 0.0

        out: list[NodeStats] = []
        throughput = 0.0
        pending = 0
        waited_too_long = False
        for n in names:
            nw, state = self.nodes[n], states[n]
            alive = state is Liveness.RUNNING
            s_short = slowdown(n, short) if alive else 0.0
            s_long = slowdown(n, long) if alive else 0.0
            kind = StragglerKind.NONE
            # Section VI-A step 5: T_i^per >= lambda * T^per -> persistent
            # (with evidence older than the short window, see module docstring).
            oldest = long[n].oldest
            if s_long >= cfg.slowness_ratio and oldest is not None and now - oldest >= cfg.min_span_s:
                kind = StragglerKind.PERSISTENT
            # Section VI-A step 3: T_i^trans >= lambda * T^trans -> transient.
            elif s_short >= cfg.slowness_ratio:
                kind = StragglerKind.TRANSIENT
            speed = short[n].speed if alive else 0.0
            if alive and nw.role != PS_ROLE:
                throughput += speed
            if state is Liveness.PENDING:
                pending += 1
            pending_s = nw.pending_s if nw.pending_since is None else max(0.0, now - nw.pending_since)
            if state is Liveness.PENDING and pending_s >= cfg.busy_pending_s:
                waited_too_long = True
            out.append(
                NodeStats(
                    node=n,
                    role=nw.role,
                    bpt_short_s=short[n].bpt_s,
                    bpt_long_s=long[n].bpt_s,
                    speed_samples_per_s=speed,
                    samples_total=nw.samples_total,
                    cpu_percent=nw.cpu_percent,
                    rss_bytes=nw.rss_bytes,
                    last_seen=nw.last_seen,
                    state=state,
                    pending_s=pending_s,
                    init_s=nw.init_s,
                    restarts=nw.restarts,
                    slowdown_short=s_short,
                    slowdown_long=s_long,
                    straggler=kind,
                )
            )
        return JobStatistics(
            job=self.job,
            ts=now,
            window_short_s=window_short,
            window_long_s=cfg.window_long_s,
            throughput_samples_per_s=throughput,
            nodes=out,
            cluster_busy=cluster_busy or waited_too_long,
            pending_nodes=pending,
            shards=self.shard_summary(),
            slowness_ratio=cfg.slowness_ratio,
        )


class MonitorCore:
    """The monitor's state over every job, plus the cluster's.

    Feed it observations in arrival order (each with the monitor's ``now``),
    then ask :meth:`statistics`.  Jobs are created by their first observation
    and dropped with :meth:`forget`.
    """

    def __init__(self, cfg: MonitorConfig | None = None) -> None:
        self.cfg = cfg or MonitorConfig()
        self.jobs: dict[str, JobWindows] = {}
        self.cluster: ClusterInfo | None = None

    def job(self, job: str) -> JobWindows:
        jw = self.jobs.get(job)
        if jw is None:
            jw = self.jobs[job] = JobWindows(job, self.cfg)
        return jw

    def observe_metrics(self, m: AgentMetrics, now: float) -> None:
        """Application state (V-D): one agent report of k steps."""
        self.job(m.job).observe_metrics(m, now)

    def observe_heartbeat(self, hb: Heartbeat, now: float) -> None:
        """An agent is alive: keeps a node that steps slowly from looking dead."""
        self.job(hb.job).observe_heartbeat(hb, now)

    def observe_node_event(self, ev: NodeEvent, now: float) -> None:
        """Node state (V-D): pending / running / died, which also counts restarts and pending time.

        Kinds it does not know are ignored (and create nothing).
        """
        if ev.kind.lower() in PENDING_KINDS | RUNNING_KINDS | DEAD_KINDS:
            self.job(ev.job).observe_node_event(ev, now)

    def observe_shards(self, st: DatasetStatus, now: float) -> None:
        """Third-party information (V-D): a dataset's shard counts from the shard service."""
        self.job(st.job).observe_shards(st, now)

    def observe_cluster(
        self,
        pending_pods: int,
        now: float,
        *,
        free_cpu: float | None = None,
        total_cpu: float | None = None,
    ) -> bool:
        """Third-party information (V-D): the cluster scheduler's queue and capacity.

        Returns whether the cluster is busy: pods are queued or too little
        capacity is free.  AntDT-ND takes KILL_RESTART only when it is not
        (section VI-A step 5), since a relaunched node would wait in the queue.
        """
        free: float | None = None
        if free_cpu is not None and total_cpu is not None and total_cpu > 0:
            free = max(0.0, min(1.0, free_cpu / total_cpu))
        self.cluster = ClusterInfo(max(0, pending_pods), free, now)
        return self.cluster_busy(now)

    def cluster_busy(self, now: float) -> bool:
        c = self.cluster
        if c is None or now - c.at > self.cfg.cluster_stale_s:
            return False
        if c.pending_pods >= self.cfg.busy_pending_pods:
            return True
        return c.free_fraction is not None and c.free_fraction < self.cfg.busy_free_fraction

    def statistics(self, job: str, now: float) -> JobStatistics:
        """The job's statistics at ``now`` (evicts what fell out of the long window)."""
        jw = self.jobs.get(job)
        if jw is None:
            raise NotFound(f"monitor knows nothing about job {job!r}")
        return jw.statistics(now, self.cluster_busy(now))

    def forget(self, job: str) -> None:
        """Drop a finished job's state."""
        self.jobs.pop(job, None)


def _median_without(sorted_vals: list[float], own: float) -> float:
    """Median of ``sorted_vals`` with one entry equal to ``own`` removed (0.0 if nothing is left)."""
    i = bisect.bisect_left(sorted_vals, own)
    skip = i if i < len(sorted_vals) and sorted_vals[i] == own else len(sorted_vals)
    m = len(sorted_vals) - (skip < len(sorted_vals))

    def at(j: int) -> float:
        return sorted_vals[j] if j < skip else sorted_vals[j + 1]

    if m <= 0:
        return 0.0
    k = m // 2
    return at(k) if m % 2 else (at(k - 1) + at(k)) / 2
