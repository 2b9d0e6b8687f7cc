"""Brain core: what a job's CPU and memory readings say about its model (services/brain/core/calibration.py),
the calibrated DLRover-RM model built on it (fitting.py), the exhaustive search for the fastest plans
(pareto.lattice_best) and the job-level choice (cluster.best_for_job).

The readings are generated from known parameters with noise; the tests check that the parameters come
back, and that the calibrated model then finds the plans a known job is fastest with.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer_services.brain.core.calibration import (
    Calibration,
    CalibrationConfig,
    Observation,
    calibrate,
)
from pacer_services.brain.core.cluster import (
    JobRequest,
    OverheadModel,
    Resources,
    best_for_job,
    select,
)
from pacer_services.brain.core.fitting import (
    Coefficients,
    Config,
    FitError,
    JobConstants,
    Model,
    Sample,
    fit,
)
from pacer_services.brain.core.pareto import Candidate, SearchSpace, lattice_best

CFG = CalibrationConfig(c_max=32.0, cpu_step=1.0, process_base_mb=600.0)


def observe(w: int, p: int, cw: float, cp: float, psi: float, *, o_w: float = 0.8, a: float = 0.004,
            o_p: float = 0.5, b: float = 0.0012, skew: float = 1.6, par_w: float = 32.0,
            rng: np.random.Generator | None = None, model_mb: float = 4000.0) -> Observation:
    """What the monitor shows for a plan running at ``psi``: per-node CPU and RSS from the linear model."""
    def noisy(x: float) -> float:
        return x * float(rng.lognormal(0.0, 0.03)) if rng is not None else x
    hot = min(1.0, skew / p)
    shares = [hot] + [(1.0 - hot) / (p - 1)] * (p - 1) if p > 1 else [1.0]
    worker = min(cw, par_w, noisy(o_w + a * psi / w))
    ps = sorted((min(cp, noisy(o_p + s * b * psi)) for s in shares), reverse=True)
    rss = sorted((noisy(600.0 + s * model_mb) for s in shares), reverse=True)
    return Observation(w, p, cw, cp, noisy(psi), worker, tuple(ps), tuple(rss))


# ------------------------------------------------------------------ calibrate


def test_costs_overheads_and_skews_come_back_from_several_configurations() -> None:
    rng = np.random.default_rng(3)
    # per-worker speeds from 250 to 900 samples/s: enough spread to outweigh the prior overhead
    obs = [observe(1, 2, 32.0, 32.0, 900.0, rng=rng), observe(38, 3, 4.0, 16.0, 13_000.0, rng=rng),
           observe(32, 9, 4.0, 8.0, 17_000.0, rng=rng), observe(60, 4, 3.0, 16.0, 15_000.0, rng=rng)]
    cal = calibrate(obs, CFG)
    assert cal.worker_cost == pytest.approx(0.004, rel=0.15)
    assert cal.worker_overhead == pytest.approx(0.8, abs=0.25)
    assert cal.ps_cost == pytest.approx(0.0012, rel=0.15)
    assert cal.ps_overhead == pytest.approx(0.5, abs=0.2)
    assert cal.ps_skew == pytest.approx(1.6, rel=0.15)
    assert cal.memory_skew == pytest.approx(1.6, rel=0.1)


def test_one_configuration_leans_on_the_prior_overhead() -> None:
    cal = calibrate([observe(1, 2, 32.0, 32.0, 600.0)], CFG)
    assert cal.worker_overhead == pytest.approx(CFG.prior_overhead)
    # what is left of the worker's use is the cost: (0.8 + 0.004 * 600 - 0.5) / 600
    assert cal.worker_cost == pytest.approx((0.8 + 2.4 - 0.5) / 600.0)
    # never more than half what the least busy PS used: (2 x 0.5 + 0.0012 x 600) / 2 / 2
    assert cal.ps_overhead == pytest.approx(min(CFG.prior_overhead, 0.5 * (1.0 + 0.72) / 2))


def test_worker_parallelism_is_what_it_used_rounded_up_and_doubles_when_it_filled_its_cpus() -> None:
    unstarved = calibrate([observe(1, 2, 32.0, 32.0, 600.0)], CFG)  # uses 3.2 of 32
    assert unstarved.worker_parallel == 4.0  # DLRover 2023: w = ceil(w-hat)
    starved = calibrate([observe(10, 2, 2.0, 32.0, 3000.0)], CFG)  # wants 0.8 + 1.2, has 2: filled
    assert starved.worker_parallel == 4.0  # at least twice what it filled
    capped = calibrate([observe(10, 2, 20.0, 32.0, 60_000.0)], CFG)  # wants 24.8, has 20
    assert capped.worker_parallel == CFG.c_max


def test_a_warm_jobs_one_configuration_takes_what_it_cannot_tell_from_the_similar_jobs() -> None:
    """A warm job starts with one configuration: its overheads are the similar jobs' (the prior row),
    a worker that filled its CPUs can use what theirs could (not twice its allocation); the costs and
    the skew stay the job's own readings, and a reading that shows the parallelism wins over the prior."""
    prior = Calibration(worker_overhead=1.4, worker_cost=0.01, worker_parallel=5.0, ps_overhead=0.7,
                        ps_cost=0.002, ps_skew=3.0, ps_parallel=9.0, memory_skew=3.0)
    starved = observe(10, 2, 2.0, 32.0, 3000.0)  # uses 0.8 + 1.2 of 2: filled
    alone, warm = calibrate([starved], CFG), calibrate([starved], CFG, prior)
    assert alone.worker_parallel == 4.0 and warm.worker_parallel == 5.0
    assert warm.worker_overhead == pytest.approx(min(1.4, 0.5 * 2.0)) != alone.worker_overhead
    assert warm.worker_cost == pytest.approx((2.0 - warm.worker_overhead) / 300.0)
    assert warm.ps_overhead == pytest.approx(0.7) and alone.ps_overhead == pytest.approx(CFG.prior_overhead)
    assert warm.ps_skew == pytest.approx(1.6, rel=0.1)  # the readings' (net of the PS overhead), not the prior's 3
    # a prior below what the worker filled: at least the allocation
    assert calibrate([starved], CFG, replace(prior, worker_parallel=1.0)).worker_parallel == 2.0
    # an unstarved worker shows its parallelism (3.2 of 32 -> 4): the prior does not move it
    assert calibrate([observe(1, 2, 32.0, 32.0, 600.0)], CFG, prior).worker_parallel == 4.0


