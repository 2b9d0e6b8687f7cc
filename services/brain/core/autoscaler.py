"""A job's resources from submission to its end: DLRover's stages, steered by DLRover-RM's model.

One :class:`JobAutoscaler` per job, fed the monitor's statistics
(:class:`pacer.contracts.monitor.JobStatistics`) as they come; the brain
service and the simulator's ``pacer`` scaler drive the same object, so what
the benchmark measures is the code that runs jobs.

Stages (DLRover 2023 §4.2, the cores in :mod:`.stages`):

* **sample** - a job without history starts with :func:`.stages.sample_plan`
  (one worker and a few PS with C_max CPUs).  An OOM while sampling doubles
  the failed role (:func:`.stages.on_sample_oom`); saturated PS get more CPU
  and the sample goes on (:func:`.stages.on_sample_saturated`).  A job with
  history starts from its warm-start plan (DLRover-RM Alg. 1) and skips the
  sample.
* **optimize** - once the sample plan has been measured: N_w and s_total from
  w-hat and s-hat (DLRover 2023 Eq. 10-11, :func:`.stages.optimize`).
* **adjust** - every ``adjust_interval_s`` (DLRover-RM §6: 3 min), in order:
  1. OOM prevention (DLRover-RM §5.3, :class:`.oom.MemoryWatch`);
  2. hot PS get the CPU their share needs (DLRover 2023 §4.2 "Hot parameter
     server"; one plan gives all PS one size, so the PS CPU becomes the
     largest replacement's);
  3. the model: DLRover-RM Eq. 1-6 fitted online by NNLS on every
     configuration measured so far (:func:`.fitting.fit`), Pareto candidates
     of (cost, throughput) by NSGA-II (:func:`.pareto.pareto_candidates`),
     and the weighted greedy choice (Eq. 8, 11-14, :func:`.cluster.select`)
     within the job's quota - or, across jobs, within the cluster's
     (:func:`plan_cluster`);
  4. while the model has too few configurations to fit, idle PS CPU buys
     workers (DLRover 2023 §4.2 "Idle CPU resource in PS").

Choices of ours where the papers are silent (all in :class:`AutoscaleConfig`):

* A measurement counts only when every node of the plan in force is running
  and has been for ``settle_s``; nothing new is decided while the last
  decision is not in force (for at most three intervals); throughput per configuration is the mean of
  its valid measurements (noise averages out, a configuration revisited adds
  evidence).
* A model fitted on few configurations extrapolates badly, so candidates lie
  in a trust region around the current plan (counts at most x ``trust`` and
  +``trust_add``), and where a candidate was measured its measured
  throughput replaces the prediction; the measured configurations are
  candidates too, so a step that disappointed is undone.
* A change must promise at least ``min_gain`` (2 %) more throughput than
  the current plan measures, and more than twice the noise of that
  measurement (the relative spread of windows of one plan, pooled); below
  that the job stays put (Eq. 8's overhead already discounts pauses; this
  keeps noise and the optimism of the model's best prediction from causing
  churn).
* After ``patience`` (3) exploring moves in a row that did not raise the
  best measured throughput by ``min_gain``, the job goes back to its best
  measured plan and stops exploring (each move pauses training).

Pure: no IO and no clock; ``now`` is whatever clock the caller uses.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pacer.contracts.jobs import JobSpec, ResourceLimits, ResourcePlan
from pacer.contracts.monitor import JobStatistics, NodeState

from .cluster import (
    DEFAULT_RHO,
    JobChoice,
    JobRequest,
    OverheadModel,
    Resources,
    ScalingRecord,
    plan_resources,
    select,
)
from .fitting import Config, FitError, Model, Sample, fit
from .oom import DEFAULT_OOM, MemorySample, MemoryWatch, OomConfig, fit_memory_trend
from .pareto import (
    Candidate,
    NoFeasiblePlan,
    Prices,
    SearchSpace,
    non_dominated,
    pareto_candidates,
    plan_cost,
)
from .stages import (
    DEFAULT_STAGES,
    MIB,
    WORKER_ROLES,
    SampleProfile,
    StageConfig,
    adjust,
    cpu_up,
    fit_to_spec,
    job_cpu_quota,
    memory_for,
    on_sample_oom,
    on_sample_saturated,
    optimize,
    profile_from_statistics,
    sample_plan,
)

__all__ = [
    "AutoscaleConfig",
    "Decision",
    "JobAutoscaler",
    "Proposal",
    "Stage",
    "plan_cluster",
    "same_resources",
]


class Stage(str, enum.Enum):
    SAMPLE = "sample"
    ADJUST = "adjust"


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """Knobs of the autoscaler; the defaults are the documented ones."""

    stages: StageConfig = DEFAULT_STAGES
    adjust_interval_s: float = 180.0  # DLRover-RM §6: "adjusts ... every 3 minutes"
    settle_s: float = 30.0  # a plan counts as measured after all its nodes ran this long
    min_gain: float = 0.02  # a model-based change must promise this much more throughput
    trust: float = 1.5  # candidates: counts at most x trust ...
    trust_add: int = 4  # ... + trust_add of the current plan's (CPUs per node: x trust only)
    busy: float = 0.9  # a node using this share of its CPUs may need more
    min_configs: int = 2  # distinct measured configurations before the model is fitted
    patience: int = 3  # exploring moves in a row that do not raise the best measured throughput -> converged
    default_noise: float = 0.05  # relative noise of one window until it can be estimated
    memory_horizon_s: float = 3600.0  # new PS are sized for the model this far ahead
    hot_ps_growth: float = 1.5  # a hot PS gets CPU for this much more throughput than now
    max_memory_mb: int | None = None  # the job's memory quota when limits.max_memory_mb is absent
    prices: Prices = field(default_factory=Prices)
    rho: float = DEFAULT_RHO
    overhead: OverheadModel = field(default_factory=OverheadModel)  # defaults until pauses are reported
    pop_size: int = 40
    generations: int = 50
    seed: int = 0
    oom: OomConfig | None = DEFAULT_OOM  # None: no OOM prediction (the benchmark's control)


@dataclass(frozen=True, slots=True)
class Decision:
    """A new plan for the job and why."""

    plan: ResourcePlan
    stage: Stage
    rule: str  # sample-oom | sample-saturated | optimize | oom | hot-ps | model | idle-ps
    predicted_throughput: float = 0.0  # 0: not predicted


@dataclass(frozen=True, slots=True)
class Proposal:
    """What one job brings to a planning round: a rule's decision, or candidates for the cluster stage."""

    decision: Decision | None = None
    request: JobRequest | None = None


