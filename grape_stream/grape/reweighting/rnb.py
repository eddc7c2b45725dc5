"""R&B's Balance step (Ge et al. 2025): the new mixture from the Gram of the training steps' own domain gradients.

No probe and no target task: over a round of ``alpha_every`` optimizer steps the training backward of the
observed steps also sums each domain's part of the gradient (grape.instep_gram, on the in-step engine), and
at the end of the round

    G_ij = <sum g_i, sum g_j> / (W_i W_j),     s = G p,     alpha = softmax(lambda * s / ||s||_2)

with g_i domain i's part of a step's gradient (sum over its samples of w_s grad l_s, w_s the sample's weight in
the objective), W_i the sum of those w_s (the paper's |S_i| when every sample weighs the same), p the
evaluation proportions (``eval_weights``, default uniform) and lambda (``rnb_lambda``) the inverse temperature
of the entropy-regularised greedy step. Each round overwrites the mixture (no multiplicative memory). A domain
no observed step sampled has no gradient: its row and column of G are 0 (s_i = 0). The paper's Regroup
stage (re-clustering the data into new domains) is not part of this. docs/reweighting.md, "R&B".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.options import ReweighterOptions, real
from grape_stream.grape.reweighting.registry import register
from grape_stream.simplex import check_simplex, log_normalize, probs_from_log, uniform

__all__ = ["RnbOptions", "RnbReweighter", "rnb_scores", "rnb_step"]


@dataclass
class RnbOptions(ReweighterOptions):
    rnb_lambda: float = 3.0  # lambda: the softmax's inverse temperature (the authors' S1 setting: 3)
    eval_weights: Optional[list[float]] = None  # p: each domain's share of the evaluation data (None: uniform)
    # the parameters whose gradients form G, as fnmatch patterns of their names (None: all; the authors track the
    # final layer: e.g. ["lm_head.*"]); fewer parameters, fewer kept gradient copies
    rnb_params: Optional[list[str]] = None

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        lam = real(self.rnb_lambda, "rnb_lambda")
        if not (math.isfinite(lam) and lam >= 0):
            raise ConfigError(f"rnb_lambda must be a finite number >= 0, got {lam!r}")
        out = super().resolve(num_domains, num_tasks)
        out["rnb_lambda"] = lam
        params = self.rnb_params
        if params is not None and (isinstance(params, str) or not params
                                   or not all(isinstance(x, str) and x for x in params)):
            raise ConfigError(f"rnb_params must be None (every parameter) or a non-empty list of parameter-name "
                              f"patterns (fnmatch), got {params!r}")
        if params is not None:
            out["rnb_params"] = list(params)
        try:
            out["eval_weights"] = (None if self.eval_weights is None
                                   else check_simplex(self.eval_weights, "eval_weights", num_domains).tolist())
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return out


def rnb_scores(gram: np.ndarray, eval_weights: np.ndarray, seen: Optional[np.ndarray] = None) -> np.ndarray:
    """s = G p with the rows and columns of unseen domains (``seen`` False) set to 0."""
    g = np.asarray(gram, dtype=np.float64).copy()
    if seen is not None:
        g[~seen, :] = 0.0
        g[:, ~seen] = 0.0
    return g @ np.asarray(eval_weights, dtype=np.float64)


def rnb_step(gram: np.ndarray, eval_weights: np.ndarray, lam: float,
             seen: Optional[np.ndarray] = None) -> tuple[Optional[np.ndarray], np.ndarray, Optional[str]]:
    """(new log-alpha or None, the exponent lambda * s / ||s||_2, why there is no step or None): a pure function."""
    s = rnb_scores(gram, eval_weights, seen)
    norm = float(np.linalg.norm(s))
    if not np.all(np.isfinite(s)) or not math.isfinite(norm):
        return None, s, "non-finite domain Gram"
    if norm == 0.0:
        return None, s, "G p is zero (no observed domain gradient)"
    exponent = lam * s / norm
    return log_normalize(exponent), exponent, None


@register
class RnbReweighter(Reweighter):
    method = "rnb"
    description = ("R&B (Ge et al. 2025): alpha = softmax(lambda Gp / ||Gp||), G the per-domain Gram of the training "
                   "steps' own gradients; no probe, no tasks")
    Options = RnbOptions
    moves_alpha = True
    #: updates read the per-domain Gram summed over the training steps (grape.instep_gram)
    signal = Signal.step_gram

    def update(self, gram: Any, task_losses: Any, lr: float | None, step: int | None = None, *,
               update_alpha: bool = True, update_z: bool = True) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError("method 'rnb' updates from the training steps' per-domain Gram "
                                  "(update_from_step_gram; the controller observes the steps), not from a probe Gram")

    def eval_weights(self) -> np.ndarray:
        p = self._options.get("eval_weights")
        return uniform(self.num_domains) if p is None else np.asarray(p, dtype=np.float64)

    def update_from_step_gram(self, gram: Any, samples: Any, lr: float | None = None,
                              step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One round's update from the K x K Gram of the domains' mean gradients (NaN rows allowed where
        ``samples`` is 0). Returns copies of (alpha, z); a zero or non-finite G p skips (recorded)."""
        k = self.num_domains
        g = np.asarray(gram, dtype=np.float64)
        n = np.asarray(samples, dtype=np.float64)
        if g.shape != (k, k) or n.shape != (k,):
            raise ValueError(f"gram {g.shape} and samples {n.shape}: expected ({k}, {k}) and ({k},)")
        index = self._num_updates
        lr_value = self._check_lr(lr)
        lam = float(self._options["rnb_lambda"])
        log_alpha, exponent, skipped = rnb_step(g, self.eval_weights(), lam, seen=n > 0)
        if log_alpha is None:
            assert skipped is not None
            return self._skip(index, step, lr_value, np.zeros(0), lam, 0.0, skipped, b=exponent)
        self._log_alpha, self._alpha = log_alpha, probs_from_log(log_alpha)
        self._record(index, step, lr_value, np.zeros(0), None, exponent, lam, 0.0, None)
        self._num_updates += 1
        return self._alpha.copy(), self._z.copy()
