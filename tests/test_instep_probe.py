"""The task probe of in-step alignments against explicit per-task gradients (float64): losses, alignments with
a fixed direction, and the combined target direction for coefficients that depend on both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _alignment_helpers import gpt, lm_groups, one_thread  # noqa: F401  (autouse: one torch thread)
from _instep_helpers import directions
from grape_stream.grape.instep_probe import task_probe
from grape_stream.models import per_sample_lm_loss


def _coefficients(losses: np.ndarray, r: np.ndarray, gram=None) -> np.ndarray:
    z = np.exp(-3.0 * r[:, 0] / losses)
    return z / z.sum() / losses  # GRAPE's shape: an updated z over the losses


@pytest.mark.parametrize("keep", [True, False])
def test_task_probe_is_exact_and_leaves_grad_alone(keep: bool) -> None:
    model = gpt(seed=3)
    groups = lm_groups([3, 2, 4], seed=9)
    params = [p for p in model.parameters() if p.requires_grad]
    fixed = directions(model, 1, seed=2)
    got = task_probe(model, per_sample_lm_loss, groups, fixed=fixed, coefficients=_coefficients, keep_gradients=keep)
    assert all(p.grad is None for p in params)
    grads, losses, r = [], [], []
    for g in groups:
        loss = per_sample_lm_loss(model, g).mean()
        gr = torch.autograd.grad(loss, params)
        grads.append(gr)
        losses.append(float(loss.detach()))
        r.append(sum(float((a * fixed[0][p]).sum()) for a, p in zip(gr, params)))
    np.testing.assert_allclose(got.losses, losses, rtol=1e-13)
    np.testing.assert_allclose(got.alignments[:, 0], r, rtol=1e-10)
    c = _coefficients(np.array(losses), np.array(r)[:, None])
    np.testing.assert_allclose(got.coefficients, c, rtol=1e-10)
    if keep:
        flat = [torch.cat([g.reshape(-1) for g in gr]) for gr in grads]
        want_gram = torch.stack(flat) @ torch.stack(flat).t()
        np.testing.assert_allclose(got.task_gram, want_gram.numpy(), rtol=1e-10)
    else:
        assert got.task_gram is None
    for i, p in enumerate(params):
        want = sum(float(c[n]) * grads[n][i] for n in range(len(groups)))
        assert float((got.direction[p] - want).abs().max()) <= 1e-10 * float(want.abs().max())
