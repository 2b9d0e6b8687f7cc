"""Offline metrics in numpy: AUC and log loss, to judge a model on held-out data."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def auc(labels: ArrayLike, scores: ArrayLike) -> float:
    """ROC AUC by ranks (the Mann-Whitney U statistic); tied scores share their average rank.

    Returns NaN when only one class is present (AUC is undefined then).
    """
    y = np.asarray(labels).ravel() > 0.5
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape:
        raise ValueError(f"labels {y.shape} and scores {s.shape} differ in shape")
    pos = int(y.sum())
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # Average ranks over runs of equal scores, so ties count one half.
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    avg = (starts + ends + 1) / 2.0  # mean of 1-based ranks start+1 .. end
    ranks = np.empty(len(s), dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y].sum() - pos * (pos + 1) / 2.0
    return float(u / (pos * neg))


def logloss(labels: ArrayLike, probs: ArrayLike, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy; probabilities are clipped to [eps, 1 - eps] so a sure miss is finite."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probs, dtype=np.float64).ravel(), eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))
