"""The functional core every method shares: pure functions from (weights, Gram, step sizes) to new weights.

As Composer keeps a functional form beside each Algorithm, the arithmetic of a reweighting step lives here
and in the method files (``grape_step``, ``doge_step``) as pure functions of their arguments: no state, no
history, no checks of user input. The :class:`~grape_stream.grape.reweighting.base.Reweighter` classes
hold the state (weights, EMAs, history, checkpoints), check the inputs, and call them. A method's step is
its scores (the per-task vector ``a`` and per-domain vector ``b`` in the exponents) followed by
:func:`mirror_step`; docs/reweighting.md has the equations.

Weights travel in log space (``log_alpha``, ``log_z``, normalised): that is where the step is exact and
where an exactly-zero weight (``-inf``) stays zero.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from grape_stream.grape.reweighting import noise
from grape_stream.grape.reweighting.gram_input import clip_gram
from grape_stream.simplex import apply_floor, exp_gradient_step, log_normalize, mix_uniform, probs_from_log

__all__ = ["WeightStep", "condition_gram", "mirror_step", "raw_scores"]


class WeightStep(NamedTuple):
    """The result of one step: the new log weights, the scores they moved along, and why no step was taken."""

    log_alpha: np.ndarray
    log_z: np.ndarray
    a: np.ndarray  # per-task scores (N): z moves along -a
    b: np.ndarray  # per-domain scores (K): alpha moves along b
    skipped: str | None = None  # set when the exponent overflowed: the weights are the inputs, unchanged


def condition_gram(g: np.ndarray, clip_norm: float | None = None, alignment: str = "inner") -> np.ndarray:
    """The Gram the scores read: per-gradient clipping to ``clip_norm`` (D G D), then ``alignment="cosine"``
    (unit-length gradients). The identity with the defaults (the paper)."""
    g = clip_gram(g, clip_norm)
    return noise.cosine_gram(g) if alignment == "cosine" else g


def raw_scores(alignment: np.ndarray, alpha: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a = A^T alpha, b = A z: the raw alignments (logged by methods whose weights never move)."""
    return alignment.T @ alpha, alignment @ z


def mirror_step(
    log_alpha: np.ndarray,
    log_z: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    eta_alpha: float,
    eta_z: float,
    *,
    move_alpha: bool = True,
    move_z: bool = True,
    alpha_ema: float = 0.0,
    alpha_floor: float = 0.0,
    z_smoothing: float = 0.0,
) -> WeightStep:
    """One exponentiated-gradient (mirror descent) step: alpha *= exp(eta_alpha * b), z *= exp(-eta_z * a),
    renormalised, for the sides that move.

    Then, on a side that moved: ``alpha_ema`` damps the alpha step (Dynamic Gradient Alignment:
    alpha = beta * alpha_prev + (1 - beta) * step), ``alpha_floor`` keeps every alpha_k >= the floor,
    ``z_smoothing`` mixes z with the uniform vector (the authors' code). An exponent that is not finite
    leaves both sides unchanged and says why in ``skipped``.
    """
    try:
        new_z = exp_gradient_step(log_z, -a, eta_z) if move_z else log_z
        new_alpha = exp_gradient_step(log_alpha, b, eta_alpha) if move_alpha else log_alpha
    except FloatingPointError:
        reason = (f"exponent overflow: eta_alpha*b or eta_z*a is not finite (eta_alpha={eta_alpha!r}, "
                  f"eta_z={eta_z!r}, max|a|={float(np.max(np.abs(a)))!r}, max|b|={float(np.max(np.abs(b)))!r})")
        return WeightStep(log_alpha, log_z, a, b, reason)
    if move_alpha:
        if alpha_ema > 0.0:
            new_alpha = log_normalize(noise.mix_log_weights(log_alpha, new_alpha, alpha_ema))
        if alpha_floor > 0.0:
            new_alpha = log_normalize(np.log(apply_floor(probs_from_log(new_alpha), alpha_floor)))
    if move_z and z_smoothing > 0.0:
        new_z = log_normalize(np.log(mix_uniform(probs_from_log(new_z), z_smoothing)))
    return WeightStep(new_alpha, new_z, a, b)
