"""How often an agent reports a worker's steps (pure: the agent and the straggler simulator both use it)."""

from __future__ import annotations


def window_steps(k: int, bpt_s: float, report_s: float) -> int:
    """Steps in a worker's next metrics window: k, or as many as take ``report_s`` at ``bpt_s`` when
    that is fewer (at least one), so a job of slow steps is reported every few seconds, not every k
    steps: 10 steps of 2 s would keep a straggler out of the monitor's sight for 20-40 s."""
    if bpt_s <= 0:
        return k
    return max(1, min(k, int(report_s / bpt_s)))


def heartbeat_due(since_sent_s: float, heartbeat_s: float, changed: bool) -> bool:
    """Whether an agent sends a heartbeat now, ``since_sent_s`` after its last message to its job.

    Peers and the monitor take *any* message of the agent as a sign of life
    (a metrics window sets a member's ``seen`` as a heartbeat does), so a
    heartbeat is needed only when nothing else went out for ``heartbeat_s``,
    or when what only a heartbeat says (the trainer's liveness and pid, the
    primary flag) changed.  A worker reporting every 2 s and a PS every 2 s
    then send half the heartbeats of a fixed 1-s beat, and every member is
    still heard at least every ``heartbeat_s``.  2 % of slack: a sleep timed
    to the deadline may wake a hair early.
    """
    return changed or since_sent_s >= heartbeat_s * 0.98
