"""DoGE and DoGE-PCGrad: z stays uniform, alpha follows the domains' alignment with the target gradient.

DoGE uses the mean task gradient; DoGE-PCGrad first removes conflicts between task gradients (PCGrad,
Yu et al. 2020), done in coefficient space so that only the task-task Gram S is needed: memory stays
O((K+N)^2) instead of N copies of a model gradient. See docs/reweighting.md.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np

from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.registry import register

__all__ = ["DogePCGradReweighter", "DogeReweighter", "pcgrad_coefficients", "pcgrad_task_orders"]


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


@register
class DogeReweighter(Reweighter):
    method = "doge"
    description = "DoGE: z fixed uniform, alpha_k *= exp(eta_alpha * mean_n <g_k, h_n>) (raw alignment)"
    options_accepted: ClassVar[tuple[str, ...]] = (
        "mu_alpha", "step_size", "eta_alpha", "kl_alpha", "clip_norm", "alpha0", "alpha_floor", "history_limit",
        "alignment", "gram_ema", "alpha_ema",
    )
    moves_alpha = True

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        out = self._resolve_step_options(opts, ("alpha",))
        out.update(Reweighter._resolve_options(self, opts))
        return out

    def _alignments(self, alignment, task_gram, losses, index):
        return alignment.T @ self._alpha, alignment.mean(axis=1), self._loss_ema

    def target_coefficients(self, task_losses, task_gram):
        return np.full(self.num_tasks, 1.0 / self.num_tasks)


@register
class DogePCGradReweighter(DogeReweighter):
    method = "doge_pcgrad"
    description = "DoGE against the PCGrad-combined task gradient (mean of projected h_n), seeded order"
    options_accepted = DogeReweighter.options_accepted + ("seed",)

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        seed = opts.pop("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        out = super()._resolve_options(opts)
        out["seed"] = int(seed)
        return out

    def target_coefficients(self, task_losses, task_gram):
        if task_gram is None:
            raise ValueError("doge_pcgrad needs the task Gram for its target direction")
        orders = pcgrad_task_orders(self._options["seed"], self._num_updates, self.num_tasks)
        return pcgrad_coefficients(np.asarray(task_gram, dtype=np.float64), orders).mean(axis=0)

    def _alignments(self, alignment, task_gram, losses, index):
        orders = pcgrad_task_orders(self._options["seed"], index, self.num_tasks)
        coeffs = pcgrad_coefficients(task_gram, orders)
        combined = coeffs.mean(axis=0)  # g_PCGrad = (1/N) sum_i h~_i = sum_m combined_m h_m
        return alignment.T @ self._alpha, alignment @ combined, self._loss_ema
