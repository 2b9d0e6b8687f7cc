"""Brain core, DLRover-RM §5.3: predict a node's memory growth (PS and workers) and raise its memory before the OOM."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats
from pacer_services.brain.core.oom import (
    ALL_ROLES,
    MemorySample,
    MemoryWatch,
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
    """True RSS = 1000 + 0.5 * step with +-80 MiB noise; at step 20000 it would be 11000 MiB.

    The limit (4096 MiB) is crossed near step 6200.  Sampled to step 3900 that is far beyond the
    lead (900): wait; sampled to step 5800 it is within it: raise, for the job's end."""
    early = line(1000.0, 0.5, n=40, noise=80.0)
    now = forecast_oom("ps-1", early, 4096, 20_000, OomConfig(lead=None))  # acting on the far forecast
    assert now.act and now.new_memory_mb is not None and now.new_memory_mb >= 11000
    assert now.trend is not None and now.trend.slope_mb == pytest.approx(0.5, abs=0.05)
    waits = forecast_oom("ps-1", early, 4096, 20_000)
    assert not waits.act and "wait" in waits.reason
    late = line(1000.0, 0.5, n=59, noise=80.0)
    f = forecast_oom("ps-1", late, 4096, 20_000)
    assert f.act and f.new_memory_mb is not None and f.new_memory_mb >= 11000
    assert f.oom_at is not None and f.oom_at > late[-1].at  # before the limit is reached


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


# ------------------------------------------------------------ workers, over the monitor's statistics

def window(t: float, rss_mb: dict[str, float], restarts: dict[str, int] | None = None) -> JobStatistics:
    """One statistics window: each node RUNNING with the given RSS (roles from the names; worker-0 is the chief)."""
    def role(node: str) -> str:
        return "ps" if node.startswith("ps") else "chief" if node == "worker-0" else "worker"

    nodes = [NodeStats(node=name, role=role(name), bpt_short_s=0.1, bpt_long_s=0.1, speed_samples_per_s=100.0,
                       samples_total=0, cpu_percent=90.0, rss_bytes=int(mb * (1 << 20)), last_seen=t,
                       state=Liveness.RUNNING, pending_s=0.0, restarts=(restarts or {}).get(name, 0),
                       slowdown_short=1.0, slowdown_long=1.0)
             for name, mb in sorted(rss_mb.items())]
    return JobStatistics(job="j", ts=t, window_short_s=300.0, window_long_s=600.0, throughput_samples_per_s=200.0,
                         nodes=nodes)


PLAN = ResourcePlan("j", 2, 1, 1.0, 2048, 2.0, 4096, PlanSource.BRAIN)


def test_a_worker_whose_memory_grows_gets_more_worker_memory_and_the_ps_keep_theirs() -> None:
    """worker-1 grows 2 MiB/s from 1000 MiB (1180 MiB at t=90, under its 2048 MiB limit): by the job's end at
    t=1000 the line says 3000 MiB; x1.2 = 3600 -> 3648 MiB.  The PS and the chief are flat."""
    watch = MemoryWatch()
    for i in range(10):
        watch.feed(window(10.0 * i, {"ps-0": 3000.0, "worker-0": 900.0, "worker-1": 1000.0 + 20.0 * i}))
    assert watch.plan_for(PLAN, 1000.0) is None  # the default: PS only
    out = watch.plan_for(PLAN, 1000.0, roles=ALL_ROLES)
    assert out is not None
    assert out.worker_memory_mb == 3648 and out.ps_memory_mb == 4096
    assert "worker-1" in out.reason and "worker-0" not in out.reason and "ps-0" not in out.reason
    assert (out.workers, out.ps, out.worker_cpu, out.ps_cpu) == (2, 1, 1.0, 2.0)


def test_the_chief_counts_as_a_worker_and_a_flat_worker_gets_nothing() -> None:
    watch = MemoryWatch()
    for i in range(10):
        watch.feed(window(10.0 * i, {"worker-0": 1000.0 + 20.0 * i, "worker-1": 1000.0}))
    out = watch.plan_for(PLAN, 1000.0, roles=ALL_ROLES)
    assert out is not None and out.worker_memory_mb > 2048 and "worker-0" in out.reason
    flat = MemoryWatch()
    for i in range(10):
        flat.feed(window(10.0 * i, {"worker-0": 1500.0, "worker-1": 1500.0 + (5.0 if i % 2 else -5.0)}))
    assert flat.plan_for(PLAN, 10_000.0, roles=ALL_ROLES) is None


def test_a_replaced_worker_starts_afresh_without_the_old_process_samples() -> None:
    """worker-1 grew to 1980 MiB, then was replaced (restarts 0 -> 1): the monitor still shows the old
    process's 1980 MiB for a window, then the new process's flat 700 MiB.  The new process alone is judged:
    with the old samples (or the stale report) a line would slope through the drop."""
    watch = MemoryWatch()
    for i in range(10):
        watch.feed(window(10.0 * i, {"worker-1": 1800.0 + 20.0 * i}))
    assert watch.plan_for(PLAN, 1000.0, roles=ALL_ROLES) is not None  # growing: would be raised
    watch.feed(window(100.0, {"worker-1": 1980.0}, {"worker-1": 1}))  # the old report, the new count
    assert "worker-1" not in watch.nodes
    for i in range(1, 7):
        watch.feed(window(100.0 + 10.0 * i, {"worker-1": 700.0}, {"worker-1": 1}))
    assert [s.rss_mb for s in watch.nodes["worker-1"]] == [700.0] * 6
    assert watch.plan_for(replace(PLAN, worker_memory_mb=3648), 1000.0, roles=ALL_ROLES) is None


def test_a_dead_node_forecasts_nothing() -> None:
    """worker-1 grew towards its limit, then was scaled away: the monitor shows it DEAD (with its last RSS)
    until the job ends.  No process is left to run out of memory, so no plan raises memory for it."""
    watch = MemoryWatch()
    for i in range(10):
        watch.feed(window(10.0 * i, {"worker-0": 900.0, "worker-1": 1800.0 + 20.0 * i}))
    assert watch.plan_for(PLAN, 1000.0, roles=ALL_ROLES) is not None  # growing while it runs: would be raised
    gone = window(100.0, {"worker-0": 900.0, "worker-1": 1980.0})
    gone = replace(gone, nodes=[replace(n, state=Liveness.DEAD) if n.node == "worker-1" else n
                                for n in gone.nodes])
    watch.feed(gone)
    assert "worker-1" not in watch.nodes
    assert watch.plan_for(PLAN, 1000.0, roles=ALL_ROLES) is None
