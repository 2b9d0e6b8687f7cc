"""Brain core, DLRover 2023 §4.2: sample, optimize (Eq. 10-11, Table 1) and adjust.

Table 1 of the paper (C_total = 200, batch 512, R in steps/s)::

    model stage     N_w  w   N_ps  w-hat  s_total-hat  R
    W&D   sample    1    32  1     2.5    5.7          12
          optimize  24   3   8     2.3    85.1         210
    xDFM  sample    1    32  1     19.4   3.1          6.2
          optimize  8    20  2     18.3   27.4         47.8

The optimize rows follow from the sample rows with Eq. 10 rounded down
(N_w in Z+ within C_total), Eq. 11 with the sampled w-hat, N_ps = s_total / 16
rounded down, and w = w-hat rounded up to whole cores.
"""

from __future__ import annotations

from dataclasses import replace

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
    TrainingMode,
)
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats
from pacer_services.brain.core.stages import (
    MIB,
    SampleProfile,
    StageConfig,
    adjust,
    fit_to_spec,
    on_sample_oom,
    on_sample_saturated,
    optimize,
    profile_from_statistics,
    sample_plan,
)

PAPER = StageConfig(c_total=200.0, c_max=32.0, ps_cpu_target=16.0)


def spec(name: str = "j", **kw: object) -> JobSpec:
    base: dict[str, object] = dict(
        name=name,
        model=ModelConfig(name=ModelName.WIDE_DEEP),
        dataset=DatasetConfig(path="/data/day0.tsv", format=DataFormat.CRITEO_TSV),
    )
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def sampled(w_hat: float, s_total_hat: float, r: float, **kw: object) -> SampleProfile:
    base: dict[str, object] = dict(workers=1, ps=1, worker_cpu=w_hat, ps_cpu_total=s_total_hat, throughput=r)
    base.update(kw)
    return SampleProfile(**base)  # type: ignore[arg-type]


def cpu(plan: ResourcePlan) -> float:
    return plan.workers * plan.worker_cpu + plan.ps * plan.ps_cpu


# ------------------------------------------------------------------ optimize


def test_table1_wide_deep_optimize_row_from_its_sample_row() -> None:
    """W&D: N_w = 200 / (2.5 + 5.7) = 24.39 -> 24; s_total = 200 - 24 * 2.5 = 140;
    N_ps = 140 / 16 = 8.75 -> 8; w = 2.5 -> 3.  All of Table 1's optimize row."""
    out = optimize(sampled(2.5, 5.7, 12.0), spec(), PAPER)
    assert out.n_workers_exact == pytest.approx(24.390, abs=1e-3)
    assert out.s_total == pytest.approx(140.0)
    assert (out.plan.workers, out.plan.worker_cpu, out.plan.ps) == (24, 3.0, 8)
    assert out.plan.ps_cpu == 16.0
    assert cpu(out.plan) <= 200.0
    assert out.plan.source == PlanSource.BRAIN


def test_table1_xdeepfm_optimize_row_from_its_sample_row() -> None:
    """xDFM: N_w = 200 / (19.4 + 3.1) = 8.89 -> 8; s_total = 200 - 8 * 19.4 = 44.8;
    N_ps = 44.8 / 16 = 2.8 -> 2; w = 19.4 -> 20."""
    out = optimize(sampled(19.4, 3.1, 6.2), spec(), PAPER)
    assert out.n_workers_exact == pytest.approx(8.889, abs=1e-3)
    assert out.s_total == pytest.approx(44.8)
    assert (out.plan.workers, out.plan.worker_cpu, out.plan.ps) == (8, 20.0, 2)
    assert cpu(out.plan) <= 200.0


@pytest.mark.parametrize(("w_hat", "s_hat", "r", "r_opt", "paper_ratio"), [
    (2.5, 5.7, 12.0, 210.0, 0.73),  # §4.2: "0.96 vs 0.73" (the text also says 0.81 once)
    (19.4, 3.1, 6.2, 47.8, 0.96),
])
def test_predicted_throughput_gives_the_papers_speed_up_ratio(
        w_hat: float, s_hat: float, r: float, r_opt: float, paper_ratio: float) -> None:
    """Speed-up ratio = measured R / (N_w x sampled per-worker R): 210 / 288 and 47.8 / 49.6."""
    out = optimize(sampled(w_hat, s_hat, r), spec(), PAPER)
    assert r_opt / out.predicted_throughput == pytest.approx(paper_ratio, abs=0.005)


def test_optimize_uses_limits_max_cpu_as_c_total() -> None:
    """C_total = 50: N_w = 50 / 8.2 -> 6, s_total = 50 - 15 = 35, N_ps = 2."""
    out = optimize(sampled(2.5, 5.7, 12.0), spec(limits=ResourceLimits(max_cpu=50)), PAPER)
    assert out.c_total == 50.0
    assert (out.plan.workers, out.plan.ps) == (6, 2)
    assert cpu(out.plan) <= 50.0


