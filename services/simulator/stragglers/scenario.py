"""Scenario files of the straggler simulator: schema, defaults and validation.

A scenario is a YAML mapping.  Every field, its unit and its default
(defaults follow AntDT §VII-A: 100 batches per shard, agent reports every 10
iterations, monitor every 5 min, lambda 1.5, L_trans 5 min, L_per 10 min):

``name``   (str, required) a label for reports.
``seed``   (int, default 0) seeds every random choice of the run (transient
           straggler draws, shard order).  Same scenario + seed -> same result.
``method`` (str, default ``none``) the straggler policy: ``none`` | ``antdt-nd``
           | ``antdt-dd`` | ``lb-bsp`` | ``backup-workers`` (or any name the
           controller's policy registry knows); ``--method`` overrides it.
``params`` (mapping, default {}) policy parameters, passed as
           ``PolicyRequest.params``.

``cluster``:
  ``workers``        (int >= 1, required) worker count; nodes are ``worker-0`` ...
  ``ps``             (int >= 1, default 1) parameter servers ``ps-0`` ...
  ``worker_speed``   (samples/s > 0, required) compute speed of a healthy worker:
                     T_w = B_i / worker_speed (AntDT Eq. 1's F(B_i), linear in B_i
                     as the paper's Fig. 8 validates for CPUs).
  ``device_groups``  (list, default none) a heterogeneous (dedicated) cluster, AntDT-DD:
                     ``[{name: fast, count: 15, speed: 3000, max_batch: 4096}, ...]``;
                     counts sum to ``workers`` and are assigned in order (worker-0
                     first); ``speed`` replaces ``worker_speed`` for the group;
                     ``max_batch`` (0: unbounded) is the group's device memory
                     limit, passed to the policy as
                     ``params.max_batch_per_group``.
  ``ps_time_s``      (s >= 0, default 0.1) server time T_s per step of a healthy PS.
  ``comm_s``         (s >= 0, default 0.1) communication time T_m per step.
  ``pending_s``      (s >= 0, default 20) a relaunched pod waits this long in the
                     scheduler queue (idle cluster; DLRover's pod start-up).
  ``init_s``         (s >= 0, default 100) trainer start after the pod runs:
                     rebuild the communication world, restore the checkpoint,
                     rebuild the graph (AntDT §V-D: "several minutes"; DDS-based
                     restart delay ~2 min in AntDT Fig. 17).
  ``ps_migration``   (``restart`` | ``seamless``, default restart) how a PS is
                     KILL_RESTARTed: ``restart``: the PS is gone at once and
                     training pauses pending_s + init_s; ``seamless`` as
                     Pacer's executor migrates a PS (DLRover-RM §5.2): the
                     replacement starts (pending_s + ps_start_s) while the old
                     PS keeps serving, then training pauses init_s while the
                     workers move.  Seamless wins for a mildly slow PS and
                     loses for a very slow one (it keeps serving meanwhile).
  ``ps_start_s``     (s >= 0, default 30) a new PS process's start-up after its pod runs.
  ``adjust_bs_s``    (s >= 0, default 0) what one ADJUST_BS costs in BSP: every
                     worker waits this long at the step boundary where it
                     applies (live it is a two-phase barrier at an iteration
                     chosen ahead of every worker, so normally ~0; a
                     sensitivity knob).
  ``busy``           (bool, default false) the cluster scheduler has pods queued:
                     the monitor's cluster-busy flag (AntDT-ND then does not
                     KILL_RESTART workers).
  ``report_steps``   (int >= 1, default 10) k: the agent reports every k iterations,
  ``worker_report_s`` (s > 0, default 4) or after fewer when k take longer than
                     this (at least one; the live agent's ``PACER_AGENT_WORKER_REPORT_S``).
  ``report_span_s``  (s > 0, default 30) consecutive k-step reports whose BPT did
                     not change are merged into one report covering at most this
                     long (speed; the monitor's windows are step-weighted, so
                     the means are unchanged; but the monitor's adapted window
                     is a number of reports x their spacing, and a change is
                     seen one report later: set it to ``worker_report_s`` for
                     the live cadence throughout, as ``make bench-stragglers``
                     does).
  ``report_noise``   (>= 0, default 0) measurement noise: each worker report's BPT
                     is multiplied by 1 + N(0, report_noise) (seeded by the run's
                     seed); the steps themselves are not.  Live BPTs are never
                     exact; the monitor's noise-adapted window reads this.
  ``progress_s``     (s > 0, default 30) a worker reports its shard progress to the
                     shard service this often (the shard client's lease sync);
                     work since the last report is recomputed after a death.

``job``:
  ``mode``              ``bsp`` | ``asp`` (default ``bsp``).
  ``global_batch``      (int >= workers, required) B; the local batch starts at
                        B // workers (the remainder goes to the first workers).
  ``records``           (int > 0, required) records per epoch.
  ``epochs``            (int >= 1, default 1).
  ``batches_per_shard`` (int >= 1, default 100) M: a shard is M local batches.
  ``backup_workers``    (int >= 0, default 0) b at start (BSP: the b slowest
                        gradients of each step are dropped).
  ``min_batch``         (int >= 1, default 1) / ``max_batch`` (int >= 0, default 0 =
                        unbounded): bounds on B_i passed to the policy.
  ``tail_split``        (bool, default true) the shard service cuts the last
                        shards into pieces by each worker's rate
                        (``DatasetSpec.tail_split``); false: whole shards.

``stragglers``: a list of (AntDT §VII-A4, T_delay = sleep_s x intensity):
  ``node``        (str, required) ``worker-<i>`` or ``ps-<j>``, must exist.
  ``side``        ``worker`` | ``ps`` (default: from the node name; must agree).
                  Worker delays add to T_w, PS delays to that PS's T_s.
  ``pattern``     ``persistent`` | ``transient`` | ``none`` (default ``persistent``).
  ``sleep_s``     (s >= 0, default 1.5) SleepDuration.
  ``intensity``   (0..1, default 0.8) Intensity.
  ``start_s``     (s >= 0, default 0) the pattern begins at this time.
  ``period_s``    (s > 0, default 1800) transient: time is cut into periods ...
  ``on_s``        (0 < on_s <= period_s, default 900) ... and in each period ...
  ``probability`` (0..1, default 0.3) ... with this probability the node is slow
                  for the first ``on_s`` seconds (one seeded draw per period).
  ``follows_restart`` (bool; default false for persistent, true for transient):
                  whether the slowness stays with the node after KILL_RESTART
                  (false: the relaunched node lands on a healthy machine).

``monitor``:
  ``interval_s``      (s > 0, default 300) a policy decision this often (the
                      controller's ``PACER_CONTROLLER_EVERY_S``); more often when
                      the monitor's short window is shorter (see ``stats_s``).
  ``stats_s``         (s > 0, default: ``interval_s``) the monitor computes the
                      statistics this often (``PACER_MONITOR_INTERVAL_S``); at
                      each, a round is due when ``min(interval_s, the statistics'
                      short window)`` has passed since the last one, as the live
                      controller decides (one round per fresh short window).
  ``window_short_s``  (s > 0, default 300) L_trans.
  ``window_long_s``   (s >= window_short_s, default 600) L_per.
  ``lambda``          (> 1, default 1.5) slowness ratio.
  ``window_short_min_s`` (s > 0, default none: a fixed L_trans) the monitor's
                      noise-adapted short window may shrink to this
                      (``MonitorConfig.window_short_min_s``,
                      ``PACER_MONITOR_WINDOW_SHORT_MIN_S`` live).
  ``window_short_rel_error`` (> 0, default 0.035) the relative standard error
                      of a node's mean BPT that the adapted window must reach.

Unknown fields and bad values raise :class:`ScenarioError` naming the field
by its dotted path (``cluster.workers``, ``stragglers[0].intensity``).

Names: a scenario's :class:`SimCluster` (machines), :class:`Workload` (the
training job) and :class:`InjectedStraggler` (one straggler pattern on one
node; its delays come from :class:`pacer.trainer.straggler.Pattern`, the
generator of the real trainer's injection) are distinct from the live
system's ``Workload`` and ``StragglerSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pacer.contracts.common import Role
from pacer.trainer.straggler import PatternKind, StragglerSpec

from ..fields import Fields, ScenarioError

__all__ = ["InjectedStraggler", "MonitorSpec", "Scenario", "ScenarioError", "SimCluster", "SimDeviceGroup",
           "Workload", "load", "parse"]


@dataclass(frozen=True, slots=True)
class SimDeviceGroup:
    """``cluster.device_groups[i]``: workers of one device type (AntDT-DD)."""

    name: str
    count: int
    speed: float
    max_batch: int = 0


@dataclass(frozen=True, slots=True)
class SimCluster:
    """``cluster``: the simulated machines, their speeds and the costs of a relaunch."""

    workers: int
    worker_speed: float
    ps: int = 1
    ps_time_s: float = 0.1
    comm_s: float = 0.1
    pending_s: float = 20.0
    init_s: float = 100.0
    busy: bool = False
    ps_migration: str = "restart"
    ps_start_s: float = 30.0
    adjust_bs_s: float = 0.0
    report_steps: int = 10
    worker_report_s: float = 4.0
    report_span_s: float = 30.0
    report_noise: float = 0.0
    progress_s: float = 30.0
    device_groups: tuple[SimDeviceGroup, ...] = ()

    def speeds(self) -> list[float]:
        """Compute speed of each worker (worker-0 first)."""
        if not self.device_groups:
            return [self.worker_speed] * self.workers
        return [g.speed for g in self.device_groups for _ in range(g.count)]

    def groups(self) -> dict[str, str]:
        """worker -> device group name (empty for a homogeneous cluster)."""
        names = [g.name for g in self.device_groups for _ in range(g.count)]
        return {f"worker-{i}": n for i, n in enumerate(names)}


@dataclass(frozen=True, slots=True)
class Workload:
    """``job``: the training job that runs on the cluster (its data, batch and mode)."""

    global_batch: int
    records: int
    mode: str = "bsp"
    epochs: int = 1
    batches_per_shard: int = 100
    backup_workers: int = 0
    min_batch: int = 1
    max_batch: int = 0
    tail_split: bool = True


@dataclass(frozen=True, slots=True)
class InjectedStraggler:
    """One straggler pattern on one node of the simulated job (the fields of ``stragglers[i]``)."""

    node: str
    side: Role
    pattern: PatternKind = PatternKind.PERSISTENT
    sleep_s: float = 1.5
    intensity: float = 0.8
    start_s: float = 0.0
    period_s: float = 1800.0
    on_s: float = 900.0
    probability: float = 0.3
    follows_restart: bool = False

    def spec(self, seed: int) -> StragglerSpec:
        """The trainer's straggler spec of this pattern in a run seeded ``seed`` (the run's seed, not the file's)."""
        return StragglerSpec(kind=self.pattern, sleep_s=self.sleep_s, intensity=self.intensity,
                             period_s=self.period_s, on_s=self.on_s, probability=self.probability,
                             seed=seed, start_s=self.start_s)


