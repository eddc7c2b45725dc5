"""grape_stream.grape.reweighting against an independent slow computation on explicit gradient vectors.

The reference below never looks at a Gram matrix: it forms the K domain and N task gradients as float64
vectors, does the paper's arithmetic on the vectors (update direction d = sum_k alpha_k g_k, inner
products with h_n / l_n, PCGrad projections of vectors, clipping by vector norms) and multiplies weights
in probability space. The reweighters get only ``V @ V.T``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grape_stream.config.choices import Signal
from grape_stream.grape.reweighting import (
    REWEIGHTERS,
    Reweighter,
    available_methods,
    build_reweighter,
    method_options,
    pcgrad_coefficients,
    pcgrad_task_orders,
    reweighter_from_state_dict,
)

METHODS = ["uniform", "static", "doge", "doge_pcgrad", "grape", "grape_gap", "grape_ema"]  # Gram updates
#: methods that update from the training losses, never a Gram (tests/test_online_methods.py tests them)
LOSS_METHODS = ["odm", "ado"]
MOVING = ["doge", "doge_pcgrad", "grape", "grape_gap", "grape_ema"]
GRAPES = ["grape", "grape_gap", "grape_ema"]
SETTINGS = settings(max_examples=50, deadline=None)
PEAK_LR = 1.5e-4
RTOL = 1e-9


# ----------------------------------------------------------------------------------------------------
# the independent slow computation
# ----------------------------------------------------------------------------------------------------
def make_vectors(rng: np.random.Generator, k: int, n: int, dim: int = 48, max_norm: float = 1.5) -> np.ndarray:
    """K+N random gradient vectors with norms in [0.2, max_norm]; about half of all pairs conflict."""
    v = rng.normal(size=(k + n, dim))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v * rng.uniform(0.2, max_norm, size=(k + n, 1))


def cosine_lr(t: int, total: int) -> float:
    return PEAK_LR * 0.5 * (1.0 + math.cos(math.pi * t / total))


def static_weights(k: int) -> list[float]:
    w = np.arange(1, k + 1, dtype=np.float64)
    return (w / w.sum()).tolist()


def reference_pcgrad(h: np.ndarray, orders: list[list[int]]) -> np.ndarray:
    """PCGrad (Yu et al. 2020, Alg. 1) on vectors: returns the projected task gradients (N x dim)."""
    out = []
    for i in range(h.shape[0]):
        hp = h[i].copy()
        for j in orders[i]:
            dot = float(np.dot(hp, h[j]))
            if dot < 0.0:
                hp = hp - dot / float(np.dot(h[j], h[j])) * h[j]
        out.append(hp)
    return np.array(out)


def reference_floor(w: np.ndarray, floor: float) -> np.ndarray:
    """Independent reference: find c with sum(max(floor, c*w)) = 1 by bisection."""
    lo, hi = 0.0, 1.0 / max(float(w.max()), 1e-300)
    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if np.maximum(floor, mid * w).sum() > 1.0:
            hi = mid
        else:
            lo = mid
    return np.maximum(floor, lo * w)


class Reference:
    """Paper arithmetic on explicit vectors, weights kept in probability space."""

    def __init__(self, method: str, k: int, n: int, **opts):
        self.method, self.k, self.n, self.opts = method, k, n, opts
        self.alpha = np.array(opts.get("alpha0", opts.get("weights", np.full(k, 1.0 / k))), dtype=np.float64)
        self.z = np.array(opts.get("z0", np.full(n, 1.0 / n)), dtype=np.float64)
        self.ema = None
        self.index = 0
        self.lr_peak = 0.0

    def paper_etas(self, lr: float) -> tuple[float, float] | None:
        """(eta_alpha, eta_z) of the paper's / the authors' rule; None under the trust region (the default)."""
        rule = self.opts.get("step_size") or ("lr_over_mu" if "mu_alpha" in self.opts or "mu_z" in self.opts
                                              else "trust_region")
        if rule == "constant":
            return self.opts["eta_alpha"], self.opts.get("eta_z", 0.0)
        if rule == "lr_over_mu":
            return lr / self.opts.get("mu_alpha", 1e-4), lr / self.opts.get("mu_z", 1.5e-5)
        return None

    def trust_step(self, w: np.ndarray, s: np.ndarray, kl: float) -> np.ndarray:
        """Independent trust region: w * exp(eta s) / Z with KL(new || w) = kl, eta found by Brent's method on
        the divergence computed in probability space (no log-space, no bisection)."""
        from scipy.optimize import brentq

        def step(eta: float) -> np.ndarray:
            x = w * np.exp(eta * (s - s.max()))
            return x / x.sum()

        def kl_of(eta: float) -> float:
            p = step(eta)
            live = p > 0
            return float(np.sum(p[live] * np.log(p[live] / w[live])))

        if kl <= 0 or np.ptp(s[w > 0]) == 0:
            return w.copy()
        top = s >= s[w > 0].max()
        kl_max = -math.log(float(w[top].sum()))
        if kl >= kl_max * (1 - 1e-6):  # saturated: keep 1e-6 of the mass off the argmax set
            off0 = math.log(float(w[~top].sum()))
            f = lambda e: math.log(float(step(e)[~top].sum())) - (off0 + math.log(1e-6))  # noqa: E731
            hi = 1.0
            while f(hi) > 0:
                hi *= 2.0
            return step(brentq(f, 0.0, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500))
        hi = 1.0
        while kl_of(hi) < kl:
            hi *= 2.0
        eta = brentq(lambda e: kl_of(e) - kl, 0.0, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500)
        return step(eta)

    def update(self, vectors: np.ndarray, losses: np.ndarray, lr: float):
        k, n, m = self.k, self.n, self.method
        vecs = [v.copy() for v in vectors]
        clip = self.opts.get("clip_norm")
        if clip is not None:
            vecs = [v * min(1.0, clip / float(np.linalg.norm(v))) for v in vecs]
        g, h = vecs[:k], vecs[k:]
        index, self.index = self.index, self.index + 1
        if m in ("uniform", "static"):
            return self.alpha.copy(), self.z.copy()
        self.lr_peak = max(self.lr_peak, lr)
        share = lr / self.lr_peak if self.lr_peak > 0 else 0.0
        etas = self.paper_etas(lr)
        if etas is None:
            kl_alpha = self.opts.get("kl_alpha", 0.02) * share
            kl_z = self.opts.get("kl_z", 0.04) * share
            move_alpha = lambda b: self.trust_step(self.alpha, b, kl_alpha)  # noqa: E731
            move_z = lambda a: self.trust_step(self.z, -a, kl_z)  # noqa: E731
        else:
            def move_alpha(b):
                x = self.alpha * np.exp(etas[0] * b)
                return x / x.sum()

            def move_z(a):
                x = self.z * np.exp(-etas[1] * a)
                return x / x.sum()
        d = sum(self.alpha[i] * g[i] for i in range(k))  # the update direction
        if m in ("doge", "doge_pcgrad"):
            if m == "doge":
                target = sum(h) / n
            else:
                orders = pcgrad_task_orders(self.opts.get("seed", 0), index, n)
                target = reference_pcgrad(np.array(h), orders).mean(axis=0)
            b = np.array([np.dot(g[i], target) for i in range(k)])
            new_alpha = move_alpha(b)
            new_z = self.z.copy()
        else:
            if m == "grape":
                task_div, dom_div = losses, losses
            elif m == "grape_gap":
                task_div, dom_div = np.ones(n), np.ones(n)
            else:
                beta = self.opts.get("ema_beta", 0.7)
                self.ema = losses.copy() if self.ema is None else beta * self.ema + (1 - beta) * losses
                task_div, dom_div = self.ema, losses
            a = np.array([np.dot(h[j] / task_div[j], d) for j in range(n)])
            target = sum(self.z[j] * h[j] / dom_div[j] for j in range(n))
            b = np.array([np.dot(g[i], target) for i in range(k)])
            new_z = move_z(a)
            s = self.opts.get("z_smoothing", 0.0)
            new_z = (1 - s) * new_z + s / n
            new_alpha = move_alpha(b)
        if self.opts.get("alpha_floor", 0.0) > 0:
            new_alpha = reference_floor(new_alpha, self.opts["alpha_floor"])
        self.alpha, self.z = new_alpha, new_z
        return self.alpha.copy(), self.z.copy()


def options_for(method: str, k: int, **extra) -> dict:
    opts = dict(extra)
    if method == "static":
        opts = {"weights": static_weights(k)}
    return opts


def assert_rel_close(got: np.ndarray, want: np.ndarray, rtol: float = RTOL) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    err = np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-300))
    assert err <= rtol, f"relative error {err:.3e} > {rtol:g}\n got={got}\nwant={want}"


def run_both(method, k, n, steps=5, seed=0, max_norm=1.5, **opts):
    rng = np.random.default_rng(seed)
    ref = Reference(method, k, n, **options_for(method, k, **opts))
    r = build_reweighter(method, num_domains=k, num_tasks=n, **options_for(method, k, **opts))
    for t in range(steps):
        v = make_vectors(rng, k, n, max_norm=max_norm)
        losses = rng.uniform(1.5, 6.0, size=n)
        lr = cosine_lr(t, steps)
        want_alpha, want_z = ref.update(v, losses, lr)
        alpha, z = r.update(v @ v.T, losses, lr, step=100 * t)
        assert alpha.dtype == np.float64 and z.dtype == np.float64
        assert_rel_close(alpha, want_alpha)
        assert_rel_close(z, want_z)
    return r, ref


# ----------------------------------------------------------------------------------------------------
# against the slow computation
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 6, 8])
@pytest.mark.parametrize("k", [1, 2, 7, 20])
@pytest.mark.parametrize("method", METHODS)
def test_matches_slow_vector_computation(method, k, n):
    r, _ = run_both(method, k, n, steps=5, seed=1000 * k + n)
    assert len(r.history) == 5
    if method in MOVING and k > 1:
        assert np.max(np.abs(r.alpha - 1.0 / k)) > 1e-3, "alpha never moved: the comparison is vacuous"
    if method in GRAPES and n > 1:
        assert np.max(np.abs(r.z - 1.0 / n)) > 1e-3, "z never moved: the comparison is vacuous"


SWITCHES = {
    "constant": {"step_size": "constant", "eta_alpha": 1.5, "eta_z": 5.0},
    "clip": {"clip_norm": 1.0},
    "smooth": {"z_smoothing": 0.001},
    "authors-code": {"step_size": "constant", "eta_alpha": 1.5, "eta_z": 5.0, "clip_norm": 1.0, "z_smoothing": 0.001},
    "floor": {"alpha_floor": None},  # set per case so that it binds
    "mu": {"mu_alpha": 3e-4, "mu_z": 1e-5},  # giving mu selects the paper's step
    "paper": {"step_size": "lr_over_mu"},
    "kl": {"kl_alpha": 0.1, "kl_z": 0.005},
}


def _switch_cases():
    for method in MOVING:
        for label, switches in SWITCHES.items():
            if method not in GRAPES:  # z never moves: drop the z-side switches
                switches = {k: v for k, v in switches.items() if not k.endswith("_z") and k != "z_smoothing"}
            if switches:
                yield pytest.param(method, switches, id=f"{method}-{label}")


@pytest.mark.parametrize("method, switches", list(_switch_cases()))
def test_switches_match_slow_computation_and_change_the_result(method, switches):
    k, n = 7, 6
    plain, _ = run_both(method, k, n, steps=4, seed=7, max_norm=3.0)
    if "alpha_floor" in switches:  # a floor that binds for this trajectory
        switches = {**switches, "alpha_floor": 0.5 * (float(plain.alpha.min()) + 1.0 / k)}
    r, _ = run_both(method, k, n, steps=4, seed=7, max_norm=3.0, **switches)
    changed = np.max(np.abs(r.alpha - plain.alpha)) + np.max(np.abs(r.z - plain.z))
    assert changed > 1e-6, f"switches {switches} did not change the result"
    if "alpha_floor" in switches:
        assert r.alpha.min() >= switches["alpha_floor"] * (1 - 1e-12)
    if "z_smoothing" in switches:
        assert r.z.min() >= switches["z_smoothing"] / n * (1 - 1e-12)


def test_constant_step_ignores_lr():
    rng = np.random.default_rng(3)
    v = make_vectors(rng, 4, 3)
    out = []
    for lr in (None, 1e-5, 1.0):
        r = build_reweighter("grape", 4, 3, step_size="constant", eta_alpha=1.5, eta_z=5.0)
        out.append(r.update(v @ v.T, [2.0, 3.0, 4.0], lr))
        assert r.history[-1]["eta_alpha"] == 1.5 and r.history[-1]["eta_z"] == 5.0
    for alpha, z in out[1:]:
        np.testing.assert_array_equal(alpha, out[0][0])
        np.testing.assert_array_equal(z, out[0][1])


def test_clip_norm_only_shrinks_long_gradients():
    rng = np.random.default_rng(4)
    v = make_vectors(rng, 3, 2, max_norm=0.9)  # every norm < 1: clipping at 1 is a no-op
    a = build_reweighter("grape", 3, 2).update(v @ v.T, [2.0, 3.0], PEAK_LR)
    b = build_reweighter("grape", 3, 2, clip_norm=1.0).update(v @ v.T, [2.0, 3.0], PEAK_LR)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


# ----------------------------------------------------------------------------------------------------
# PCGrad in coefficient space
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 6, 8])
@pytest.mark.parametrize("conflicting", [False, True])
def test_pcgrad_from_gram_equals_pcgrad_on_vectors(n, conflicting):
    rng = np.random.default_rng(n)
    h = make_vectors(rng, 0, n)
    if conflicting:  # subtracting the mean makes most pairs point away from each other
        h = h - 0.9 * h.mean(axis=0)
    for index in range(5):
        orders = pcgrad_task_orders(seed=11, update_index=index, num_tasks=n)
        coeffs = pcgrad_coefficients(h @ h.T, orders)
        want = reference_pcgrad(h, orders)
        got = coeffs @ h
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()))
        if conflicting and n > 1:
            assert not np.allclose(coeffs, np.eye(n)), "no conflict was projected: the test is vacuous"


def test_pcgrad_orders_are_seeded_permutations_that_vary():
    orders = [pcgrad_task_orders(5, i, 6) for i in range(10)]
    for per_update in orders:
        for i, row in enumerate(per_update):
            assert sorted(row) == [j for j in range(6) if j != i]
    assert orders[3] == pcgrad_task_orders(5, 3, 6)
    assert len({json.dumps(o) for o in orders}) > 1
    assert pcgrad_task_orders(6, 0, 6) != orders[0]


def test_pcgrad_projection_depends_on_the_order():
    """A combined direction that is order-dependent proves the reweighter uses the seeded order."""
    rng = np.random.default_rng(2)
    k, n = 3, 6
    v = make_vectors(rng, k, n)
    v[k:] -= 0.9 * v[k:].mean(axis=0)
    results = set()
    for seed in range(6):
        r = build_reweighter("doge_pcgrad", k, n, seed=seed, step_size="constant", eta_alpha=1.0)
        results.add(tuple(r.update(v @ v.T, np.full(n, 2.0), None)[0].round(12)))
    assert len(results) > 1


# ----------------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------------
def _random_case(seed: int, k: int, n: int, max_norm: float = 1.5):
    rng = np.random.default_rng(seed)
    v = make_vectors(rng, k, n, max_norm=max_norm)
    losses = rng.uniform(0.5, 8.0, size=n)
    alpha0 = rng.dirichlet(np.ones(k))
    z0 = rng.dirichlet(np.ones(n))
    return v, losses, alpha0, z0


def _init_opts(method: str, k: int, alpha0, z0) -> dict:
    if method == "static":
        return {"weights": alpha0.tolist()}
    if method == "uniform":
        return {}
    opts = {"alpha0": alpha0.tolist()}
    if method in GRAPES:
        opts["z0"] = z0.tolist()
    return opts


@SETTINGS
@given(
    method=st.sampled_from(METHODS),
    k=st.integers(1, 6),
    n=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    eta=st.floats(1e-3, 1e3),
    steps=st.integers(1, 4),
)
def test_weights_stay_on_the_simplex(method, k, n, seed, eta, steps):
    v, losses, alpha0, z0 = _random_case(seed, k, n, max_norm=5.0)
    opts = _init_opts(method, k, alpha0, z0)
    if method in MOVING:
        opts.update(step_size="constant", eta_alpha=eta)
        if method in GRAPES:
            opts["eta_z"] = eta
    r = build_reweighter(method, k, n, **opts)
    for _ in range(steps):
        alpha, z = r.update(v @ v.T, losses, PEAK_LR)
        for w, size in ((alpha, k), (z, n)):
            assert w.shape == (size,) and np.all(np.isfinite(w)) and np.all(w >= 0)
            assert abs(w.sum() - 1.0) < 1e-12
        assert r.history[-1]["skipped"] is None


@SETTINGS
@given(
    method=st.sampled_from(METHODS),
    k=st.integers(1, 6),
    n=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_permuting_domains_and_tasks_permutes_the_result(method, k, n, seed, data):
    v, losses, alpha0, z0 = _random_case(seed, k, n)
    pk = np.array(data.draw(st.permutations(range(k))))
    # PCGrad's random task order is keyed by task index, so only domains are permuted for it.
    pn = np.arange(n) if method == "doge_pcgrad" else np.array(data.draw(st.permutations(range(n))))
    r1 = build_reweighter(method, k, n, **_init_opts(method, k, alpha0, z0))
    r2 = build_reweighter(method, k, n, **_init_opts(method, k, alpha0[pk], z0[pn]))
    vp = np.concatenate([v[:k][pk], v[k:][pn]])
    for t in range(3):
        a1, z1 = r1.update(v @ v.T, losses, cosine_lr(t, 3))
        a2, z2 = r2.update(vp @ vp.T, losses[pn], cosine_lr(t, 3))
        np.testing.assert_allclose(a2, a1[pk], rtol=1e-10, atol=1e-300)
        np.testing.assert_allclose(z2, z1[pn], rtol=1e-10, atol=1e-300)


@SETTINGS
@given(method=st.sampled_from(METHODS), k=st.integers(1, 6), n=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_zero_alignments_leave_weights_unchanged(method, k, n, seed):
    rng = np.random.default_rng(seed)
    v = np.zeros((k + n, 2 * (k + n)))
    v[:k, : k + n] = rng.normal(size=(k, k + n))  # domains and tasks live on disjoint coordinates
    v[k:, k + n :] = rng.normal(size=(n, k + n))
    gram = v @ v.T
    assert np.all(gram[:k, k:] == 0.0)
    alpha0, z0 = rng.dirichlet(np.ones(k)), rng.dirichlet(np.ones(n))
    r = build_reweighter(method, k, n, **_init_opts(method, k, alpha0, z0))
    before_alpha, before_z = r.alpha, r.z
    alpha, z = r.update(gram, rng.uniform(1, 5, size=n), PEAK_LR)
    np.testing.assert_allclose(alpha, before_alpha, rtol=1e-13)
    np.testing.assert_allclose(z, before_z, rtol=1e-13)


def _alignment_matrix(v: np.ndarray, k: int) -> np.ndarray:
    return np.array([[float(np.dot(v[i], v[k + j])) for j in range(v.shape[0] - k)] for i in range(k)])


@SETTINGS
@given(method=st.sampled_from(GRAPES), k=st.integers(1, 6), n=st.integers(2, 5), seed=st.integers(0, 2**32 - 1))
def test_least_aligned_task_gains_weight(method, k, n, seed):
    v, losses, alpha0, z0 = _random_case(seed, k, n)
    A = _alignment_matrix(v, k)
    div = np.ones(n) if method == "grape_gap" else losses  # grape_ema's first EMA is the first loss
    a = alpha0 @ (A / div)  # alignment of each task with d = sum_k alpha_k g_k
    assume(np.ptp(a) > 1e-6)
    r = build_reweighter(method, k, n, alpha0=alpha0.tolist(), z0=z0.tolist())
    _, z = r.update(v @ v.T, losses, PEAK_LR)
    worst = int(np.argmin(a))
    assert z[worst] > z0[worst]
    assert int(np.argmax(z / z0)) == worst


@SETTINGS
@given(
    method=st.sampled_from(["doge", "grape", "grape_gap", "grape_ema"]),
    k=st.integers(2, 6),
    n=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_domain_best_aligned_with_weighted_tasks_gains_weight(method, k, n, seed):
    v, losses, alpha0, z0 = _random_case(seed, k, n)
    A = _alignment_matrix(v, k)
    if method == "doge":
        b = A.mean(axis=1)
        r = build_reweighter(method, k, n, alpha0=alpha0.tolist())
    else:
        div = np.ones(n) if method == "grape_gap" else losses
        b = (A / div) @ z0
        r = build_reweighter(method, k, n, alpha0=alpha0.tolist(), z0=z0.tolist())
    assume(np.ptp(b) > 1e-6)
    alpha, _ = r.update(v @ v.T, losses, PEAK_LR)
    best = int(np.argmax(b))
    assert alpha[best] > alpha0[best]
    assert int(np.argmax(alpha / alpha0)) == best


@SETTINGS
@given(method=st.sampled_from(["uniform", "static"]), k=st.integers(1, 6), n=st.integers(1, 5),
       seed=st.integers(0, 2**32 - 1))
def test_uniform_and_static_never_move(method, k, n, seed):
    v, losses, alpha0, _ = _random_case(seed, k, n, max_norm=50.0)
    r = build_reweighter(method, k, n, **_init_opts(method, k, alpha0, None))
    start = r.alpha
    for t in range(3):
        alpha, z = r.update(v @ v.T, losses, 10.0 * t)
        np.testing.assert_array_equal(alpha, start)
        np.testing.assert_array_equal(z, np.full(n, 1.0 / n))
    assert r.history[-1]["eta_alpha"] == 0.0 and r.history[-1]["eta_z"] == 0.0


# ----------------------------------------------------------------------------------------------------
# numerics at the edges
# ----------------------------------------------------------------------------------------------------
def _gram_with_alignment(A: np.ndarray, diag: float = 1.0) -> np.ndarray:
    k, n = A.shape
    g = np.eye(k + n) * diag
    g[:k, k:] = A
    g[k:, :k] = A.T
    return g


def test_exponents_of_1e4_give_finite_weights_and_log_space_keeps_them_recoverable():
    r = build_reweighter("doge", 3, 1, step_size="constant", eta_alpha=1.0)
    alpha, _ = r.update(_gram_with_alignment(np.array([[1e4], [-1e4], [0.0]])), [1.0], None)
    assert np.all(np.isfinite(alpha)) and abs(alpha.sum() - 1) < 1e-15 and alpha[0] == 1.0
    # domain 0 is now penalised by 3e4: domain 2 (down by 1e4 only) must win, not NaN from 0/0
    alpha, _ = r.update(_gram_with_alignment(np.array([[-3e4], [0.0], [0.0]])), [1.0], None)
    assert np.all(np.isfinite(alpha)) and abs(alpha.sum() - 1) < 1e-15 and alpha[2] == 1.0

    g = build_reweighter("grape_gap", 2, 2, step_size="constant", eta_alpha=1.0, eta_z=1.0)
    alpha, z = g.update(_gram_with_alignment(np.array([[2e4, -2e4], [-2e4, 2e4]])), [1.0, 1.0], None)
    assert np.all(np.isfinite(alpha)) and np.all(np.isfinite(z))
    assert abs(alpha.sum() - 1) < 1e-15 and abs(z.sum() - 1) < 1e-15


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("method", ["grape", "grape_ema", "doge"])
def test_non_finite_gram_is_skipped_and_never_poisons_the_weights(method, bad):
    rng = np.random.default_rng(9)
    clean = build_reweighter(method, 4, 3)
    probe = build_reweighter(method, 4, 3)
    grams = [make_vectors(rng, 4, 3) for _ in range(4)]
    losses = [rng.uniform(1, 5, size=3) for _ in range(4)]
    for t, v in enumerate(grams):
        if t == 2:
            broken = v @ v.T
            broken[1, 5] = broken[5, 1] = bad
            before = (probe.alpha, probe.z)
            alpha, z = probe.update(broken, [math.nan, 2.0, 3.0], PEAK_LR, step=t)
            np.testing.assert_array_equal(alpha, before[0])
            np.testing.assert_array_equal(z, before[1])
            rec = probe.history[-1]
            assert "non-finite" in rec["skipped"] and rec["a"] is None and rec["task_losses"][0] is None
            json.dumps(rec, allow_nan=False)
        clean.update(v @ v.T, losses[t], PEAK_LR)
        probe.update(v @ v.T, losses[t], PEAK_LR)
        np.testing.assert_array_equal(probe.alpha, clean.alpha)
        np.testing.assert_array_equal(probe.z, clean.z)
    assert probe.num_skipped == 1 and len(probe.history) == 5


def test_exponent_overflow_is_skipped():
    r = build_reweighter("grape_gap", 2, 2, step_size="constant", eta_alpha=1e10, eta_z=1e10)
    alpha, z = r.update(_gram_with_alignment(np.array([[1e300, 0.0], [0.0, 1e300]]), diag=1e300), [1.0, 1.0], None)
    assert alpha.tolist() == [0.5, 0.5] and z.tolist() == [0.5, 0.5]
    assert "overflow" in r.history[-1]["skipped"]


# ----------------------------------------------------------------------------------------------------
# inputs and errors
# ----------------------------------------------------------------------------------------------------
def test_registry_and_names():
    assert available_methods() == METHODS + ["rnb", "doremi"] + LOSS_METHODS  # rnb, doremi: own test files
    assert set(REWEIGHTERS) == set(METHODS + LOSS_METHODS) | {"rnb", "doremi"}
    assert REWEIGHTERS["doremi"].signal is Signal.training_losses and REWEIGHTERS["doremi"].needs_reference
    assert all(REWEIGHTERS[m].signal is Signal.training_losses for m in LOSS_METHODS)
    assert not any(REWEIGHTERS[m].signal is Signal.training_losses for m in METHODS)
    for name in METHODS + LOSS_METHODS:
        r = build_reweighter(name, 2, 2, **options_for(name, 2))
        assert isinstance(r, Reweighter) and r.method == name and REWEIGHTERS[name].description
    assert build_reweighter("GRAPE-gap", 2, 2).method == "grape_gap"
    assert "seed" in method_options("doge_pcgrad") and "seed" not in method_options("grape")
    with pytest.raises(ValueError, match="unknown reweighting method 'remido'.*grape_ema"):
        build_reweighter("remido", 2, 2)


@pytest.mark.parametrize(
    "name, opts, exc, fragment",
    [
        ("grape", {"mu_alfa": 1e-4}, TypeError, "'mu_alfa' is not an option of method 'grape'"),
        ("grape", {"seed": 1}, TypeError, "does not apply to method 'grape'"),
        ("doge", {"z0": [0.5, 0.5]}, TypeError, "options of 'doge': mu_alpha"),
        ("uniform", {"mu_alpha": 1e-4}, TypeError, "'mu_alpha' does not apply"),
        ("static", {}, ValueError, "needs weights"),
        ("static", {"weights": [0.5, 0.5, 0.0]}, ValueError, "weights has 3 entries but 2"),
        ("static", {"weights": [0.7, 0.7]}, ValueError, "weights sums to 1.4"),
        ("grape", {"alpha0": [1.2, -0.2]}, ValueError, "alpha0 has negative entries"),
        ("grape", {"z0": [0.5]}, ValueError, "z0 has 1 entries but 2"),
        ("grape", {"step_size": "adam"}, ValueError, "step_size must be"),
        ("grape", {"step_size": "constant", "eta_alpha": 1.5}, ValueError, "needs eta_z"),
        ("grape", {"eta_alpha": 1.5}, ValueError, "eta_alpha is used only with step_size='constant'"),
        ("grape", {"step_size": "lr_over_mu", "eta_alpha": 1.5}, ValueError,
         "eta_alpha is only used with step_size='constant'"),
        ("grape", {"step_size": "trust_region", "mu_alpha": 1e-4}, ValueError,
         "mu_alpha is used only with step_size='lr_over_mu'"),
        ("grape", {"step_size": "lr_over_mu", "kl_alpha": 0.1}, ValueError, "kl_alpha is used only with"),
        ("grape", {"kl_z": -0.1}, ValueError, "kl_z must be a finite number >= 0"),
        ("grape", {"step_size": "constant", "mu_alpha": 1e-4, "eta_alpha": 1, "eta_z": 1}, ValueError,
         "mu_alpha is not used"),
        ("grape", {"mu_z": 0.0}, ValueError, "mu_z must be a finite number > 0"),
        ("grape", {"clip_norm": -1.0}, ValueError, "clip_norm"),
        ("grape", {"z_smoothing": 1.5}, ValueError, "z_smoothing must lie in"),
        ("grape_ema", {"ema_beta": 1.0}, ValueError, "ema_beta"),
        ("grape", {"alpha_floor": 0.6}, ValueError, "alpha_floor must lie in"),
        ("doge_pcgrad", {"seed": -1}, ValueError, "seed must be"),
        ("grape", {"history_limit": -1}, ValueError, "history_limit"),
    ],
)
def test_bad_options_are_named(name, opts, exc, fragment):
    with pytest.raises(exc) as info:
        build_reweighter(name, 2, 2, **opts)
    assert fragment in str(info.value)


def _good_gram(k=2, n=2):
    v = make_vectors(np.random.default_rng(0), k, n)
    return v @ v.T


@pytest.mark.parametrize(
    "gram, losses, lr, fragment",
    [
        (np.eye(3), [2.0, 2.0], PEAK_LR, "gram has shape (3, 3), expected (4, 4)"),
        (np.ones((4, 5)), [2.0, 2.0], PEAK_LR, "gram has shape (4, 5)"),
        ("nope", [2.0, 2.0], PEAK_LR, "gram must be a square matrix of numbers"),
        (_good_gram(), [2.0], PEAK_LR, "task_losses has 1 entries, expected num_tasks = 2"),
        (_good_gram(), [2.0, 0.0], PEAK_LR, "task_losses must be finite and > 0"),
        (_good_gram(), [-1.0, 2.0], PEAK_LR, "bad entries at [0]"),
        (_good_gram(), [math.nan, 2.0], PEAK_LR, "task_losses must be finite and > 0"),
        (_good_gram(), [2.0, 2.0], -1e-4, "lr must be a finite number >= 0"),
        (_good_gram(), [2.0, 2.0], math.nan, "lr must be a finite number >= 0"),
        (_good_gram(), [2.0, 2.0], None, "lr is required"),
        (_good_gram() + np.triu(np.ones((4, 4)), 1), [2.0, 2.0], PEAK_LR, "gram is not symmetric"),
        (np.diag([1.0, -1.0, 1.0, 1.0]), [2.0, 2.0], PEAK_LR, "negative diagonal entries at [1]"),
    ],
)
def test_bad_update_inputs_are_named(gram, losses, lr, fragment):
    r = build_reweighter("grape", 2, 2, step_size="lr_over_mu")
    with pytest.raises(ValueError) as info:
        r.update(gram, losses, lr)
    assert fragment in str(info.value)
    assert r.num_updates == 0 and r.history == [] and r.alpha.tolist() == [0.5, 0.5]


def test_tiny_asymmetry_is_tolerated_and_averaged():
    v = make_vectors(np.random.default_rng(1), 3, 2)
    g = v @ v.T
    noisy = g.copy()
    noisy[0, 3] *= 1 + 1e-7
    a = build_reweighter("grape", 3, 2).update(g, [2.0, 3.0], PEAK_LR)
    b = build_reweighter("grape", 3, 2).update(noisy, [2.0, 3.0], PEAK_LR)
    np.testing.assert_allclose(b[0], a[0], rtol=1e-6)


def test_lr_zero_is_a_valid_no_move_step():
    """Warm-up schedules start at lr=0; with eta = lr/mu that is a step of size zero, not an error."""
    r = build_reweighter("grape", 3, 2)
    alpha, z = r.update(_good_gram(3, 2), [2.0, 3.0], 0.0)
    np.testing.assert_allclose(alpha, 1 / 3, rtol=1e-14)
    np.testing.assert_allclose(z, 0.5, rtol=1e-14)


def test_torch_inputs_equal_numpy_inputs():
    torch = pytest.importorskip("torch")
    g = _good_gram(3, 2)
    a = build_reweighter("grape", 3, 2).update(g, [2.0, 3.0], PEAK_LR)
    b = build_reweighter("grape", 3, 2).update(torch.tensor(g), torch.tensor([2.0, 3.0]),
                                               torch.tensor(PEAK_LR, dtype=torch.float64))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    c = build_reweighter("grape", 3, 2).update(torch.tensor(g, dtype=torch.float32), [2.0, 3.0], PEAK_LR)
    np.testing.assert_allclose(c[0], a[0], rtol=1e-5)


def test_returned_arrays_are_copies():
    r = build_reweighter("grape", 3, 2)
    alpha, z = r.update(_good_gram(3, 2), [2.0, 3.0], PEAK_LR)
    alpha[:] = 0.0
    r.alpha[:] = 0.0
    assert abs(r.alpha.sum() - 1.0) < 1e-15 and abs(r.z.sum() - 1.0) < 1e-15


def test_update_one_side_only():
    g = _good_gram(3, 2)
    both = build_reweighter("grape", 3, 2)
    alpha_both, z_both = both.update(g, [2.0, 3.0], PEAK_LR)
    only_alpha = build_reweighter("grape", 3, 2)
    alpha, z = only_alpha.update(g, [2.0, 3.0], PEAK_LR, update_z=False)
    np.testing.assert_array_equal(alpha, alpha_both)  # simultaneous: alpha uses the previous z anyway
    assert z.tolist() == [0.5, 0.5] and only_alpha.history[-1]["eta_z"] == 0.0
    only_z = build_reweighter("grape", 3, 2)
    alpha, z = only_z.update(g, [2.0, 3.0], PEAK_LR, update_alpha=False)
    np.testing.assert_array_equal(z, z_both)
    np.testing.assert_allclose(alpha, 1 / 3, rtol=1e-15)


# ----------------------------------------------------------------------------------------------------
# history and state
# ----------------------------------------------------------------------------------------------------
def test_history_records_every_update_in_json():
    rng = np.random.default_rng(5)
    r = build_reweighter("grape", 3, 2, step_size="lr_over_mu")
    v = make_vectors(rng, 3, 2)
    r.update(v @ v.T, [2.0, 4.0], PEAK_LR, step=100)
    rec = r.history[-1]
    assert set(rec) == {"update", "step", "lr", "alpha", "z", "task_losses", "a", "b", "eta_alpha", "eta_z", "skipped"}
    assert rec["update"] == 0 and rec["step"] == 100 and rec["lr"] == PEAK_LR and rec["skipped"] is None
    assert rec["alpha"] == r.alpha.tolist() and rec["z"] == r.z.tolist() and rec["task_losses"] == [2.0, 4.0]
    assert rec["eta_alpha"] == pytest.approx(1.5) and rec["eta_z"] == pytest.approx(10.0)
    A = _alignment_matrix(v, 3)
    np.testing.assert_allclose(rec["a"], (A / [2.0, 4.0]).T @ np.full(3, 1 / 3), rtol=1e-9)
    np.testing.assert_allclose(rec["b"], (A / [2.0, 4.0]) @ np.full(2, 0.5), rtol=1e-9)
    assert json.loads(json.dumps(r.history, allow_nan=False)) == r.history


def test_history_limit_keeps_the_newest_records():
    r = build_reweighter("grape", 2, 2, history_limit=3)
    for t in range(5):
        r.update(_good_gram(), [2.0, 3.0], PEAK_LR, step=t)
    assert [h["update"] for h in r.history] == [2, 3, 4] and r.history_dropped == 2
    sd = r.state_dict()
    assert len(sd["history"]) == 3 and sd["history_dropped"] == 2


def _sequence(method, k, n, steps, seed=21):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        v = make_vectors(rng, k, n)
        g = v @ v.T
        if t == 1:
            g[0, 0] = math.nan  # a skipped update before the checkpoint, so the PCGrad index must persist
        out.append((g, rng.uniform(1, 6, size=n), cosine_lr(t, steps)))
    return out


ROUND_TRIP_OPTS = {
    "uniform": {},
    "static": {"weights": [0.1, 0.2, 0.3, 0.4]},
    "doge": {"alpha_floor": 0.01, "clip_norm": 1.0},
    "doge_pcgrad": {"seed": 17},
    "grape": {"z_smoothing": 0.001, "history_limit": 4},
    "grape_gap": {"step_size": "constant", "eta_alpha": 1.5, "eta_z": 5.0},
    "grape_ema": {"ema_beta": 0.7},
}


@pytest.mark.parametrize("method", METHODS)
def test_resume_from_json_state_equals_uninterrupted_run(method):
    k, n, steps, cut = 4, 5, 8, 4
    seq = _sequence(method, k, n, steps)
    whole = build_reweighter(method, k, n, **ROUND_TRIP_OPTS[method])
    for g, loss, lr in seq:
        whole.update(g, loss, lr, step=None)

    first = build_reweighter(method, k, n, **ROUND_TRIP_OPTS[method])
    for g, loss, lr in seq[:cut]:
        first.update(g, loss, lr)
    text = json.dumps(first.state_dict(), allow_nan=False)
    second = build_reweighter(method, k, n, **ROUND_TRIP_OPTS[method])
    second.load_state_dict(json.loads(text))
    assert second.alpha.tobytes() == first.alpha.tobytes() and second.z.tobytes() == first.z.tobytes()
    assert second.state_dict() == first.state_dict()
    for g, loss, lr in seq[cut:]:
        second.update(g, loss, lr)
    assert second.alpha.tobytes() == whole.alpha.tobytes()
    assert second.z.tobytes() == whole.z.tobytes()
    assert second.history == whole.history
    assert second.state_dict() == whole.state_dict()
    rebuilt = reweighter_from_state_dict(json.loads(json.dumps(whole.state_dict())))
    assert type(rebuilt) is type(whole) and rebuilt.state_dict() == whole.state_dict()
    if method in MOVING:
        assert whole.num_skipped == 1 and whole.alpha.tolist() != np.full(k, 1 / k).tolist()


def test_state_keeps_zero_weights_and_tiny_weights_exactly():
    r = build_reweighter("doge", 3, 1, alpha0=[0.0, 0.5, 0.5], step_size="constant", eta_alpha=1.0)
    r.update(_gram_with_alignment(np.array([[0.0], [700.0], [0.0]])), [1.0], None)
    assert r.alpha[0] == 0.0 and 0.0 < r.alpha[2] < 1e-300
    sd = json.loads(json.dumps(r.state_dict(), allow_nan=False))
    r2 = build_reweighter("doge", 3, 1, alpha0=[0.0, 0.5, 0.5], step_size="constant", eta_alpha=1.0)
    r2.load_state_dict(sd)
    assert r2.alpha.tobytes() == r.alpha.tobytes()


def test_load_state_dict_checks_what_it_loads():
    r = build_reweighter("grape", 3, 2, step_size="lr_over_mu")
    r.update(_good_gram(3, 2), [2.0, 3.0], PEAK_LR)
    sd = r.state_dict()
    with pytest.raises(ValueError, match="method='grape'.*method='grape_gap'"):
        build_reweighter("grape_gap", 3, 2).load_state_dict(sd)
    with pytest.raises(ValueError, match="num_domains=3.*num_domains=4"):
        build_reweighter("grape", 4, 2).load_state_dict(sd)
    with pytest.raises(ValueError, match="num_tasks=2.*num_tasks=3"):
        build_reweighter("grape", 3, 3).load_state_dict(sd)
    other = build_reweighter("grape", 3, 2, mu_alpha=2e-4)
    with pytest.raises(ValueError, match="mu_alpha: saved 0.0001 vs now 0.0002"):
        other.load_state_dict(sd)
    other.load_state_dict(sd, strict=False)
    assert other.alpha.tobytes() == r.alpha.tobytes() and other.options["mu_alpha"] == 2e-4
    edited = json.loads(json.dumps(sd))
    edited["alpha"][0] += 0.1
    with pytest.raises(ValueError, match="does not match"):
        build_reweighter("grape", 3, 2, step_size="lr_over_mu").load_state_dict(edited)
    with pytest.raises(ValueError, match="step_size: saved 'lr_over_mu' vs now 'trust_region'"):
        build_reweighter("grape", 3, 2).load_state_dict(sd)  # an old (paper-step) state under the new default


# ----------------------------------------------------------------------------------------------------
# options beyond the paper: cosine alignments, Gram EMA, alpha EMA (grape.reweighting.noise)
# ----------------------------------------------------------------------------------------------------
class NoiseReference:
    """The options on explicit vectors: clip, then unit length (cosine); the alignment matrix is the closed
    form sum_s c_s <g_k^s, h_n^s> with c_0 = beta^(t-1), c_s = (1 - beta) beta^(t-1-s) (Gram EMA); alpha
    damped in probability space (alpha EMA)."""

    def __init__(self, method: str, k: int, n: int, **opts):
        self.method, self.k, self.n, self.opts = method, k, n, opts
        self.alpha, self.z = np.full(k, 1.0 / k), np.full(n, 1.0 / n)
        self.past: list[np.ndarray] = []

    def update(self, vectors: np.ndarray, losses: np.ndarray, lr: float):
        k, n, o = self.k, self.n, self.opts
        vecs = [v.copy() for v in vectors]
        if o.get("clip_norm") is not None:
            vecs = [v * min(1.0, o["clip_norm"] / float(np.linalg.norm(v))) for v in vecs]
        if o.get("alignment") == "cosine":
            vecs = [v / float(np.linalg.norm(v)) for v in vecs]
        self.past.append(np.array([[float(np.dot(vecs[i], vecs[k + j])) for j in range(n)] for i in range(k)]))
        beta, t = o.get("gram_ema", 0.0), len(self.past)
        coef = [beta ** (t - 1)] + [(1 - beta) * beta ** (t - 1 - s) for s in range(1, t)]
        A = sum(c * a for c, a in zip(coef, self.past))
        eta_alpha, eta_z = lr / o.get("mu_alpha", 1e-4), lr / o.get("mu_z", 1.5e-5)
        div = losses if self.method == "grape" else np.ones(n)
        if self.method == "doge":
            b, new_z = A.mean(axis=1), self.z
        else:
            a = np.array([sum(self.alpha[i] * A[i, j] for i in range(k)) / div[j] for j in range(n)])
            b = np.array([sum(self.z[j] * A[i, j] / div[j] for j in range(n)) for i in range(k)])
            new_z = self.z * np.exp(-eta_z * a)
            new_z /= new_z.sum()
        step = self.alpha * np.exp(eta_alpha * b)
        step /= step.sum()
        damp = o.get("alpha_ema", 0.0)
        self.alpha, self.z = damp * self.alpha + (1 - damp) * step, new_z
        return self.alpha.copy(), self.z.copy()


NOISE_CASES = {
    "cosine": {"alignment": "cosine"},
    "gram_ema": {"gram_ema": 0.6},
    "alpha_ema": {"alpha_ema": 0.5},
    "all": {"alignment": "cosine", "gram_ema": 0.3, "alpha_ema": 0.2, "clip_norm": 1.0},
}


@pytest.mark.parametrize("case", list(NOISE_CASES))
@pytest.mark.parametrize("method", ["grape", "grape_gap", "doge"])
def test_noise_options_match_slow_computation_and_change_the_result(method, case):
    k, n, steps = 5, 4, 6
    opts = {**NOISE_CASES[case], "mu_alpha": 3e-5, "mu_z": 3e-5} if method != "doge" else \
        {**NOISE_CASES[case], "mu_alpha": 3e-5}
    rng = np.random.default_rng(7)
    ref = NoiseReference(method, k, n, **opts)
    r = build_reweighter(method, k, n, **opts)
    plain = build_reweighter(method, k, n, **{key: v for key, v in opts.items() if key.startswith("mu_")})
    for t in range(steps):
        v = make_vectors(rng, k, n, max_norm=4.0)
        losses = rng.uniform(1.5, 6.0, size=n)
        lr = cosine_lr(t, steps)
        want_alpha, want_z = ref.update(v, losses, lr)
        alpha, z = r.update(v @ v.T, losses, lr)
        plain.update(v @ v.T, losses, lr)
        assert_rel_close(alpha, want_alpha)
        assert_rel_close(z, want_z)
    assert np.max(np.abs(r.alpha - 1.0 / k)) > 1e-3, "alpha never moved: the comparison is vacuous"
    assert np.max(np.abs(r.alpha - plain.alpha)) > 1e-6, "the option did not change the result"


def test_cosine_ignores_gradient_norms():
    rng = np.random.default_rng(3)
    k, n = 4, 3
    a = build_reweighter("grape", k, n, alignment="cosine")
    b = build_reweighter("grape", k, n, alignment="cosine")
    for _ in range(3):
        v = make_vectors(rng, k, n)
        scaled = v * rng.uniform(0.01, 100.0, size=(k + n, 1))  # norm swings of 100x either way
        losses = rng.uniform(1, 5, size=n)
        a.update(v @ v.T, losses, PEAK_LR)
        b.update(scaled @ scaled.T, losses, PEAK_LR)
        assert_rel_close(b.alpha, a.alpha, 1e-12)
        assert_rel_close(b.z, a.z, 1e-12)


def test_zero_gradient_under_cosine_stays_zero():
    v = np.array([[1.0, 0.0], [0.0, 0.0], [3.0, 4.0]])  # domain 1 has a zero gradient
    r = build_reweighter("grape", 2, 1, alignment="cosine")
    r.update(v @ v.T, [2.0], PEAK_LR)
    assert np.all(np.isfinite(r.alpha)) and r.history[-1]["b"][1] == 0.0


@pytest.mark.parametrize("opts, fragment", [
    ({"alignment": "dot"}, "alignment must be 'inner'"),
    ({"gram_ema": 1.0}, "gram_ema must lie in"),
    ({"alpha_ema": -0.1}, "alpha_ema must lie in"),
    ({"gram_ema": "x"}, "gram_ema must be a number"),
])
def test_bad_noise_options_are_named(opts, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_reweighter("grape", 2, 2, **opts)


def test_noise_options_do_not_apply_to_fixed_methods_and_defaults_leave_the_state_as_before():
    with pytest.raises(TypeError, match="does not apply to method 'uniform'"):
        build_reweighter("uniform", 2, 2, gram_ema=0.5)
    for name in ("alignment", "gram_ema", "alpha_ema"):
        assert name in method_options("grape") and name in method_options("doge_pcgrad")
    r = build_reweighter("grape", 2, 2, alignment="inner", gram_ema=0.0, alpha_ema=0.0)
    sd = r.state_dict()  # defaults are not stored: checkpoints of earlier versions compare equal
    assert not {"alignment", "gram_ema", "alpha_ema"} & set(sd["options"]) and "gram_ema" not in sd
    assert sd == build_reweighter("grape", 2, 2).state_dict()


@pytest.mark.parametrize("method", ["grape", "grape_ema", "doge_pcgrad"])
def test_resume_with_noise_options_equals_uninterrupted_run(method):
    k, n, steps, cut = 4, 3, 7, 3
    opts = {"alignment": "cosine", "gram_ema": 0.7, "alpha_ema": 0.4, "mu_alpha": 5e-5}
    seq = _sequence(method, k, n, steps)
    whole = build_reweighter(method, k, n, **opts)
    for g, loss, lr in seq:
        whole.update(g, loss, lr)
    first = build_reweighter(method, k, n, **opts)
    for g, loss, lr in seq[:cut]:
        first.update(g, loss, lr)
    sd = json.loads(json.dumps(first.state_dict(), allow_nan=False))
    assert sd["gram_ema"] is not None and sd["options"]["gram_ema"] == 0.7
    second = build_reweighter(method, k, n, **opts)
    second.load_state_dict(sd)
    for g, loss, lr in seq[cut:]:
        second.update(g, loss, lr)
    assert second.alpha.tobytes() == whole.alpha.tobytes() and second.z.tobytes() == whole.z.tobytes()
    assert second.state_dict() == whole.state_dict()
    with pytest.raises(ValueError, match="gram_ema: saved 0.7 vs now None"):
        build_reweighter(method, k, n, **{**opts, "gram_ema": 0.0}).load_state_dict(sd)


def test_preview_equals_the_next_update_and_changes_nothing():
    rng = np.random.default_rng(5)
    r = build_reweighter("grape", 3, 2, gram_ema=0.5, alpha_ema=0.3)
    v = make_vectors(rng, 3, 2)
    r.update(v @ v.T, [2.0, 3.0], PEAK_LR)
    before = r.state_dict()
    v = make_vectors(rng, 3, 2)
    fresh = build_reweighter("grape", 3, 2)
    fresh.load_state_dict({**before, "options": fresh.options, "gram_ema": None}, strict=False)
    a, b = r.preview(v @ v.T, [2.5, 1.5])
    assert r.state_dict() == before
    fresh.update(v @ v.T, [2.5, 1.5], PEAK_LR)  # no EMA: preview measures this probe alone
    assert_rel_close(a, np.array(fresh.history[-1]["a"]))
    assert_rel_close(b, np.array(fresh.history[-1]["b"]))