def same_resources(a: ResourcePlan | None, b: ResourcePlan | None) -> bool:
    """Whether two plans ask for the same nodes (reason and source aside)."""
    if a is None or b is None:
        return a is b
    return (a.workers, a.ps, a.worker_cpu, a.worker_memory_mb, a.ps_cpu, a.ps_memory_mb) == (
        b.workers, b.ps, b.worker_cpu, b.worker_memory_mb, b.ps_cpu, b.ps_memory_mb)


_Key = tuple[int, int, float, float]  # (workers, ps, worker CPU, PS CPU): what the model sees


def _key(plan: ResourcePlan) -> _Key:
    return (plan.workers, plan.ps, plan.worker_cpu, plan.ps_cpu)


@dataclass(slots=True)
class _Measured:
    n: int = 0
    throughput: float = 0.0  # running mean
    m2: float = 0.0  # sum of squared log deviations (Welford), for the measurement noise
    log_mean: float = 0.0
    plan: ResourcePlan | None = None

    def add(self, value: float, plan: ResourcePlan) -> None:
        self.n += 1
        self.throughput += (value - self.throughput) / self.n
        x = math.log(max(value, 1e-12))
        delta = x - self.log_mean
        self.log_mean += delta / self.n
        self.m2 += delta * (x - self.log_mean)
        self.plan = plan