@dataclass(frozen=True, slots=True)
class MonitorSpec:
    """``monitor``: how often statistics and decisions come, and the monitor's windows."""

    interval_s: float = 300.0
    stats_s: float | None = None  # None: interval_s
    window_short_s: float = 300.0
    window_long_s: float = 600.0
    lambda_: float = 1.5
    window_short_min_s: float | None = None
    window_short_rel_error: float = 0.035


    @property
    def tick_s(self) -> float:
        """How often the monitor computes statistics."""
        return self.interval_s if self.stats_s is None else self.stats_s


@dataclass(frozen=True, slots=True)
class Scenario:
    """One scenario file: a cluster, a job on it, its stragglers and the policy (``method``)."""

    name: str
    cluster: SimCluster
    job: Workload
    seed: int = 0
    method: str = "none"
    stragglers: tuple[InjectedStraggler, ...] = ()
    monitor: MonitorSpec = field(default_factory=MonitorSpec)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def worker_names(self) -> list[str]:
        return [f"worker-{i}" for i in range(self.cluster.workers)]

    @property
    def ps_names(self) -> list[str]:
        return [f"ps-{j}" for j in range(self.cluster.ps)]


# ---------------------------------------------------------------- parsing helpers


def _cluster(raw: Any) -> SimCluster:
    f = Fields(raw, "cluster")
    c = SimCluster(
        workers=f.int_("workers", lo=1),
        worker_speed=f.float_("worker_speed", lo=0.0, strict=True),
        ps=f.int_("ps", 1, lo=1),
        ps_time_s=f.float_("ps_time_s", 0.1, lo=0.0),
        comm_s=f.float_("comm_s", 0.1, lo=0.0),
        pending_s=f.float_("pending_s", 20.0, lo=0.0),
        init_s=f.float_("init_s", 100.0, lo=0.0),
        busy=f.bool_("busy", False),
        ps_migration=f.str_("ps_migration", "restart", choices=("restart", "seamless")),
        ps_start_s=f.float_("ps_start_s", 30.0, lo=0.0),
        adjust_bs_s=f.float_("adjust_bs_s", 0.0, lo=0.0),
        report_steps=f.int_("report_steps", 10, lo=1),
        worker_report_s=f.float_("worker_report_s", 4.0, lo=0.0, strict=True),
        report_span_s=f.float_("report_span_s", 30.0, lo=0.0, strict=True),
        report_noise=f.float_("report_noise", 0.0, lo=0.0),
        progress_s=f.float_("progress_s", 30.0, lo=0.0, strict=True),
        device_groups=_device_groups(f.get("device_groups", [])),
    )
    f.done()
    if c.device_groups and sum(g.count for g in c.device_groups) != c.workers:
        raise ScenarioError(f"cluster.device_groups: counts sum to {sum(g.count for g in c.device_groups)}, "
                            f"not to cluster.workers ({c.workers})")
    return c


