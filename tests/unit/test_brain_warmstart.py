"""Brain core, DLRover-RM Alg. 1: top-k similar jobs, exponential smoothing, cold start; config DB records."""

from __future__ import annotations

import json
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
)
from pacer.jobs.spec import default_plan
from pacer_services.brain.core.calibration import Calibration
from pacer_services.brain.core.fitting import Coefficients
from pacer_services.brain.core.history import (
    JobFeatures,
    JobHistory,
    ObservedProfile,
    similarity,
    size_similarity,
    top_k_similar,
)
from pacer_services.brain.core.warmstart import (
    WarmStartConfig,
    exponential_smoothing,
    smoothing_weights,
    warm_start,
    warm_start_error_pct,
)


def spec(name: str = "new", model: ModelName = ModelName.WIDE_DEEP, path: str = "/data/criteo/day0.tsv",
         embed_dim: int = 8, **kw: object) -> JobSpec:
    base: dict[str, object] = dict(
        name=name,
        model=ModelConfig(name=model, embed_dim=embed_dim),
        dataset=DatasetConfig(path=path, format=DataFormat.CRITEO_TSV, records=1_000_000),
    )
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def history(job: str, s: JobSpec, workers: int, ps: int, worker_cpu: float, worker_mem: int,
            ps_cpu: float, ps_mem: int, throughput: float, finished_at: float = 100.0,
            succeeded: bool = True) -> JobHistory:
    plan = ResourcePlan(job, workers, ps, worker_cpu, worker_mem, ps_cpu, ps_mem, PlanSource.BRAIN, "final")
    first = ResourcePlan(job, 1, 2, 16.0, 2048, 16.0, 2048, PlanSource.BRAIN, "sample")
    return JobHistory(job=job, features=JobFeatures.from_spec(s), plans=(first, plan),
                      profiles=(ObservedProfile(at=60.0, workers=1, ps=2, worker_cpu=2.0, ps_cpu_total=1.5,
                                                throughput=throughput / workers, worker_rss_mb=900.0,
                                                ps_rss_mb=1200.0),),
                      throughput=throughput, finished_at=finished_at, succeeded=succeeded)


# Most similar to spec(): same model, same table, same sizes.
SAME = history("same", spec("same"), 10, 4, 2.0, 3000, 4.0, 5000, 1000.0)
# Same model, another table, embeddings twice as wide.
NEAR = history("near", spec("near", path="/data/other/day1.tsv", embed_dim=16), 6, 2, 1.0, 2000, 2.0, 3000, 300.0)
DCN = history("dcn", spec("dcn", model=ModelName.DCN, path="/x/y.tsv", embed_dim=64), 40, 20, 8.0, 9000, 8.0, 9000, 5.0)
XDFM = history("xdfm", spec("xdfm", model=ModelName.XDEEPFM, path="/x/z.tsv", embed_dim=32), 30, 10, 8.0, 9000, 8.0, 9000, 5.0)


def test_exponential_smoothing_follows_the_recurrence_by_hand() -> None:
    """A-bar^0 = 10; A-bar^1 = .5*20 + .5*10 = 15; A-bar^2 = .5*40 + .5*15 = 27.5."""
    assert exponential_smoothing([10.0, 20.0, 40.0], 0.5) == pytest.approx(27.5)
    assert exponential_smoothing([7.0], 0.3) == 7.0
    assert smoothing_weights(3, 0.5) == pytest.approx((0.25, 0.25, 0.5))
    assert sum(smoothing_weights(5, 0.6)) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        exponential_smoothing([1.0], 1.0)


def test_top_k_picks_the_most_similar_jobs_in_order() -> None:
    feats = JobFeatures.from_spec(spec())
    top = top_k_similar(feats, [DCN, NEAR, XDFM, SAME], k=2)
    assert [s.history.job for s in top] == ["same", "near"]
    assert top[0].similarity == pytest.approx(1.0)
    assert top[0].similarity > top[1].similarity
    # the order of the DB does not matter
    assert [s.history.job for s in top_k_similar(feats, [SAME, XDFM, NEAR, DCN], k=2)] == ["same", "near"]


