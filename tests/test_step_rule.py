"""The default step rule (a KL trust region per update): its size, its independence of the gradients' scale, the
lr schedule's share, and its state across a checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from grape_stream.grape.reweighting import build_reweighter
from grape_stream.grape.reweighting.step_rule import DEFAULT_KL, kl_of_step, trust_region_eta


def _case(k: int = 5, n: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(k + n, 32))
    return v @ v.T, rng.uniform(2.0, 5.0, size=n)


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    return float(np.sum(p * np.log(p / q)))


@pytest.mark.parametrize("method", ["grape", "grape_gap", "grape_ema", "doge", "doge_pcgrad"])
def test_each_update_moves_the_weights_by_the_stated_divergence(method):
    gram, losses = _case()
    r = build_reweighter(method, 5, 3)
    before_a, before_z = r.alpha, r.z
    alpha, z = r.update(gram, losses, lr=3e-4)
    assert _kl(alpha, before_a) == pytest.approx(DEFAULT_KL["alpha"], rel=1e-9)
    if method.startswith("grape"):
        assert _kl(z, before_z) == pytest.approx(DEFAULT_KL["z"], rel=1e-9)
    else:
        np.testing.assert_array_equal(z, before_z)


def test_the_step_does_not_depend_on_the_gradients_scale_or_the_lr_value():
    """The paper's eta = lr / mu moves 100x further when every gradient is 10x longer; the trust region does not."""
    gram, losses = _case(seed=1)
    out = []
    for scale, lr in ((1.0, 1e-4), (100.0, 1e-4), (1e-4, 3.0)):
        r = build_reweighter("grape", 5, 3)
        out.append(r.update(gram * scale, losses, lr=lr))
    for alpha, z in out[1:]:
        np.testing.assert_allclose(alpha, out[0][0], rtol=1e-9)
        np.testing.assert_allclose(z, out[0][1], rtol=1e-9)
    paper = [build_reweighter("grape", 5, 3, step_size="lr_over_mu").update(gram * s, losses, lr=1e-4)[0]
             for s in (1.0, 100.0)]
    assert np.abs(paper[0] - paper[1]).max() > 1e-3  # the contrast: the paper's step follows the scale


def test_the_divergence_follows_the_lr_schedule_relative_to_its_peak():
    gram, losses = _case(seed=2)
    r = build_reweighter("grape", 5, 3, kl_alpha=0.03, kl_z=0.0)
    r.update(gram, losses, lr=1e-3)  # the peak
    a0 = r.alpha
    a1, _ = r.update(gram, losses, lr=2.5e-4)  # a quarter of the peak: a quarter of the divergence
    assert _kl(a1, a0) == pytest.approx(0.03 / 4, rel=1e-9)
    np.testing.assert_array_equal(r.z, np.full(3, 1 / 3))  # kl_z = 0: z stays
    warm = build_reweighter("grape", 5, 3)
    a, _ = warm.update(gram, losses, lr=0.0)  # lr 0 (warm-up's first step): no move
    np.testing.assert_array_equal(a, np.full(5, 0.2))


def test_a_constant_kl_schedule_moves_the_full_divergence_however_far_the_lr_has_decayed():
    gram, losses = _case(seed=2)
    r = build_reweighter("grape", 5, 3, kl_alpha=0.03, kl_schedule="constant")
    r.update(gram, losses, lr=1e-3)  # the peak
    a0, z0 = r.alpha, r.z
    a1, z1 = r.update(gram, losses, lr=1e-5)  # 1% of the peak: still the whole divergence, on both sides
    assert _kl(a1, a0) == pytest.approx(0.03, rel=1e-9)
    assert _kl(z1, z0) == pytest.approx(DEFAULT_KL["z"], rel=1e-9)
    # the default ("lr") on the same updates: a hundredth of it
    d = build_reweighter("grape", 5, 3, kl_alpha=0.03, kl_schedule="lr")
    d.update(gram, losses, lr=1e-3)
    b0 = d.alpha
    assert _kl(d.update(gram, losses, lr=1e-5)[0], b0) == pytest.approx(0.03 / 100, rel=1e-9)


def test_kl_schedule_is_checked_and_stored_only_when_it_changes_the_step():
    from grape_stream.errors import ConfigError

    with pytest.raises(ConfigError, match="kl_schedule must be 'lr'.*or 'constant'"):
        build_reweighter("grape", 5, 3, kl_schedule="cosine")
    with pytest.raises(ConfigError, match="kl_schedule is used only with step_size='trust_region'"):
        build_reweighter("grape", 5, 3, step_size="lr_over_mu", kl_schedule="constant")
    # the default leaves the state as it was before the option existed (older checkpoints load strictly)
    assert "kl_schedule" not in json.dumps(build_reweighter("grape", 5, 3, kl_schedule="lr").state_dict())
    assert "kl_schedule" in json.dumps(build_reweighter("grape", 5, 3, kl_schedule="constant").state_dict())
    gram, losses = _case(seed=4)
    a = build_reweighter("doge", 5, 3, kl_schedule="constant")
    a.update(gram, losses, lr=1e-3)
    b = build_reweighter("doge", 5, 3, kl_schedule="constant")
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    np.testing.assert_array_equal(a.update(gram, losses, lr=1e-5)[0], b.update(gram, losses, lr=1e-5)[0])


def test_peak_lr_survives_a_checkpoint_so_a_resumed_run_steps_the_same():
    gram, losses = _case(seed=3)
    a = build_reweighter("grape", 5, 3)
    a.update(gram, losses, lr=1e-3)
    state = json.loads(json.dumps(a.state_dict()))
    b = build_reweighter("grape", 5, 3)
    b.load_state_dict(state)
    assert state["lr_peak"] == 1e-3
    np.testing.assert_array_equal(a.update(gram, losses, lr=5e-4)[0], b.update(gram, losses, lr=5e-4)[0])


def test_saturation_a_tiny_weight_left_off_the_top_is_well_defined():
    log_w = np.log(np.array([0.999999, 1e-6]))
    s = np.array([1.0, 0.0])
    eta = trust_region_eta(log_w, s, kl=0.5)  # more than an infinite step could give (-log 0.999999)
    assert np.isfinite(eta) and eta > 0
    new = np.exp(log_w + eta * s)
    new /= new.sum()
    assert new[1] == pytest.approx(1e-12, rel=1e-6)  # 1e-6 of the mass off the top
    assert kl_of_step(log_w, s, eta) <= -np.log(0.999999)


def test_constant_exponents_do_not_move():
    assert trust_region_eta(np.log(np.full(4, 0.25)), np.full(4, 3.0), 0.1) == 0.0
    assert trust_region_eta(np.log(np.full(4, 0.25)), np.array([1.0, 2.0, 3.0, 4.0]), 0.0) == 0.0
