"""One clamp of a plan to a job's limits (libs/pacer/jobs/limits.py), used by the default plan and the brain."""

from __future__ import annotations

import pytest
from pacer.contracts.jobs import (
    DataFormat,
    DatasetConfig,
    JobSpec,
    ModelConfig,
    ModelName,
    PlanSource,
    ResourceLimits,
    ResourcePlan,
    ResourceRequest,
)
from pacer.jobs.limits import Clamped, LimitsError, clamp
from pacer.jobs.spec import JobSpecError, default_plan
from pacer_services.brain.core.stages import fit_to_spec


def plan(workers: int = 8, ps: int = 4, cpu: float = 4.0, mem: int = 4096) -> ResourcePlan:
    return ResourcePlan("j", workers, ps, cpu, mem, cpu, mem, PlanSource.BRAIN)


def spec(limits: ResourceLimits | None = None, resources: ResourceRequest | None = None,
         backup_workers: int = 0) -> JobSpec:
    return JobSpec(name="j", model=ModelConfig(name=ModelName.WIDE_DEEP), dataset=DatasetConfig(path="/d.rec", format=DataFormat.RECORD),
                   limits=limits, resources=resources, backup_workers=backup_workers)


def test_a_plan_within_its_limits_is_unchanged() -> None:
    assert clamp(plan(), ResourceLimits(max_workers=8, max_ps=4, max_cpu=48.0, max_memory_mb=48 * 1024)) == \
        Clamped(plan())
    assert clamp(plan(), None) == Clamped(plan())


def test_a_count_limit_never_leaves_a_job_without_a_worker_or_a_ps() -> None:
    """The resolved difference: the default plan clamped PS to ``max_ps`` as given (0 -> a plan without a PS,
    which no executor can run), the brain to ``max(max_ps, 1)``.  Validation rejects limits below one, so
    this only happens to limits built in code; both now get one PS, and one worker."""
    zero = ResourceLimits(max_workers=0, max_ps=0)
    out = clamp(plan(), zero)
    assert (out.plan.workers, out.plan.ps) == (1, 1)
    assert out.notes == ("workers clamped to limits.max_workers=0", "ps clamped to limits.max_ps=0")
    assert (default_plan(spec(zero)).workers, default_plan(spec(zero)).ps) == (1, 1)
    assert (fit_to_spec(plan(), spec(zero)).workers, fit_to_spec(plan(), spec(zero)).ps) == (1, 1)


def test_the_default_plan_and_the_brain_clamp_alike() -> None:
    lim = ResourceLimits(max_workers=6, max_ps=3, max_cpu=10.0, max_memory_mb=9000)
    start = ResourcePlan("j", 2, 2, 1.0, 2048, 1.0, 2048, PlanSource.DEFAULT)  # the default plan's numbers
    by_default = default_plan(spec(lim))
    by_brain = fit_to_spec(start, spec(lim))
    fields = ("workers", "ps", "worker_cpu", "worker_memory_mb", "ps_cpu", "ps_memory_mb")
    assert [getattr(by_default, f) for f in fields] == [getattr(by_brain, f) for f in fields]
    assert by_default.workers * by_default.worker_memory_mb + by_default.ps * by_default.ps_memory_mb <= 9000


def test_cpu_is_fitted_by_workers_then_ps_then_per_node_amounts_and_user_values_stay() -> None:
    out = clamp(plan(workers=8, ps=4, cpu=4.0), ResourceLimits(max_cpu=20.0))
    assert (out.plan.workers, out.plan.ps, out.plan.worker_cpu) == (1, 4, 4.0)  # 4 + 16 = 20
    assert out.notes == ("workers/ps reduced to 1/4 to fit limits.max_cpu=20",)
    # the user fixed the workers: PS go, then the PS CPU scales into what the workers leave
    out = clamp(plan(workers=8, ps=4, cpu=2.0), ResourceLimits(max_cpu=17.0), user={"workers", "worker_cpu"})
    assert (out.plan.workers, out.plan.worker_cpu, out.plan.ps) == (8, 2.0, 1)
    assert out.plan.ps_cpu == 1.0 and len(out.notes) == 2
    with pytest.raises(LimitsError, match=r"limits\.max_cpu: 10 is below the 18"):
        clamp(plan(workers=8, ps=1, cpu=2.0), ResourceLimits(max_cpu=10.0), user={"workers", "worker_cpu"})


def test_backup_workers_set_the_fewest_workers() -> None:
    out = clamp(plan(workers=1), None, min_workers=3)
    assert out.plan.workers == 3
    with pytest.raises(LimitsError, match="backup_workers"):
        clamp(plan(workers=2), None, user={"workers"}, min_workers=3)
    # the spec's functions report it as a spec error, as before
    with pytest.raises(JobSpecError, match=r"limits\.max_memory_mb"):
        fit_to_spec(plan(), spec(ResourceLimits(max_memory_mb=1000), ResourceRequest(worker_memory_mb=4096)))
