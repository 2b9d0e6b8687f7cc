"""Brain core, issue 15: the rules that decide how long to measure and when a prediction is worth a move.

The pure rules of :mod:`pacer_services.brain.core.evidence` alone, then each
as the autoscaler uses it (the stopping rule of the sample, the model's plan
directly after the sample, anchored predictions, OOM plans while one is on
its way, the memory a warm-start plan implies).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from pacer.contracts.brain import BrainRule
from pacer.contracts.jobs import ResourcePlan
from pacer_services.brain.core.autoscaler import JobAutoscaler
from pacer_services.brain.core.evidence import (
    anchored,
    model_mb_of_plan,
    plan_distance,
    takes_model_plan,
    windows_needed,
)
from pacer_services.brain.core.stages import DEFAULT_STAGES, memory_for, sample_plan

from .test_brain_autoscaler import CFG, STAGES, Truth, spec, stats_of

# ------------------------------------------------------------------ the stopping rule


def test_a_quiet_measurement_stops_at_the_least_windows() -> None:
    assert windows_needed(0.05, 0.1) == 2  # (2 x 0.05 / 0.1)^2 = 1 < least
    assert windows_needed(0.0, 0.1, least=1) == 1


def test_a_noisy_measurement_takes_more_windows_as_the_square_of_its_noise() -> None:
    assert windows_needed(0.1, 0.1) == 4  # (2 x 0.1 / 0.1)^2
    assert windows_needed(0.15, 0.1) == 9
    assert windows_needed(0.15, 0.1, z=1.0) == 3  # ceil(2.25)


def test_the_stopping_rule_is_capped_and_refuses_nonsense() -> None:
    assert windows_needed(1.0, 0.1, most=8) == 8
    assert windows_needed(math.nan, 0.1, most=6) == 6  # a noise it cannot tell: measure the longest
    with pytest.raises(ValueError):
        windows_needed(0.05, 0.0)
    with pytest.raises(ValueError):
        windows_needed(0.05, 0.1, least=3, most=2)


# ------------------------------------------------------------------ anchored predictions


def test_a_prediction_is_scaled_by_how_far_the_model_misses_the_measured_plan() -> None:
    # the model says 1100 where 1000 was measured: it overrates by 10 %, so 2200 means 2000
    assert anchored(2200.0, 1100.0, 1000.0) == pytest.approx(2000.0)
    assert anchored(2200.0, 0.0, 1000.0) == 2200.0  # nothing to anchor at
    assert anchored(2200.0, 1100.0, 0.0) == 2200.0


def test_plan_distance_is_relative_and_symmetric() -> None:
    a, b = (10, 4, 8.0, 2.0), (20, 4, 8.0, 2.0)
    assert plan_distance(a, a) == 0.0
    assert plan_distance(a, b) == pytest.approx(math.log(2.0))
    assert plan_distance(a, b) == plan_distance(b, a)
    assert plan_distance((1, 1, 1.0, 1.0), (2, 1, 1.0, 1.0)) == pytest.approx(plan_distance(a, b))


# ------------------------------------------------------------------ the model's plan directly


@pytest.mark.parametrize(("gain", "model", "rule", "taken"), [
    (100.0, 1200.0, 1000.0, True),  # pays for its pause and beats Eq. 10-11's promise
    (0.0, 1200.0, 1000.0, False),  # does not pay for its pause (Eq. 8: TG <= 0)
    (-5.0, 1200.0, 1000.0, False),
    (100.0, 1000.0, 1000.0, False),  # no better than what Eq. 10-11 promise: measure their plan first
    (100.0, 900.0, 1000.0, False),
])
def test_the_model_plan_is_taken_directly_only_when_sure(gain: float, model: float, rule: float,
                                                         taken: bool) -> None:
    assert takes_model_plan(gain, model, rule) is taken


@pytest.mark.parametrize(("plan_ps", "sampled_ps", "taken"), [
    (4, 2, True),  # near the PS count the sample measured: taken though Eq. 10-11 promise more
    (10, 2, True),  # NEAR_PS_RATIO times the sample's, still near
    (11, 2, False),  # beyond: the model's PS side is extrapolated, Eq. 10-11's plan is measured first
    (1, 8, False),
    (2, 8, True),
    (4, 0, False),  # the sample's PS count unknown: only the throughput test
])
def test_a_model_plan_near_the_sampled_ps_count_is_taken_even_below_the_rule(plan_ps: int, sampled_ps: int,
                                                                            taken: bool) -> None:
    assert takes_model_plan(100.0, 900.0, 1000.0, plan_ps=plan_ps, sampled_ps=sampled_ps, model_error=0.05) is taken
    # Eq. 8 still rules
    assert not takes_model_plan(0.0, 900.0, 1000.0, plan_ps=plan_ps, sampled_ps=sampled_ps, model_error=0.05)


def test_a_near_model_plan_far_below_the_rule_is_not_taken() -> None:
    # within three model errors of Eq. 10-11's promise (exp(-0.15) = 0.861 at 5 %): alike as far as the model
    # can tell; further below, Eq. 10-11's plan is measured first
    assert takes_model_plan(100.0, 870.0, 1000.0, plan_ps=4, sampled_ps=2, model_error=0.05)
    assert not takes_model_plan(100.0, 850.0, 1000.0, plan_ps=4, sampled_ps=2, model_error=0.05)
    assert not takes_model_plan(100.0, 760.0, 1000.0, plan_ps=6, sampled_ps=2, model_error=0.05)
    # a model that has missed by more is given more room, one that is exact none
    assert takes_model_plan(100.0, 760.0, 1000.0, plan_ps=6, sampled_ps=2, model_error=0.1)
    assert not takes_model_plan(100.0, 990.0, 1000.0, plan_ps=4, sampled_ps=2, model_error=0.0)


def drive(auto: JobAutoscaler, truth: Truth, until_s: float, *, noise: tuple[float, ...] = (1.0,)) -> list[str]:
    """The service's loop; ``noise`` multiplies the throughput of successive windows. The rules decided."""
    auto.applied(auto.first_plan(), 0.0)
    rules: list[str] = []
    t, k = 0.0, 0
    while t < until_s:
        t += 60.0
        assert auto.plan is not None
        st = stats_of(truth, auto.plan, t)
        st = replace(st, throughput_samples_per_s=st.throughput_samples_per_s * noise[k % len(noise)])
        k += 1
        d = auto.step(t, st)
        if d is not None:
            rules.append(d.rule.value)
            auto.applied(d.plan, t)
    return rules


