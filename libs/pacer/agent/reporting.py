"""How often an agent reports a worker's steps (pure: the agent and the straggler simulator both use it)."""

from __future__ import annotations


def window_steps(k: int, bpt_s: float, report_s: float) -> int:
    """Steps in a worker's next metrics window: k, or as many as take ``report_s`` at ``bpt_s`` when
    that is fewer (at least one), so a job of slow steps is reported every few seconds, not every k
    steps: 10 steps of 2 s would keep a straggler out of the monitor's sight for 20-40 s."""
    if bpt_s <= 0:
        return k
    return max(1, min(k, int(report_s / bpt_s)))
