"""GRAPE (Fan, Glarou, Jaggi): task weights z and domain weights alpha moved together by Group DRO.

The three progress metrics of the paper differ only in what divides the alignments A[k, n] on each
side: RoI (``grape``, the default) divides by the task loss l_n on both sides, GOI (``grape_gap``) by
nothing, RoI-ema (``grape_ema``) by an EMA of l_n on the task side. See docs/reweighting.md.
:func:`grape_step` is the functional form of one update; the classes hold the state and call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from grape_stream.errors import ConfigError
from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.options import StepOptions, real
from grape_stream.grape.reweighting.registry import register
from grape_stream.grape.reweighting.step import WeightStep, mirror_step
from grape_stream.simplex import check_simplex, probs_from_log

__all__ = ["GrapeEmaOptions", "GrapeEmaReweighter", "GrapeGapReweighter", "GrapeOptions", "GrapeReweighter",
           "grape_scores", "grape_step"]


def grape_scores(alignment: np.ndarray, alpha: np.ndarray, z: np.ndarray, task_divisor: np.ndarray,
                 domain_divisor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a, b): a_n = sum_k alpha_k A[k, n] / task_divisor_n, b_k = sum_n z_n A[k, n] / domain_divisor_n."""
    with np.errstate(over="ignore", invalid="ignore"):
        a = (alignment / task_divisor[None, :]).T @ alpha
        b = (alignment / domain_divisor[None, :]) @ z
    return a, b


def grape_step(log_alpha: np.ndarray, log_z: np.ndarray, gram: np.ndarray, task_losses: np.ndarray,
               eta_alpha: float, eta_z: float, *, task_divisor: np.ndarray | None = None,
               domain_divisor: np.ndarray | None = None, move_alpha: bool = True, move_z: bool = True,
               alpha_ema: float = 0.0, alpha_floor: float = 0.0, z_smoothing: float = 0.0) -> WeightStep:
    """One GRAPE step, a pure function: z *= exp(-eta_z * a), alpha *= exp(eta_alpha * b), both from the
    previous weights.

    ``gram`` is the conditioned (K+N)x(K+N) Gram (domains first), ``task_losses`` the N probe losses. The
    divisors of the alignments default to the task losses (RoI, the paper's default progress metric);
    GOI passes ones, RoI-ema an EMA of the losses as ``task_divisor``. The other options are
    :func:`~grape_stream.grape.reweighting.step.mirror_step`'s.
    """
    k = log_alpha.shape[0]
    a, b = grape_scores(gram[:k, k:], probs_from_log(log_alpha), probs_from_log(log_z),
                        task_losses if task_divisor is None else task_divisor,
                        task_losses if domain_divisor is None else domain_divisor)
    return mirror_step(log_alpha, log_z, a, b, eta_alpha, eta_z, move_alpha=move_alpha, move_z=move_z,
                       alpha_ema=alpha_ema, alpha_floor=alpha_floor, z_smoothing=z_smoothing)


@dataclass
class GrapeOptions(StepOptions):
    """GRAPE's options: StepOptions for both sides, plus z's."""

    sides: ClassVar[tuple[str, ...]] = ("alpha", "z")

    mu_z: Optional[float] = None  # step_size="lr_over_mu" only: eta_z = lr / mu_z (None: PAPER_MU_Z)
    eta_z: Optional[float] = None  # step_size="constant" only
    kl_z: Optional[float] = None  # step_size="trust_region" only: KL per update at peak lr (None: 0.04)
    z0: Optional[list[float]] = None  # initial task weights (None: uniform)
    z_smoothing: float = 0.0  # share of the uniform vector mixed into z after each step (authors' code: 0.001)

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        out = super().resolve(num_domains, num_tasks)
        out["z0"] = None if self.z0 is None else check_simplex(self.z0, "z0", num_tasks).tolist()
        share = real(self.z_smoothing, "z_smoothing")
        if not (0.0 <= share <= 1.0):
            raise ConfigError(f"z_smoothing must lie in [0, 1] (authors' code: 0.001), got {share!r}")
        out["z_smoothing"] = share
        return out


@register
class GrapeReweighter(Reweighter):
    method = "grape"
    description = "GRAPE with rate-of-improvement (RoI): both sides use grad log l_n = h_n / l_n"
    Options: ClassVar[type[GrapeOptions]] = GrapeOptions
    moves_alpha = True
    moves_z = True

    def _divisors(self, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(task-side divisor, domain-side divisor, the loss EMA after this update)."""
        return losses, losses, self._loss_ema

    def _scores(self, g: np.ndarray, losses: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray]:
        task_div, domain_div, _ = self._divisors(losses)
        k = self.num_domains
        return grape_scores(g[:k, k:], self._alpha, self._z, task_div, domain_div)

    def _step(self, g: np.ndarray, losses: np.ndarray, eta_alpha: float, eta_z: float, index: int,
              update_alpha: bool, update_z: bool) -> tuple[WeightStep, np.ndarray | None]:
        task_div, domain_div, loss_ema = self._divisors(losses)
        return grape_step(self._log_alpha, self._log_z, g, losses, eta_alpha, eta_z, task_divisor=task_div,
                          domain_divisor=domain_div, **self._step_options(update_alpha, update_z)), loss_ema

    def target_coefficients(self, task_losses: np.ndarray, task_gram: np.ndarray | None) -> np.ndarray:
        _, domain_div, _ = self._divisors(np.asarray(task_losses, dtype=np.float64))
        return self._z / domain_div

    def task_scores(self, task_alignment: np.ndarray, task_losses: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        task_div, _, loss_ema = self._divisors(np.asarray(task_losses, dtype=np.float64))
        return np.asarray(task_alignment, dtype=np.float64) / task_div, loss_ema


@register
class GrapeGapReweighter(GrapeReweighter):
    method = "grape_gap"
    description = "GRAPE with gap-of-improvement (GOI): raw alignments on both sides"

    def _divisors(self, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        return np.ones_like(losses), np.ones_like(losses), self._loss_ema


@dataclass
class GrapeEmaOptions(GrapeOptions):
    ema_beta: float = 0.7  # the task side divides by an EMA of the losses with this beta

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        beta = real(self.ema_beta, "ema_beta")
        if not (0.0 <= beta < 1.0):
            raise ConfigError(f"ema_beta must lie in [0, 1), got {beta!r}")
        out = super().resolve(num_domains, num_tasks)
        out["ema_beta"] = beta
        return out


@register
class GrapeEmaReweighter(GrapeReweighter):
    method = "grape_ema"
    description = "GRAPE with EMA rate-of-improvement: task side divides by an EMA of the losses (beta=0.7)"
    Options = GrapeEmaOptions

    def _divisors(self, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        # Paper: l_ema^t = beta * l_ema^{t-1} + (1 - beta) * l_n(theta_t), used at the same step t, i.e.
        # updated before use. It starts at the first observed losses (so the first update equals GRAPE).
        beta = self._options["ema_beta"]
        ema = losses.copy() if self._loss_ema is None else beta * self._loss_ema + (1.0 - beta) * losses
        return ema, losses, ema
