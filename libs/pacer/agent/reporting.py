"""How often an agent reports a worker's steps (pure: the agent and the straggler simulator both use it)."""

from __future__ import annotations


def window_steps(k: int, bpt_s: float, report_s: float) -> int:
    """Steps in a worker's next metrics window: k, or as many as take ``report_s`` at ``bpt_s`` when
    that is fewer (at least one), so a job of slow steps is reported every few seconds, not every k
    steps: 10 steps of 2 s would keep a straggler out of the monitor's sight for 20-40 s."""
    if bpt_s <= 0:
        return k
    return max(1, min(k, int(report_s / bpt_s)))


def window_overdue(steps_done: int, open_s: float, planned_s: float, report_s: float) -> bool:
    """Whether a worker's open metrics window closes now with the ``steps_done`` it has, short of the
    steps :func:`window_steps` planned to take ``planned_s`` (its step count times the last BPT).

    :func:`window_steps` sizes a window by the *last* BPT, so a worker that
    turns 4x slower mid-window took 4x the planned time to say so (10 steps
    planned at 0.2 s, run at 0.8 s: 8 s).  A window still open after
    ``report_s`` *and* half again its planned time closes: the slow window
    reaches the monitor ``report_s`` (4 s) after it began, the next is sized
    by the new BPT, and a window planned near ``report_s`` is not cut by
    the ordinary jitter of its steps (only by a BPT up 50 %).  Unknown plan
    (``inf``: the first window of a trainer) or no step yet: it stays open.
    """
    return steps_done >= 1 and open_s >= window_deadline(planned_s, report_s)


def window_deadline(planned_s: float, report_s: float) -> float:
    """Seconds after it opened that a window planned to take ``planned_s`` is overdue (:func:`window_overdue`)."""
    return max(report_s, 1.5 * planned_s)


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
