"""Monitor core: the noise-adapted short window (issue 15: windows adapted to the measured noise).

Every test injects ``now``; nothing reads a clock.  Reports come every 10 s.
"""

from __future__ import annotations

import random

import pytest
from pacer.contracts.agent import AgentMetrics
from pacer.contracts.monitor import JobStatistics, NodeStats, StragglerKind
from pacer.errors import ValidationError
from pacer_services.monitor.core import MonitorConfig, MonitorCore

JOB = "job1"
T0 = 1_000_000.0
EVERY = 10.0
ADAPTIVE = MonitorConfig(window_short_min_s=20.0)


def report(core: MonitorCore, node: str, t: float, bpt: float, batch: int = 100, role: str = "worker") -> None:
    core.observe_metrics(AgentMetrics(
        job=JOB, node=node, role=role, ts=t, local_step=0, iteration=0, bpt_s=bpt, batch_size=batch,
        samples_per_s=batch / bpt if batch else 0.0, samples_total=0, cpu_percent=100.0, rss_bytes=1,
        last_action_seq=0, last_action_iteration=-1, primary=False, steps=10), t)


def run(core: MonitorCore, until: float, bpt: dict[str, float] | None = None, *, start: float = T0,
        noise: float = 0.0, seed: int = 0, batch: dict[str, int] | None = None,
        slow: dict[str, tuple[float, float]] | None = None) -> None:
    """Eight workers report every EVERY s over [start, until): BPT 1 s (or ``bpt``) x (1 + noise), and
    ``slow[node] = (from, bpt)`` from that time on."""
    rng = random.Random(seed)
    t = start
    while t < until:
        for i in range(8):
            node = f"worker-{i}"
            b = (bpt or {}).get(node, 1.0)
            if slow and node in slow and t >= slow[node][0]:
                b = slow[node][1]
            report(core, node, t, b * (1 + rng.gauss(0.0, noise)), (batch or {}).get(node, 100))
        t += EVERY


def stats(core: MonitorCore, now: float) -> JobStatistics:
    return core.statistics(JOB, now)


def node(st: JobStatistics, name: str) -> NodeStats:
    return next(n for n in st.nodes if n.node == name)


def test_off_by_default_the_short_window_is_l_trans() -> None:
    core = MonitorCore()
    run(core, T0 + 600)
    assert stats(core, T0 + 600).window_short_s == 300.0


def test_a_quiet_job_gets_a_short_window_and_sees_a_new_straggler_in_full() -> None:
    """Noise-free BPTs: two reports make an exact mean, so the window is two report intervals."""
    fixed, adapted = MonitorCore(), MonitorCore(ADAPTIVE)
    for core in (fixed, adapted):
        run(core, T0 + 640, slow={"worker-3": (T0 + 600, 2.0)})
    now = T0 + 640
    st_f, st_a = stats(fixed, now), stats(adapted, now)
    assert st_a.window_short_s == pytest.approx(20.0)
    # 40 s of a 2x straggler: diluted to ~1.13x over 5 min (below lambda), in full over the adapted window.
    assert node(st_f, "worker-3").slowdown_short < 1.5 <= node(st_a, "worker-3").slowdown_short
    assert node(st_a, "worker-3").straggler is StragglerKind.TRANSIENT
    assert node(st_f, "worker-3").straggler is StragglerKind.NONE


def test_a_noisy_job_keeps_the_long_short_window() -> None:
    core = MonitorCore(ADAPTIVE)
    run(core, T0 + 600, noise=0.2)
    w = stats(core, T0 + 600).window_short_s
    assert w == 300.0  # (0.2 / 0.035)^2 = 33 reports needed: clamped to L_trans
    mild = MonitorCore(ADAPTIVE)
    run(mild, T0 + 600, noise=0.07)
    assert 20.0 < stats(mild, T0 + 600).window_short_s < 300.0  # ~4 reports x 10 s: in between


