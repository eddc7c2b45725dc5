"""Probe size chosen from the measured probe variance (option ``probe_rse``; off by default = the paper).

Why: a probe of 8 samples per group gives alignments whose noise can exceed their signal (docs/results.md:
a 4x larger probe halved GRAPE's deficit on one seed), while a large fixed probe wastes compute when the
signal is strong. So the controller measures the noise at every update and sizes the next probe.

The rule (docs/reweighting.md, "Probe size from the measured variance"):

1. Every probe group of n samples (n even) is split into two halves of n/2, and the fused Gram is taken
   over the 2(K+N) half-groups in the same single pass. Because a group's mean-loss gradient is the mean
   of its halves' (g = (g' + g'') / 2), the full Gram is exact: G[i, j] = 1/4 sum_{u,v} H[(i,u), (j,v)];
   losses likewise. The update itself uses G, so nothing about it changes but the cost of a larger Gram.
2. The quantity that moves alpha is the domain score b (K numbers; only its centred part matters, the
   softmax ignores a common shift). The reweighter computes b' and b'' from each half's Gram alone
   (``Reweighter.preview``: same clipping / cosine / loss normalisation, current weights, no state
   change) and b from G. With centred vectors c(.), the noise variance of one component of b is
   sigma^2 = mean((c(b') - c(b''))^2) / 4 (two independent halves: Var(b' - b'') = 2 s^2 with s^2 the
   half-probe variance, and b's is s^2 / 2), and the signal is S^2 = max(mean(c(b)^2) - sigma^2, 0).
   The relative standard error is rse = sigma / S (inf when S = 0).
3. Noise variance falls as 1/n, so the size that hits the target r is n * (rse / r)^2. The next probe
   uses that factor, limited to [1/2, 2] per update (one noisy estimate must not swing the size), applied
   to both the domain and the task batch, rounded to even numbers and kept within ``probe_batch_bounds``.

The current sizes are the only state; they are checkpointed with the controller, so a resumed run draws
exactly the probes its uninterrupted twin draws.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from grape_stream.config import PROBE_BATCH_BOUNDS

__all__ = ["DEFAULT_PROBE_BOUNDS", "ProbeSizer", "combine_halves", "relative_standard_error", "split_halves"]

#: Default smallest and largest per-group probe batch (per rank) with ``probe_rse`` (stated in grape_stream.config).
DEFAULT_PROBE_BOUNDS = PROBE_BATCH_BOUNDS
_MAX_FACTOR = 2.0


def split_halves(groups: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """[g0, g1, ...] -> [g0', g0'', g1', g1'', ...]: each batch cut into its first and second half."""
    out: list[dict[str, torch.Tensor]] = []
    for i, g in enumerate(groups):
        sizes = {int(v.shape[0]) for v in g.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if len(sizes) != 1 or next(iter(sizes)) % 2:
            raise ValueError(f"probe group {i} must hold an even number of samples to be split in halves, got {sizes}")
        h = next(iter(sizes)) // 2
        out.append({k: (v[:h] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in g.items()})
        out.append({k: (v[h:] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in g.items()})
    return out


def combine_halves(half_gram: np.ndarray, half_losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Gram and losses of the whole groups from those of their interleaved halves (exact)."""
    g = half_gram.shape[0] // 2
    gram = half_gram.reshape(g, 2, g, 2).sum(axis=(1, 3)) / 4.0
    return gram, half_losses.reshape(g, 2).mean(axis=1)


def relative_standard_error(
    b_full: np.ndarray, b_first: np.ndarray, b_second: np.ndarray
) -> tuple[float, float, float]:
    """(sigma / S, sigma^2, S^2) of the centred domain score (module docstring, step 2); sigma / S is inf
    when no signal is left above the noise."""
    def centred(x: np.ndarray) -> np.ndarray:
        return x - x.mean()

    noise = float(np.mean((centred(b_first) - centred(b_second)) ** 2)) / 4.0
    signal = float(np.mean(centred(b_full) ** 2)) - noise
    if not math.isfinite(noise) or not math.isfinite(signal):
        return math.inf, noise, signal
    if signal <= 0.0:
        return (math.inf if noise > 0.0 else 0.0), noise, max(signal, 0.0)
    return math.sqrt(noise / signal), noise, signal


def _even(x: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, 2 * round(x / 2.0))))


class ProbeSizer:
    """The per-group probe sizes and the rule that updates them (module docstring)."""

    def __init__(self, target_rse: float, domain_batch: int, task_batch: int,
                 bounds: Sequence[int] = DEFAULT_PROBE_BOUNDS) -> None:
        if isinstance(target_rse, bool) or not (isinstance(target_rse, (int, float)) and 0 < target_rse < math.inf):
            raise ValueError(f"probe_rse must be a number > 0 (a target relative standard error), got {target_rse!r}")
        lo, hi = (int(b) for b in bounds)
        if not (2 <= lo <= hi) or lo % 2 or hi % 2:
            raise ValueError(f"probe_batch_bounds must be two even numbers 2 <= min <= max, got {list(bounds)}")
        for name, n in (("probe_domain_batch", domain_batch), ("probe_task_batch", task_batch)):
            if n % 2 or not lo <= n <= hi:
                raise ValueError(f"with probe_rse, {name} must be even and within probe_batch_bounds "
                                 f"{[lo, hi]}, got {n}")
        self.target = float(target_rse)
        self.bounds = (lo, hi)
        self.domain_batch = int(domain_batch)
        self.task_batch = int(task_batch)

    def next_sizes(self, rse: float) -> tuple[int, int]:
        """Apply the rule to the measured rse; returns (and keeps) the next (domain, task) batch sizes."""
        factor = _MAX_FACTOR if not math.isfinite(rse) else (rse / self.target) ** 2
        factor = min(_MAX_FACTOR, max(1.0 / _MAX_FACTOR, factor))
        self.domain_batch = _even(self.domain_batch * factor, *self.bounds)
        self.task_batch = _even(self.task_batch * factor, *self.bounds)
        return self.domain_batch, self.task_batch

    def state_dict(self) -> dict[str, Any]:
        return {"domain_batch": self.domain_batch, "task_batch": self.task_batch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.domain_batch = int(state["domain_batch"])
        self.task_batch = int(state["task_batch"])
