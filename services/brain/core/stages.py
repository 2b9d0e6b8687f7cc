"""DLRover 2023 §4.2: the three stages of a job's resources (sample, optimize, adjust).

*Sample* (:func:`sample_plan`): a new job without history runs one worker (the
paper; here as many as the quota leaves, up to ``sample_workers``) and
a few PS, every node with C_max CPUs and the default memory, so that the
worker's CPU need w-hat and the PS's CPU need s-hat can be measured without
either side being starved.  An OOM while sampling doubles the worker's memory
or the number of PS (:func:`on_sample_oom`); saturated PS get more CPU
(:func:`on_sample_saturated`), since s-hat measured at 100 % is only a lower
bound.

*Optimize* (:func:`optimize`): from the sample's profile,

    N_w     = C_total / (w-hat + s-hat)              (DLRover 2023 Eq. 10)
    s_total = C_total - N_w * w-hat                  (DLRover 2023 Eq. 11)
    N_ps    = s_total / s,  s = 16                   (DLRover 2023 §4.2)

where s-hat is the PS CPU that *one* worker causes (all PS together).  Counts
are whole numbers (Eq. 6, N_w, N_ps in Z+), rounded down so the plan stays
within C_total; a worker gets w-hat rounded up to whole cores.  With these
roundings both optimize rows of Table 1 follow from their sample rows
(``tests/unit/test_brain_stages.py``).

*Adjust* (:func:`adjust`): a hot PS is replaced by one with

    s = min(s_hot-hat / s_total-hat * s-hat * N_w, C_max)   (DLRover 2023 §4.2, "Hot parameter server")

and idle PS CPU buys more workers:

    s-hat'   = s_total-hat / N_w
    Delta N_w = min(s_total / s-hat', sqrt(K)) - N_w        (DLRover 2023 §4.2, "Idle CPU resource in PS")

The paper leaves K undefined; here sqrt(K) is a ceiling on the worker count
(:attr:`StageConfig.idle_k`, default 1024, i.e. at most 32 workers).

Every plan goes through :func:`fit_to_spec`: the user's own ``resources``
win and ``limits`` clamp the rest by :func:`pacer.jobs.limits.clamp`, the
clamp :func:`pacer.jobs.spec.default_plan` uses too.

Units: CPU in cores (the monitor's ``cpu_percent`` / 100), memory in MiB,
throughput in whatever unit the caller feeds in (the monitor gives samples/s;
Table 1 gives steps/s), carried through unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from pacer.contracts.jobs import (
    JobSpec,
    PlanSource,
    ResourceLimits,
    ResourcePlan,
    ResourceRequest,
)
from pacer.contracts.monitor import JobStatistics, Liveness
from pacer.jobs.limits import LimitsError, clamp
from pacer.jobs.spec import DEFAULT_PLAN, RESOURCE_FIELDS, JobSpecError

from .calibration import skew

MIB = 1024 * 1024
WORKER_ROLES = ("worker", "chief")  # the chief trains like any worker
_EPS = 1e-9  # absorbs float noise before floor/ceil (200 / 8.0 must stay 25)


@dataclass(frozen=True, slots=True)
class StageConfig:
    """Knobs of the three stages; the defaults are the documented ones."""

    c_total: float = 64.0  # C_total: a job's CPU quota when its limits.max_cpu is absent
    c_max: float = 16.0  # C_max: CPUs of one node (Eq. 5)
    ps_cpu_target: float = 16.0  # s: CPUs per PS after optimize ("we set s = 16", §4.2)
    cpu_step: float = 1.0  # CPUs are whole cores (Eq. 6: w_i, s_j in Z+)
    sample_ps: int = 2  # "a few parameter servers" while sampling
    sample_workers: int = 4  # C_max workers while sampling, as many as the quota leaves beside the PS, at most this
    sample_memory_mb: int = DEFAULT_PLAN.worker_memory_mb  # "default memory" while sampling ...
    sample_memory_per_cpu_mb: int = 512  # ... or this per CPU of the C_max node, if more (a node's shape)
    memory_headroom: float = 0.3  # memory = observed RSS x (1 + headroom)
    memory_step_mb: int = 64  # memory is rounded up to this
    min_memory_mb: int = 512  # no node gets less
    max_node_memory_mb: int = 64 * 1024  # no node gets more (OOM doubling stops here)
    process_base_mb: int = 600  # RSS of a bare TF process (docs/design.md): not partitioned over PS
    ps_saturated: float = 0.9  # sample: PS CPU use / PS CPU above this -> more PS CPU (§4.2 "like 0.9")
    hot_ps: float = 0.9  # adjust: a PS whose CPU use / its CPU is above this is hot
    idle_ps: float = 0.5  # adjust: PS CPU use / PS CPU below this is idle
    idle_k: float = 1024.0  # adjust: K of Delta N_w; sqrt(K) caps the worker count


DEFAULT_STAGES = StageConfig()


# ------------------------------------------------------------------ profiles


@dataclass(frozen=True, slots=True)
class SampleProfile:
    """What a running job uses: the input of optimize and adjust.

    ``worker_cpu`` is w-hat (cores one worker uses, mean over workers);
    ``ps_cpu_total`` is s_total-hat (cores all PS use together).
    """

    workers: int
    ps: int
    worker_cpu: float
    ps_cpu_total: float
    throughput: float
    worker_rss_mb: float = 0.0  # the largest worker RSS
    ps_rss_mb: tuple[float, ...] = ()  # each PS's RSS, in the order of ps_nodes
    ps_cpu: tuple[float, ...] = ()  # each PS's CPU use (cores), in the order of ps_nodes
    ps_nodes: tuple[str, ...] = ()

    @property
    def s_hat(self) -> float:
        """PS CPU per worker: s-hat = s_total-hat / N_w (DLRover 2023 §4.2)."""
        return self.ps_cpu_total / self.workers


def profile_from_statistics(stats: JobStatistics) -> SampleProfile | None:
    """The profile of a job from the monitor's statistics; ``None`` without a measured worker.

    Only running nodes count; a node without a CPU report (0) is not measured yet.
    """
    live = [n for n in stats.nodes if n.state == Liveness.RUNNING]
    workers = [n for n in live if n.role in WORKER_ROLES and n.cpu_percent > 0]
    ps = sorted((n for n in live if n.role == "ps"), key=lambda n: n.node)
    if not workers:
        return None
    return SampleProfile(
        workers=len(workers),
        ps=len(ps),
        worker_cpu=sum(n.cpu_percent for n in workers) / 100.0 / len(workers),
        ps_cpu_total=sum(n.cpu_percent for n in ps) / 100.0,
        throughput=stats.throughput_samples_per_s,
        worker_rss_mb=max(n.rss_bytes for n in workers) / MIB,
        ps_rss_mb=tuple(n.rss_bytes / MIB for n in ps),
        ps_cpu=tuple(n.cpu_percent / 100.0 for n in ps),
        ps_nodes=tuple(n.node for n in ps),
    )


# ---------------------------------------------------------- limits and units


def job_cpu_quota(spec: JobSpec, config: StageConfig = DEFAULT_STAGES) -> float:
    """C_total of the job: the configured quota, lowered to ``limits.max_cpu``."""
    lim = spec.limits or ResourceLimits()
    return config.c_total if lim.max_cpu is None else min(config.c_total, lim.max_cpu)


def fit_to_spec(plan: ResourcePlan, spec: JobSpec) -> ResourcePlan:
    """``plan`` with the user's ``resources`` applied and clamped to ``limits``.

    User values win and are never changed; the rest is clamped by
    :func:`pacer.jobs.limits.clamp` (counts to ``max_workers`` /
    ``max_ps``, then non-user workers, PS and per-node amounts shrink to fit
    ``max_cpu`` and ``max_memory_mb``), as the default plan is.  Raises :class:`~pacer.jobs.spec.JobSpecError` when the
    user's own values leave no way to fit (the spec's validation rejects such
    specs already).
    """
    req = spec.resources or ResourceRequest()
    user = {f for f in RESOURCE_FIELDS if getattr(req, f) is not None}
    given: dict[str, Any] = {f: getattr(req, f) for f in user}
    plan = replace(plan, **given)
    notes: list[str] = [plan.reason] if plan.reason else []
    if user:
        notes.append(f"user resources kept ({', '.join(f for f in RESOURCE_FIELDS if f in user)})")
    try:
        clamped = clamp(plan, spec.limits, user=user, min_workers=spec.backup_workers + 1,
                        min_cpu=DEFAULT_PLAN.min_cpu, min_memory_mb=DEFAULT_PLAN.min_memory_mb)
    except LimitsError as exc:
        raise JobSpecError(exc.problems) from None
    plan = clamped.plan
    notes.extend(clamped.notes)
    return replace(plan, source=PlanSource.BRAIN, reason="; ".join(notes))


def cpu_up(cores: float, config: StageConfig = DEFAULT_STAGES) -> float:
    """``cores`` rounded up to whole ``cpu_step`` (at least one step, at most C_max)."""
    steps = max(1, math.ceil(cores / config.cpu_step - _EPS))
    return min(steps * config.cpu_step, config.c_max)


def cpu_down(cores: float, config: StageConfig = DEFAULT_STAGES) -> float:
    """``cores`` rounded down to whole ``cpu_step`` (at least one step)."""
    steps = max(1, math.floor(cores / config.cpu_step + _EPS))
    return steps * config.cpu_step


def memory_for(rss_mb: float, config: StageConfig = DEFAULT_STAGES) -> int:
    """Memory for a node that was seen using ``rss_mb``: with headroom, rounded up, bounded."""
    want = rss_mb * (1.0 + config.memory_headroom)
    step = config.memory_step_mb
    mb = math.ceil(want / step - _EPS) * step
    return int(min(max(mb, config.min_memory_mb), config.max_node_memory_mb))


# -------------------------------------------------------------------- sample


def sample_memory(config: StageConfig = DEFAULT_STAGES) -> int:
    """Memory of a sample-stage node: the default, or more on a big C_max node.

    DLRover 2023 §4.2 samples with "default memory" and doubles it on an OOM;
    each OOM costs a relaunch while the job trains at the sample's crawl.  A
    node of C_max CPUs comes with memory in proportion on any machine
    (``sample_memory_per_cpu_mb`` per CPU), so the sample asks for that: a
    few minutes of generous memory instead of OOM relaunches.
    """
    mb = max(config.sample_memory_mb, int(config.c_max * config.sample_memory_per_cpu_mb))
    return min(mb, config.max_node_memory_mb)


def sample_plan(spec: JobSpec, config: StageConfig = DEFAULT_STAGES) -> ResourcePlan:
    """The plan that profiles a new job: workers and a few PS with C_max CPUs (DLRover 2023 §4.2).

    The paper samples with one worker; the job crawls on the sample meanwhile,
    so it gets as many C_max workers as the quota leaves beside the sample's
    PS, at most ``sample_workers`` (w-hat and s-hat per worker are measured
    the same way; measured in the autoscaling simulator: four workers cut
    cold-start JCT over the oracle's by about 1 point).  BSP jobs with
    backup workers get at least the fewest workers they can run with.
    """
    mem = sample_memory(config)
    plan = ResourcePlan(
        job=spec.name,
        workers=max(1, spec.backup_workers + 1, min(config.sample_workers, int(
            (job_cpu_quota(spec, config) - config.sample_ps * config.c_max) // config.c_max))),
        ps=config.sample_ps,
        worker_cpu=config.c_max,
        worker_memory_mb=mem,
        ps_cpu=config.c_max,
        ps_memory_mb=mem,
        source=PlanSource.BRAIN,
        reason=f"sample stage: profile workers and {config.sample_ps} PS with C_max={config.c_max:g} CPUs",
    )
    return fit_to_spec(plan, spec)


def on_sample_oom(plan: ResourcePlan, role: str, spec: JobSpec,
                  config: StageConfig = DEFAULT_STAGES) -> ResourcePlan:
    """The sample plan after a node of ``role`` died of OOM (DLRover 2023 §4.2, "Sampling").

    A worker gets double memory.  For PS the paper doubles the *number* of PS
    so that the partitioned model has twice the memory; where ``limits.max_ps``,
    a user-fixed PS count or the CPU quota forbids that, each PS's memory
    doubles instead.
    Memory stops at ``max_node_memory_mb``.
    """
    req = spec.resources or ResourceRequest()
    lim = spec.limits or ResourceLimits()
    if role in WORKER_ROLES:
        mem = min(plan.worker_memory_mb * 2, config.max_node_memory_mb)
        out = replace(plan, worker_memory_mb=mem, reason=f"sample stage: worker OOM, worker memory doubled to {mem} MiB")
    elif role == "ps":
        can_grow = req.ps is None and (lim.max_ps is None or plan.ps * 2 <= lim.max_ps)
        if can_grow:
            out = replace(plan, ps=plan.ps * 2, reason=f"sample stage: PS OOM, PS doubled to {plan.ps * 2}")
            grown = fit_to_spec(out, spec)
            if grown.ps * grown.ps_memory_mb >= 2 * plan.ps * plan.ps_memory_mb:
                return grown
        # the PS count cannot double (limits, the user's count, or the CPU quota): memory per PS does
        mem = min(plan.ps_memory_mb * 2, config.max_node_memory_mb)
        out = replace(plan, ps_memory_mb=mem, reason=f"sample stage: PS OOM, PS memory doubled to {mem} MiB")
    else:
        raise ValueError(f"role must be worker, chief or ps, got {role!r}")
    return fit_to_spec(out, spec)


def on_sample_saturated(plan: ResourcePlan, profile: SampleProfile, spec: JobSpec,
                        config: StageConfig = DEFAULT_STAGES) -> ResourcePlan | None:
    """More PS CPU when the sampled PS are saturated, else ``None`` (DLRover 2023 §4.2, "Sampling").

    A saturated PS hides how much CPU it would use, so s-hat is only a lower
    bound: each PS's CPU doubles (up to C_max) and the sample goes on.  When
    the PS already have C_max, one more PS is added instead.
    """
    capacity = plan.ps * plan.ps_cpu
    if capacity <= 0 or profile.ps_cpu_total / capacity < config.ps_saturated:
        return None
    if plan.ps_cpu < config.c_max:
        cpu = min(plan.ps_cpu * 2, config.c_max)
        out = replace(plan, ps_cpu=cpu, reason=f"sample stage: PS saturated, PS CPU raised to {cpu:g}")
    else:
        out = replace(plan, ps=plan.ps + 1, reason=f"sample stage: PS saturated at C_max, PS raised to {plan.ps + 1}")
    fitted = fit_to_spec(out, spec)
    return None if (fitted.ps, fitted.ps_cpu) == (plan.ps, plan.ps_cpu) else fitted


# ------------------------------------------------------------------ optimize


@dataclass(frozen=True, slots=True)
class Optimized:
    """The result of the optimize stage, with the quantities of Eq. 10-11 for provenance."""

    plan: ResourcePlan
    c_total: float  # C_total used
    n_workers_exact: float  # Eq. 10 before rounding
    s_total: float  # Eq. 11
    predicted_throughput: float  # Eq. 1 with every worker at the sampled per-worker speed


def optimize(profile: SampleProfile, spec: JobSpec, config: StageConfig = DEFAULT_STAGES) -> Optimized:
    """The optimal plan from a profile (DLRover 2023 Eq. 10-11 and §4.2 "Optimize").

    Raises ``ValueError`` on a profile without CPU use (nothing to divide by).
    """
    w_hat = profile.worker_cpu
    s_hat = profile.s_hat
    if profile.workers < 1 or w_hat + s_hat <= 0:
        raise ValueError("optimize needs a profile with at least one worker using CPU")
    c_total = job_cpu_quota(spec, config)
    n_exact = c_total / (w_hat + s_hat)  # DLRover 2023 Eq. 10
    n_workers = max(1, math.floor(n_exact + _EPS))  # Eq. 9: N_w in Z+, rounded down to stay within Eq. 8
    s_total = max(0.0, c_total - n_workers * w_hat)  # DLRover 2023 Eq. 11
    n_ps = max(1, math.floor(s_total / config.ps_cpu_target + _EPS))  # §4.2: N_ps = s_total / s
    ps_cpu = min(config.ps_cpu_target, config.c_max, cpu_down(s_total / n_ps, config))
    worker_cpu = cpu_up(w_hat, config)  # Table 1: w-hat 2.5 -> w 3, 19.4 -> 20
    # The model's embeddings are partitioned over the PS; the TF runtime of each is not.  The
    # partitions are not equal (a hot embedding): the largest PS's share of what the sampled PS
    # held, kappa_mem = max share x p, gives the largest share over n_ps PS, min(1, kappa_mem / n_ps).
    shared = min([float(config.process_base_mb), *profile.ps_rss_mb])
    held = [max(0.0, r - shared) for r in profile.ps_rss_mb]
    partitioned = sum(held)
    share = min(1.0, (skew(held) or 1.0) / n_ps)
    ps_mem = memory_for(shared + partitioned * share, config) if profile.ps_rss_mb else sample_memory(config)
    worker_mem = memory_for(profile.worker_rss_mb, config) if profile.worker_rss_mb > 0 else sample_memory(config)
    plan = ResourcePlan(
        job=spec.name,
        workers=n_workers,
        ps=n_ps,
        worker_cpu=worker_cpu,
        worker_memory_mb=worker_mem,
        ps_cpu=ps_cpu,
        ps_memory_mb=ps_mem,
        source=PlanSource.BRAIN,
        reason=(f"optimize stage: w-hat={w_hat:.3g} s-hat={s_hat:.3g} C_total={c_total:g} -> "
                f"N_w={n_exact:.3g} (Eq. 10), s_total={s_total:.3g} (Eq. 11)"),
    )
    plan = fit_to_spec(plan, spec)
    per_worker = profile.throughput / profile.workers
    return Optimized(plan=plan, c_total=c_total, n_workers_exact=n_exact, s_total=s_total,
                     predicted_throughput=per_worker * plan.workers)


# -------------------------------------------------------------------- adjust


@dataclass(frozen=True, slots=True)
class PsReplacement:
    """Replace the hot PS ``node`` with one that has ``cpu`` cores."""

    node: str
    cpu: float
    usage: float  # s_hot-hat: the cores the hot PS uses now


@dataclass(frozen=True, slots=True)
class Adjustment:
    """What the adjust stage decided; ``changed`` is false when there is nothing to do."""

    plan: ResourcePlan
    replace_ps: tuple[PsReplacement, ...] = ()
    added_workers: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.replace_ps) or self.added_workers != 0


def adjust(plan: ResourcePlan, profile: SampleProfile, s_hat: float, spec: JobSpec,
           config: StageConfig = DEFAULT_STAGES) -> Adjustment:
    """Fix hot and idle PS of a running job (DLRover 2023 §4.2, "Adjust").

    ``profile`` is the job's current profile under ``plan`` (per-PS CPU use in
    ``ps_cpu`` / ``ps_nodes``); ``s_hat`` is the PS CPU that one worker caused
    in the sample stage ("the CPU usage of all PS where there is one worker").
    A ResourcePlan gives every PS the same CPU, so hot PS come back as
    replacements for the executor to apply node by node.  Hot PS are fixed
    first: more workers would only load a hot PS further, so idle PS CPU is
    turned into workers only when no PS is hot.
    """
    n_w = plan.workers
    s_total_hat = profile.ps_cpu_total
    replacements: list[PsReplacement] = []
    if s_total_hat > 0 and plan.ps_cpu > 0:
        for node, usage in zip(profile.ps_nodes, profile.ps_cpu, strict=True):
            if usage / plan.ps_cpu < config.hot_ps:
                continue
            # DLRover 2023 §4.2 "Hot parameter server": the hot PS's share of the
            # PS work, times the PS CPU that N_w workers need.
            want = min(usage / s_total_hat * s_hat * n_w, config.c_max)
            cpu = min(cpu_up(want, config), config.c_max)
            if cpu > plan.ps_cpu + _EPS:
                replacements.append(PsReplacement(node=node, cpu=cpu, usage=usage))
    added = 0
    out = plan
    s_total = plan.ps * plan.ps_cpu
    if not replacements and n_w > 0 and s_total > 0 and 0 < s_total_hat < config.idle_ps * s_total:
        s_hat_now = s_total_hat / n_w  # DLRover 2023 §4.2 "Idle CPU": s-hat = s_total-hat / N_w
        target = min(s_total / s_hat_now, math.sqrt(config.idle_k))  # Delta N_w = min(s_total / s-hat, sqrt(K)) - N_w
        delta = math.floor(target + _EPS) - n_w
        if delta > 0:
            grown = replace(plan, workers=n_w + delta,
                            reason=f"adjust stage: idle PS ({s_total_hat:.3g} of {s_total:g} CPUs used), +{delta} workers")
            out = fit_to_spec(grown, spec)
            added = out.workers - n_w
    if replacements:
        names = ", ".join(f"{r.node}->{r.cpu:g}" for r in replacements)
        out = replace(plan, reason=f"adjust stage: hot PS replaced ({names})")
    return Adjustment(plan=out, replace_ps=tuple(replacements), added_workers=added)