def test_a_calibration_round_trips_and_refuses_bad_values() -> None:
    cal = calibrate([observe(10, 2, 2.0, 32.0, 3000.0)], CFG)
    assert Calibration.from_dict(cal.to_dict()) == cal
    with pytest.raises(ValueError):
        Calibration.from_dict({**cal.to_dict(), "ps_skew": float("nan")})
    with pytest.raises(KeyError):
        Calibration.from_dict({k: v for k, v in cal.to_dict().items() if k != "worker_cost"})


def test_a_worker_paced_by_a_saturated_ps_is_not_taken_to_use_only_what_it_used() -> None:
    # 45 workers of 3.4 CPUs behind 23 PS whose hottest fills its 2 CPUs: the PS sets the pace (the
    # throughput is at the PS capacity), the workers wait for it and use 2.2 cores on average.  That
    # says nothing of how many cores they could use (DLRover 2023's ceil(w-hat) = 3 would rate every
    # larger worker no faster): nothing showed they cannot use their 3.4, rounded up to CPU steps.
    paced = Observation(45, 23, 3.4, 2.0, 15_300.0, 2.2, (2.0,) + (1.6,) * 22)
    cal = calibrate([paced], CFG)
    assert float(cal.ps_capacity(23, 2.0)) <= 15_300.0 / 0.95  # the PS paced it
    assert cal.worker_parallel == 4.0
    # a configuration the PS did not pace says what the workers use (here the sample's 2.4 of 32)
    assert calibrate([observe(1, 2, 32.0, 32.0, 400.0), replace(paced, worker_cpu=6.0)], CFG).worker_parallel == 3.0


