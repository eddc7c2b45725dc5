"""Updates from the training steps' own per-domain losses: what the loss-driven online methods need.

DoReMi, ODM and ADO never probe: they read each domain's training loss on the batches the model trains on
anyway (and DoReMi its excess over a reference model's loss on the same tokens). The controller's
training-loss mode sums those per domain over the steps since the last update (and over ranks) and hands
them over as one :class:`DomainLosses`; :meth:`FromLosses.update_from_losses` checks them, asks the
method's :meth:`FromLosses._loss_step` for the new log-weights, and keeps them with the same record,
counters and state as an update from a Gram. A mixin of
:class:`~grape_stream.grape.reweighting.base.Reweighter`, kept apart so that module stays small.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional

import numpy as np

from grape_stream.config.choices import Signal
from grape_stream.simplex import log_normalize, probs_from_log

__all__ = ["DomainLosses", "FromLosses"]


@dataclasses.dataclass(frozen=True)
class DomainLosses:
    """What the training steps since the last update measured, per domain (K entries each; summed over ranks).

    ``loss``: the mean per-sample training loss of each domain's samples (NaN where ``samples`` is 0);
    ``samples``: how many of each domain's samples were trained on; ``steps``: the optimizer steps covered;
    ``excess``: DoReMi's per-token excess loss max(l_proxy - l_ref, 0) averaged over each domain's tokens
    (NaN where none), present only for a method with ``needs_reference``.
    """

    loss: np.ndarray
    samples: np.ndarray
    steps: int = 1
    excess: Optional[np.ndarray] = None

    def check(self, num_domains: int) -> None:
        for name in ("loss", "samples") + (("excess",) if self.excess is not None else ()):
            v = np.asarray(getattr(self, name))
            if v.shape != (num_domains,):
                raise ValueError(f"DomainLosses.{name} has shape {v.shape}, expected ({num_domains},)")
        if np.any(np.asarray(self.samples) < 0) or int(self.steps) < 1:
            raise ValueError("DomainLosses: samples must be >= 0 and steps >= 1")

    @property
    def seen(self) -> np.ndarray:
        """Which domains had at least one sample in the interval."""
        return np.asarray(self.samples) > 0


class FromLosses:
    """The training-loss side of a Reweighter (uses its log-weights, ``_check_lr``, ``_record``, ``_skip``).

    A method sets ``signal = Signal.training_losses`` (no probe runs), optionally
    ``needs_reference = True`` (DoReMi: the loop computes a reference model's losses on the same batch), and
    implements :meth:`_loss_step`. Its own state (a bandit's estimates, a loss history) goes through
    :meth:`_method_state` / :meth:`_load_method_state`, which the base state_dict carries as ``method_state``.
    """

    method: ClassVar[str]
    num_domains: int
    num_tasks: int
    _num_updates: int
    _log_alpha: np.ndarray
    _log_z: np.ndarray
    _alpha: np.ndarray
    _z: np.ndarray
    _history: Any
    signal: ClassVar[Signal]  # Signal.training_losses: updates read the steps' per-domain losses (update_from_losses)
    #: whether those losses need a reference model's loss on the same tokens (DoReMi's excess loss)
    needs_reference: ClassVar[bool] = False

    if TYPE_CHECKING:  # provided by Reweighter
        def _check_lr(self, lr: Any) -> float | None: ...
        def _skip(self, index: int, step: int | None, lr: float | None, losses: np.ndarray, eta_alpha: float,
                  eta_z: float, reason: str, a: np.ndarray | None = None,
                  b: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]: ...
        def _record(self, index: int, step: int | None, lr: float | None, losses: np.ndarray, a: np.ndarray | None,
                    b: np.ndarray | None, eta_alpha: float, eta_z: float, skipped: str | None) -> None: ...

    def update_from_losses(self, losses: DomainLosses, lr: float | None,
                           step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One update from the interval's per-domain training losses. Returns copies of (alpha, z).

        Non-finite losses of a domain that was seen skip the update (recorded in ``history``)."""
        if self.signal is not Signal.training_losses:
            raise NotImplementedError(f"method {self.method!r} does not update from training losses")
        losses.check(self.num_domains)
        index = self._num_updates
        lr_value = self._check_lr(lr)
        seen = losses.seen
        signal = [np.asarray(losses.loss, dtype=np.float64)]
        if self.needs_reference:
            if losses.excess is None:
                raise ValueError(f"method {self.method!r} needs the reference model's excess losses")
            signal.append(np.asarray(losses.excess, dtype=np.float64))
        bad = [int(k) for v in signal for k in np.flatnonzero(seen & ~np.isfinite(v))]
        if bad:
            return self._skip(index, step, lr_value, np.zeros(0), 0.0, 0.0,
                              f"non-finite training losses of domain(s) {sorted(set(bad))}")
        log_alpha, score, eta = self._loss_step(losses, lr_value, index)
        log_alpha = log_normalize(np.asarray(log_alpha, dtype=np.float64))
        self._log_alpha, self._alpha = log_alpha, probs_from_log(log_alpha)
        self._record(index, step, lr_value, np.zeros(0), None, score, eta, 0.0, None)
        extra = self._record_extra()
        if extra and self._history:
            self._history[-1].update(extra)
        self._num_updates += 1
        return self._alpha.copy(), self._z.copy()

    # -- what a loss-driven method implements ---------------------------------------------------------
    def _loss_step(self, losses: DomainLosses, lr: float | None,
                   index: int) -> tuple[np.ndarray, np.ndarray | None, float]:
        """(new log-alpha (normalised here), the per-domain score it used (recorded as ``b``), its step size)."""
        raise NotImplementedError

    def _record_extra(self) -> dict[str, Any]:
        """Entries a method adds to its update record (plain JSON types; DoReMi's ``average_alpha``); the
        controller's training-loss mode copies them into its own record (the trajectory)."""
        return {}

    def _method_state(self) -> Optional[dict[str, Any]]:
        """The method's own state beyond the weights (plain JSON types), or None."""
        return None

    def _load_method_state(self, state: Optional[Mapping[str, Any]]) -> None:
        """Restore :meth:`_method_state`'s output (None: a fresh method state)."""
