"""The Gram matrix a reweighter is given: read it, check it is one, symmetrise it, clip it.

Clipping every probe gradient to a norm c is a rescaling g_i <- g_i * min(1, c / ||g_i||), which on
the Gram is D G D with D_ii = min(1, c / sqrt(G_ii)): no gradient is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["GRAM_ASYMMETRY_RTOL", "check_and_symmetrise", "clip_gram", "to_matrix"]

#: Largest tolerated |G - G^T| relative to max|G|. A Gram computed in float32 by summing per-layer
#: products in different orders is asymmetric at the 1e-7 level; anything near 1e-4 is a wrong matrix.
GRAM_ASYMMETRY_RTOL = 1e-4


def to_matrix(gram: Any) -> np.ndarray:
    """A float64 numpy copy of a Gram given as numpy, nested lists or a torch tensor (any device)."""
    if hasattr(gram, "detach"):  # torch.Tensor, any device / dtype
        gram = gram.detach().cpu().double().numpy()
    try:
        return np.array(gram, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"gram must be a square matrix of numbers, got {type(gram).__name__}: {exc}") from None


def check_and_symmetrise(g: np.ndarray) -> np.ndarray:
    """(G + G^T) / 2 after checking G is symmetric up to float32 noise with a non-negative diagonal."""
    scale = float(np.max(np.abs(g)))
    asym = float(np.max(np.abs(g - g.T)))
    if asym > GRAM_ASYMMETRY_RTOL * scale:
        i, j = np.unravel_index(int(np.argmax(np.abs(g - g.T))), g.shape)
        raise ValueError(
            f"gram is not symmetric: |G[{i},{j}] - G[{j},{i}]| = {asym!r} exceeds "
            f"{GRAM_ASYMMETRY_RTOL:g} * max|G| = {GRAM_ASYMMETRY_RTOL * scale!r}; pass the Gram matrix "
            f"of inner products <v_i, v_j> of the K domain then N task gradients"
        )
    g = 0.5 * g + 0.5 * g.T  # (g + g.T) / 2 could overflow near the float64 limit
    diag = np.diag(g)
    neg = np.flatnonzero(diag < -GRAM_ASYMMETRY_RTOL * scale)
    if neg.size:
        raise ValueError(
            f"gram has negative diagonal entries at {neg.tolist()} ({diag[neg].tolist()}); a diagonal "
            f"entry is a squared gradient norm"
        )
    return g


def clip_gram(g: np.ndarray, clip_norm: float | None) -> np.ndarray:
    """Per-group gradient clipping g_i <- g_i * min(1, c/||g_i||), expressed on the Gram: D G D."""
    if clip_norm is None:
        return g
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    scale = np.ones_like(norms)
    big = norms > clip_norm
    scale[big] = clip_norm / norms[big]
    return g * scale[:, None] * scale[None, :]
