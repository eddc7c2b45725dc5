"""ADO's per-domain scaling-law fit, L(n) = eps + beta * n^(-a), in plain numpy, and its bounded history.

The authors fit (log L) with a Huber loss by L-BFGS from a grid of starts (jax). Here: for each exponent a
on a fixed grid the best (eps, beta) is a weighted linear least-squares problem in x = n^(-a), solved in
closed form (with eps >= 0, beta >= 0 enforced by the two boundary solutions); the best grid exponent is then
refined by a fixed number of finer grids between its neighbours. No iteration stops on a tolerance
and no random start is drawn, so the same points give bit-identical parameters (a resumed run refits
exactly), and a fit of 13 domains x 200 points takes a few milliseconds. It fits the loss itself (squared
error), not its log with a Huber loss: docs/reweighting.md ("ADO") says what that changes.

The history is per domain a list of bins (n, loss, weight): each update adds a bin of weight 1 and, past
``max_points`` bins, neighbouring pairs merge into their weighted means (weight summed), so memory is
bounded, old stretches of the curve are kept at a coarser resolution, and the least-squares weights keep
every observation counted once.
"""

from __future__ import annotations

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

    def to_json(self) -> dict[str, list[float]]:
        return {"n": list(self.n), "loss": list(self.loss), "weight": list(self.weight)}

    @classmethod
    def from_json(cls, value: Any) -> "Bins":
        n, loss, weight = (tuple(float(v) for v in value[key]) for key in ("n", "loss", "weight"))
        if not len(n) == len(loss) == len(weight):
            raise ValueError("an ADO loss history has lists of different lengths")
        return cls(n, loss, weight)


def add_point(bins: Bins, n: float, loss: float, max_points: int) -> Bins:
    """``bins`` with (n, loss) appended at weight 1; past ``max_points`` bins, pairs (0,1), (2,3), ... merge."""
    n_, loss_, w_ = list(bins.n) + [float(n)], list(bins.loss) + [float(loss)], list(bins.weight) + [1.0]
    if len(n_) <= max_points:
        return Bins(tuple(n_), tuple(loss_), tuple(w_))
    out_n, out_l, out_w = [], [], []
    for i in range(0, len(n_) - 1, 2):
        w = w_[i] + w_[i + 1]
        out_n.append((w_[i] * n_[i] + w_[i + 1] * n_[i + 1]) / w)
        out_l.append((w_[i] * loss_[i] + w_[i + 1] * loss_[i + 1]) / w)
        out_w.append(w)
    if len(n_) % 2:
        out_n.append(n_[-1])
        out_l.append(loss_[-1])
        out_w.append(w_[-1])
    return Bins(tuple(out_n), tuple(out_l), tuple(out_w))


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
