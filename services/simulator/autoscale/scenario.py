"""Scenario files of the autoscaling simulator (:mod:`pacer_services.simulator.autoscale`): schema, defaults, validation, running.

Why: the autoscaling experiments of DLRover-RM §6 (a 200-CPU quota per job,
decisions every 3 minutes, Fig. 7 JCT and Fig. 10 throughput over time) are
kept as plain YAML files that users can edit (``examples/sim/autoscale-*.yaml``)
and run with ``pacer sim FILE [--scaler NAME]``.

A scenario is a YAML mapping with a top-level ``autoscale`` key (that key
is what tells ``pacer sim`` it is not a straggler scenario):

``name``  (str, default ``autoscale``) a label for reports.

``autoscale``:
  ``profile``            ``wide_deep`` | ``xdeepfm`` (default ``wide_deep``): the job family
                         whose nominal true parameters are used.
  ``truth``              (mapping, default {}) overrides of the profile's nominal true
                         parameters, by name (``a_grad``, ``b_grad``, ``par_w``, ``u_ps``,
                         ``skew`` (>= 1), ``par_p``, ``a_sync``, ``model_mb``,
                         ``bandwidth_mb_s``, ``beta``, ``ovh_w``, ``ovh_p``,
                         ``worker_base_mb``, ``ps_base_mb``, ``growth_mb_per_hour``,
                         ``batch_size``) and ``form``: ``dlrover`` (default) or
                         ``off-model``, a truth that departs from the structure the
                         brain's model assumes (:mod:`.truth`).  Scalers never see
                         them (only the oracle).
  ``draw``               (bool, default true) draw the job's true parameters around the
                         nominal ones (lognormal, ``sigma``) from the seed.
  ``sigma``              (>= 0, default 0.2) spread of those draws.
  ``samples``            (int > 0, default the profile's) samples to train.
  ``seed``               (int, default 0) seeds every draw; same file + seed -> same run.
  ``noise``              (>= 0, default 0.05) sigma of the lognormal noise on every measurement.
  ``scaler``             (str, default ``es``) ``oracle`` | ``es`` | ``optimus`` | ``static``
                         | ``pacer`` (any name of ``autoscale.SCALERS``); for a cluster
                         scenario a name of ``autoscale.CLUSTER_SCALERS``.
  ``params``             (mapping, default {}) scaler parameters (ES: ``step_workers``,
                         ``threshold``).
  ``quota_cpu``          (> 0, default 200) CPUs one job may hold (limits.max_cpu).
  ``quota_memory_mb``    (> 0, default unbounded) memory one job may hold.
  ``max_pod_cpu``        (> 0, default 32) CPUs of one pod at most.
  ``adjust_interval_s``  (> 0, default 180) the scaler decides this often.
  ``pending_s``          (>= 0, default 20) a new pod waits this long to be scheduled.
  ``init_s``             (>= 0, default 100) a trainer starts this long after its pod runs.
  ``checkpoint_s``       (> 0, default 600) a checkpoint this often; an OOM loses the rest.
  ``tick_s``             (> 0, default 10) simulation time step.
  ``max_hours``          (> 0, default 168) give up on a job after this long.
  ``user_plan``          (mapping) the typical user plan the baselines start from:
                         ``workers`` (4), ``worker_cpu`` (8), ``worker_memory_mb`` (16384),
                         ``ps`` (2), ``ps_cpu`` (8), ``ps_memory_mb`` (16384).
  ``cluster``            (mapping, default none) run many jobs sharing one quota instead:
                         ``cpu`` (> 0, default 2000), ``memory_mb`` (default 8 TiB),
                         ``jobs`` (int >= 1, default 50), ``arrival_mean_s`` (> 0, default
                         600; Poisson arrivals), ``mix`` (profile -> weight, default
                         ``{wide_deep: 0.5, xdeepfm: 0.5}``), ``size_min`` / ``size_max``
                         (default 0.1 / 0.5: a job trains the profile's samples x
                         U(size_min, size_max)).

Unknown fields and bad values raise :class:`ScenarioError` naming the field
by its dotted path (``autoscale.quota_cpu``, ``autoscale.cluster.mix.dcn``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ..fields import Fields, ScenarioError
from .runner import run_cluster, run_job
from .scalers import CLUSTER_SCALERS, SCALERS
from .truth import PROFILES, JobTruth
from .types import ClusterRun, JobRun, ScalerContext, SharedCluster, SimConfig, UserPlan

__all__ = ["AutoscaleScenario", "is_autoscale", "load", "parse", "run"]

_TRUTH_FLOATS = tuple(
    f.name for f in fields(JobTruth) if f.name not in ("profile", "model", "batch_size", "form")
)


@dataclass(frozen=True, slots=True)
class AutoscaleScenario:
    name: str
    profile: str
    truth: JobTruth  # nominal (before the seeded draw)
    samples_total: int
    scaler: str
    config: SimConfig
    seed: int = 0
    draw: bool = True
    user_plan: UserPlan = field(default_factory=UserPlan)
    params: dict[str, Any] = field(default_factory=dict)
    cluster: SharedCluster | None = None


def _truth(raw: Any, base: JobTruth) -> JobTruth:
    f = Fields(raw, "autoscale.truth")
    values: dict[str, Any] = {}
    for k in _TRUTH_FLOATS:
        if k in f.raw:
            values[k] = f.float_(k, lo=0.0, strict=k not in ("b_grad", "beta", "ovh_w", "ovh_p", "growth_mb_per_hour"))
    if "skew" in values and values["skew"] < 1.0:
        raise ScenarioError(f"autoscale.truth.skew: must be >= 1, got {values['skew']}")
    if "batch_size" in f.raw:
        values["batch_size"] = f.int_("batch_size", lo=1)
    if "form" in f.raw:
        values["form"] = f.str_("form", choices=("dlrover", "off-model"))
    f.done()
    return replace(base, **values)


def _user_plan(raw: Any) -> UserPlan:
    f = Fields(raw, "autoscale.user_plan")
    d = UserPlan()
    u = UserPlan(
        workers=f.int_("workers", d.workers, lo=1),
        worker_cpu=f.float_("worker_cpu", d.worker_cpu, lo=0.0, strict=True),
        worker_memory_mb=f.int_("worker_memory_mb", d.worker_memory_mb, lo=1),
        ps=f.int_("ps", d.ps, lo=1),
        ps_cpu=f.float_("ps_cpu", d.ps_cpu, lo=0.0, strict=True),
        ps_memory_mb=f.int_("ps_memory_mb", d.ps_memory_mb, lo=1),
    )
    f.done()
    return u


def _cluster(raw: Any) -> SharedCluster:
    f = Fields(raw, "autoscale.cluster")
    d = SharedCluster()
    mix_raw = f.get("mix", dict(d.mix))
    if not isinstance(mix_raw, Mapping) or not mix_raw:
        raise ScenarioError("autoscale.cluster.mix: must be a non-empty mapping profile -> weight")
    mf = Fields(mix_raw, "autoscale.cluster.mix")
    mix = []
    for k in mix_raw:
        if k not in PROFILES:
            raise ScenarioError(f"autoscale.cluster.mix.{k}: unknown profile; known: {', '.join(sorted(PROFILES))}")
        mix.append((str(k), mf.float_(k, lo=0.0)))
    if sum(w for _, w in mix) <= 0:
        raise ScenarioError("autoscale.cluster.mix: the weights must not all be 0")
    c = SharedCluster(
        cpu=f.float_("cpu", d.cpu, lo=0.0, strict=True),
        memory_mb=f.float_("memory_mb", d.memory_mb, lo=0.0, strict=True),
        jobs=f.int_("jobs", d.jobs, lo=1),
        arrival_mean_s=f.float_("arrival_mean_s", d.arrival_mean_s, lo=0.0, strict=True),
        mix=tuple(mix),
        size_min=f.float_("size_min", d.size_min, lo=0.0, strict=True),
        size_max=f.float_("size_max", d.size_max, lo=0.0, strict=True),
    )
    f.done()
    if c.size_max < c.size_min:
        raise ScenarioError(f"autoscale.cluster.size_max: must be >= size_min ({c.size_min}), got {c.size_max}")
    return c


def parse(raw: Any) -> AutoscaleScenario:
    """A validated :class:`AutoscaleScenario` from plain data (a loaded YAML document)."""
    top = Fields(raw, "")
    name = top.str_("name", "autoscale")
    f = Fields(top.get("autoscale"), "autoscale")
    top.done()
    profile = f.str_("profile", "wide_deep")
    if profile not in PROFILES:
        raise ScenarioError(f"autoscale.profile: unknown profile {profile!r}; known: {', '.join(sorted(PROFILES))}")
    truth = _truth(f.get("truth", {}), PROFILES[profile].truth)
    d = SimConfig()
    qmem = f.get("quota_memory_mb", None)
    cfg = SimConfig(
        quota_cpu=f.float_("quota_cpu", d.quota_cpu, lo=0.0, strict=True),
        quota_memory_mb=None if qmem is None else f.float_("quota_memory_mb", lo=0.0, strict=True),
        max_pod_cpu=f.float_("max_pod_cpu", d.max_pod_cpu, lo=0.0, strict=True),
        adjust_interval_s=f.float_("adjust_interval_s", d.adjust_interval_s, lo=0.0, strict=True),
        pending_s=f.float_("pending_s", d.pending_s, lo=0.0),
        init_s=f.float_("init_s", d.init_s, lo=0.0),
        checkpoint_s=f.float_("checkpoint_s", d.checkpoint_s, lo=0.0, strict=True),
        tick_s=f.float_("tick_s", d.tick_s, lo=0.0, strict=True),
        noise=f.float_("noise", d.noise, lo=0.0),
        sigma=f.float_("sigma", d.sigma, lo=0.0),
        max_time_s=f.float_("max_hours", d.max_time_s / 3600.0, lo=0.0, strict=True) * 3600.0,
    )
    if cfg.max_pod_cpu < 1.0 or cfg.quota_cpu < 2.0:
        raise ScenarioError(f"autoscale.quota_cpu: need >= 2 CPU and pods of >= 1 CPU, got "
                            f"quota_cpu {cfg.quota_cpu:g}, max_pod_cpu {cfg.max_pod_cpu:g}")
    cluster = _cluster(f.get("cluster")) if f.raw.get("cluster") is not None else None
    f.used.add("cluster")
    scaler = f.str_("scaler", "first-come-static" if cluster else "es")
    _check_scaler(scaler, cluster is not None)
    params = f.get("params", {})
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise ScenarioError("autoscale.params: must be a mapping with string keys")
    sc = AutoscaleScenario(
        name=name, profile=profile, truth=truth,
        samples_total=f.int_("samples", PROFILES[profile].samples_total, lo=1),
        scaler=scaler, config=cfg, seed=f.int_("seed", 0), draw=f.bool_("draw", True),
        user_plan=_user_plan(f.get("user_plan", {})), params=dict(params), cluster=cluster,
    )
    f.done()
    up = sc.user_plan
    if max(up.worker_cpu, up.ps_cpu) > cfg.max_pod_cpu:
        raise ScenarioError(f"autoscale.user_plan: pods must have <= max_pod_cpu ({cfg.max_pod_cpu:g}) CPUs")
    if up.ps * up.ps_cpu + up.worker_cpu > cfg.quota_cpu:
        raise ScenarioError(f"autoscale.user_plan: its PS and one worker exceed quota_cpu ({cfg.quota_cpu:g})")
    return sc


def _check_scaler(name: str, cluster: bool, field_name: str = "autoscale.scaler") -> None:
    known = CLUSTER_SCALERS if cluster else SCALERS
    if name not in known:
        kind = "cluster scaler" if cluster else "scaler"
        raise ScenarioError(f"{field_name}: unknown {kind} {name!r}; known: {', '.join(sorted(known))}")


def is_autoscale(path: str | Path) -> bool:
    """Whether the YAML file at ``path`` is an autoscale scenario (a top-level ``autoscale`` key)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError:
        return False
    return isinstance(raw, Mapping) and "autoscale" in raw