def test_top_k_skips_failed_jobs_and_ties_go_to_the_newer_job() -> None:
    failed = history("failed", spec("failed"), 1, 1, 1.0, 1000, 1.0, 1000, 1.0, succeeded=False)
    older = history("older", spec("older"), 1, 1, 1.0, 1000, 1.0, 1000, 1.0, finished_at=50.0)
    top = top_k_similar(JobFeatures.from_spec(spec()), [failed, older, SAME], k=3)
    assert [s.history.job for s in top] == ["same", "older"]


def test_warm_start_smooths_the_final_plans_by_hand() -> None:
    """k = 2, mu = 0.6; A^0 = near (less similar), A^1 = same (most similar):
    workers .6*10 + .4*6 = 8.4 -> 8; ps .6*4 + .4*2 = 3.2 -> 3; worker_cpu 1.6; worker mem 2600;
    ps_cpu 3.2; ps mem 4200; per-worker throughput .6*100 + .4*50 = 80 -> x 8 workers = 640."""
    out = warm_start(spec(), [DCN, NEAR, SAME, XDFM], WarmStartConfig(k=2, mu=0.6, min_similarity=0.5))
    p = out.plan
    assert not out.cold
    assert [s.history.job for s in out.sources] == ["near", "same"]
    assert (p.workers, p.ps, p.worker_cpu, p.worker_memory_mb, p.ps_cpu, p.ps_memory_mb) == (8, 3, 1.6, 2600, 3.2, 4200)
    assert p.source == PlanSource.BRAIN and p.job == "new"
    assert out.weights == pytest.approx((0.4, 0.6))
    assert out.predicted_throughput == pytest.approx(640.0)


def test_the_most_similar_job_weighs_mu() -> None:
    """With mu = 0.9 the plan is nearly the most similar job's: .9*10 + .1*6 = 9.6 -> 10 workers."""
    out = warm_start(spec(), [NEAR, SAME], WarmStartConfig(k=2, mu=0.9))
    assert out.plan.workers == 10
    low = warm_start(spec(), [NEAR, SAME], WarmStartConfig(k=2, mu=0.1))  # .1*10 + .9*6 = 6.4 -> 6
    assert low.plan.workers == 6


def test_empty_history_is_a_cold_start_with_the_default_plan() -> None:
    out = warm_start(spec(), [])
    d = default_plan(spec())
    p = out.plan
    assert out.cold and out.sources == () and out.predicted_throughput == 0.0
    assert (p.workers, p.ps, p.worker_cpu, p.worker_memory_mb, p.ps_cpu, p.ps_memory_mb) == (
        d.workers, d.ps, d.worker_cpu, d.worker_memory_mb, d.ps_cpu, d.ps_memory_mb)
    assert p.source == PlanSource.BRAIN and "cold start" in p.reason


def test_only_dissimilar_jobs_is_a_cold_start() -> None:
    out = warm_start(spec(), [DCN, XDFM], WarmStartConfig(min_similarity=0.5))
    assert out.cold


def test_warm_start_respects_limits_and_user_resources() -> None:
    s = spec(limits=ResourceLimits(max_workers=5), resources=ResourceRequest(ps_memory_mb=8000))
    out = warm_start(s, [NEAR, SAME], WarmStartConfig(k=2))
    assert out.plan.workers == 5
    assert out.plan.ps_memory_mb == 8000


def test_warm_start_error_pct() -> None:
    out = warm_start(spec(), [NEAR, SAME], WarmStartConfig(k=2, mu=0.6))
    assert warm_start_error_pct(out, 800.0) == pytest.approx(20.0)  # |640 - 800| / 800
    assert warm_start_error_pct(900.0, 800.0) == pytest.approx(12.5)
    with pytest.raises(ValueError):
        warm_start_error_pct(1.0, 0.0)


# ------------------------------------------------------------------ history