def test_where_the_ps_paced_every_configuration_sync_and_beta_are_the_priors() -> None:
    # at the PS capacity the throughput says nothing of the iteration time (fitting.py): fitted on it,
    # Eq. 4's sync absorbed the wait for the PS and the model saw every plan sync-bound
    paced = Observation(45, 23, 3.4, 2.0, 15_300.0, 2.2, (2.0,) + (1.6,) * 22)
    cal = calibrate([paced], CFG)
    prior = Coefficients(alpha_grad=0.005, alpha_upd=0.001, alpha_sync=0.066, alpha_emb=0.0, beta=0.018)
    fixed = {"alpha_grad": cal.worker_cost, "alpha_upd": cal.ps_cost, "alpha_emb": 0.0}
    model = fit([Sample(Config(45, 23, 3.4, 2.0, 512), 15_300.0)], JobConstants(calibration=cal),
                fixed=fixed, prior=prior)
    c = model.coefficients
    assert (c.alpha_sync, c.beta) == (prior.alpha_sync, prior.beta)
    assert (c.alpha_grad, c.alpha_upd, c.alpha_emb) == (cal.worker_cost, cal.ps_cost, 0.0)
    assert model.samples == 1 and model.rmsle < 0.1  # it still predicts the cap it ran at
    # without a prior the configuration is fitted as before (nothing else to go by)
    alone = fit([Sample(Config(45, 23, 3.4, 2.0, 512), 15_300.0)], JobConstants(calibration=cal), fixed=fixed)
    assert alone.coefficients.alpha_sync + alone.coefficients.beta > 0.0


def test_a_ps_is_credited_with_more_than_its_load() -> None:
    cal = calibrate([observe(38, 3, 4.0, 16.0, 13_000.0)], CFG)  # the hot PS uses ~8.8 of 16
    hot = 0.5 + 1.6 / 3 * 0.0012 * 13_000.0
    assert cal.ps_parallel >= hot / CFG.busy
    # so the plan it ran with is not at the capacity the reading itself implies
    assert float(cal.ps_capacity(3, 16.0)) > 13_000.0


def test_capacity_of_a_ps_set_follows_the_hot_share() -> None:
    cal = Calibration(worker_overhead=1.0, worker_cost=0.004, worker_parallel=4.0, ps_overhead=0.5,
                      ps_cost=0.0012, ps_skew=1.6, ps_parallel=8.0, memory_skew=1.6)
    # 28 PS x 2 CPUs: the hottest serves 1.6/28 of 0.0012 core-s per sample with 1.5 cores
    assert float(cal.ps_capacity(28, 2.0)) == pytest.approx(1.5 / (1.6 / 28 * 0.0012))
    # more CPUs than the parallelism buy nothing
    assert float(cal.ps_capacity(4, 16.0)) == pytest.approx(float(cal.ps_capacity(4, 8.0)))
    assert float(cal.hot_share(1)) == 1.0
    unmeasured = Calibration(1.0, 0.004, 4.0, 0.5, 0.0, 1.0, 8.0, 1.0)
    assert math.isinf(float(unmeasured.ps_capacity(4, 8.0)))


def test_calibrate_needs_a_measured_configuration() -> None:
    with pytest.raises(ValueError, match="at least one configuration"):
        calibrate([Observation(1, 1, 1.0, 1.0, 0.0, 0.5, (0.5,))], CFG)


# ------------------------------------------------------------------ the calibrated model


def truth_throughput(w: float, p: float, cw: float, cp: float, m: int = 512) -> float:
    """A job of the calibrated form: parallel cores, hot PS, a network term in w/p, a PS capacity."""
    lw = min(cw, 4.5) - 0.8
    lp = min(cp, 8.0) - 0.5
    hot = min(1.0, 1.6 / p)
    t = 0.004 * m / lw + 0.0012 * m * hot / lp + 0.04 * w / p + 0.1
    return min(w * m / t, lp / (hot * 0.0012))


