"""Autoscaling simulator: the brain reaches the oracle sooner than without its sample and anchoring rules, on seeded jobs.

"Before" is the same brain with this issue's rules switched off (the
one-worker sample of DLRover 2023, Eq. 10-11's plan always measured before
the model's, predictions not anchored at measured plans).  Seeded runs of the
simulator, compared with each other and with the oracle: no wall clock.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from pacer_services.brain.core.autoscaler import AutoscaleConfig
from pacer_services.simulator.autoscale import SimConfig, run_job
from pacer_services.simulator.autoscale.scalers import PacerScaler, autoscale_config

CFG = SimConfig()


def before(cfg: AutoscaleConfig) -> AutoscaleConfig:
    return replace(cfg, direct=False, anchor=False, stages=replace(cfg.stages, sample_workers=1))


@pytest.mark.parametrize(("profile", "seed"), [("xdeepfm", 0), ("wide_deep", 0), ("wide_deep", 4)])
def test_the_brain_gets_closer_to_the_oracle_with_no_more_restarts(profile: str, seed: int) -> None:
    oracle = run_job(profile, "oracle", seed=seed, config=CFG)
    new = run_job(profile, PacerScaler(autoscale_config(CFG)), seed=seed, config=CFG)
    old = run_job(profile, PacerScaler(before(autoscale_config(CFG))), seed=seed, config=CFG)
    assert oracle.jct_s is not None and new.jct_s is not None and old.jct_s is not None
    assert new.jct_s < old.jct_s
    assert new.jct_s <= 1.07 * oracle.jct_s  # cold start, from no history at all
    assert new.scalings <= old.scalings


def test_xdeepfm_seed_0_makes_no_move_that_does_not_pay() -> None:
    # before: sample -> Eq. 10-11 -> the model's plan -> a third move to a plan no better (issue 15)
    sc = PacerScaler(autoscale_config(CFG))
    run = run_job("xdeepfm", sc, seed=0, config=CFG)
    model_moves = [d for d in sc.autoscaler.decisions if d.rule.value in ("optimize", "model")]
    assert len(model_moves) == 1, [(d.rule.value, d.plan.workers, d.plan.ps) for d in model_moves]
    assert run.oom_failures == 0


def test_a_neighbour_of_the_plan_in_force_is_not_doubted_like_a_far_plan() -> None:
    """Wide&Deep seed 2 lands 4.6 % below the oracle's throughput after the model's first plan; the model
    sees the better neighbour (+4.7 %) but the whole model error (5 %) discounted it away.  With the
    doubt in proportion to the distance (doubt_reach) the job takes it."""
    oracle = run_job("wide_deep", "oracle", seed=2, config=CFG)
    near = run_job("wide_deep", PacerScaler(autoscale_config(CFG)), seed=2, config=CFG)
    flat = run_job("wide_deep", PacerScaler(replace(autoscale_config(CFG), doubt_reach=1e-9)), seed=2, config=CFG)
    assert oracle.jct_s is not None and near.jct_s is not None and flat.jct_s is not None
    assert near.jct_s < flat.jct_s
    assert near.timeline[-1][1] > flat.timeline[-1][1]  # a better final plan, not only a shorter run
    assert near.scalings == flat.scalings + 1