class JobAutoscaler:
    """The resources of one job over its life (module docstring).

    ``batch_size`` is m of DLRover-RM Eq. 1: samples per worker per
    iteration.  ``first`` is the plan to start with (default: the sample
    stage's, :func:`.stages.sample_plan`); with ``warm`` it is a warm-start
    plan (DLRover-RM Alg. 1) and the sample stage is skipped, else it is
    measured as the sample.
    Drive it with :meth:`first_plan`, then :meth:`step` (or, across jobs,
    :meth:`propose` and :func:`plan_cluster`) on every statistics window,
    :meth:`applied` when the plan in force changed and :meth:`on_oom`
    when a node died of OOM.
    """

    def __init__(self, spec: JobSpec, batch_size: int, config: AutoscaleConfig | None = None,
                 *, first: ResourcePlan | None = None, warm: bool = False) -> None:
        self.spec = spec
        self.batch_size = max(1, batch_size)
        self.config = config or AutoscaleConfig()
        self.stage = Stage.ADJUST if warm and first is not None else Stage.SAMPLE
        self._first = first
        self.plan: ResourcePlan | None = None  # the plan in force
        self.measured: dict[_Key, _Measured] = {}
        self.sample_profile: SampleProfile | None = None  # s-hat for the adjust stage's hot-PS rule
        self.pauses: list[ScalingRecord] = []
        self.memory = MemoryWatch(self.config.oom) if self.config.oom is not None else None
        self.model: Model | None = None
        self._model_keys: frozenset[_Key] = frozenset()
        self._candidates: list[Candidate] = []
        self._candidates_for: _Key | None = None  # the plan the trust region was around
        self._running_since: float | None = None
        self._last_decision: float = -math.inf
        self._pending: ResourcePlan | None = None  # decided, not yet reported applied
        self._model_mem: deque[MemorySample] = deque(maxlen=60)  # records trained -> model MiB on all PS
        self._records_total = 0
        self.decisions: list[Decision] = []
        self.converged = False  # the model stopped finding better plans: no more exploring moves
        self._fruitless = 0
        self._best_at_last_move = 0.0

    # ------------------------------------------------------------ inputs
    @property
    def quota(self) -> Resources:
        lim = self.spec.limits or ResourceLimits()
        mem = lim.max_memory_mb if lim.max_memory_mb is not None else self.config.max_memory_mb
        return Resources(cpu=job_cpu_quota(self.spec, self.config.stages),
                         memory_mb=float(mem) if mem is not None else math.inf)

    def first_plan(self) -> ResourcePlan:
        """The plan to start with: ``first``, else the sample stage's."""
        if self._first is None:
            self._first = sample_plan(self.spec, self.config.stages)
        return self._first

    def applied(self, plan: ResourcePlan, now: float) -> None:
        """``plan`` is now in force (the executor applied it); measurements restart."""
        if self.memory is not None and self.plan is not None and (
                plan.ps_memory_mb != self.plan.ps_memory_mb or plan.ps != self.plan.ps):
            for node in [n for n, r in self.memory.roles.items() if r == "ps"]:
                self.memory.forget(node)
        self.plan = plan
        self._running_since = None
        if same_resources(plan, self._pending):
            self._pending = None

    def paused(self, record: ScalingRecord) -> None:
        """The executor's report of what a re-plan cost (DLRover-RM Eq. 8's overhead, from history)."""
        self.pauses.append(record)

    def on_oom(self, role: str) -> ResourcePlan | None:
        """A node of ``role`` died of OOM: the sample stage's answer, or None (the executor's relaunch)."""
        if self.stage is not Stage.SAMPLE or self.plan is None:
            return None
        out = on_sample_oom(self.plan, role, self.spec, self.config.stages)
        self.decisions.append(Decision(out, Stage.SAMPLE, "sample-oom"))
        return out

    def _observe(self, now: float, stats: JobStatistics) -> SampleProfile | None:
        """Record a valid measurement of the plan in force; the profile when it is valid."""
        if self.memory is not None:
            self.memory.feed(stats)
        plan = self.plan
        if plan is None:
            return None
        live = [n for n in stats.nodes if n.state is NodeState.RUNNING]
        ps_rss = [n.rss_bytes / MIB for n in live if n.role == "ps" and n.rss_bytes > 0]
        if stats.shards is not None and ps_rss and len(ps_rss) == plan.ps:
            self._records_total = stats.shards.records_total
            base = float(self.config.stages.process_base_mb)
            done = float(stats.shards.records_done)
            if not self._model_mem or done > self._model_mem[-1].at:
                self._model_mem.append(MemorySample(done, sum(ps_rss) - base * len(ps_rss)))
        workers = sum(1 for n in live if n.role in WORKER_ROLES)
        ps = sum(1 for n in live if n.role == "ps")
        if workers != plan.workers or ps != plan.ps or stats.pending_nodes or stats.throughput_samples_per_s <= 0:
            self._running_since = None
            return None
        if self._running_since is None:
            self._running_since = now
            if self._last_decision == -math.inf:  # the first plan is measured for a whole interval
                self._last_decision = now
        if now - self._running_since < self.config.settle_s:
            return None
        profile = profile_from_statistics(stats)
        if profile is None:
            return None
        self.measured.setdefault(_key(plan), _Measured()).add(stats.throughput_samples_per_s, plan)
        return profile

    # ------------------------------------------------------------ decisions
    def step(self, now: float, stats: JobStatistics) -> Decision | None:
        """Feed one statistics window; a new plan for this job alone (within its quota), or None."""
        prop = self.propose(now, stats)
        if prop is None:
            return None
        if prop.decision is not None:
            return prop.decision
        assert prop.request is not None
        choice = select([prop.request], self.quota, prices=self.config.prices,
                        overhead=self.overhead_model(), rho=self.config.rho).choices[0]
        return self.accept(choice, now)

    def overhead_model(self) -> OverheadModel:
        return OverheadModel.from_history(self.pauses, self.config.overhead)

    def propose(self, now: float, stats: JobStatistics) -> Proposal | None:
        """Feed one statistics window; a rule's decision, a request for the cluster stage, or None."""
        profile = self._observe(now, stats)
        plan = self.plan
        if plan is None:
            return None
        remaining = 0.0
        if stats.shards is not None:
            remaining = max(0.0, float(stats.shards.records_total - stats.shards.records_done))
        # OOM prevention does not wait for the adjust interval nor for a valid measurement; while
        # sampling, OOMs double the role instead (DLRover 2023 §4.2) and the horizon means nothing.
        if (self.memory is not None and self.stage is Stage.ADJUST and stats.throughput_samples_per_s > 0
                and remaining > 0):
            raised = self.memory.plan_for(plan, now + remaining / stats.throughput_samples_per_s)
            if raised is not None:
                return Proposal(self._decide(now, Decision(replace(raised, job=plan.job), self.stage, "oom")))
        if profile is None or now - self._last_decision < self.config.adjust_interval_s:
            return None
        if self._pending is not None and now - self._last_decision < 3 * self.config.adjust_interval_s:
            return None  # the last decision is not in force yet (after 3 intervals: given up on)
        if self.stage is Stage.SAMPLE:
            return Proposal(self._sample_done(now, plan, profile))
        return self._adjust(now, plan, profile, remaining)

    def _decide(self, now: float, d: Decision) -> Decision:
        # Every plan within the job's quota: the stages round up (w = ceil(w-hat)), so Eq. 10's
        # N_w workers can exceed C_total; fit_to_spec then takes workers away first.
        lim = self.spec.limits or ResourceLimits()
        quota = self.quota
        capped = replace(self.spec, limits=replace(
            lim, max_cpu=quota.cpu, max_memory_mb=None if math.isinf(quota.memory_mb) else int(quota.memory_mb)))
        d = replace(d, plan=fit_to_spec(d.plan, capped))
        self._last_decision, self._pending = now, d.plan
        self.decisions.append(d)
        return d

    def _sample_done(self, now: float, plan: ResourcePlan, profile: SampleProfile) -> Decision:
        cfg = self.config.stages
        more = on_sample_saturated(plan, profile, self.spec, cfg)
        if more is not None:  # s-hat measured at 100 % is only a lower bound: sample on
            return self._decide(now, Decision(more, Stage.SAMPLE, "sample-saturated"))
        self.sample_profile = profile
        self.stage = Stage.ADJUST
        opt = optimize(profile, self.spec, cfg)
        plan = opt.plan
        grown = self._model_mb_ahead(opt.predicted_throughput)
        if grown is not None:  # Eq. 10-11 size the PS from the sample's RSS; embeddings keep growing
            need = memory_for(cfg.process_base_mb + grown * (1.0 + cfg.memory_headroom) / plan.ps, cfg)
            if need > plan.ps_memory_mb:
                plan = replace(plan, ps_memory_mb=need)
        return self._decide(now, Decision(plan, Stage.ADJUST, "optimize", opt.predicted_throughput))

    def _model_mb_ahead(self, throughput: float) -> float | None:
        """The model's MiB on all PS ``memory_horizon_s`` ahead at ``throughput`` (or at the job's end, if
        sooner), from its growth over the records trained (DLRover-RM §5.3); beyond the horizon the
        per-node OOM prediction raises memory in time, so an early, noisy slope is not extrapolated
        over the whole job (nor beyond ten times the progress it was measured over)."""
        if self.config.oom is None or self._records_total <= 0 or not self._model_mem:
            return None
        trend = fit_memory_trend(list(self._model_mem), self.config.oom)
        if trend is None:
            return None
        span = self._model_mem[-1].at - self._model_mem[0].at
        ahead = min(throughput * self.config.memory_horizon_s, 10.0 * span)  # no wild extrapolation
        at = min(float(self._records_total), self._model_mem[-1].at + ahead)
        return trend.at(at) + self.config.oom.z * trend.sigma_mb

    def _adjust(self, now: float, plan: ResourcePlan, profile: SampleProfile, remaining: float) -> Proposal | None:
        cfg = self.config.stages
        s_hat = profile.s_hat
        sp = self.sample_profile
        if sp is not None and sp.throughput > 0 and profile.throughput > 0 and plan.workers > 0:
            # The hot-PS rule's s-hat x N_w is the PS CPU N_w workers need.  The sample's s-hat is per
            # worker of the sample plan (one worker with C_max CPUs, far faster than one of N_w), so
            # scale the sample's PS CPU per sample/s to the job's throughput now, with room to grow.
            s_hat = sp.ps_cpu_total / sp.throughput * profile.throughput * self.config.hot_ps_growth / plan.workers
        adj = adjust(plan, profile, s_hat, self.spec, cfg)
        if adj.replace_ps:
            cpu = max(r.cpu for r in adj.replace_ps)
            hot = fit_to_spec(replace(plan, ps_cpu=cpu, reason=adj.plan.reason), self.spec)
            tried = self.measured.get(_key(hot))
            # Only where the quota allows it as such (fit_to_spec would otherwise take workers away),
            # and not again if it was measured and did no better than the plan in force.
            if (plan_resources(hot).fits_in(self.quota) and hot.workers == plan.workers
                    and not same_resources(hot, plan)
                    and (tried is None or tried.throughput > self.measured[_key(plan)].throughput)):
                return Proposal(self._decide(now, Decision(hot, Stage.ADJUST, "hot-ps")))
        candidates = self._model_candidates(plan, profile)
        if candidates is None:
            if adj.added_workers > 0:
                return Proposal(self._decide(now, Decision(adj.plan, Stage.ADJUST, "idle-ps")))
            self._last_decision = now
            return None
        current = self.measured[_key(plan)].throughput
        self._last_decision = now  # one model round per interval, whatever the cluster stage picks
        return Proposal(request=JobRequest(job=plan.job, candidates=candidates, remaining_samples=remaining,
                                           current=plan, current_throughput=current))

    def accept(self, choice: JobChoice, now: float) -> Decision | None:
        """The cluster stage's choice for this job, if it is worth a change (``min_gain``)."""
        plan = self.plan
        if choice.scored is None or choice.plan is None or plan is None or same_resources(choice.plan, plan):
            return None
        current = self.measured.get(_key(plan))
        predicted = choice.scored.candidate.throughput
        tried = self.measured.get(_key(choice.plan))
        if self.converged and (tried is None or not tried.n):
            return None  # done exploring: only a move back to a measured plan
        if current is not None:
            # Significant against the noise of a mean of current.n windows, and at least min_gain.
            need = max(self.config.min_gain, 2.0 * self.noise() / math.sqrt(max(1, current.n)))
            if predicted < current.throughput * (1.0 + need):
                return None
        if tried is None or not tried.n:  # an exploring move: count the ones that did not pay
            best = max((m.throughput for m in self.measured.values() if m.n), default=0.0)
            if best <= self._best_at_last_move * (1.0 + self.config.min_gain):
                self._fruitless += 1
            else:
                self._fruitless = 0
            self._best_at_last_move = max(best, self._best_at_last_move)
            if self._fruitless >= self.config.patience:
                self.converged = True
                return self._back_to_best(now)
        new = fit_to_spec(replace(choice.plan, job=plan.job), self.spec)
        return self._decide(now, Decision(new, Stage.ADJUST, "model", predicted))

    def noise(self) -> float:
        """Relative noise of one window's throughput, pooled over the configurations measured twice or more."""
        dof = sum(m.n - 1 for m in self.measured.values() if m.n > 1)
        if dof < 2:
            return self.config.default_noise
        return math.sqrt(sum(m.m2 for m in self.measured.values() if m.n > 1) / dof)

    def _back_to_best(self, now: float) -> Decision | None:
        plan = self.plan
        best = max((m for m in self.measured.values() if m.n and m.plan is not None),
                   key=lambda m: m.throughput, default=None)
        if plan is None or best is None or best.plan is None or same_resources(best.plan, plan):
            return None
        new = fit_to_spec(replace(best.plan, job=plan.job, reason=f"converged: back to the best measured plan "
                                  f"({best.throughput:.1f} samples/s)"), self.spec)
        return self._decide(now, Decision(new, Stage.ADJUST, "model", best.throughput))

    # ------------------------------------------------------------ the model
    def _fit(self) -> Model | None:
        keys = frozenset(k for k, m in self.measured.items() if m.n > 0)
        if len(keys) < self.config.min_configs:
            return None
        if keys != self._model_keys or self.model is None:
            samples = [Sample(Config(k[0], k[1], k[2], k[3], self.batch_size), self.measured[k].throughput)
                       for k in sorted(keys)]
            try:
                self.model = fit(samples)
            except FitError:
                self.model = None
            self._model_keys = keys
            self._candidates = []
        return self.model

    def _space(self, plan: ResourcePlan, profile: SampleProfile) -> SearchSpace:
        cfg, quota, c = self.config.stages, self.quota, self.config
        lim = self.spec.limits or ResourceLimits()
        by_cpu = max(1, int(quota.cpu // cfg.cpu_step))
        max_w = min(by_cpu, max(1, int(plan.workers * c.trust) + c.trust_add))
        max_p = min(by_cpu, max(1, int(plan.ps * c.trust) + c.trust_add))
        if lim.max_workers is not None:
            max_w = min(max_w, lim.max_workers)
        if lim.max_ps is not None:
            max_p = min(max_p, lim.max_ps)
        min_w = max(1, self.spec.backup_workers + 1, min(max_w, plan.workers // 2))
        min_p = max(1, min(max_p, plan.ps // 2))
        # CPUs per node: at most x trust per step, and no more than a node was seen to use
        # (+ the headroom) unless it used all it had: CPUs a node leaves idle buy nothing.
        def cpu_range(have: float, used: float) -> tuple[float, float]:
            hi = min(cfg.c_max, have * c.trust)
            if used < self.config.busy * have:
                hi = min(hi, max(cfg.cpu_step, cpu_up(used * (1.0 + cfg.memory_headroom), cfg)))
            return min(hi, max(cfg.cpu_step, have / c.trust)), hi
        lo_wc, hi_wc = cpu_range(plan.worker_cpu, profile.worker_cpu)
        lo_pc, hi_pc = cpu_range(plan.ps_cpu, max(profile.ps_cpu, default=plan.ps_cpu))
        # Memory: the PS share the model they hold; the TF runtime of each PS is not shared (as
        # optimize does), and every node keeps the stages' headroom over what it was seen using.
        base = float(cfg.process_base_mb)
        model_mb = max(0.0, sum(profile.ps_rss_mb) - base * len(profile.ps_rss_mb))
        # Embeddings grow with the data seen (DLRover-RM §5.3, Fig. 1(b)): size the PS for the
        # model at the job's end, from the model's size over the records trained (any PS count).
        current = self.measured.get(_key(plan))
        model_mb = max(model_mb, self._model_mb_ahead(current.throughput if current else profile.throughput) or 0.0)
        return SearchSpace(
            batch_size=self.batch_size, max_workers=max_w, max_ps=max_p,
            max_worker_cpu=hi_wc, max_ps_cpu=hi_pc, min_worker_cpu=lo_wc, min_ps_cpu=lo_pc,
            worker_memory_mb=plan.worker_memory_mb, ps_memory_mb=cfg.min_memory_mb,
            model_memory_mb=int(model_mb * (1.0 + cfg.memory_headroom)), ps_base_mb=memory_for(base, cfg),
            min_workers=min_w, min_ps=min_p, cpu_step=cfg.cpu_step,
            max_cpu=quota.cpu, max_memory_mb=None if math.isinf(quota.memory_mb) else int(quota.memory_mb),
        )

    def _model_candidates(self, plan: ResourcePlan, profile: SampleProfile) -> list[Candidate] | None:
        model = self._fit()
        if model is None:
            return None
        if not self._candidates or self._candidates_for != _key(plan):
            self._candidates_for = _key(plan)
            try:
                found = pareto_candidates(plan.job, model, self._space(plan, profile), seed=self.config.seed,
                                          prices=self.config.prices, pop_size=self.config.pop_size,
                                          generations=self.config.generations)
            except NoFeasiblePlan:
                found = []
            self._candidates = found
        prices = self.config.prices
        out: list[Candidate] = []
        seen: set[_Key] = set()
        for c in self._candidates:
            m = self.measured.get(_key(c.plan))
            out.append(Candidate(c.plan, c.cost, m.throughput) if m is not None and m.n else c)
            seen.add(_key(c.plan))
        quota = self.quota
        for k, m in self.measured.items():  # measured plans: a step that disappointed can be undone
            if k not in seen and m.plan is not None and plan_resources(m.plan).fits_in(quota):
                out.append(Candidate(replace(m.plan, reason=f"measured: {m.throughput:.1f} samples/s"),
                                     plan_cost(m.plan, prices), m.throughput))
        return non_dominated(out)


def plan_cluster(rounds: Sequence[tuple[JobAutoscaler, float, JobStatistics]], total: Resources,
                 *, prices: Prices | None = None, rho: float = DEFAULT_RHO) -> dict[str, Decision]:
    """One planning round across jobs sharing ``total`` (DLRover-RM §4.3 cluster stage, Eq. 11-14).

    Each item is (autoscaler, now, statistics).  Rule decisions (sample,
    optimize, OOM, hot PS) are taken first, in order, where they fit in what
    is left; the model requests then share the rest by weighted greedy
    selection.  ``total`` is what these jobs may hold together (their
    current plans included).
    """
    left = total
    for a, _, _ in rounds:
        left = left - plan_resources(a.plan)
    out: dict[str, Decision] = {}
    requests: list[tuple[JobAutoscaler, float, JobRequest]] = []
    for a, now, stats in rounds:
        prop = a.propose(now, stats)
        if prop is None or a.plan is None:
            continue
        if prop.decision is not None:
            extra = plan_resources(prop.decision.plan) - plan_resources(a.plan)
            if (left - extra).cpu >= -1e-9 and (left - extra).memory_mb >= -1e-9:
                out[a.plan.job] = prop.decision
                left = left - extra
            continue
        if prop.request is not None:
            requests.append((a, now, prop.request))
    if not requests:
        return out
    pool = left
    for _, _, r in requests:
        pool = pool + plan_resources(r.current)
    decision = select([r for _, _, r in requests], pool, prices=prices, rho=rho,
                      overhead=OverheadModel.from_history([p for a, _, _ in requests for p in a.pauses]))
    for (a, now, _), choice in zip(requests, decision.choices, strict=True):
        d = a.accept(choice, now)
        if d is not None:
            out[choice.job] = d
    return out