def test_optimize_clamps_to_max_workers_and_keeps_user_values() -> None:
    s = spec(limits=ResourceLimits(max_workers=10), resources=ResourceRequest(ps=3))
    plan = optimize(sampled(2.5, 5.7, 12.0), s, PAPER).plan
    assert plan.workers == 10
    assert plan.ps == 3
    assert "max_workers" in plan.reason


def test_s_hat_is_per_worker_when_more_than_one_worker_was_sampled() -> None:
    """Two workers at 2.5 cores causing 11.4 PS cores = the W&D row per worker: same plan."""
    two = optimize(sampled(2.5, 11.4, 24.0, workers=2), spec(), PAPER).plan
    one = optimize(sampled(2.5, 5.7, 12.0), spec(), PAPER).plan
    assert (two.workers, two.ps, two.worker_cpu) == (one.workers, one.ps, one.worker_cpu)


def test_optimize_memory_from_observed_rss_with_headroom() -> None:
    """Default config: N_w = 64 / 4 = 16, s_total = 32, N_ps = 2.  PS: 600 MiB of runtime each
    plus (3200 - 2 x 600) partitioned over 2 PS = 1600 x 1.3 = 2080 -> 2112 (64 MiB steps);
    worker: 1000 x 1.3 = 1300 -> 1344."""
    prof = sampled(2.0, 2.0, 100.0, ps=2, worker_rss_mb=1000.0, ps_rss_mb=(1600.0, 1600.0))
    plan = optimize(prof, spec()).plan
    assert (plan.workers, plan.ps) == (16, 2)
    assert plan.ps_memory_mb == 2112
    assert plan.worker_memory_mb == 1344


def test_optimize_rejects_a_profile_without_cpu() -> None:
    with pytest.raises(ValueError):
        optimize(sampled(0.0, 0.0, 0.0), spec())


# -------------------------------------------------------------------- sample


def test_sample_plan_is_one_worker_and_a_few_ps_with_c_max() -> None:
    plan = sample_plan(spec(), replace(PAPER, sample_workers=1))  # the paper's sample: one worker
    assert (plan.workers, plan.ps, plan.worker_cpu, plan.ps_cpu) == (1, 2, 32.0, 32.0)
    assert plan.source == PlanSource.BRAIN


def test_sample_plan_takes_the_c_max_workers_the_quota_leaves_beside_the_ps() -> None:
    # 200 CPUs - 2 PS x 32 = 136: four 32-CPU workers (the default's most); 100 CPUs: one
    plan = sample_plan(spec(), PAPER)
    assert (plan.workers, plan.ps, plan.worker_cpu, plan.ps_cpu) == (4, 2, 32.0, 32.0)
    assert sample_plan(spec(), replace(PAPER, sample_workers=2)).workers == 2
    assert sample_plan(spec(), replace(PAPER, c_total=100.0)).workers == 1


def test_sample_plan_respects_backup_workers_and_limits() -> None:
    s = spec(mode=TrainingMode.BSP, backup_workers=1, limits=ResourceLimits(max_cpu=20))
    plan = sample_plan(s, PAPER)
    assert plan.workers == 2
    assert cpu(plan) <= 20.0


def test_worker_oom_while_sampling_doubles_worker_memory() -> None:
    plan = sample_plan(spec(), PAPER)
    after = on_sample_oom(plan, "worker", spec(), PAPER)
    assert after.worker_memory_mb == 2 * plan.worker_memory_mb
    assert (after.ps, after.ps_memory_mb) == (plan.ps, plan.ps_memory_mb)


def test_ps_oom_while_sampling_doubles_the_ps_count() -> None:
    plan = sample_plan(spec(), PAPER)
    after = on_sample_oom(plan, "ps", spec(), PAPER)
    assert after.ps == 2 * plan.ps
    assert after.ps_memory_mb == plan.ps_memory_mb


def test_ps_oom_with_max_ps_reached_doubles_ps_memory_instead() -> None:
    s = spec(limits=ResourceLimits(max_ps=2))
    plan = sample_plan(s, PAPER)
    after = on_sample_oom(plan, "ps", s, PAPER)
    assert after.ps == 2
    assert after.ps_memory_mb == 2 * plan.ps_memory_mb


def test_saturated_ps_while_sampling_get_more_cpu() -> None:
    plan = ResourcePlan("j", 1, 2, 8.0, 2048, 4.0, 2048, PlanSource.BRAIN)
    raised = on_sample_saturated(plan, sampled(2.0, 7.5, 10.0, ps=2), spec(), PAPER)
    assert raised is not None and raised.ps_cpu == 8.0
    assert on_sample_saturated(plan, sampled(2.0, 4.0, 10.0, ps=2), spec(), PAPER) is None


# -------------------------------------------------------------------- adjust


def running(ps_cpu: list[float], workers: int = 24) -> SampleProfile:
    return SampleProfile(workers=workers, ps=len(ps_cpu), worker_cpu=2.3, ps_cpu_total=sum(ps_cpu),
                         throughput=200.0, ps_cpu=tuple(ps_cpu),
                         ps_nodes=tuple(f"ps-{i}" for i in range(len(ps_cpu))))


