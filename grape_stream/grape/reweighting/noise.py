"""Noise controls beyond the paper, all off by default: cosine alignments, an EMA of the Gram, an EMA of alpha.

Why: probe gradients are noisy and their norms swing 10-100x between updates (docs/results.md), so the
raw inner products the paper uses make the step size depend on the gradient norm of the moment. Three
remedies, each a pure function of the Gram matrix or of the weights, hence exact and checkpointable:

* ``alignment="cosine"``: every probe gradient normalised to unit length, G <- D G D with
  D_ii = 1 / sqrt(G_ii) (a zero gradient stays zero), an alternative to ``clip_norm``;
* ``gram_ema=beta``: the alignments use M_t = beta * M_{t-1} + (1 - beta) * G_t (after clipping /
  cosine), started at the first Gram, so noise averages out across updates;
* ``alpha_ema=beta``: as in Dynamic Gradient Alignment (Fan, Grangier, Ablin 2024), the mirror-descent
  step's result is damped, alpha_t = beta * alpha_{t-1} + (1 - beta) * step(alpha_{t-1}).

The options themselves (their fields and checks) are ``NoiseOptions`` in grape.reweighting.options. Only
non-default values are stored in a reweighter's options (and its state), so checkpoints written before
these options existed still load strictly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["ALIGNMENTS", "cosine_gram", "ema", "gram_ema_from_state", "mix_log_weights"]

#: "inner": raw inner products (paper); "cosine": unit-length gradients.
ALIGNMENTS = ("inner", "cosine")


def cosine_gram(g: np.ndarray) -> np.ndarray:
    """Gram of the unit-length gradients: G[i, j] / (||v_i|| ||v_j||); a zero gradient stays zero."""
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    inv = np.zeros_like(norms)
    nz = norms > 0.0
    inv[nz] = 1.0 / norms[nz]
    return g * inv[:, None] * inv[None, :]


def ema(prev: np.ndarray | None, new: np.ndarray, beta: float) -> np.ndarray:
    """beta * prev + (1 - beta) * new, started at `new` (so the first update is the paper's)."""
    if prev is None or beta == 0.0:
        return new.copy()
    return beta * prev + (1.0 - beta) * new


def mix_log_weights(log_prev: np.ndarray, log_step: np.ndarray, beta: float) -> np.ndarray:
    """log(beta * p_prev + (1 - beta) * p_step) of two normalised log-weight vectors, in log space.

    Both inputs are normalised, so the result is too; exact zeros (-inf) stay zero only where both are.
    """
    if beta == 0.0:
        return log_step
    with np.errstate(divide="ignore"):
        a = log_prev + math.log(beta)
        b = log_step + math.log1p(-beta)
    return np.logaddexp(a, b)


def gram_ema_from_state(value: Any, size: int) -> np.ndarray | None:
    """The saved running Gram (a list of rows, or None before the first update), checked."""
    if value is None:
        return None
    m = np.array(value, dtype=np.float64)
    if m.shape != (size, size) or not np.all(np.isfinite(m)):
        raise ValueError(f"state_dict['gram_ema'] must be a finite {size}x{size} matrix")
    return m
