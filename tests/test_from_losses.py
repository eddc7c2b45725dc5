"""The training-loss update path every loss-driven method (DoReMi, ODM, ADO) builds on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from grape_stream.config.choices import Signal
from grape_stream.grape.reweighting import DomainLosses, Reweighter


class _TowardsLoss(Reweighter):
    """A toy loss-driven method: log alpha += loss, with a counter as its own state."""

    method = "towards_loss_test"
    signal = Signal.training_losses
    moves_alpha = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen_total = 0.0

    def _loss_step(self, losses, lr, index):
        self.seen_total += float(np.nansum(losses.samples))
        return self._log_alpha + np.where(losses.seen, losses.loss, 0.0), losses.loss, 1.0

    def _method_state(self):
        return {"seen_total": self.seen_total}

    def _load_method_state(self, state):
        self.seen_total = 0.0 if state is None else float(state["seen_total"])


def test_update_moves_alpha_records_and_round_trips_its_own_state():
    r = _TowardsLoss(3, 1)
    alpha, _ = r.update_from_losses(DomainLosses(np.array([1.0, 2.0, np.nan]), np.array([4, 4, 0]), steps=2), 1e-3, 5)
    want = np.exp([1.0, 2.0, 0.0]) / np.exp([1.0, 2.0, 0.0]).sum()
    np.testing.assert_allclose(alpha, want, rtol=1e-12)
    assert r.history[-1]["step"] == 5 and r.history[-1]["skipped"] is None and r.num_updates == 1
    state = json.loads(json.dumps(r.state_dict()))
    assert state["method_state"] == {"seen_total": 8.0}
    other = _TowardsLoss(3, 1)
    other.load_state_dict(state)
    assert other.seen_total == 8.0 and other.alpha.tolist() == r.alpha.tolist()


def test_non_finite_loss_of_a_seen_domain_skips_and_bad_shapes_raise():
    r = _TowardsLoss(2, 1)
    alpha, _ = r.update_from_losses(DomainLosses(np.array([np.inf, 1.0]), np.array([1, 1])), 1e-3)
    assert alpha.tolist() == [0.5, 0.5] and "domain(s) [0]" in r.history[-1]["skipped"]
    with pytest.raises(ValueError, match="shape"):
        r.update_from_losses(DomainLosses(np.ones(3), np.ones(3)), 1e-3)


def test_gram_methods_refuse_training_losses():
    from grape_stream.grape.reweighting import build_reweighter

    with pytest.raises(NotImplementedError, match="does not update from training losses"):
        build_reweighter("grape", 2, 1).update_from_losses(DomainLosses(np.ones(2), np.ones(2)), 1e-3)