def test_one_odd_report_is_no_change_of_level() -> None:
    core = MonitorCore(ADAPTIVE)
    run(core, T0 + 600)
    report(core, "worker-2", T0 + 600, 3.0)  # one slow report (a GC pause), then normal again
    for i in range(8):
        if i != 2:
            report(core, f"worker-{i}", T0 + 600, 1.0)
    st = stats(core, T0 + 601)
    # The odd report is not a confirmed level: the node keeps its usual window, which dilutes it.
    assert node(st, "worker-2").slowdown_short < 3.0


def test_after_a_batch_change_the_window_holds_only_the_new_size() -> None:
    """The first report at the new size may still hold steps at the old one: it is left out once a second one exists."""
    core = MonitorCore(MonitorConfig(window_short_min_s=20.0, window_short_s=300.0))
    run(core, T0 + 600, bpt={"worker-3": 2.0})
    t = T0 + 600
    for bpt in (1.6, 1.1, 1.1):  # mixed, then pure at the new (smaller) batch
        for i in range(8):
            if i == 3:
                report(core, "worker-3", t, bpt, batch=40)
            else:
                report(core, f"worker-{i}", t, 1.0)
        t += EVERY
    st = stats(core, t)
    assert node(st, "worker-3").bpt_short_s == pytest.approx(1.1)
    fixed = MonitorCore(MonitorConfig(window_short_s=300.0))
    run(fixed, T0 + 600, bpt={"worker-3": 2.0})
    assert stats(fixed, T0 + 600).window_short_s == 300.0


def test_persistence_keeps_the_configured_span() -> None:
    """A node slow for 60 s is transient, not persistent, however short the adapted window is."""
    core = MonitorCore(ADAPTIVE)
    run(core, T0 + 660, slow={"worker-5": (T0 + 600, 3.0)})
    st = stats(core, T0 + 660)
    assert node(st, "worker-5").straggler is StragglerKind.TRANSIENT
    old = MonitorCore(ADAPTIVE)
    run(old, T0 + 700, slow={"worker-5": (T0, 3.0)})
    assert node(stats(old, T0 + 700), "worker-5").straggler is StragglerKind.PERSISTENT


def test_too_few_reports_keep_l_trans() -> None:
    core = MonitorCore(ADAPTIVE)
    report(core, "worker-0", T0, 1.0)
    report(core, "worker-1", T0, 1.0)
    assert stats(core, T0 + 1).window_short_s == 300.0


def test_quiet_ps_do_not_hide_the_workers_noise() -> None:
    """Workers and PS are measured apart: exact PS answer times do not make noisy workers look quiet."""
    core = MonitorCore(ADAPTIVE)
    rng = random.Random(2)
    t = T0
    while t < T0 + 600:
        for i in range(4):
            report(core, f"worker-{i}", t, 1.0 * (1 + rng.gauss(0.0, 0.2)))
        for j in range(8):
            report(core, f"ps-{j}", t, 0.05, batch=0, role="ps")
        t += EVERY
    assert stats(core, t).window_short_s == 300.0


def test_ps_jitter_below_the_latency_floor_is_no_noise() -> None:
    """Sub-millisecond PS answer times jitter by 50 %; against the 20 ms floor that is no noise."""
    core = MonitorCore(ADAPTIVE)
    rng = random.Random(1)
    t = T0
    while t < T0 + 600:
        for i in range(8):
            report(core, f"worker-{i}", t, 1.0)
        for j in range(4):
            report(core, f"ps-{j}", t, 0.0005 * (1 + rng.uniform(-0.5, 0.5)), batch=0, role="ps")
        t += EVERY
    assert stats(core, t).window_short_s == pytest.approx(20.0)


@pytest.mark.parametrize("kw", [dict(window_short_min_s=0.0), dict(window_short_min_s=-5.0),
                                dict(window_short_rel_error=0.0)])
def test_bad_adaptive_config_is_rejected(kw: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        MonitorConfig(**kw)  # type: ignore[arg-type]