def test_fixed_coefficients_stay_and_the_rest_is_fitted() -> None:
    cal = Calibration(worker_overhead=0.8, worker_cost=0.004, worker_parallel=4.5, ps_overhead=0.5,
                      ps_cost=0.0012, ps_skew=1.6, ps_parallel=8.0, memory_skew=1.6)
    configs = [(1, 2, 32.0, 32.0), (38, 3, 4.0, 16.0), (32, 9, 4.0, 8.0), (20, 6, 3.0, 4.0)]
    samples = [Sample(Config(w, p, cw, cp, 512), truth_throughput(w, p, cw, cp)) for w, p, cw, cp in configs]
    model = fit(samples, JobConstants(calibration=cal),
                fixed={"alpha_grad": cal.worker_cost, "alpha_upd": cal.ps_cost, "alpha_emb": 0.0})
    c = model.coefficients
    assert (c.alpha_grad, c.alpha_upd, c.alpha_emb) == (0.004, 0.0012, 0.0)
    assert c.alpha_sync == pytest.approx(0.04, rel=0.05) and c.beta == pytest.approx(0.1, rel=0.1)
    for w, p, cw, cp in [(36, 28, 4.0, 2.0), (10, 2, 8.0, 8.0)]:  # plans it never saw
        assert model.predict(Config(w, p, cw, cp, 512)) == pytest.approx(truth_throughput(w, p, cw, cp), rel=0.03)


def test_on_one_configuration_the_prior_splits_what_the_data_cannot() -> None:
    """One plan cannot tell Eq. 4's sync (w/p) from beta; the similar jobs' coefficients can.  With more
    configurations the data outweigh a wrong prior."""
    cal = Calibration(0.8, 0.004, 4.5, 0.5, 0.0012, 1.6, 8.0, 1.6)
    fixed = {"alpha_grad": 0.004, "alpha_upd": 0.0012, "alpha_emb": 0.0}
    one = [Sample(Config(38, 6, 4.0, 16.0, 512), truth_throughput(38, 6, 4.0, 16.0))]  # below the PS capacity
    right = fit(one, JobConstants(calibration=cal), fixed=fixed, prior=Coefficients(0.004, 0.0012, 0.04, 0.0, 0.1))
    assert right.coefficients.alpha_sync == pytest.approx(0.04, rel=0.05)
    assert right.coefficients.beta == pytest.approx(0.1, rel=0.1)
    assert right.predict(Config(36, 28, 4.0, 2.0, 512)) == pytest.approx(truth_throughput(36, 28, 4.0, 2.0), rel=0.03)
    wrong = Coefficients(0.004, 0.0012, 0.01, 0.0, 0.5)
    many = [Sample(Config(w, p, cw, cp, 512), truth_throughput(w, p, cw, cp))
            for w, p, cw, cp in [(1, 2, 32.0, 32.0), (38, 3, 4.0, 16.0), (32, 9, 4.0, 8.0), (20, 6, 3.0, 4.0)]]
    model = fit(many, JobConstants(calibration=cal), fixed=fixed, prior=wrong)
    assert model.coefficients.alpha_sync == pytest.approx(0.04, rel=0.1)
    assert model.coefficients.beta == pytest.approx(0.1, rel=0.2)


def test_unknown_or_negative_fixed_coefficients_are_refused() -> None:
    s = [Sample(Config(1, 1, 1.0, 1.0, 8), 10.0)]
    with pytest.raises(FitError, match="unknown coefficient"):
        fit(s, fixed={"alpha_x": 1.0})
    with pytest.raises(FitError, match="finite and >= 0"):
        fit(s, fixed={"beta": -1.0})


def test_configurations_at_the_ps_capacity_are_left_out_of_the_latency_fit() -> None:
    cal = Calibration(0.8, 0.004, 4.5, 0.5, 0.0012, 1.6, 8.0, 1.6)
    # one plan starved by a single 2-CPU PS: its throughput is the capacity, whatever the latency
    capped = Sample(Config(40, 1, 4.0, 2.0, 512), float(cal.ps_capacity(1, 2.0)))
    free = [Sample(Config(w, p, cw, cp, 512), truth_throughput(w, p, cw, cp))
            for w, p, cw, cp in [(1, 2, 32.0, 32.0), (38, 3, 4.0, 16.0), (32, 9, 4.0, 8.0)]]
    fixed = {"alpha_grad": 0.004, "alpha_upd": 0.0012, "alpha_emb": 0.0}
    with_cap = fit([*free, capped], JobConstants(calibration=cal), fixed=fixed)
    without = fit(free, JobConstants(calibration=cal), fixed=fixed)
    assert with_cap.coefficients == without.coefficients
    assert with_cap.predict(capped.config) == pytest.approx(capped.throughput)  # the cap still predicts it


