"""RegMix (regression over proxy runs): train many tiny proxies on Dirichlet-random mixtures, fit a
regressor mixture -> average target loss, and take the mixture it predicts best.

Only the math lives here (sampling, the regressor, the argmin); the proxies themselves are recipe runs
(:mod:`grape_stream.apps.mixture`). As in the RegMix paper: LightGBM regressor, alpha = the mean of the
``top_k`` best-predicted mixtures among many Dirichlet samples (averaging makes the argmin less sensitive
to the regressor's noise).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["REGRESSORS", "dirichlet_mixtures", "fit_regressor", "regmix_argmin"]

REGRESSORS = ("lightgbm", "linear")


def dirichlet_mixtures(k: int, n: int, seed: int, *, concentration: float = 1.0,
                       include_uniform: bool = True) -> np.ndarray:
    """(n, k) mixtures: Dirichlet(concentration) samples (the first one uniform if ``include_uniform``)."""
    if k < 1 or n < 1 or concentration <= 0:
        raise ValueError(f"need k >= 1, n >= 1, concentration > 0 (got {k}, {n}, {concentration})")
    rng = np.random.default_rng(seed)
    x = rng.dirichlet(np.full(k, float(concentration)), size=n)
    if include_uniform:
        x[0] = 1.0 / k
    return x


def fit_regressor(x: np.ndarray, y: np.ndarray, kind: str = "lightgbm",
                  seed: int = 0) -> Callable[[np.ndarray], np.ndarray]:
    """A predictor mixture -> loss fitted on (x, y). ``lightgbm``: gradient-boosted trees (the paper's;
    leaves may hold 2 samples, since proxies are few); ``linear``: least squares on the weights (RegMix's
    linear variant)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need at least 2 (mixture, loss) pairs of matching length, got x {x.shape}, y {y.shape}")
    if kind == "linear":
        a = np.hstack([x, np.ones((len(x), 1))])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        return lambda q: np.hstack([np.asarray(q, dtype=np.float64), np.ones((len(q), 1))]) @ coef
    if kind != "lightgbm":
        raise ValueError(f"regressor must be one of {REGRESSORS}, got {kind!r}")
    import lightgbm  # the native API: its scikit-learn wrapper would need scikit-learn too

    params = {"objective": "regression", "learning_rate": 0.05, "num_leaves": 8, "min_data_in_leaf": 2,
              "min_sum_hessian_in_leaf": 0.0, "min_data_in_bin": 1, "seed": seed, "deterministic": True,
              "force_row_wise": True, "num_threads": 1, "verbose": -1}
    model: Any = lightgbm.train(params, lightgbm.Dataset(x, y, params={"min_data_in_bin": 1, "verbose": -1}),
                                num_boost_round=300)
    return lambda q: np.asarray(model.predict(np.asarray(q, dtype=np.float64)), dtype=np.float64)


def regmix_argmin(predict: Callable[[np.ndarray], np.ndarray], k: int, *, samples: int = 100_000,
                  top_k: int = 100, seed: int = 0, concentration: float = 1.0) -> np.ndarray:
    """The mean of the ``top_k`` mixtures with the lowest predicted loss among ``samples`` Dirichlet draws."""
    cand = dirichlet_mixtures(k, samples, seed + 1, concentration=concentration, include_uniform=True)
    pred = predict(cand)
    best = np.argsort(pred, kind="stable")[: max(1, min(top_k, samples))]
    alpha = cand[best].mean(axis=0)
    return alpha / alpha.sum()
