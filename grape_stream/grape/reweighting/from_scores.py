"""Updates from scores instead of a probe Gram: what in-step alignments (``alignments: steps``) need of a method.

With in-step alignments the domain side is measured on the training steps against one target direction
v = sum_n c_n h_n, and the task side against the update direction d: r_n = <h_n, d>. A method states which
c makes its domain score b_k = <g_k, v> (:meth:`FromScores.target_coefficients`) and how r becomes its task
score a (:meth:`FromScores.task_scores`); :meth:`FromScores.update_from_scores` then takes the same step
as an update from a Gram (step sizes, log-space steps, floors, smoothing, record, state). A mixin of
:class:`~grape_stream.grape.reweighting.base.Reweighter`, kept apart so that module stays small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from grape_stream.simplex import as_float_vector

__all__ = ["FromScores"]


class FromScores:
    """The in-step side of a Reweighter (uses its weights, step sizes and ``_apply_scores``)."""

    method: ClassVar[str]
    num_domains: int
    num_tasks: int
    _num_updates: int
    _gram_ema: np.ndarray | None
    _loss_ema: np.ndarray | None

    if TYPE_CHECKING:  # provided by Reweighter
        def _check_lr(self, lr: Any) -> float | None: ...
        def _skip(self, index: int, step: int | None, lr: float | None, losses: np.ndarray, eta_alpha: float,
                  eta_z: float, reason: str, a: np.ndarray | None = None,
                  b: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]: ...
        def _etas(self, lr_value: float | None, scores: tuple[np.ndarray, np.ndarray] | None, update_alpha: bool,
                  update_z: bool) -> tuple[float, float]: ...
        def _apply_scores(self, index: int, step: int | None, lr_value: float | None, losses: np.ndarray,
                          a: np.ndarray, b: np.ndarray, update_alpha: bool, update_z: bool,
                          loss_ema: np.ndarray | None,
                          gram_ema: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]: ...

    def target_coefficients(self, task_losses: np.ndarray, task_gram: np.ndarray | None) -> np.ndarray:
        """c (N) such that this method's domain score is b_k = <g_k, sum_n c_n h_n>, with the current weights:
        the target direction that the training steps' domain gradients are aligned with."""
        raise NotImplementedError(f"method {self.method!r} does not move alpha by an alignment")

    def task_scores(self, task_alignment: np.ndarray, task_losses: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(a, the loss EMA after this update) from r_n = <h_n, d>, d the update direction sum_k alpha_k g_k."""
        return np.asarray(task_alignment, dtype=np.float64), self._loss_ema

    def update_from_scores(self, a: Any, b: Any, task_losses: Any, lr: float | None, step: int | None = None, *,
                           loss_ema: np.ndarray | None = None, update_alpha: bool = True,
                           update_z: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """One update from the exponents' vectors themselves (``a`` from :meth:`task_scores`, ``b`` the domain
        scores measured against the :meth:`target_coefficients` direction): the same step sizes, log-space
        steps, floors, smoothing, record and state as :meth:`update`. Non-finite scores skip the update."""
        index = self._num_updates
        losses = as_float_vector(task_losses, "task_losses")
        a, b = as_float_vector(a, "a"), as_float_vector(b, "b")
        if a.shape != (self.num_tasks,) or b.shape != (self.num_domains,):
            raise ValueError(f"a has {a.shape}, b {b.shape}: expected ({self.num_tasks},) and ({self.num_domains},)")
        lr_value = self._check_lr(lr)
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            eta_alpha, eta_z = self._etas(lr_value, None, update_alpha, update_z)
            return self._skip(index, step, lr_value, losses, eta_alpha, eta_z, "non-finite in-step scores", a=a, b=b)
        return self._apply_scores(index, step, lr_value, losses, a, b, update_alpha, update_z, loss_ema,
                                  self._gram_ema)
