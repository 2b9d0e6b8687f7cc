"""The agent's reporting rules (pacer.agent.reporting): when a window closes, when a heartbeat is due.

The rules are pure and shared by the live agent and both simulators; the
live agent's use of them is exercised by tests/integration/test_agent.py.
"""

from __future__ import annotations

import math

import pytest
from pacer.agent.reporting import heartbeat_due, window_overdue, window_steps


def test_windows_are_k_steps_or_fewer_when_k_would_take_longer_than_report_s() -> None:
    assert window_steps(10, 0.2, 4.0) == 10  # 2 s
    assert window_steps(10, 0.8, 4.0) == 5  # 10 would take 8 s
    assert window_steps(10, 9.0, 4.0) == 1  # at least one
    assert window_steps(10, 0.0, 4.0) == 10  # no BPT yet


@pytest.mark.parametrize(
    ("steps", "open_s", "planned_s", "overdue"),
    [
        (7, 3.9, 2.0, False),  # a straggler's window: 10 steps planned at 0.2 s, not yet report_s open
        (7, 4.0, 2.0, True),  # ... closes after report_s with what it has
        (3, 4.0, 3.6, False),  # planned near report_s: jitter does not cut it ...
        (3, 5.4, 3.6, True),  # ... a BPT up 50 % does
        (0, 60.0, 2.0, False),  # nothing to report yet
        (5, 60.0, math.inf, False),  # a trainer's first window: no plan, k steps as before
    ],
)
def test_an_open_window_is_overdue_after_report_s_and_half_again_its_plan(
    steps: int, open_s: float, planned_s: float, overdue: bool
) -> None:
    assert window_overdue(steps, open_s, planned_s, 4.0) is overdue


def test_a_straggler_onset_reaches_the_monitor_within_report_s_of_its_window_opening() -> None:
    # Replay the agent's loop at 0.01 s resolution: 0.2 s steps, 4x slower from t = 10.05 s.
    k, report_s, onset = 10, 4.0, 10.05

    def steps_at(t: float) -> int:
        return int(t / 0.2) if t <= onset else int(onset / 0.2) + int((t - onset) / 0.8)

    windows: list[tuple[float, int]] = []  # (closed at, steps)
    first, w, opened, planned, t = 0, k, 0.0, math.inf, 0.0
    while t < 30.0:
        t = round(t + 0.01, 2)
        n = steps_at(t)
        if first <= n < first + w and window_overdue(n - first, t - opened, planned, report_s):
            w = n - first
        if n >= first + w:
            windows.append((t, w))
            bpt = (t - opened) / w
            first, opened = first + w, t
            w = window_steps(k, bpt, report_s)
            planned = w * bpt
    slow = [c for c, _ in windows if c > onset]
    assert slow and slow[0] - onset <= report_s + 0.01, windows  # sized by the last BPT alone: ~8 s
    assert sum(s for _, s in windows) == steps_at(windows[-1][0])  # the windows tile the steps


@pytest.mark.parametrize(
    ("since_s", "changed", "due"),
    [
        (0.3, False, False),  # a metrics window went out 0.3 s ago: it said the agent lives
        (0.99, False, True),  # a sleep timed to the deadline may wake a hair early
        (1.0, False, True),
        (0.1, True, True),  # the trainer died or the primary changed: say so now
    ],
)
def test_a_heartbeat_is_due_after_a_second_of_silence_or_a_change(since_s: float, changed: bool, due: bool) -> None:
    assert heartbeat_due(since_s, 1.0, changed) is due