def load(path: str | Path) -> AutoscaleScenario:
    """Read and validate a scenario file (``OSError`` if unreadable)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {e}") from e
    return parse(raw)


def run(sc: AutoscaleScenario, scaler: str | None = None, *, oracle: bool = True) -> tuple[JobRun | ClusterRun, JobRun | None]:
    """Run the scenario under ``scaler`` (default the scenario's); also the oracle reference for one job.

    Returns (the run, the oracle's run or None).  An unknown scaler name is a
    :class:`ScenarioError` naming ``--scaler``.
    """
    name = scaler or sc.scaler
    _check_scaler(name, sc.cluster is not None, "--scaler" if scaler else "autoscale.scaler")
    if sc.cluster is not None:
        return run_cluster(sc.cluster, CLUSTER_SCALERS[name](
            ScalerContext(sc.truth, sc.samples_total, sc.config, sc.user_plan, sc.params)), sc.seed, sc.config), None
    kw: dict[str, Any] = dict(seed=sc.seed, samples_total=sc.samples_total, config=sc.config,
                              user_plan=sc.user_plan, params=sc.params, name=sc.name, draw=sc.draw)
    res = run_job(sc.truth, name, **kw)
    ref = run_job(sc.truth, "oracle", **kw) if oracle and name != "oracle" else (res if name == "oracle" else None)
    return res, ref
