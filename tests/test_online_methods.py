"""ODM and ADO (the loss-driven online methods) against slow computations written from the papers' equations.

The references below are plain Python loops over domains and steps (no numpy vector arithmetic, no code
shared with grape.reweighting): ODM's Algorithm 1 (Albalak et al. 2023) step for step, and ADO's policy
(Jiang et al. 2025) from given power-law fits. The fit itself is checked on hand-made curves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import pytest

from grape_stream.errors import ConfigError
from grape_stream.grape.reweighting import DomainLosses, build_reweighter, reweighter_from_state_dict
from grape_stream.grape.reweighting.ado_fit import Bins, PowerLaw, add_point, fit_power_law


# ----------------------------------------------------------------------------------------------------
# ODM
# ----------------------------------------------------------------------------------------------------
def slow_odm(k: int, batches: list[tuple[list[float], list[int]]], smoothing: float) -> list[list[float]]:
    """Algorithm 1 of the ODM paper, one training step per batch, in loops. Returns pi before each step."""
    rewards = [0.0] * k
    eps_prev = 1.0 / k
    out = []
    for t, (loss, samples) in enumerate(batches, start=1):
        eps = min(1.0 / k, math.sqrt(math.log(k) / (k * t)))
        z = sum(math.exp(eps_prev * r) for r in rewards)
        pi = [(1 - k * eps) * math.exp(eps_prev * r) / z + eps for r in rewards]
        out.append(pi)
        for i in range(k):
            if samples[i] > 0:
                rewards[i] = smoothing * rewards[i] + (1 - smoothing) * loss[i] / pi[i]
        eps_prev = eps
    return out


def _odm_batches(k: int, steps: int, seed: int) -> list[tuple[list[float], list[int]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        samples = rng.integers(0, 3, size=k).tolist()
        loss = [float(1.0 + i + rng.normal(0, 0.3)) if s else math.nan for i, s in enumerate(samples)]
        out.append((loss, samples))
    return out


@pytest.mark.parametrize("k, smoothing", [(2, 0.9), (5, 0.5), (13, 0.0)])
def test_odm_matches_algorithm_1_step_for_step(k, smoothing):
    steps = 120  # past t = K ln K, where eps_t drops below 1/K and the policy leaves uniform
    batches = _odm_batches(k, steps, seed=k)
    want = slow_odm(k, batches, smoothing)
    r = build_reweighter("odm", k, 1, smoothing=smoothing)
    for t, (loss, samples) in enumerate(batches):
        np.testing.assert_allclose(r.alpha, want[t], rtol=1e-12, atol=1e-15)
        r.update_from_losses(DomainLosses(np.array(loss), np.array(samples)), None, t)
    assert np.max(np.abs(r.alpha - 1.0 / k)) > 1e-3, "the policy never left uniform: the comparison is vacuous"
    assert int(np.argmax(r.alpha)) == k - 1  # the hardest domain (highest loss) is sampled most


def test_odm_multi_step_intervals_count_steps_and_leave_unseen_domains():
    r = build_reweighter("odm", 3, 1)
    r.update_from_losses(DomainLosses(np.array([2.0, math.nan, 1.0]), np.array([4, 0, 4]), steps=40), None)
    rewards = r.history[-1]["b"]
    assert rewards[1] == 0.0 and rewards[0] == pytest.approx(0.1 * 2.0 * 3) and r.state_dict()["method_state"][
        "steps_seen"] == 40
    eps40, eps41 = math.sqrt(math.log(3) / 120), math.sqrt(math.log(3) / 123)
    e = [math.exp(eps40 * x) for x in rewards]
    np.testing.assert_allclose(r.alpha, [(1 - 3 * eps41) * v / sum(e) + eps41 for v in e], rtol=1e-12)


# ----------------------------------------------------------------------------------------------------
# ADO: the fit
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps, beta, a", [(2.0, 5.0, 0.3), (1.0, 20.0, 0.5), (3.0, 1.0, 0.1), (0.5, 3.0, 1.2)])
def test_fit_recovers_exact_power_laws(eps, beta, a):
    n = np.arange(1, 301) * 8.0
    fit = fit_power_law(Bins(tuple(n), tuple(eps + beta * n ** -a), (1.0,) * n.size))
    assert fit is not None
    assert fit.eps == pytest.approx(eps, rel=1e-6) and fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.exponent == pytest.approx(a, rel=1e-6)


def test_fit_on_noisy_curve_through_bounded_history_predicts_the_curve():
    eps, beta, a = 2.0, 6.0, 0.35
    rng = np.random.default_rng(0)
    bins = Bins()
    n = np.arange(1, 2001) * 4.0
    for x in n:
        bins = add_point(bins, x, eps + beta * x ** -a + rng.normal(0, 0.05), bins_per_decade=20)
    assert len(bins.n) <= 20 * 4 and sum(bins.weight) == n.size  # bounded, every observation counted once
    fit = fit_power_law(bins)
    assert fit is not None and abs(fit.exponent - a) < 0.1 and abs(fit.eps - eps) < 0.25
    for x in (n[100], n[1000], n[-1]):  # the curve and its slope where the policy reads them
        assert fit(x) == pytest.approx(eps + beta * x ** -a, abs=0.02)
        assert fit.speed(x) == pytest.approx(a * beta * x ** (-a - 1), rel=0.3)


def test_fit_is_deterministic_fast_and_refuses_too_few_points():
    rng = np.random.default_rng(1)
    bins = [Bins(tuple(np.arange(1, 201) * 8.0), tuple(1 + 4 * (np.arange(1, 201) * 8.0) ** -0.3
                                                      + rng.normal(0, 0.05, 200)), (1.0,) * 200) for _ in range(13)]
    start = time.perf_counter()
    fits = [fit_power_law(b) for b in bins]
    elapsed = time.perf_counter() - start
    assert [fit_power_law(b) for b in bins] == fits  # bit-identical (dataclass equality of floats)
    assert elapsed < 0.5, f"13 fits took {elapsed:.3f} s"
    assert fit_power_law(Bins((1.0, 2.0), (3.0, 2.0), (1.0, 1.0))) is None
    flat = fit_power_law(Bins((1.0, 2.0, 3.0, 4.0), (2.0, 2.1, 2.2, 2.3), (1.0,) * 4))  # a rising curve
    assert flat is not None and flat.beta == 0.0 and flat.speed(5.0) == 0.0


# ----------------------------------------------------------------------------------------------------
# ADO: the policy
# ----------------------------------------------------------------------------------------------------
def slow_ado_policy(fits, n_seen, h, prior, pi_bar, credit, s, min_prob, gamma2):
    """pi = gamma2 pi_bar + (1 - gamma2) rho, rho_k ~ prior_k lambda_k (-dL_k/dn)(n_k) floored, in loops."""
    k = len(fits)
    raw = []
    for i in range(k):
        eps, beta, a = fits[i]
        loss_now = eps + beta * n_seen[i] ** (-a)
        speed = a * (loss_now - eps) / n_seen[i]  # the paper's -dL/dn = a (L(n) - eps) / n
        lam = h[i] ** s if credit == "h" else (h[i] * (1 - h[i])) ** s
        raw.append(prior[i] * lam * speed)
    rho = [max(v / sum(raw), min_prob) for v in raw]
    rho = [v / sum(rho) for v in rho]
    return [gamma2 * pi_bar[i] + (1 - gamma2) * rho[i] for i in range(k)], rho


@pytest.mark.parametrize("credit", ["h", "h(1-h)"])
def test_ado_policy_matches_the_equations_and_favours_the_faster_learner(credit):
    from grape_stream.grape.reweighting.ado import AdoState, ado_step

    k = 3
    fits = [(2.0, 5.0, 0.5), (2.0, 5.0, 0.2), (1.0, 0.5, 0.3)]
    prior = np.array([0.5, 0.3, 0.2])
    state = AdoState(99, np.array([300.0, 400.0, 500.0]), np.array([0.4, 0.4, 0.2]), np.array([0.2, 0.5, 0.3]),
                     (Bins(),) * k, tuple(PowerLaw(*f) for f in fits), 99)
    opts = {"gamma1": 0.9, "gamma2": 0.8, "credit": credit, "credit_power": 0.5, "min_prob": 0.05,
            "ignore_steps": 10**9, "warmup_steps": 1, "fit_every": 1000, "bins_per_decade": 10}
    losses = DomainLosses(np.array([3.0, 3.0, math.nan]), np.array([4, 4, 0]))
    new, policy, rho = ado_step(state, losses, opts, prior)
    n_seen, h = [304.0, 404.0, 500.0], [0.9 * 0.4 + 0.1 * 0.5, 0.9 * 0.4 + 0.1 * 0.5, 0.9 * 0.2]
    want_pi, want_rho = slow_ado_policy(fits, n_seen, h, prior.tolist(), [0.2, 0.5, 0.3], credit, 0.5, 0.05, 0.8)
    np.testing.assert_allclose(rho, want_rho, rtol=1e-12)
    np.testing.assert_allclose(policy, want_pi, rtol=1e-12)
    np.testing.assert_allclose(new.pi_bar, (100 * np.array([0.2, 0.5, 0.3]) + np.array(want_rho)) / 101, rtol=1e-12)
    # same prior, credit and n: the domain whose fitted loss falls faster at n (-dL/dn larger) gets more
    faster = (PowerLaw(2.0, 5.0, 0.5), PowerLaw(2.0, 1.0, 0.5), PowerLaw(2.0, 1.0, 0.2))
    same = dataclasses.replace(state, h=np.full(3, 1 / 3), n_seen=np.full(3, 300.0), fits=faster)
    rho_same = ado_step(same, DomainLosses(np.full(3, 3.0), np.array([4, 4, 4])), {**opts, "min_prob": 0.0},
                        np.full(3, 1 / 3))[2]
    speeds = [f.speed(304.0) for f in faster]
    assert rho_same is not None and rho_same[0] > rho_same[1] and rho_same[2] > rho_same[1]
    np.testing.assert_allclose(rho_same, np.array(speeds) / sum(speeds), rtol=1e-12)


def test_ado_warms_up_on_the_prior_then_moves_towards_the_faster_learner():
    """Two domains with the same exponent: domain 0 has 6x the reducible loss, so its loss falls faster."""
    r = build_reweighter("ado", 2, 1, prior=[0.3, 0.7], warmup_steps=40, fit_every=10, ignore_steps=5)
    rng = np.random.default_rng(0)
    n = np.zeros(2)
    for t in range(1, 241):
        samples = rng.multinomial(16, r.alpha)
        n += samples
        true = 1.0 + np.array([6.0, 1.0]) * np.maximum(n, 1) ** -0.3
        r.update_from_losses(DomainLosses(np.where(samples > 0, true + rng.normal(0, 0.01, 2), np.nan), samples),
                             None, t)
        if t == 39:
            assert r.alpha.tolist() == [0.3, 0.7] and r.history[-1]["b"] is None
    assert all(f is not None for f in r.fits) and r.fits[0].exponent == pytest.approx(0.3, abs=0.1)
    assert r.alpha[0] > 0.4 and r.history[-1]["b"][0] > 0.5


def _fixed_stream(steps: int, seed: int = 0) -> list[DomainLosses]:
    """Batches independent of the weights (a fixed draw), so two reweighters can read the same stream."""
    rng = np.random.default_rng(seed)
    n, out = np.zeros(2), []
    for _ in range(steps):
        samples = rng.multinomial(16, [0.4, 0.6])
        n += samples
        true = 1.0 + 6.0 * np.maximum(n, 1) ** -np.array([0.6, 0.1])
        out.append(DomainLosses(np.where(samples > 0, true + rng.normal(0, 0.01, 2), np.nan), samples))
    return out


@pytest.mark.parametrize("method, opts", [("odm", {"smoothing": 0.7}),
                                          ("ado", {"warmup_steps": 20, "fit_every": 7, "ignore_steps": 3,
                                                   "bins_per_decade": 8})])
def test_state_round_trip_through_json_gives_identical_following_updates(method, opts):
    stream = _fixed_stream(60)
    whole = build_reweighter(method, 2, 1, **opts)
    first = build_reweighter(method, 2, 1, **opts)
    for t, losses in enumerate(stream):
        whole.update_from_losses(losses, None, t)
        if t < 30:
            first.update_from_losses(losses, None, t)
    second = reweighter_from_state_dict(json.loads(json.dumps(first.state_dict(), allow_nan=False)))
    assert second.state_dict() == first.state_dict()
    for t, losses in enumerate(stream[30:], start=30):
        second.update_from_losses(losses, None, t)
    assert second.alpha.tobytes() == whole.alpha.tobytes()
    assert second.state_dict() == whole.state_dict()
    assert whole.alpha.tolist() != [0.5, 0.5], "the weights never moved: the comparison is vacuous"


@pytest.mark.parametrize("method, opts, fragment", [
    ("odm", {"smoothing": 1.0}, "smoothing must lie in"),
    ("ado", {"prior": [0.5, 0.5, 0.0]}, "prior must give every domain"),
    ("ado", {"min_prob": 0.5}, "min_prob must lie in"),
    ("ado", {"credit": "bernoulli"}, "credit must be one of"),
    ("ado", {"gamma2": 1.0}, "gamma2 must lie in"),
    ("ado", {"fit_every": 0}, "fit_every must be a positive integer"),
    ("ado", {"ignore_steps": -1}, "ignore_steps must be an integer >= 0"),
    ("ado", {"bins_per_decade": 0}, "bins_per_decade must be a positive integer"),
])
def test_bad_options_are_one_clear_error(method, opts, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        build_reweighter(method, 3, 1, **opts)
    assert "\n" not in str(info.value)