def test_hot_ps_is_replaced_with_its_share_of_the_needed_cpu() -> None:
    """s = min(s_hot / s_total-hat * s-hat * N_w, C_max) with s-hat = 5.7 (W&D sample), N_w = 24:
    15.5 / 91.5 * 136.8 = 23.2 -> 24 cores and 16 / 91.5 * 136.8 = 23.9 -> 24 cores."""
    plan = ResourcePlan("j", 24, 8, 3.0, 2048, 16.0, 4096, PlanSource.BRAIN)
    out = adjust(plan, running([10.0] * 6 + [15.5, 16.0]), 5.7, spec(), PAPER)
    assert [(r.node, r.cpu) for r in out.replace_ps] == [("ps-6", 24.0), ("ps-7", 24.0)]
    assert out.added_workers == 0
    capped = adjust(plan, running([10.0] * 6 + [15.5, 16.0]), 5.7, spec(), StageConfig(c_max=20.0))
    assert {r.cpu for r in capped.replace_ps} == {20.0}


def test_balanced_ps_are_not_replaced() -> None:
    plan = ResourcePlan("j", 24, 8, 3.0, 2048, 16.0, 4096, PlanSource.BRAIN)
    out = adjust(plan, running([12.0] * 8), 5.7, spec(), PAPER)
    assert not out.changed
    assert out.plan == plan


def test_idle_ps_cpu_adds_workers_by_delta_n_w() -> None:
    """N_w = 8, s_total = 2 x 16 = 32, used 12: s-hat = 12 / 8 = 1.5, 32 / 1.5 = 21.3 -> 21,
    below sqrt(1024) = 32: +13 workers.  With K = 100 the ceiling sqrt(K) = 10 gives +2."""
    plan = ResourcePlan("j", 8, 2, 20.0, 2048, 16.0, 4096, PlanSource.BRAIN)
    out = adjust(plan, running([6.0, 6.0], workers=8), 3.1, spec(), PAPER)
    assert out.added_workers == 13 and out.plan.workers == 21
    small_k = adjust(plan, running([6.0, 6.0], workers=8), 3.1, spec(), StageConfig(c_max=32.0, idle_k=100.0))
    assert small_k.added_workers == 2


def test_idle_rule_respects_limits_and_threshold() -> None:
    plan = ResourcePlan("j", 8, 2, 20.0, 2048, 16.0, 4096, PlanSource.BRAIN)
    limited = adjust(plan, running([6.0, 6.0], workers=8), 3.1, spec(limits=ResourceLimits(max_workers=12)), PAPER)
    assert limited.plan.workers == 12 and limited.added_workers == 4
    busy = adjust(plan, running([10.0, 10.0], workers=8), 3.1, spec(), PAPER)  # 20 / 32 = 0.625 >= 0.5
    assert not busy.changed


# ------------------------------------------------------------ profile / spec


def node(name: str, role: str, cpu_percent: float, rss_mb: float,
         state: Liveness = Liveness.RUNNING) -> NodeStats:
    return NodeStats(node=name, role=role, bpt_short_s=0.1, bpt_long_s=0.1, speed_samples_per_s=10.0,
                     samples_total=100, cpu_percent=cpu_percent, rss_bytes=int(rss_mb * MIB), last_seen=1.0,
                     state=state, pending_s=0.0, restarts=0, slowdown_short=1.0, slowdown_long=1.0)


def test_profile_from_statistics_in_cores_and_mib() -> None:
    stats = JobStatistics(job="j", ts=1.0, window_short_s=300, window_long_s=600, throughput_samples_per_s=512.0,
                          nodes=[node("chief-0", "chief", 250.0, 900.0), node("worker-1", "worker", 150.0, 1100.0),
                                 node("worker-2", "worker", 900.0, 5000.0, Liveness.DEAD),
                                 node("ps-1", "ps", 80.0, 2000.0), node("ps-0", "ps", 120.0, 1500.0)])
    prof = profile_from_statistics(stats)
    assert prof is not None
    assert prof.workers == 2 and prof.ps == 2
    assert prof.worker_cpu == pytest.approx(2.0)  # (2.5 + 1.5) / 2, the dead worker left out
    assert prof.ps_cpu_total == pytest.approx(2.0)
    assert prof.s_hat == pytest.approx(1.0)
    assert prof.worker_rss_mb == pytest.approx(1100.0)
    assert prof.ps_nodes == ("ps-0", "ps-1") and prof.ps_cpu == pytest.approx((1.2, 0.8))
    empty = JobStatistics(job="j", ts=1.0, window_short_s=300, window_long_s=600, throughput_samples_per_s=0.0,
                          nodes=[node("ps-0", "ps", 50.0, 100.0)])
    assert profile_from_statistics(empty) is None


def test_fit_to_spec_scales_to_max_memory() -> None:
    plan = ResourcePlan("j", 4, 2, 2.0, 4096, 2.0, 8192, PlanSource.BRAIN)
    out = fit_to_spec(plan, spec(limits=ResourceLimits(max_memory_mb=16384)))
    assert out.workers * out.worker_memory_mb + out.ps * out.ps_memory_mb <= 16384
    assert out.workers >= 1 and out.ps >= 1
