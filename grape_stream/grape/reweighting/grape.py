"""GRAPE (Fan, Glarou, Jaggi): task weights z and domain weights alpha moved together by Group DRO.

The three progress metrics of the paper differ only in what divides the alignments A[k, n] on each
side: RoI (``grape``, the default) divides by the task loss l_n on both sides, GOI (``grape_gap``) by
nothing, RoI-ema (``grape_ema``) by an EMA of l_n on the task side. See docs/reweighting.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.options import real
from grape_stream.grape.reweighting.registry import register
from grape_stream.simplex import check_simplex

__all__ = ["GrapeEmaReweighter", "GrapeGapReweighter", "GrapeReweighter"]


@register
class GrapeReweighter(Reweighter):
    method = "grape"
    description = "GRAPE with rate-of-improvement (RoI): both sides use grad log l_n = h_n / l_n"
    options_accepted: ClassVar[tuple[str, ...]] = (
        "mu_alpha", "mu_z", "step_size", "eta_alpha", "eta_z", "kl_alpha", "kl_z", "clip_norm", "z_smoothing",
        "alpha0", "z0", "alpha_floor", "history_limit", "alignment", "gram_ema", "alpha_ema",
    )
    moves_alpha = True
    moves_z = True

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        out = self._resolve_step_options(opts, ("alpha", "z"))
        z0 = opts.pop("z0", None)
        out["z0"] = None if z0 is None else check_simplex(z0, "z0", self.num_tasks).tolist()
        share = real(opts.pop("z_smoothing", 0.0), "z_smoothing")
        if not (0.0 <= share <= 1.0):
            raise ValueError(f"z_smoothing must lie in [0, 1] (authors' code: 0.001), got {share!r}")
        out["z_smoothing"] = share
        out.update(Reweighter._resolve_options(self, opts))
        return out

    def _task_side_divisor(self, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return losses, self._loss_ema

    def _domain_side_divisor(self, losses: np.ndarray) -> np.ndarray:
        return losses

    def target_coefficients(self, task_losses, task_gram):
        return self._z / self._domain_side_divisor(np.asarray(task_losses, dtype=np.float64))

    def task_scores(self, task_alignment, task_losses):
        task_div, new_ema = self._task_side_divisor(np.asarray(task_losses, dtype=np.float64))
        return np.asarray(task_alignment, dtype=np.float64) / task_div, new_ema

    def _alignments(self, alignment, task_gram, losses, index):
        task_div, new_ema = self._task_side_divisor(losses)
        a = (alignment / task_div[None, :]).T @ self._alpha  # a_n = sum_k alpha_k A_z[k, n]
        b = (alignment / self._domain_side_divisor(losses)[None, :]) @ self._z  # b_k = sum_n z_n A_alpha[k, n]
        return a, b, new_ema


@register
class GrapeGapReweighter(GrapeReweighter):
    method = "grape_gap"
    description = "GRAPE with gap-of-improvement (GOI): raw alignments on both sides"

    def _task_side_divisor(self, losses):
        return np.ones_like(losses), self._loss_ema

    def _domain_side_divisor(self, losses):
        return np.ones_like(losses)


@register
class GrapeEmaReweighter(GrapeReweighter):
    method = "grape_ema"
    description = "GRAPE with EMA rate-of-improvement: task side divides by an EMA of the losses (beta=0.7)"
    options_accepted = GrapeReweighter.options_accepted + ("ema_beta",)

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        beta = real(opts.pop("ema_beta", 0.7), "ema_beta")
        if not (0.0 <= beta < 1.0):
            raise ValueError(f"ema_beta must lie in [0, 1), got {beta!r}")
        out = super()._resolve_options(opts)
        out["ema_beta"] = beta
        return out

    def _task_side_divisor(self, losses):
        # Paper: l_ema^t = beta * l_ema^{t-1} + (1 - beta) * l_n(theta_t), used at the same step t, i.e.
        # updated before use. It starts at the first observed losses (so the first update equals GRAPE).
        beta = self._options["ema_beta"]
        ema = losses.copy() if self._loss_ema is None else beta * self._loss_ema + (1.0 - beta) * losses
        return ema, ema
