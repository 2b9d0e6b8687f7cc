"""The resource-performance model of DLRover-RM §4.1 and its online fit (§4.3, "Online Model Fitting").

One iteration of a PS job (DLRover-RM Eq. 1-5)::

    T_iter = T_grad + T_upd + T_sync + T_emb
    T_grad = a_grad * m / C_w                + b_grad   (Eq. 2, C_w = lambda_w: CPUs per worker)
    T_upd  = a_upd  * w / (p * C_p)          + b_upd    (Eq. 3, C_p = lambda_p: CPUs per PS)
    T_sync = a_sync * (M / p) / (B / w)      + b_sync   (Eq. 4, M model size, B bandwidth)
    T_emb  = a_emb  * m * D / p              + b_emb    (Eq. 5, D embedding dimension)
    Psi    = w * m / T_iter                             (Eq. 1, samples per second)

``m`` is the mini-batch of *one worker* per iteration (the paper's m; a
job spec's ``batch_size`` is the global batch, so divide it by ``w``
first).  Eq. 6 names eight parameters, but the four betas only ever appear
as their sum, so only ``beta = b_grad + b_upd + b_sync + b_emb`` can be
identified from throughput data: the model keeps that sum (the paper also
reports only the sum, "2.45 for the sum of beta", §6.2).

Fitting.  The paper minimises the RMSLE between model and measurements
with NNLS, all parameters non-negative.  With ``theta = (a_grad, a_upd,
a_sync, a_emb, beta)`` and the feature row ``x = (m/C_w, w/(p C_p),
M w/(p B), m D/p, 1)``, the model is ``T_iter = x . theta``, linear in
``theta``; but the log-error ``log Psi_obs - log Psi_model = log(x . theta)
- log T_obs`` is not.  We minimise it by projected Gauss-Newton, each step
an NNLS problem: linearising ``log(x . theta)`` around the current
``T_k = x . theta_k`` gives the residual
``log T_k + x . (theta - theta_k) / T_k - log T_obs``, i.e. the NNLS system
``A = x / T_k``, ``b = 1 + log(T_obs / T_k)``.  The first step takes
``T_k = T_obs`` and so minimises the relative error ``(x . theta - T_obs) / T_obs``,
which is the first-order expansion of the log error; later steps converge
to the RMSLE minimum.  A step is kept only if it lowers the RMSLE, so the
result is never worse than the relative-error NNLS solution.

Calibrated model.  With a :class:`~.calibration.Calibration` in the job's
constants (what the job's CPU readings say, :mod:`.calibration`):

* lambda_w and lambda_p are the *parallel* cores of the paper's definition
  (§4.1: "the number of parallel computing CPU cores"), ``min(C, P) - o``,
  rather than the CPUs given;
* Eq. 2's alpha_grad is the worker cost the CPU readings measured (core-
  seconds per sample: workload ``m`` at rate lambda_w takes ``a m /
  lambda_w``), fixed rather than fitted;
* Eq. 3 and Eq. 5 are the PS's work on a batch, the gradient update and
  the embedding lookups, and both are PS CPU, which the readings measure as
  ``b`` core-seconds per sample over all PS.  A batch waits for the hottest
  PS, which serves ``h(p)`` of that work at lambda_p cores: the PS term is
  ``b m h(p) / lambda_p`` (alpha_upd := b, feature ``m h(p) / lambda_p``;
  alpha_emb := 0, its work is in that term).  Fitted from throughput alone
  the two PS terms and Eq. 4's sync are nearly collinear over the few
  configurations a job can afford, and NNLS puts the weight on whichever
  fits the noise best; measured, they are not guessed;
* what is left to fit is Eq. 4's sync (the network, ``w / p``) and beta;
* the prediction is capped by what the hottest PS can serve,
  ``lambda_p / (h(p) b)``; configurations that ran at that cap say nothing
  about the iteration time and are left out of the fit; where nothing
  else is left, a prior (a warm start's similar jobs) gives the terms they
  cannot tell (sync, beta), else they are fitted on the capped ones.

RMSLE here is on ``log Psi`` rather than ``log(1 + Psi)``: throughputs are
hundreds to thousands of samples per second, where the two differ by less
than ``1 / Psi``, and the plain log makes the fit independent of the unit
of throughput (samples/s or steps/s).

Pure: no IO, no clock; numpy arrays in, dataclasses out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.optimize import nnls  # type: ignore[import-untyped]

from .calibration import Calibration

FloatArray = npt.NDArray[np.float64]

__all__ = [
    "PAPER_COEFFICIENTS",
    "UNIT_CONSTANTS",
    "Coefficients",
    "Config",
    "FitError",
    "JobConstants",
    "Model",
    "Sample",
    "features",
    "fit",
    "rmsle",
]


class FitError(ValueError):
    """The samples cannot be fitted: none, or a non-positive throughput or resource."""


@dataclass(frozen=True, slots=True)
class Config:
    """A resource configuration of one job: the inputs (w, p, C_w, C_p, m) of DLRover-RM Eq. 1-5."""

    workers: int  # w
    ps: int  # p
    worker_cpu: float  # C_w = lambda_w, parallel cores per worker
    ps_cpu: float  # C_p = lambda_p, parallel cores per PS
    batch_size: int  # m, samples per worker per iteration


@dataclass(frozen=True, slots=True)
class JobConstants:
    """What DLRover-RM treats as constant for a job "during a short time": M, B (Eq. 4) and D (Eq. 5).

    Only ``model_size / bandwidth`` and ``embedding_dim`` enter the model,
    each multiplied by a free alpha; with the unit defaults the alphas
    absorb them.  Fix them when they are known, so that alphas fitted on one
    job mean the same on a job with a bigger model.
    """

    model_size: float = 1.0  # M
    bandwidth: float = 1.0  # B
    embedding_dim: float = 1.0  # D
    calibration: Calibration | None = None  # parallel cores, hot PS, PS capacity (module docstring)


UNIT_CONSTANTS = JobConstants()


_NAMES = ("alpha_grad", "alpha_upd", "alpha_sync", "alpha_emb", "beta")  # the columns of features()


@dataclass(frozen=True, slots=True)
class Coefficients:
    """The learnable, non-negative parameters of DLRover-RM Eq. 6 (betas as their identifiable sum)."""

    alpha_grad: float
    alpha_upd: float
    alpha_sync: float
    alpha_emb: float
    beta: float  # b_grad + b_upd + b_sync + b_emb

    def __post_init__(self) -> None:
        for name in ("alpha_grad", "alpha_upd", "alpha_sync", "alpha_emb", "beta"):
            value = getattr(self, name)
            if not (value >= 0.0 and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and >= 0 (DLRover-RM §4.3), got {value}")

    def as_vector(self) -> FloatArray:
        """In the column order of :func:`features`."""
        return np.array(
            [self.alpha_grad, self.alpha_upd, self.alpha_sync, self.alpha_emb, self.beta],
            dtype=np.float64,
        )

    def to_dict(self) -> dict[str, float]:
        return {name: float(v) for name, v in zip(_NAMES, self.as_vector(), strict=True)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Coefficients:
        """From :meth:`to_dict`'s form; ``ValueError`` (from ``__post_init__``) on a bad value."""
        return cls(**{name: float(d[name]) for name in _NAMES})

    @classmethod
    def from_vector(cls, theta: FloatArray) -> Coefficients:
        g, u, s, e, b = (max(0.0, float(v)) for v in theta)
        return cls(alpha_grad=g, alpha_upd=u, alpha_sync=s, alpha_emb=e, beta=b)


