"""The primary agent's choice of T, the iteration at which every worker applies a global action.

T leaves the fastest worker enough steps for the prepare to reach every agent, doubles its margin
on a retry, never falls below what the previous attempt's votes showed, and never below the T of
an action the primary already committed: the trainers apply due actions by (T, arrival), so a later
action with a lower T would run first, and an older ADJUST_BS would undo a newer one.
"""

from __future__ import annotations

from pacer.agent.agent import estimate_iteration, margin_iterations, pick_target


def test_margin_covers_the_lead_time_of_the_fastest_worker() -> None:
    assert margin_iterations(0.1, 0.5) == 7  # ceil(0.5 / 0.1) + 2
    assert margin_iterations(10.0, 0.5) == 3  # slow steps: the minimum margin
    assert margin_iterations(0.0, 0.5) >= 500  # unknown BPT: taken as 1 ms, a generous margin


def test_target_is_ahead_of_every_worker_and_doubles_its_margin_on_retry() -> None:
    est = {"worker-0": 20, "worker-1": 24}
    first = pick_target(est, [0.1, 0.2], 0.5, attempt=1)
    assert first == 24 + 7
    assert pick_target(est, [0.1, 0.2], 0.5, attempt=2) == 24 + 14
    assert pick_target(est, [0.1, 0.2], 0.5, attempt=2, floor=40) == 40 + 14  # a vote saw iteration 40


def test_a_later_action_never_lands_before_an_earlier_one() -> None:
    """The run that found it: ADJUST_BS committed at T=31, then ADJUST_LR was given T=30, because a fresh
    heartbeat lowered the extrapolated iterations and slower steps shrank the margin."""
    before = {"worker-0": estimate_iteration(20, 1.0, 0.1)}  # extrapolated: 30
    bs = pick_target(before, [0.25], 0.5, attempt=1)
    after = {"worker-0": 24}  # the heartbeat that came next: the trainer is at 24, not 30
    assert pick_target(after, [0.5], 0.5, attempt=1) < bs  # what T was before the fix
    lr = pick_target(after, [0.5], 0.5, attempt=1, committed=bs)
    assert lr == bs  # the same T: applied in arrival order, after ADJUST_BS
    assert pick_target({"worker-0": 40}, [0.5], 0.5, attempt=1, committed=bs) == 43  # ahead: unaffected