def _device_groups(raw: Any) -> tuple[SimDeviceGroup, ...]:
    if not isinstance(raw, list):
        raise ScenarioError("cluster.device_groups: must be a list")
    out = []
    for i, item in enumerate(raw):
        f = Fields(item, f"cluster.device_groups[{i}]")
        out.append(SimDeviceGroup(name=f.str_("name"), count=f.int_("count", lo=1),
                               speed=f.float_("speed", lo=0.0, strict=True), max_batch=f.int_("max_batch", 0, lo=0)))
        f.done()
    if len({g.name for g in out}) != len(out):
        raise ScenarioError("cluster.device_groups: group names must differ")
    return tuple(out)


def _job(raw: Any, workers: int) -> Workload:
    f = Fields(raw, "job")
    j = Workload(
        mode=f.str_("mode", "bsp", choices=("bsp", "asp")),
        global_batch=f.int_("global_batch", lo=1),
        records=f.int_("records", lo=1),
        epochs=f.int_("epochs", 1, lo=1),
        batches_per_shard=f.int_("batches_per_shard", 100, lo=1),
        backup_workers=f.int_("backup_workers", 0, lo=0),
        min_batch=f.int_("min_batch", 1, lo=1),
        max_batch=f.int_("max_batch", 0, lo=0),
        tail_split=f.bool_("tail_split", True),
    )
    f.done()
    if j.global_batch < workers:
        raise ScenarioError(f"job.global_batch: must be >= cluster.workers ({workers}), got {j.global_batch}")
    if j.backup_workers >= workers:
        raise ScenarioError(f"job.backup_workers: must be < cluster.workers ({workers}), got {j.backup_workers}")
    if j.global_batch // workers < j.min_batch:
        raise ScenarioError(f"job.min_batch: the local batch {j.global_batch // workers} is below it ({j.min_batch})")
    return j