# DLRover-RM §6.2: "alpha_grad = 3.48, alpha_upd = 2.36, alpha_lookup = 2.45,
# alpha_sync = 0.68, and 2.45 for the sum of beta" (alpha_lookup is Eq. 5's
# alpha_emb).  The paper gives no units; with them the model predicts in
# whatever unit m, M/B and D were measured in.
PAPER_COEFFICIENTS = Coefficients(
    alpha_grad=3.48, alpha_upd=2.36, alpha_sync=0.68, alpha_emb=2.45, beta=2.45
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One measurement: the job ran with ``config`` at ``throughput`` samples per second."""

    config: Config
    throughput: float


def features(
    workers: npt.ArrayLike,
    ps: npt.ArrayLike,
    worker_cpu: npt.ArrayLike,
    ps_cpu: npt.ArrayLike,
    batch_size: npt.ArrayLike,
    constants: JobConstants = UNIT_CONSTANTS,
) -> FloatArray:
    """The design matrix: one row ``x`` per configuration with ``T_iter = x . theta``.

    Columns follow the alphas of DLRover-RM Eq. 2, 3, 4, 5 and the beta sum.
    Accepts scalars or equally shaped arrays (vectorised for NSGA-II).
    """
    w = np.asarray(workers, dtype=np.float64)
    p = np.asarray(ps, dtype=np.float64)
    cw = np.asarray(worker_cpu, dtype=np.float64)
    cp = np.asarray(ps_cpu, dtype=np.float64)
    m = np.asarray(batch_size, dtype=np.float64)
    w, p, cw, cp, m = np.broadcast_arrays(w, p, cw, cp, m)
    cal = constants.calibration
    sync = (constants.model_size / p) / (constants.bandwidth / w)  # Eq. 4: (M/p) / (B/w)
    if cal is None:
        grad = m / cw  # Eq. 2: workload m over rate lambda_w
        upd = w / (p * cp)  # Eq. 3: w gradient copies shared by p PS with lambda_p cores each
        emb = m * constants.embedding_dim / p  # Eq. 5: m * D / p
    else:  # parallel cores; the PS work of a batch at the hottest PS (module docstring)
        lp = cal.lambda_p(cp)
        grad = m / cal.lambda_w(cw)
        upd = m * cal.hot_share(p) / lp
        emb = np.zeros_like(w)
    return np.stack([grad, upd, sync, emb, np.ones_like(w)], axis=-1)


def rmsle(predicted: npt.ArrayLike, observed: npt.ArrayLike) -> float:
    """Root mean squared log error on ``log Psi`` (see the module docstring for why not log1p)."""
    pred = np.asarray(predicted, dtype=np.float64)
    obs = np.asarray(observed, dtype=np.float64)
    return float(np.sqrt(np.mean((np.log(pred) - np.log(obs)) ** 2)))


@dataclass(frozen=True, slots=True)
class Model:
    """A fitted (or given) resource-performance model: DLRover-RM Eq. 6, ``Psi = F(alphas, beta)``."""

    coefficients: Coefficients
    constants: JobConstants = UNIT_CONSTANTS
    rmsle: float = 0.0  # fit quality on the samples it was fitted on (0 for given coefficients)
    samples: int = 0  # how many samples it was fitted on

    def iteration_time(self, config: Config) -> float:
        """T_iter = T_grad + T_upd + T_sync + T_emb (DLRover-RM Eq. 1-5), in the unit of the fit."""
        x = features(
            config.workers, config.ps, config.worker_cpu, config.ps_cpu, config.batch_size,
            self.constants,
        )
        return float(x @ self.coefficients.as_vector())

    def predict(self, config: Config) -> float:
        """Throughput Psi = w * m / T_iter (DLRover-RM Eq. 1), within the PS capacity; ``inf`` if all is 0."""
        _check_config(config)
        return float(self.predict_many(config.workers, config.ps, config.worker_cpu, config.ps_cpu,
                                       config.batch_size))

    def predict_many(
        self,
        workers: npt.ArrayLike,
        ps: npt.ArrayLike,
        worker_cpu: npt.ArrayLike,
        ps_cpu: npt.ArrayLike,
        batch_size: npt.ArrayLike,
    ) -> FloatArray:
        """:meth:`predict` over arrays of configurations (one call per NSGA-II generation)."""
        x = features(workers, ps, worker_cpu, ps_cpu, batch_size, self.constants)
        t = x @ self.coefficients.as_vector()
        w = np.broadcast_to(np.asarray(workers, dtype=np.float64), t.shape)
        m = np.broadcast_to(np.asarray(batch_size, dtype=np.float64), t.shape)
        with np.errstate(divide="ignore"):
            psi: FloatArray = np.where(t > 0.0, w * m / np.where(t > 0.0, t, 1.0), np.inf)
        cal = self.constants.calibration
        if cal is not None:
            psi = np.minimum(psi, cal.ps_capacity(np.asarray(ps, dtype=np.float64),
                                                  np.asarray(ps_cpu, dtype=np.float64)))
        return psi


def _check_config(config: Config) -> None:
    if config.workers < 1 or config.ps < 1 or config.batch_size < 1:
        raise FitError(f"workers, ps and batch_size must be >= 1: {config}")
    if not (config.worker_cpu > 0.0 and config.ps_cpu > 0.0):
        raise FitError(f"worker_cpu and ps_cpu must be > 0: {config}")


def fit(
    samples: Sequence[Sample],
    constants: JobConstants = UNIT_CONSTANTS,
    *,
    max_steps: int = 20,
    tol: float = 1e-10,
    fixed: dict[str, float] | None = None,
    prior: Coefficients | None = None,
    prior_weight: float = 0.01,
) -> Model:
    """Fit the non-negative alphas and beta of DLRover-RM Eq. 1-6 to ``samples`` minimising RMSLE.

    NNLS (``scipy.optimize.nnls``) on the relative-error linearisation, then
    up to ``max_steps`` projected Gauss-Newton steps on the exact log error
    (module docstring).  Columns are scaled to unit maximum before NNLS so
    that features of very different magnitudes (m / C_w in the hundreds,
    the constant 1) do not upset its active-set tolerance.  ``fixed``
    names coefficients (``alpha_grad``, ``alpha_upd``, ``alpha_sync``,
    ``alpha_emb``, ``beta``) that keep the given value; the others are
    fitted around them (a fixed offset in every iteration time).

    ``prior`` (e.g. the similar jobs' coefficients of a warm start) adds one
    row per free, positive coefficient, ``prior_weight * (theta / prior -
    1)``: a relative deviation from the prior costs as much as a log error
    of ``prior_weight`` in one sample.  A few configurations cannot tell
    every term apart (one cannot tell the sync term from beta at all); the
    prior decides there and the data everywhere else.
    """
    if not samples:
        raise FitError("no samples to fit")
    for s in samples:
        _check_config(s.config)
        if not (s.throughput > 0.0 and math.isfinite(s.throughput)):
            raise FitError(f"throughput must be finite and > 0: {s}")
    fixed = dict(fixed or {})
    for name, value in fixed.items():
        if name not in _NAMES:
            raise FitError(f"fixed: unknown coefficient {name!r}; known: {', '.join(_NAMES)}")
        if not (value >= 0.0 and math.isfinite(value)):
            raise FitError(f"fixed: {name} must be finite and >= 0, got {value}")
    cal = constants.calibration
    if cal is not None:  # at the PS capacity the throughput says nothing about the iteration time
        free = [s for s in samples if not cal.paced(s.config.ps, s.config.ps_cpu, s.throughput)]
        if not free and prior is not None:
            # ... so where every configuration ran at it, the terms it cannot tell (Eq. 4's sync, beta)
            # are the prior's (a warm start's similar jobs), the rest as fixed: no fit of noise to the cap
            given = {**prior.to_dict(), **fixed}
            model = Model(Coefficients.from_dict(given), constants)
            return replace(model, rmsle=rmsle([model.predict(s.config) for s in samples],
                                              [s.throughput for s in samples]), samples=len(samples))
        samples = free or list(samples)
    cfg = [s.config for s in samples]
    x = features(
        [c.workers for c in cfg], [c.ps for c in cfg], [c.worker_cpu for c in cfg],
        [c.ps_cpu for c in cfg], [c.batch_size for c in cfg], constants,
    )
    psi = np.array([s.throughput for s in samples], dtype=np.float64)
    t_obs = np.array([c.workers * c.batch_size for c in cfg], dtype=np.float64) / psi  # Eq. 1
    offset = np.zeros_like(t_obs)
    x = x.copy()
    for name, value in fixed.items():
        i = _NAMES.index(name)
        offset = offset + value * x[:, i]
        x[:, i] = 0.0
    scale = np.max(np.abs(x), axis=0)
    scale[scale == 0.0] = 1.0
    xs = x / scale

    # prior rows in the scaled unknowns: theta_j = theta_scaled_j / scale_j
    p_rows = np.zeros((0, x.shape[1]))
    p_target = np.zeros(0)
    if prior is not None and prior_weight > 0.0:
        pv = prior.as_vector()
        kept = [j for j, name in enumerate(_NAMES) if name not in fixed and pv[j] > 0.0]
        p_rows = np.zeros((len(kept), x.shape[1]))
        for r, j in enumerate(kept):
            p_rows[r, j] = prior_weight / (pv[j] * scale[j])
        p_target = np.full(len(kept), prior_weight)

    def rmsle_of(theta_scaled: FloatArray) -> float:
        t = offset + xs @ theta_scaled
        if np.any(t <= 0.0):
            return math.inf
        return float(np.sqrt(np.mean((np.log(t) - np.log(t_obs)) ** 2)))  # = RMSLE of Psi

    def objective(theta_scaled: FloatArray) -> float:
        err = rmsle_of(theta_scaled)
        return err * err * len(t_obs) + float(np.sum((p_rows @ theta_scaled - p_target) ** 2))

    t_k = t_obs
    best: FloatArray | None = None
    best_obj = math.inf
    for _ in range(max_steps + 1):
        a = np.vstack([xs / t_k[:, None], p_rows])
        b = np.concatenate([1.0 + np.log(t_obs / t_k) - offset / t_k,  # linearised around T_k,
                            p_target])                                # the fixed part moved right
        theta, _ = nnls(a, b)
        obj = objective(theta)
        if obj >= best_obj - tol:
            break
        best, best_obj = theta, obj
        t_k = offset + xs @ theta
    if best is None:  # every parameter 0 or no positive time: nothing fits
        raise FitError("NNLS found no model with a positive iteration time for these samples")
    theta = best / scale
    for name, value in fixed.items():
        theta[_NAMES.index(name)] = value
    coefficients = Coefficients.from_vector(theta)
    return Model(coefficients=coefficients, constants=constants, rmsle=rmsle_of(best), samples=len(samples))
