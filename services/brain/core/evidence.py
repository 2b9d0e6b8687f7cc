"""How much a job's measurements say: when to stop measuring, what a prediction is worth, what a plan implies.

Three small rules of the autoscaler (:mod:`.autoscaler`), each a pure
function so that it can be tested alone:

* :func:`windows_needed` - a statistical stopping rule.  The mean of ``n``
  windows of relative noise ``sigma`` is within ``tolerance`` of the truth
  with confidence ``z`` once ``z sigma / sqrt(n) <= tolerance``, i.e.
  ``n >= (z sigma / tolerance)^2``; never fewer than ``least`` windows (one
  window cannot tell its own noise) nor more than ``most``.  A quiet job
  stops at ``least``, a noisy one measures longer instead of acting on
  noise.
* :func:`anchored` - a model's prediction for a plan, scaled by how far the
  model misses a measured plan (the autoscaler takes the nearest, by
  :func:`plan_distance`): ``Psi(c) x Psi_measured(ref) / Psi_model(ref)``.
  The fitted model's bias near the job's configurations is largely shared
  by its neighbours, so the *ratio* it predicts is more trustworthy than
  its level.  The autoscaler caps a prediction at its anchored value, so a
  candidate is worth a move only when both its level and its ratio clear
  the noise and the pause (DLRover-RM Eq. 8, TG(A) = Delta Psi - Overhead(A)).
  Without the cap a model that overrates every plan by a few percent moved
  converged xDeepFM jobs to plans no better than the ones they ran.
* :func:`takes_model_plan` - after the sample, the model's plan directly
  (one restart) instead of Eq. 10-11's plan and then the model's (two), when
  the model's pessimistic prediction (anchored, discounted by its error)
  both pays for the pause (Eq. 8's gain net of the overhead is positive)
  and either beats what Eq. 10-11 promise from the same sample or, with
  the PS count near the sample's (within :data:`NEAR_PS_RATIO` times),
  comes within three model errors of that promise: the
  PS side of the model (the hot PS's share ``min(1, kappa / p)``, Eq. 3-5's
  ``1 / p`` terms) is measured at the sample's ``p`` alone, so a plan near
  it is an interpolation the model can be trusted with, while Eq. 10-11's
  promise, made without any PS model, costs a second restart to check.
  Where neither holds (typically a PS-bound job whose model wants many
  times the sample's PS), Eq. 10-11's plan is measured first.  Measured
  (cold, in-place memory growth, 10 seeds per profile): xDeepFM
  +4.68 -> +3.47 % over the oracle on seeds 0-9, +4.40 -> +3.55 % on the
  unseen seeds 10-19; Wide&Deep unchanged (its model plans have 13-56 PS
  for the sample's 2, and taking them directly was worse: +5.62 -> +6.63 %).
  The xDeepFM model plans taken came within 0.90-0.99 of the promise (the
  margin is exp(-3 x 0.05) = 0.86 with the prior error); a synthetic
  worker-bound job whose one-window model wanted 5 workers for Eq. 10-11's
  14 (0.76, tests/integration/test_brain_service.py) measures Eq. 10-11's
  plan first.
* :func:`model_mb_of_plan` - the model size (MiB over all PS) a plan's PS
  memory was made for: a warm-start plan (DLRover-RM Alg. 1) is built from
  similar jobs' plans *as they ran to their end*, OOM relaunches included,
  so its PS memory says how large the embeddings grow, long before the
  job's own RSS trend can (DLRover-RM §5.3).  Inverts the sizing of
  :func:`.stages.memory_for` and the hottest partition's share
  ``min(1, kappa / p)``.

Pure: no IO, no clock.
"""

from __future__ import annotations

import math

__all__ = ["NEAR_PS_RATIO", "anchored", "model_mb_of_plan", "plan_distance", "takes_model_plan", "windows_needed"]


def windows_needed(sigma: float, tolerance: float, *, z: float = 2.0, least: int = 2, most: int = 10) -> int:
    """Windows to average so the mean is within ``tolerance`` (relative) at ``z`` standard errors."""
    if least < 1 or most < least:
        raise ValueError(f"need 1 <= least <= most, got least={least} most={most}")
    if tolerance <= 0.0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")
    if not math.isfinite(sigma) or sigma < 0.0:
        return most
    n = math.ceil((z * sigma / tolerance) ** 2 - 1e-9)
    return max(least, min(most, n))


def anchored(predicted: float, model_at_current: float, measured_current: float) -> float:
    """``predicted`` scaled by measured / predicted throughput of the plan in force (no anchor: unchanged)."""
    if model_at_current <= 0.0 or measured_current <= 0.0 or not math.isfinite(model_at_current):
        return predicted
    return predicted * measured_current / model_at_current


def model_mb_of_plan(ps: int, ps_memory_mb: int, *, memory_skew: float, base_mb: float, headroom: float) -> float:
    """MiB of model over all PS that ``ps`` PS of ``ps_memory_mb`` each were sized to hold.

    A PS gets ``(base + share x model) x (1 + headroom)`` with the hottest
    share ``min(1, kappa / p)``; so ``model = (mem / (1 + headroom) - base) / share``.
    """
    if ps < 1 or ps_memory_mb <= 0:
        return 0.0
    share = min(1.0, max(1.0, memory_skew) / ps)
    return max(0.0, ps_memory_mb / (1.0 + headroom) - base_mb) / share


#: A model plan whose PS count is within this factor of the sample's is near enough to be taken directly.
NEAR_PS_RATIO = 5.0


def takes_model_plan(gain_net_of_overhead: float, model_throughput: float, rule_throughput: float,
                     *, plan_ps: int = 0, sampled_ps: int = 0, model_error: float = 0.0) -> bool:
    """Whether the model's plan is sure enough to skip Eq. 10-11's step: it pays for its pause
    (TG > 0, DLRover-RM Eq. 8), and its pessimistic throughput beats Eq. 10-11's promise, or, with its
    PS count near the sample's, comes within three model errors of it (module doc: the two are then
    alike as far as the model can tell, and the model's saves a restart).  ``plan_ps`` /
    ``sampled_ps`` 0: not known."""
    if gain_net_of_overhead <= 0.0:
        return False
    if model_throughput > rule_throughput:
        return True
    near = 0 < plan_ps and 0 < sampled_ps and max(plan_ps, sampled_ps) <= NEAR_PS_RATIO * min(plan_ps, sampled_ps)
    return near and model_throughput >= rule_throughput * math.exp(-3.0 * max(0.0, model_error))


def plan_distance(a: tuple[int, int, float, float], b: tuple[int, int, float, float]) -> float:
    """Distance of two plans (workers, PS, worker CPU, PS CPU) in log space: relative changes count alike."""
    return math.sqrt(sum(math.log(max(x, 1e-9) / max(y, 1e-9)) ** 2 for x, y in zip(a, b, strict=True)))