# ------------------------------------------------------------------ the fastest plans


def test_lattice_best_finds_the_fastest_plan_of_the_space() -> None:
    model = Model(Coefficients(1.2, 30.0, 6.0, 4.0, 9.0), JobConstants(model_size=4.0, bandwidth=10.0,
                                                                       embedding_dim=0.05))
    space = SearchSpace(batch_size=256, max_workers=24, max_ps=6, max_worker_cpu=6.0, max_ps_cpu=6.0,
                        worker_memory_mb=2048, ps_memory_mb=1024, model_memory_mb=8192, cpu_step=1.0,
                        max_cpu=48.0, max_memory_mb=64 * 1024, memory_skew=1.5)
    best = 0.0
    for w, p, cw, cp in itertools.product(range(1, 25), range(1, 7), range(1, 7), range(1, 7)):
        mem = w * 2048 + p * int(space.ps_memory(p))
        if w * cw + p * cp <= 48 and mem <= 64 * 1024:
            best = max(best, model.predict(Config(w, p, float(cw), float(cp), 256)))
    top = lattice_best("j", model, space, count=3)
    assert top[0].throughput == pytest.approx(best)
    assert [c.throughput for c in top] == sorted((c.throughput for c in top), reverse=True)
    for c in top:
        assert c.plan.workers * c.plan.worker_cpu + c.plan.ps * c.plan.ps_cpu <= 48.0
        assert c.plan.ps_memory_mb == int(space.ps_memory(c.plan.ps))


def test_ps_memory_covers_the_largest_partition() -> None:
    space = SearchSpace(batch_size=1, max_workers=1, max_ps=8, max_worker_cpu=1.0, max_ps_cpu=1.0,
                        worker_memory_mb=1, ps_memory_mb=512, model_memory_mb=8000, ps_base_mb=600,
                        memory_skew=2.0)
    assert int(space.ps_memory(8)) == 600 + 2000  # 2/8 of the model, not 1/8
    assert int(space.ps_memory(1)) == 600 + 8000
    even = SearchSpace(batch_size=1, max_workers=1, max_ps=8, max_worker_cpu=1.0, max_ps_cpu=1.0,
                       worker_memory_mb=1, ps_memory_mb=512, model_memory_mb=8000, ps_base_mb=600)
    assert int(even.ps_memory(8)) == 600 + 1000


# ------------------------------------------------------------------ one job alone


def _plan(w: int, cpu: float = 4.0) -> ResourcePlan:
    return ResourcePlan("j", w, 2, cpu, 2048, 4.0, 2048, PlanSource.BRAIN)


def test_a_job_alone_takes_the_largest_gain_not_the_most_efficient_step() -> None:
    current = _plan(10)
    small_free = Candidate(_plan(10, 3.9), 100.0, 1050.0)  # a bit faster and a bit cheaper
    big = Candidate(_plan(40), 400.0, 3000.0)
    req = JobRequest("j", [small_free, big], remaining_samples=1e8, current=current, current_throughput=1000.0)
    quota = Resources(cpu=200.0, memory_mb=math.inf)
    assert best_for_job(req, quota).plan == big.plan
    # Eq. 11-14 between jobs: the free step has infinite efficiency and wins there
    assert select([req], quota).choices[0].plan == small_free.plan


def test_a_job_alone_keeps_its_plan_when_nothing_gains_or_fits() -> None:
    current = _plan(10)
    over = Candidate(_plan(60), 600.0, 9000.0)  # 248 CPUs
    slower = Candidate(_plan(5), 50.0, 500.0)
    req = JobRequest("j", [over, slower], remaining_samples=1e8, current=current, current_throughput=1000.0)
    choice = best_for_job(req, Resources(cpu=200.0, memory_mb=math.inf), overhead=OverheadModel())
    assert choice.plan == current and not choice.changed
