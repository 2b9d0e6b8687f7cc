"""Pacer's brain (the service's JobAutoscaler) in the autoscaling simulator, against the baselines.

These check behaviour that must hold on any seed (quota respected, every
sample trained, the sample -> optimize -> adjust path taken, OOM prediction
preventing what the control run suffers), not benchmark numbers
(``make bench-brain`` reports those).
"""

from __future__ import annotations

from dataclasses import replace

from pacer_services.simulator.autoscale import (
    PROFILES,
    ScalerContext,
    SharedCluster,
    SimConfig,
    draw_truth,
    rngs,
    run_cluster,
    run_job,
)
from pacer_services.simulator.autoscale.scalers.pacer import (
    PacerScaler,
    autoscale_config,
    pacer_cluster,
)

CFG = SimConfig()


def test_pacer_trains_every_sample_within_the_quota_and_beats_the_static_user_plan() -> None:
    sc = PacerScaler(autoscale_config(CFG))
    r = run_job("xdeepfm", sc, seed=3, config=CFG)
    static = run_job("xdeepfm", "static", seed=3, config=CFG)
    assert r.jct_s is not None and r.samples_done == r.samples_total
    assert r.rejected == 0  # every plan within 200 CPU and 32 CPU per pod
    rules = [d.rule for d in sc.autoscaler.decisions]
    # sample -> optimize (Eq. 10-11's plan, or the model's right after the sample, issue 15) -> adjust; on
    # this seed the model then finds no move that clears its error and the pause (it used to make two)
    assert rules and rules[0] == "optimize", rules
    assert all(r in ("model", "oom") for r in rules[1:]), rules
    assert static.jct_s is not None and r.jct_s < static.jct_s


def test_oom_prediction_prevents_the_ooms_that_the_control_run_suffers() -> None:
    prof = PROFILES["wide_deep"]
    truth = draw_truth(prof.truth, rngs(1, 0)[0], CFG.sigma)
    truth = replace(truth, growth_mb_per_hour=truth.growth_mb_per_hour * 3)
    after_sample = {}
    for pred in (True, False):
        sc = PacerScaler(autoscale_config(CFG, oom_prediction=pred))
        r = run_job(truth, sc, seed=1, config=CFG, samples_total=prof.samples_total // 2, draw=False)
        assert r.jct_s is not None
        after_sample[pred] = r.oom_failures - sum(1 for d in sc.autoscaler.decisions if d.rule == "sample-oom")
    assert after_sample[True] == 0 and after_sample[False] > 0, after_sample


def test_the_cluster_scaler_keeps_the_shared_quota_and_finishes_every_job() -> None:
    spec = SharedCluster(cpu=600.0, jobs=6, arrival_mean_s=300.0, size_min=0.05, size_max=0.1)
    prof = PROFILES["xdeepfm"]
    run = run_cluster(spec, pacer_cluster(ScalerContext(prof.truth, prof.samples_total, CFG)), seed=2, config=CFG)
    assert run.unfinished == 0 and run.rejected == 0
    assert all(r.samples_done == r.samples_total for r in run.jobs)
    assert run.cpu_allocated_util <= 1.0 + 1e-9
