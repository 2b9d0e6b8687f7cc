"""Brain core, DLRover-RM §5.3: predict a PS's memory growth and raise its memory before the OOM."""

from __future__ import annotations

import random

import pytest
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer_services.brain.core.oom import (
    MemorySample,
    OomConfig,
    fit_memory_trend,
    forecast_oom,
    prevent_oom,
)


def line(start: float, slope: float, n: int = 10, every: float = 100.0, noise: float = 0.0,
         seed: int = 7) -> list[MemorySample]:
    rng = random.Random(seed)
    return [MemorySample(at=i * every, rss_mb=start + slope * i * every + rng.uniform(-noise, noise))
            for i in range(n)]


def test_linear_growth_gets_more_memory_before_it_hits_the_limit() -> None:
    """RSS = 1000 + 1.0 * step, sampled at steps 0..900 (last 1900 MiB, under the 2048 MiB limit);
    the job ends at step 10000: peak 11000 MiB, limit hit at step 1048; 11000 x 1.2 = 13200 -> 13248."""
    samples = line(1000.0, 1.0)
    f = forecast_oom("ps-0", samples, 2048, 10_000)
    assert max(s.rss_mb for s in samples) < 2048  # not out of memory yet
    assert f.act
    assert f.oom_at == pytest.approx(1048.0, abs=1.0)
    assert f.oom_at is not None and f.oom_at > samples[-1].at
    assert f.peak_mb == pytest.approx(11000.0, abs=1.0)
    assert f.new_memory_mb == 13248


def test_growth_that_stays_under_the_limit_within_the_horizon_is_left_alone() -> None:
    f = forecast_oom("ps-0", line(1000.0, 1.0), 2048, 1000)  # peak 2000 MiB at the end
    assert not f.act and f.oom_at is None


def test_flat_memory_gets_nothing() -> None:
    f = forecast_oom("ps-0", line(1500.0, 0.0, n=30), 2048, 1_000_000)
    assert not f.act
    assert f.trend is not None and f.trend.slope_mb == pytest.approx(0.0, abs=1e-9)


def test_flat_noisy_memory_gets_nothing() -> None:
    f = forecast_oom("ps-0", line(1500.0, 0.0, n=40, noise=50.0), 2048, 20_000)
    assert not f.act
    assert f.trend is not None and f.trend.sigma_mb > 10.0


def test_noisy_growth_is_still_caught_and_covers_the_true_peak() -> None:
    """True RSS = 1000 + 0.5 * step with +-80 MiB noise; at step 20000 it would be 11000 MiB."""
    f = forecast_oom("ps-1", line(1000.0, 0.5, n=40, noise=80.0), 4096, 20_000)
    assert f.act and f.new_memory_mb is not None
    assert f.new_memory_mb >= 11000
    assert f.trend is not None and f.trend.slope_mb == pytest.approx(0.5, abs=0.05)


def test_too_few_samples_predict_nothing() -> None:
    f = forecast_oom("ps-0", line(1000.0, 10.0, n=4), 2048, 10_000)
    assert not f.act and f.trend is None
    assert fit_memory_trend([MemorySample(5.0, 100.0 + i) for i in range(10)]) is None  # no progress span


def test_new_memory_is_capped_by_the_node_maximum() -> None:
    f = forecast_oom("ps-0", line(1000.0, 1.0), 2048, 10_000, OomConfig(max_memory_mb=4096))
    assert f.new_memory_mb == 4096
    assert "capped" in f.reason
    at_max = forecast_oom("ps-0", line(1000.0, 1.0), 4096, 10_000, OomConfig(max_memory_mb=4096))
    assert not at_max.act


def test_the_fit_follows_the_recent_window() -> None:
    """Fast growth early, then flat for the newest 60 samples: the window sees no growth."""
    early = [MemorySample(float(i), 500.0 + 20.0 * i) for i in range(40)]
    late = [MemorySample(float(40 + i), 1280.0) for i in range(60)]
    recent = forecast_oom("ps-0", early + late, 2048, 10_000, OomConfig(window=60))
    everything = forecast_oom("ps-0", early + late, 2048, 10_000, OomConfig(window=0))
    assert not recent.act
    assert everything.act


def test_prevent_oom_raises_the_role_memory_to_what_its_nodes_need() -> None:
    plan = ResourcePlan("j", 4, 2, 2.0, 2048, 4.0, 2048, PlanSource.BRAIN)
    grow = forecast_oom("ps-0", line(1000.0, 1.0), 2048, 10_000)
    flat = forecast_oom("ps-1", line(1500.0, 0.0), 2048, 10_000)
    out = prevent_oom(plan, [flat, grow])
    assert out is not None
    assert out.ps_memory_mb == grow.new_memory_mb
    assert out.worker_memory_mb == 2048
    assert "ps-0" in out.reason and "ps-1" not in out.reason
    assert prevent_oom(plan, [flat]) is None