def test_history_round_trips_through_plain_dicts_and_json() -> None:
    back = JobHistory.from_dict(json.loads(json.dumps(SAME.to_dict())))
    assert back == SAME
    assert back.final_plan is not None and back.final_plan.workers == 10
    learnt = replace(SAME, coefficients=Coefficients(0.004, 0.0012, 0.04, 0.0, 0.1))
    assert JobHistory.from_dict(json.loads(json.dumps(learnt.to_dict()))) == learnt
    assert "coefficients" not in SAME.to_dict()  # records of jobs that learnt nothing stay as they were
    calibrated = replace(learnt, calibration=cal(1.2, 4.0))
    assert JobHistory.from_dict(json.loads(json.dumps(calibrated.to_dict()))) == calibrated
    assert "calibration" not in learnt.to_dict()  # and records written before it existed read as none


def cal(worker_overhead: float, worker_parallel: float) -> Calibration:
    return Calibration(worker_overhead=worker_overhead, worker_cost=0.005, worker_parallel=worker_parallel,
                       ps_overhead=0.5, ps_cost=0.0013, ps_skew=1.5, ps_parallel=8.0, memory_skew=1.6)


def test_a_warm_start_brings_the_similar_jobs_calibrations_smoothed() -> None:
    """As the coefficients (Eq. 10, mu = 0.6): A^0 = near (overhead 0.6, P_w 3), A^1 = same (1.2, 5):
    .6*1.2 + .4*0.6 = 0.96 and .6*5 + .4*3 = 4.2; a job without one is left out."""
    same, near = replace(SAME, calibration=cal(1.2, 5.0)), replace(NEAR, calibration=cal(0.6, 3.0))
    out = warm_start(spec(), [near, same], WarmStartConfig(k=2, mu=0.6))
    assert out.calibration is not None
    assert out.calibration.worker_overhead == pytest.approx(0.96)
    assert out.calibration.worker_parallel == pytest.approx(4.2)
    assert out.calibration.ps_skew == pytest.approx(1.5)
    assert warm_start(spec(), [NEAR, same], WarmStartConfig(k=2, mu=0.6)).calibration == same.calibration
    assert warm_start(spec(), [NEAR, SAME], WarmStartConfig(k=2, mu=0.6)).calibration is None


def test_a_warm_start_brings_the_similar_jobs_coefficients_smoothed() -> None:
    """A^0 = near (alpha_sync 0.02, beta 0.3), A^1 = same (0.04, 0.1); mu = 0.6:
    alpha_sync .6*0.04 + .4*0.02 = 0.032, beta .6*0.1 + .4*0.3 = 0.18.  A job without any: left out."""
    same = replace(SAME, coefficients=Coefficients(0.004, 0.0012, 0.04, 0.0, 0.1))
    near = replace(NEAR, coefficients=Coefficients(0.006, 0.0010, 0.02, 0.0, 0.3))
    out = warm_start(spec(), [near, same], WarmStartConfig(k=2, mu=0.6))
    assert out.coefficients is not None
    assert out.coefficients.alpha_sync == pytest.approx(0.032)
    assert out.coefficients.beta == pytest.approx(0.18)
    only = warm_start(spec(), [NEAR, same], WarmStartConfig(k=2, mu=0.6))
    assert only.coefficients == same.coefficients
    assert warm_start(spec(), [NEAR, SAME], WarmStartConfig(k=2, mu=0.6)).coefficients is None


def test_similarity_per_feature_type() -> None:
    assert size_similarity(8, 16) == 0.5
    assert size_similarity(0, 0) == 1.0 and size_similarity(0, 5) == 0.0
    a = JobFeatures.from_spec(spec())
    assert similarity(a, a) == pytest.approx(1.0)
    unknown = JobFeatures.from_spec(spec(), records=0)
    # an unknown record count is left out, not counted as a mismatch
    assert similarity(a, unknown) == pytest.approx(1.0)
    other_model = JobFeatures.from_spec(spec(model=ModelName.DCN))
    assert similarity(a, other_model) < similarity(a, JobFeatures.from_spec(spec(embed_dim=16)))
    # the table is the file name: the same file in another directory is the same table
    moved = JobFeatures.from_spec(spec(path="/mnt/elsewhere/day0.tsv"))
    assert similarity(a, moved) == pytest.approx(1.0)