def _straggler(raw: Any, i: int, cluster: SimCluster) -> InjectedStraggler:
    path = f"stragglers[{i}]"
    f = Fields(raw, path)
    node = f.str_("node")
    role, _, idx = node.rpartition("-")
    count = {"worker": cluster.workers, "ps": cluster.ps}.get(role)
    if count is None or not idx.isdigit() or int(idx) >= count or str(int(idx)) != idx:
        raise ScenarioError(f"{path}.node: no such node {node!r} (worker-0..worker-{cluster.workers - 1}, ps-0..ps-{cluster.ps - 1})")
    side = f.str_("side", role, choices=tuple(r.value for r in Role))
    if side != role:
        raise ScenarioError(f"{path}.side: {side!r} does not match node {node!r}")
    pattern = PatternKind(f.str_("pattern", "persistent", choices=tuple(k.value for k in PatternKind)))
    period = f.float_("period_s", 1800.0, lo=0.0, strict=True)
    s = InjectedStraggler(
        node=node,
        side=Role(side),
        pattern=pattern,
        sleep_s=f.float_("sleep_s", 1.5, lo=0.0),
        intensity=f.float_("intensity", 0.8, lo=0.0, hi=1.0),
        start_s=f.float_("start_s", 0.0, lo=0.0),
        period_s=period,
        on_s=f.float_("on_s", 900.0, lo=0.0, hi=period, strict=True),
        probability=f.float_("probability", 0.3, lo=0.0, hi=1.0),
        follows_restart=f.bool_("follows_restart", pattern is PatternKind.TRANSIENT),
    )
    f.done()
    return s


