"""DLRover-RM Eq. 1-6 throughput model and its NNLS/RMSLE fit (brain core, issue 6)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from pacer_services.brain.core.fitting import (
    PAPER_COEFFICIENTS,
    Coefficients,
    Config,
    FitError,
    JobConstants,
    Model,
    Sample,
    features,
    fit,
    rmsle,
)
from scipy.optimize import least_squares

CONSTANTS = JobConstants(model_size=4.0, bandwidth=10.0, embedding_dim=0.05)
TRUE = Coefficients(alpha_grad=1.2, alpha_upd=30.0, alpha_sync=6.0, alpha_emb=4.0, beta=9.0)


def _configs(n: int, seed: int) -> list[Config]:
    rng = np.random.default_rng(seed)
    return [
        Config(
            workers=int(rng.integers(1, 33)),
            ps=int(rng.integers(1, 9)),
            worker_cpu=float(rng.integers(1, 17)) / 2,
            ps_cpu=float(rng.integers(1, 17)) / 2,
            batch_size=int(rng.choice([128, 256, 512])),
        )
        for _ in range(n)
    ]


def _samples(model: Model, configs: list[Config], noise: float = 0.0, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [
        Sample(c, model.predict(c) * float(np.exp(rng.normal(0.0, noise)) if noise else 1.0))
        for c in configs
    ]


def test_iteration_time_is_the_sum_of_eq_2_to_5() -> None:
    c = Config(workers=8, ps=2, worker_cpu=4.0, ps_cpu=2.0, batch_size=256)
    m = Model(TRUE, CONSTANTS)
    by_hand = (
        1.2 * 256 / 4.0  # Eq. 2
        + 30.0 * 8 / (2 * 2.0)  # Eq. 3
        + 6.0 * (4.0 / 2) / (10.0 / 8)  # Eq. 4
        + 4.0 * 256 * 0.05 / 2  # Eq. 5
        + 9.0
    )
    assert m.iteration_time(c) == pytest.approx(by_hand)
    assert m.predict(c) == pytest.approx(8 * 256 / by_hand)  # Eq. 1


def test_nnls_recovers_known_parameters_from_noiseless_samples() -> None:
    model = fit(_samples(Model(TRUE, CONSTANTS), _configs(40, seed=1)), CONSTANTS)
    np.testing.assert_allclose(model.coefficients.as_vector(), TRUE.as_vector(), rtol=1e-6)
    assert model.rmsle < 1e-9
    assert model.samples == 40


def test_recovers_a_zero_parameter_without_going_negative() -> None:
    truth = Coefficients(alpha_grad=2.0, alpha_upd=0.0, alpha_sync=3.0, alpha_emb=0.0, beta=5.0)
    model = fit(_samples(Model(truth, CONSTANTS), _configs(30, seed=2)), CONSTANTS)
    assert all(v >= 0.0 for v in model.coefficients.as_vector())
    np.testing.assert_allclose(model.coefficients.as_vector(), truth.as_vector(), atol=1e-6)


def test_noisy_samples_give_a_model_close_to_the_truth() -> None:
    configs = _configs(200, seed=3)
    truth = Model(TRUE, CONSTANTS)
    samples = _samples(truth, configs, noise=0.05, seed=4)
    model = fit(samples, CONSTANTS)
    # It minimises RMSLE, so it fits the noisy data at least as well as the true parameters...
    observed = [s.throughput for s in samples]
    assert model.rmsle <= rmsle([truth.predict(c) for c in configs], observed) + 1e-9
    # ...and predicts unseen configurations within a few percent of the truth.
    fresh = _configs(100, seed=5)
    errors = [abs(model.predict(c) / truth.predict(c) - 1.0) for c in fresh]
    assert float(np.median(errors)) < 0.03
    assert max(errors) < 0.15


def test_the_fit_reaches_the_rmsle_minimum_of_a_general_bounded_solver() -> None:
    configs = _configs(60, seed=6)
    samples = _samples(Model(TRUE, CONSTANTS), configs, noise=0.2, seed=7)
    model = fit(samples, CONSTANTS)
    x = features(
        [c.workers for c in configs], [c.ps for c in configs], [c.worker_cpu for c in configs],
        [c.ps_cpu for c in configs], [c.batch_size for c in configs], CONSTANTS,
    )
    t_obs = np.array([c.workers * c.batch_size / s.throughput for c, s in zip(configs, samples, strict=True)])

    def residual(theta: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.log(np.maximum(x @ theta, 1e-12)) - np.log(t_obs)
        return out

    ref = least_squares(residual, TRUE.as_vector(), bounds=(0.0, np.inf))
    ref_rmsle = float(np.sqrt(np.mean(residual(ref.x) ** 2)))
    assert model.rmsle <= ref_rmsle + 1e-6


@pytest.mark.parametrize("coefficients", [TRUE, PAPER_COEFFICIENTS])
def test_throughput_is_monotone_where_the_model_says_so(coefficients: Coefficients) -> None:
    m = Model(coefficients, CONSTANTS)
    base = Config(workers=8, ps=2, worker_cpu=4.0, ps_cpu=2.0, batch_size=256)
    # More CPUs per worker or per PS, or more PS, shrink every term of Eq. 2-5.
    for field, values in (("worker_cpu", [1.0, 2.0, 4.0, 8.0]), ("ps_cpu", [0.5, 1.0, 4.0]),
                          ("ps", [1, 2, 4, 8]), ("workers", [1, 2, 4, 8, 16, 64])):
        preds = [m.predict(Config(**{**_as_dict(base), field: v})) for v in values]
        assert all(b > a for a, b in itertools.pairwise(preds)), (field, preds)
    # Workers saturate: Psi -> m / (a_upd/(p C_p) + a_sync M/(p B)) as w grows (Eq. 1, 3, 4).
    limit = 256 / (coefficients.alpha_upd / (2 * 2.0) + coefficients.alpha_sync * 4.0 / (2 * 10.0))
    assert m.predict(Config(workers=10**7, ps=2, worker_cpu=4.0, ps_cpu=2.0, batch_size=256)) == pytest.approx(limit, rel=1e-3)


def _as_dict(c: Config) -> dict[str, float | int]:
    return {"workers": c.workers, "ps": c.ps, "worker_cpu": c.worker_cpu, "ps_cpu": c.ps_cpu,
            "batch_size": c.batch_size}


def test_the_papers_coefficients_plug_in() -> None:
    m = Model(PAPER_COEFFICIENTS)
    assert PAPER_COEFFICIENTS.alpha_grad == 3.48 and PAPER_COEFFICIENTS.alpha_emb == 2.45
    c = Config(workers=4, ps=2, worker_cpu=8.0, ps_cpu=8.0, batch_size=512)
    # Unit constants: T = 3.48*512/8 + 2.36*4/16 + 0.68*4/2 + 2.45*512/2 + 2.45
    t = 3.48 * 512 / 8 + 2.36 * 4 / 16 + 0.68 * 4 / 2 + 2.45 * 512 / 2 + 2.45
    assert m.predict(c) == pytest.approx(4 * 512 / t)
    # Fitting samples generated from them returns them.
    back = fit(_samples(Model(PAPER_COEFFICIENTS, CONSTANTS), _configs(25, seed=8)), CONSTANTS)
    np.testing.assert_allclose(back.coefficients.as_vector(), PAPER_COEFFICIENTS.as_vector(), rtol=1e-6)


def test_predict_many_matches_predict() -> None:
    m = Model(TRUE, CONSTANTS)
    configs = _configs(10, seed=9)
    many = m.predict_many([c.workers for c in configs], [c.ps for c in configs],
                          [c.worker_cpu for c in configs], [c.ps_cpu for c in configs], 256)
    single = [m.predict(Config(c.workers, c.ps, c.worker_cpu, c.ps_cpu, 256)) for c in configs]
    np.testing.assert_allclose(many, single)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(FitError):
        fit([])
    c = Config(workers=2, ps=1, worker_cpu=1.0, ps_cpu=1.0, batch_size=64)
    with pytest.raises(FitError):
        fit([Sample(c, 0.0)])
    with pytest.raises(FitError):
        fit([Sample(Config(0, 1, 1.0, 1.0, 64), 10.0)])
    with pytest.raises(ValueError):
        Coefficients(alpha_grad=-1.0, alpha_upd=0, alpha_sync=0, alpha_emb=0, beta=0)
    assert math.isinf(Model(Coefficients(0, 0, 0, 0, 0)).predict(c))
