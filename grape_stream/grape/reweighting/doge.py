"""DoGE and DoGE-PCGrad: z stays uniform, alpha follows the domains' alignment with the target gradient.

DoGE uses the mean task gradient; DoGE-PCGrad first removes conflicts between task gradients (PCGrad,
Yu et al. 2020), done in coefficient space so that only the task-task Gram S is needed: memory stays
O((K+N)^2) instead of N copies of a model gradient. See docs/reweighting.md. :func:`doge_step` is the
functional form of one update; the classes hold the state and call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from grape_stream.errors import ConfigError
from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.options import StepOptions
from grape_stream.grape.reweighting.registry import register
from grape_stream.grape.reweighting.step import WeightStep, mirror_step
from grape_stream.simplex import probs_from_log

__all__ = ["DogePCGradOptions", "DogePCGradReweighter", "DogeReweighter", "doge_scores", "doge_step",
           "pcgrad_coefficients", "pcgrad_task_orders"]


def pcgrad_task_orders(seed: int, update_index: int, num_tasks: int) -> list[list[int]]:
    """The random order in which task i is projected against the other tasks, for every i.

    Drawn from a generator keyed by (seed, update_index) alone, so an update replays exactly after a
    resume without storing any generator state. Row i is a permutation of {0..N-1} minus {i}.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(update_index)])))
    orders = []
    for i in range(num_tasks):
        others = np.array([j for j in range(num_tasks) if j != i], dtype=np.int64)
        orders.append(rng.permutation(others).tolist())
    return orders


def pcgrad_coefficients(task_gram: np.ndarray, orders: Sequence[Sequence[int]]) -> np.ndarray:
    """PCGrad (Yu et al. 2020) on the task gradients h_n, from their Gram matrix S alone.

    Returns C (N x N) with projected task gradient i equal to sum_m C[i, m] h_m. Following the PCGrad
    algorithm, task i's running projection is compared with each *original* h_j (j != i, in
    ``orders[i]``) and, if the inner product is negative, the component along h_j is removed:
    c <- c - (<c, h_j> / ||h_j||^2) e_j, where <c, h_j> = c @ S[:, j]. A zero gradient (S[j, j] == 0)
    conflicts with nothing.
    """
    s = np.asarray(task_gram, dtype=np.float64)
    n = s.shape[0]
    coeffs = np.eye(n, dtype=np.float64)
    for i in range(n):
        c = coeffs[i]
        for j in orders[i]:
            dot = float(c @ s[:, j])
            if dot < 0.0 and s[j, j] > 0.0:
                c[j] -= dot / s[j, j]
    return coeffs


def doge_scores(gram: np.ndarray, alpha: np.ndarray,
                pcgrad_orders: Sequence[Sequence[int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) of DoGE: a = A^T alpha (logged), b_k = <g_k, target>, the target the mean task gradient or,
    with ``pcgrad_orders``, the mean of the PCGrad-projected task gradients."""
    k = alpha.shape[0]
    alignment = gram[:k, k:]
    with np.errstate(over="ignore", invalid="ignore"):
        if pcgrad_orders is None:
            return alignment.T @ alpha, alignment.mean(axis=1)
        combined = pcgrad_coefficients(gram[k:, k:], pcgrad_orders).mean(axis=0)  # sum_m combined_m h_m
        return alignment.T @ alpha, alignment @ combined


def doge_step(log_alpha: np.ndarray, log_z: np.ndarray, gram: np.ndarray, eta_alpha: float, *,
              pcgrad_orders: Sequence[Sequence[int]] | None = None, move_alpha: bool = True,
              alpha_ema: float = 0.0, alpha_floor: float = 0.0) -> WeightStep:
    """One DoGE step, a pure function: alpha *= exp(eta_alpha * b), z unchanged (uniform).

    ``gram`` is the conditioned (K+N)x(K+N) Gram (domains first); ``pcgrad_orders`` (DoGE-PCGrad) the
    projection orders of :func:`pcgrad_task_orders`.
    """
    a, b = doge_scores(gram, probs_from_log(log_alpha), pcgrad_orders)
    return mirror_step(log_alpha, log_z, a, b, eta_alpha, 0.0, move_alpha=move_alpha, move_z=False,
                       alpha_ema=alpha_ema, alpha_floor=alpha_floor)


@register
class DogeReweighter(Reweighter):
    method = "doge"
    description = "DoGE: z fixed uniform, alpha_k *= exp(eta_alpha * mean_n <g_k, h_n>) (raw alignment)"
    Options = StepOptions
    moves_alpha = True

    def _orders(self, index: int) -> list[list[int]] | None:
        return None

    def _scores(self, g: np.ndarray, losses: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray]:
        return doge_scores(g, self._alpha, self._orders(index))

    def _step(self, g: np.ndarray, losses: np.ndarray, eta_alpha: float, eta_z: float, index: int,
              update_alpha: bool, update_z: bool) -> tuple[WeightStep, np.ndarray | None]:
        o = self._step_options(update_alpha, update_z)
        return doge_step(self._log_alpha, self._log_z, g, eta_alpha, pcgrad_orders=self._orders(index),
                         move_alpha=o["move_alpha"], alpha_ema=o["alpha_ema"],
                         alpha_floor=o["alpha_floor"]), self._loss_ema

    def target_coefficients(self, task_losses: np.ndarray, task_gram: np.ndarray | None) -> np.ndarray:
        return np.full(self.num_tasks, 1.0 / self.num_tasks)


@dataclass
class DogePCGradOptions(StepOptions):
    seed: int = 0  # seeds the PCGrad projection order (keyed by update index: replays after a resume)

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
        out = super().resolve(num_domains, num_tasks)
        out["seed"] = int(seed)
        return out


@register
class DogePCGradReweighter(DogeReweighter):
    method = "doge_pcgrad"
    description = "DoGE against the PCGrad-combined task gradient (mean of projected h_n), seeded order"
    Options = DogePCGradOptions

    def _orders(self, index: int) -> list[list[int]] | None:
        return pcgrad_task_orders(self._options["seed"], index, self.num_tasks)

    def target_coefficients(self, task_losses: np.ndarray, task_gram: np.ndarray | None) -> np.ndarray:
        if task_gram is None:
            raise ValueError("doge_pcgrad needs the task Gram for its target direction")
        orders = self._orders(self._num_updates)
        assert orders is not None
        return pcgrad_coefficients(np.asarray(task_gram, dtype=np.float64), orders).mean(axis=0)