def _monitor(raw: Any) -> MonitorSpec:
    f = Fields(raw, "monitor")
    m = MonitorSpec(
        interval_s=f.float_("interval_s", 300.0, lo=0.0, strict=True),
        stats_s=(f.float_("stats_s", 0.0, lo=0.0, strict=True) if f.get("stats_s", None) is not None else None),
        window_short_s=f.float_("window_short_s", 300.0, lo=0.0, strict=True),
        window_long_s=f.float_("window_long_s", 600.0, lo=0.0, strict=True),
        lambda_=f.float_("lambda", 1.5, lo=1.0, strict=True),
        window_short_min_s=(f.float_("window_short_min_s", 0.0, lo=0.0, strict=True)
                            if f.get("window_short_min_s", None) is not None else None),
        window_short_rel_error=f.float_("window_short_rel_error", 0.035, lo=0.0, strict=True),
    )
    f.done()
    if m.window_long_s < m.window_short_s:
        raise ScenarioError(f"monitor.window_long_s: must be >= window_short_s ({m.window_short_s}), got {m.window_long_s}")
    return m


def parse(raw: Any) -> Scenario:
    """A validated :class:`Scenario` from plain data (a loaded YAML document)."""
    f = Fields(raw, "")
    name = f.str_("name")
    seed = f.int_("seed", 0)
    method = f.str_("method", "none")
    cluster = _cluster(f.get("cluster"))
    job = _job(f.get("job"), cluster.workers)
    raw_st = f.get("stragglers", [])
    if not isinstance(raw_st, list):
        raise ScenarioError(f"stragglers: must be a list, got {type(raw_st).__name__}")
    stragglers = tuple(_straggler(s, i, cluster) for i, s in enumerate(raw_st))
    monitor = _monitor(f.get("monitor", {}))
    params = f.get("params", {})
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise ScenarioError("params: must be a mapping with string keys")
    f.done()
    return Scenario(
        name=name, seed=seed, method=method, cluster=cluster, job=job,
        stragglers=stragglers, monitor=monitor, params=dict(params),
    )


def load(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {e}") from None
    return parse(raw)
