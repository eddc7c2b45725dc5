"""Weights on the probability simplex: validation, the log-space exponentiated-gradient step, floors.

GRAPE's updates are multiplicative (mirror descent with the negative entropy), so the natural state is
the *log* of the weights: one step adds ``eta * gradient`` to the log-weights and renormalises with a
log-sum-exp. Done that way an exponent of +-1e4 (which overflows ``exp`` in float64 beyond ~709) still
yields finite weights that sum to 1, and a weight that becomes tiny keeps an exact log value instead of
underflowing to a permanent zero.

Everything here is plain numpy float64, with no torch and no I/O, so the reweighters, the mixer and
the tests can share the same checks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "SUM_ATOL",
    "apply_floor",
    "as_float_vector",
    "check_simplex",
    "exp_gradient_step",
    "log_normalize",
    "logsumexp",
    "mix_uniform",
    "probs_from_log",
    "uniform",
]

#: How far from 1 a user-supplied weight vector may sum before it is rejected. Loose enough for weights
#: typed into a YAML recipe with a few decimals, tight enough to catch a vector that was never normalised.
SUM_ATOL = 1e-6


def as_float_vector(values: Any, name: str) -> np.ndarray:
    """A 1-D float64 copy of ``values`` (list, numpy array or torch tensor), or a ValueError naming ``name``."""
    if hasattr(values, "detach"):  # torch.Tensor without importing torch
        values = values.detach().cpu().double().numpy()
    try:
        arr = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a sequence of numbers, got {type(values).__name__}: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-dimensional, got shape {arr.shape}")
    return arr


def uniform(n: int) -> np.ndarray:
    """The uniform distribution over ``n`` items (float64)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"the number of weights must be a positive integer, got {n!r}")
    return np.full(int(n), 1.0 / int(n), dtype=np.float64)


def check_simplex(
    weights: Any, name: str = "weights", size: int | None = None, atol: float = SUM_ATOL
) -> np.ndarray:
    """Validate a weight vector and return an exactly renormalised float64 copy.

    Rejected, each with a message naming ``name`` and the offending entries: wrong length, NaN/inf,
    negative entries, all zeros, a sum further than ``atol`` from 1. Zeros are allowed (a domain that is
    switched off); note that the multiplicative update can never revive an exact zero.
    """
    arr = as_float_vector(weights, name)
    if size is not None and arr.shape[0] != size:
        raise ValueError(f"{name} has {arr.shape[0]} entries but {size} are expected")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} is empty")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise ValueError(f"{name} has non-finite entries at positions {bad.tolist()}: {arr[bad].tolist()}")
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        raise ValueError(f"{name} has negative entries at positions {neg.tolist()}: {arr[neg].tolist()}")
    total = float(arr.sum())
    if total == 0.0:
        raise ValueError(f"{name} is all zeros; at least one weight must be positive")
    if abs(total - 1.0) > atol:
        raise ValueError(
            f"{name} sums to {total!r}, not 1 (tolerance {atol:g}); pass normalised weights "
            f"(e.g. w / sum(w)) so that a typo is not silently rescaled"
        )
    return arr / total


def logsumexp(x: np.ndarray) -> float:
    """log(sum(exp(x))) without overflow; entries may be -inf (zero weight), not all of them."""
    x = np.asarray(x, dtype=np.float64)
    m = float(np.max(x))
    if m == -math.inf:
        raise ValueError("logsumexp of an all -inf vector (every weight is zero)")
    if not math.isfinite(m):
        raise ValueError(f"logsumexp got a non-finite maximum {m!r}")
    return m + math.log(float(np.sum(np.exp(x - m))))


def log_normalize(log_w: np.ndarray) -> np.ndarray:
    """Shift log-weights so that they are the logs of a distribution (their log-sum-exp becomes 0)."""
    log_w = np.asarray(log_w, dtype=np.float64)
    return log_w - logsumexp(log_w)


def probs_from_log(log_w: np.ndarray) -> np.ndarray:
    """Weights from log-weights: finite, non-negative, summing to 1 up to one rounding error."""
    p = np.exp(log_normalize(log_w))
    return p / p.sum()


def exp_gradient_step(log_w: np.ndarray, direction: np.ndarray, eta: float) -> np.ndarray:
    """One exponentiated-gradient step in log space: ``log w + eta * direction``, renormalised.

    This is w_i <- w_i * exp(eta * direction_i) / sum_j w_j * exp(eta * direction_j), computed without
    ever forming exp(eta * direction). Pass a negated direction for a descent step (the task weights).
    Raises FloatingPointError when ``eta * direction`` is not finite so that the caller can skip the
    update instead of storing NaNs.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        step = float(eta) * np.asarray(direction, dtype=np.float64)
    if not np.all(np.isfinite(step)):
        raise FloatingPointError(f"exponent eta*direction is not finite (eta={eta!r}, direction={direction!r})")
    return log_normalize(np.asarray(log_w, dtype=np.float64) + step)


def mix_uniform(weights: np.ndarray, share: float) -> np.ndarray:
    """``(1 - share) * w + share / n``: keeps every weight >= share / n ("fixed share" smoothing)."""
    if not (0.0 <= share <= 1.0):
        raise ValueError(f"the uniform share must lie in [0, 1], got {share!r}")
    w = np.asarray(weights, dtype=np.float64)
    if share == 0.0:
        return w.copy()
    out = (1.0 - share) * w + share / w.shape[0]
    return out / out.sum()


def apply_floor(weights: np.ndarray, floor: float) -> np.ndarray:
    """Raise every weight to at least ``floor``, keeping the others' ratios: ``w'_i = max(floor, c * w_i)``.

    ``c`` is the one constant that makes the result sum to 1, so the weights that are above the floor
    keep their exact ratios (what the reweighter decided among healthy domains is unchanged) and only the
    starving ones are lifted. This is the KL (Bregman) projection of ``w`` onto ``{w in simplex:
    w_i >= floor}``, the projection that matches the multiplicative update. ``floor`` must lie in
    [0, 1/n]; 1/n forces the uniform distribution. After the final renormalisation a floored weight may
    sit one rounding error below ``floor``.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = w.shape[0]
    if not (0.0 <= floor <= 1.0 / n + 1e-15):
        raise ValueError(f"a floor must lie in [0, 1/{n}] = [0, {1.0 / n!r}] for {n} weights, got {floor!r}")
    if floor == 0.0 or float(w.min()) >= floor:
        return w.copy()
    if floor * n >= 1.0 - 1e-12:
        return uniform(n)
    order = np.argsort(w, kind="stable")
    ws = w[order]
    suffix = np.cumsum(ws[::-1])[::-1]  # suffix[m] = sum(ws[m:])
    scale = None
    for m in range(1, n):  # m = number of weights pinned at the floor (at least one: min < floor)
        if suffix[m] <= 0.0:
            continue
        c = (1.0 - m * floor) / float(suffix[m])
        if c * ws[m] >= floor:
            scale = c
            break
    if scale is None:  # only reachable through rounding at floor ~ 1/n
        return uniform(n)
    out = np.maximum(floor, scale * w)
    return out / out.sum()
