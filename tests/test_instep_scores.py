"""The update from scores equals the update from a Gram when the scores are the Gram's own: each method's
target coefficients and task scores reproduce its a and b (alignments: steps uses them)."""

from __future__ import annotations

import numpy as np
import pytest

from grape_stream.grape.reweighting import build_reweighter

K, N = 4, 3


@pytest.mark.parametrize("step", ["lr_over_mu", "trust_region"])
@pytest.mark.parametrize("method", ["grape", "grape_gap", "grape_ema", "doge", "doge_pcgrad"])
def test_scores_reproduce_the_gram_update(method: str, step: str) -> None:
    rng = np.random.default_rng(0)
    opts = {"mu_alpha": 1e-2} if method.startswith("doge") else {"mu_alpha": 1e-2, "mu_z": 1e-2}
    if step == "trust_region":  # the default step (a KL trust region, solved from a and b): no mu
        opts = {}
    by_gram, by_scores = (build_reweighter(method, num_domains=K, num_tasks=N, **opts) for _ in range(2))
    for update in range(3):
        v = rng.normal(size=(K + N, 20))
        gram = v @ v.T
        losses = rng.uniform(1.0, 3.0, N)
        a_side = gram[:K, K:]
        c = by_scores.target_coefficients(losses, gram[K:, K:])
        b = a_side @ c  # <g_k, sum_n c_n h_n>
        a, ema = by_scores.task_scores(a_side.T @ by_scores.alpha, losses)  # r_n = <h_n, sum_k alpha_k g_k>
        want = by_gram.update(gram, losses, 0.1, step=update)
        got = by_scores.update_from_scores(a, b, losses, 0.1, step=update, loss_ema=ema)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12)
    assert by_scores.num_updates == by_gram.num_updates == 3
