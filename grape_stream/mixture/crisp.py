"""CRISP (embedding-based importance sampling, as the GRAPE paper's baseline): embed target samples and
source samples, take each source domain's centroid, and set alpha_k = the share of target samples whose
nearest centroid (cosine) is domain k.

Why centroids and shares: it is the cheapest reading of "which source looks like the targets" that needs
no training; the paper uses it as a static baseline and as a start for GRAPE (``alpha0``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["crisp_weights", "nearest_centroid"]


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(n == 0, 1.0, n)


def nearest_centroid(source: Mapping[str, np.ndarray], target: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(domain names, index of the nearest source centroid for each target row), by cosine similarity."""
    names = list(source)
    if not names:
        raise ValueError("crisp needs at least one source domain")
    cents = []
    for name in names:
        e = np.asarray(source[name], dtype=np.float64)
        if e.ndim != 2 or len(e) == 0:
            raise ValueError(f"source {name!r}: embeddings must be a non-empty (n, d) array")
        cents.append(_unit(_unit(e).mean(axis=0)))
    t = np.asarray(target, dtype=np.float64)
    if t.ndim != 2 or len(t) == 0 or t.shape[1] != cents[0].shape[0]:
        raise ValueError(f"target embeddings must be a non-empty (n, {cents[0].shape[0]}) array, got {t.shape}")
    return names, np.argmax(_unit(t) @ np.stack(cents).T, axis=1)


def crisp_weights(source: Mapping[str, np.ndarray], targets: Mapping[str, np.ndarray] | np.ndarray, *,
                  smoothing: float = 0.0, per_target: bool = True) -> dict[str, float]:
    """CRISP's alpha: the share of target samples nearest each source centroid.

    ``targets``: one array, or one per target task; with ``per_target`` (default) each task counts equally
    (its shares are averaged), so a task with many samples does not decide the mixture alone.
    ``smoothing``: added to every domain's count (Laplace); > 0 keeps every domain's weight above zero,
    which a GRAPE run started from these weights needs (a zero weight never recovers in log space).
    """
    if smoothing < 0:
        raise ValueError(f"smoothing must be >= 0, got {smoothing}")
    groups: Sequence[np.ndarray] = (list(targets.values()) if isinstance(targets, Mapping) else [targets])
    if not per_target:
        groups = [np.concatenate([np.asarray(g) for g in groups])]
    k = len(source)
    shares = np.zeros(k)
    for g in groups:
        names, idx = nearest_centroid(source, g)
        counts = np.bincount(idx, minlength=k).astype(np.float64) + smoothing
        shares += counts / counts.sum()
    shares /= shares.sum()
    return {n: float(w) for n, w in zip(names, shares)}
