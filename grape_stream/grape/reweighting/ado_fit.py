"""ADO's per-domain scaling-law fit, L(n) = eps + beta * n^(-a), in plain numpy, and its bounded history.

The authors fit (log L) with a Huber loss by L-BFGS from a grid of starts (jax). Here: for each exponent a
on a fixed grid the best (eps, beta) is a weighted linear least-squares problem in x = n^(-a), solved in
closed form (with eps >= 0, beta >= 0 enforced by the two boundary solutions); the best grid exponent is then
refined by a fixed number of finer grids between its neighbours. No iteration stops on a tolerance
and no random start is drawn, so the same points give bit-identical parameters (a resumed run refits
exactly), and a fit of 13 domains x 200 points takes a few milliseconds. It fits the loss itself (squared
error), not its log with a Huber loss: docs/reweighting.md ("ADO") says what that changes.

The history is per domain a list of bins on a log-n grid (``bins_per_decade`` bins per factor 10 of n):
a new point falling in the last bin is merged into it (the weighted mean of log n and of the loss, weight
+1), otherwise it opens a bin. Memory is bounded by bins_per_decade x log10(largest n) bins, the early,
steep part of the curve keeps one bin per point, and the least-squares weights (the bins' counts) keep
every observation counted once, as a fit through all raw points would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["EXPONENT_GRID", "REFINE_LEVELS", "REFINE_POINTS", "Bins", "PowerLaw", "add_point", "fit_power_law"]

#: The exponents tried before refinement (language-model loss curves have a of about 0.05-0.7).
EXPONENT_GRID = np.geomspace(0.005, 3.0, 96)
#: Finer grids after the first, each of REFINE_POINTS exponents spanning the best point's two neighbours
#: (the bracket shrinks 16-fold per level: 6 levels take the 7% grid spacing below 1e-8 relative).
REFINE_LEVELS = 6
REFINE_POINTS = 33


@dataclass(frozen=True)
class PowerLaw:
    """A fitted L(n) = eps + beta * n^(-exponent)."""

    eps: float
    beta: float
    exponent: float

    def __call__(self, n: float) -> float:
        return self.eps + self.beta * n ** (-self.exponent)

    def speed(self, n: float) -> float:
        """-dL/dn = exponent * beta * n^(-exponent-1) = exponent * (L(n) - eps) / n: the learning speed."""
        return self.exponent * self.beta * n ** (-self.exponent - 1.0)

    def to_json(self) -> list[float]:
        return [self.eps, self.beta, self.exponent]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> "PowerLaw":
        eps, beta, exponent = (float(v) for v in value)
        return cls(eps, beta, exponent)


@dataclass(frozen=True)
class Bins:
    """One domain's loss history: bin centres n (samples of the domain seen), mean losses, observation counts."""

    n: tuple[float, ...] = ()
    loss: tuple[float, ...] = ()
    weight: tuple[float, ...] = ()
    key: tuple[int, ...] = ()  # each bin's log-n bin number

    def to_json(self) -> dict[str, list[Any]]:
        return {"n": list(self.n), "loss": list(self.loss), "weight": list(self.weight), "key": list(self.key)}

    @classmethod
    def from_json(cls, value: Any) -> "Bins":
        n, loss, weight = (tuple(float(v) for v in value[name]) for name in ("n", "loss", "weight"))
        key = tuple(int(v) for v in value["key"])
        if not len(n) == len(loss) == len(weight) == len(key):
            raise ValueError("an ADO loss history has lists of different lengths")
        return cls(n, loss, weight, key)


def add_point(bins: Bins, n: float, loss: float, bins_per_decade: int) -> Bins:
    """``bins`` with (n, loss) added: merged into the last bin when n falls in the same log-n bin
    (floor(bins_per_decade * log10 n)), else appended as a new bin of weight 1. ``n`` never decreases."""
    key = math.floor(bins_per_decade * math.log10(n))
    if bins.key and bins.key[-1] == key:
        w0 = bins.weight[-1]
        w = w0 + 1.0
        log_n = (w0 * math.log(bins.n[-1]) + math.log(n)) / w
        mean = (w0 * bins.loss[-1] + float(loss)) / w
        return Bins(bins.n[:-1] + (math.exp(log_n),), bins.loss[:-1] + (mean,), bins.weight[:-1] + (w,), bins.key)
    return Bins(bins.n + (float(n),), bins.loss + (float(loss),), bins.weight + (1.0,), bins.key + (key,))


def _solve(exponents: np.ndarray, n: np.ndarray, loss: np.ndarray,
           w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(eps, beta_scaled, weighted squared error) of the best fit at each exponent, x = (n / max n)^(-a).

    Unconstrained weighted least squares first; where it gives beta < 0 (a rising curve) the best
    non-increasing fit is the constant eps = mean loss, beta = 0; where it gives eps < 0 the best fit
    through eps = 0 is beta = sum w x L / sum w x^2.
    """
    x = (n / n.max())[None, :] ** (-exponents[:, None])
    total = w.sum()
    mx = (w * x).sum(axis=1) / total
    ml = float((w * loss).sum() / total)
    dx = x - mx[:, None]
    sxx = (w * dx * dx).sum(axis=1)
    sxl = (w * dx * (loss - ml)).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        beta = np.where(sxx > 0, sxl / sxx, 0.0)
    eps = ml - beta * mx
    flat = beta <= 0
    beta, eps = np.where(flat, 0.0, beta), np.where(flat, ml, eps)
    through_zero = eps < 0
    beta0 = np.maximum((w * x * loss).sum(axis=1) / (w * x * x).sum(axis=1), 0.0)
    beta, eps = np.where(through_zero, beta0, beta), np.where(through_zero, 0.0, eps)
    resid = loss[None, :] - eps[:, None] - beta[:, None] * x
    return eps, beta, (w * resid * resid).sum(axis=1)


def fit_power_law(bins: Bins) -> Optional[PowerLaw]:
    """The least-squares L(n) = eps + beta n^(-a) through a domain's history (None: under 3 distinct n).

    Grid over a (:data:`EXPONENT_GRID`), then :data:`REFINE_LEVELS` finer grids of :data:`REFINE_POINTS`
    exponents between the best point's neighbours (each shrinks the bracket 16-fold). Deterministic: no
    tolerance, no randomness, the same arithmetic for the same points.
    """
    n = np.asarray(bins.n, dtype=np.float64)
    loss = np.asarray(bins.loss, dtype=np.float64)
    w = np.asarray(bins.weight, dtype=np.float64)
    if n.size < 3 or np.unique(n).size < 3 or not (np.all(n > 0) and np.all(np.isfinite(loss))):
        return None
    grid = EXPONENT_GRID
    for level in range(REFINE_LEVELS + 1):
        eps, beta, sse = _solve(grid, n, loss, w)
        best = int(np.argmin(sse))
        if level < REFINE_LEVELS:
            grid = np.linspace(grid[max(best - 1, 0)], grid[min(best + 1, grid.size - 1)], REFINE_POINTS)
    a = float(grid[best])
    return PowerLaw(float(eps[best]), float(beta[best]) * float(n.max()) ** a, a)