def test_a_noisy_sample_is_measured_longer_than_a_quiet_one() -> None:
    truth = Truth()
    quiet = JobAutoscaler(spec(), truth.m, CFG)
    noisy = JobAutoscaler(spec(), truth.m, CFG)
    drive(quiet, truth, 420.0)  # valid windows at 120, 180, ..., 420 s: six
    drive(noisy, truth, 420.0, noise=(0.85, 1.15))
    assert quiet.decisions and quiet.decisions[0].rule is BrainRule.OPTIMIZE  # 2 windows were enough
    assert quiet.sample_windows_needed() == CFG.sample_windows
    # +-15 % windows: (2 x 0.21 / 0.1)^2 > 8 windows, capped at max_sample_windows: still sampling
    assert not noisy.decisions
    assert noisy.sample_windows_needed() == CFG.max_sample_windows


@pytest.mark.parametrize("truth", [Truth(a_grad=0.03, par_w=24, u=0.0004), Truth(par_w=4)],
                         ids=["compute-bound", "narrow-workers"])
def test_after_the_sample_the_model_plan_saves_a_restart_when_it_is_sure(truth: Truth) -> None:
    direct = JobAutoscaler(spec(), truth.m, CFG)
    stepwise = JobAutoscaler(spec(), truth.m, replace(CFG, direct=False))
    drive(direct, truth, 3600.0)
    drive(stepwise, truth, 3600.0)
    first_direct, first_stepwise = direct.decisions[0], stepwise.decisions[0]
    assert first_direct.rule is first_stepwise.rule is BrainRule.OPTIMIZE
    assert "by the model" in first_direct.plan.reason and "by the model" not in first_stepwise.plan.reason
    # the model's plan is better than Eq. 10-11's, and the job gets there with fewer restarts
    assert truth.run(first_direct.plan)[0] > truth.run(first_stepwise.plan)[0]
    assert len(direct.decisions) < len(stepwise.decisions)
    assert direct.plan is not None and stepwise.plan is not None
    assert truth.run(direct.plan)[0] >= 0.97 * truth.run(stepwise.plan)[0]


# ------------------------------------------------------------------ OOM plans on their way


def test_an_oom_plan_on_its_way_is_not_decided_again_every_window() -> None:
    truth = Truth(growth_mb_per_s=2.0)
    auto = JobAutoscaler(spec(), truth.m, CFG, first=replace(sample_plan(spec(), STAGES), ps_memory_mb=3200),
                         warm=True)
    auto.applied(auto.first_plan(), 0.0)
    decided: list[tuple[float, str, ResourcePlan]] = []
    for k in range(1, 20):
        t = 60.0 * k
        assert auto.plan is not None
        d = auto.step(t, stats_of(truth, auto.plan, t, total=10**9))
        if d is not None:  # never reported applied: the executor is still at work (a PS migration)
            decided.append((t, d.rule.value, d.plan))
    ooms = [(t, p) for t, rule, p in decided if rule == BrainRule.OOM.value]
    assert ooms and ooms[0][1].ps_memory_mb > 3200
    # the same forecast is not answered again while its plan is on its way: never two OOM plans in a row
    rules = [rule for _, rule, _ in decided]
    assert all(not (a == b == BrainRule.OOM.value) for a, b in itertools.pairwise(rules)), decided


# ------------------------------------------------------------------ the memory a warm plan implies


@pytest.mark.parametrize(("ps", "model_mb", "kappa"), [(1, 3000.0, 1.0), (4, 8000.0, 1.6), (20, 12000.0, 1.9)])
def test_the_model_size_a_plan_was_made_for_is_read_back_from_its_ps_memory(ps: int, model_mb: float,
                                                                             kappa: float) -> None:
    st = DEFAULT_STAGES
    share = min(1.0, kappa / ps)
    mem = memory_for(st.process_base_mb + share * model_mb, st)  # how a plan's PS memory is sized
    back = model_mb_of_plan(ps, mem, memory_skew=kappa, base_mb=st.process_base_mb, headroom=st.memory_headroom)
    # memory_for rounds up to its step: the model read back is at least the one sized for, within a step
    assert model_mb <= back <= model_mb + st.memory_step_mb / share
    assert model_mb_of_plan(0, mem, memory_skew=kappa, base_mb=600.0, headroom=0.3) == 0.0
