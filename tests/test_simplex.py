"""grape_stream.simplex: validation messages, the log-space step, floors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grape_stream.simplex import (
    apply_floor,
    check_simplex,
    exp_gradient_step,
    log_normalize,
    logsumexp,
    mix_uniform,
    probs_from_log,
    uniform,
)
from test_reweighting import reference_floor  # the one bisection reference for alpha_floor

SETTINGS = settings(max_examples=50, deadline=None)


@pytest.mark.parametrize(
    "weights, size, fragment",
    [
        ([0.5, 0.5], 3, "has 2 entries but 3"),
        ([0.5, -0.1, 0.6], None, "negative entries at positions [1]"),
        ([0.5, float("nan"), 0.5], None, "non-finite entries at positions [1]"),
        ([0.0, 0.0], None, "all zeros"),
        ([0.2, 0.2], None, "sums to 0.4"),
        ([], None, "is empty"),
        ([[0.5, 0.5]], None, "1-dimensional"),
        (["a", "b"], None, "sequence of numbers"),
    ],
)
def test_check_simplex_names_the_problem(weights, size, fragment):
    with pytest.raises(ValueError) as info:
        check_simplex(weights, "alpha0", size)
    assert "alpha0" in str(info.value)
    assert fragment in str(info.value)


def test_check_simplex_renormalises_within_tolerance_and_keeps_zeros():
    w = check_simplex([0.2500001, 0.25, 0.0, 0.5], "w")
    assert w.dtype == np.float64
    assert abs(w.sum() - 1.0) < 1e-15
    assert w[2] == 0.0


def test_uniform_and_errors():
    assert uniform(4).tolist() == [0.25] * 4
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            uniform(bad)


def test_logsumexp_handles_huge_and_minus_inf():
    x = np.array([1e4, 1e4 - math.log(3.0), -math.inf])
    assert logsumexp(x) == pytest.approx(1e4 + math.log(4.0 / 3.0), rel=1e-15)
    with pytest.raises(ValueError, match="all -inf"):
        logsumexp(np.array([-math.inf, -math.inf]))


@pytest.mark.parametrize("eta", [1.0, -1.0])
def test_exp_gradient_step_with_exponents_of_1e4_is_finite(eta):
    log_w = np.log(uniform(3))
    out = probs_from_log(exp_gradient_step(log_w, np.array([1e4, -1e4, 0.0]), eta))
    assert np.all(np.isfinite(out)) and abs(out.sum() - 1.0) < 1e-15
    assert out[0 if eta > 0 else 1] == pytest.approx(1.0)


def test_exp_gradient_step_matches_direct_formula_and_rejects_overflow():
    w = np.array([0.1, 0.2, 0.7])
    d = np.array([0.3, -1.2, 0.5])
    direct = w * np.exp(1.7 * d)
    direct /= direct.sum()
    np.testing.assert_allclose(probs_from_log(exp_gradient_step(np.log(w), d, 1.7)), direct, rtol=1e-14)
    with pytest.raises(FloatingPointError):
        exp_gradient_step(np.log(w), np.array([1e308, 0.0, 0.0]), 10.0)


def test_mix_uniform():
    out = mix_uniform(np.array([1.0, 0.0]), 0.001)
    assert out.tolist() == pytest.approx([0.9995, 0.0005], rel=1e-15)
    with pytest.raises(ValueError):
        mix_uniform(np.array([1.0, 0.0]), 1.5)


@SETTINGS
@given(
    raw=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12).filter(lambda v: sum(v) > 1e-3),
    frac=st.floats(0.0, 1.0),
)
def test_apply_floor_is_the_ratio_preserving_projection(raw, frac):
    w = np.array(raw) / sum(raw)
    n = w.shape[0]
    floor = frac / n
    out = apply_floor(w, floor)
    assert abs(out.sum() - 1.0) < 1e-12
    assert out.min() >= floor * (1 - 1e-12)
    ref = reference_floor(w, floor)
    np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-12)
    free = out > floor * (1 + 1e-9)
    if free.sum() >= 2:  # the weights above the floor keep their ratios
        ratios = out[free] / w[free]
        np.testing.assert_allclose(ratios, ratios[0], rtol=1e-12)
    if w.min() >= floor:
        np.testing.assert_array_equal(out, w)


def test_apply_floor_rejects_a_floor_above_uniform():
    with pytest.raises(ValueError, match=r"\[0, 1/4\]"):
        apply_floor(uniform(4), 0.3)
    np.testing.assert_allclose(apply_floor(np.array([1.0, 0.0, 0.0, 0.0]), 0.25), uniform(4))


def test_log_normalize_makes_a_distribution():
    p = probs_from_log(log_normalize(np.array([-2e4, 0.0, -math.inf])))
    assert p.tolist() == [0.0, 1.0, 0.0]
