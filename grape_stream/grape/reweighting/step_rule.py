"""How big one reweighting step is: the step-size rules, as pure functions.

``trust_region`` (the default): each update moves the weights by a fixed Kullback-Leibler divergence,
KL(w_new || w_old) = ``kl`` x (lr_t / the peak lr seen so far), in the direction the method's exponents give.
Why: with the paper's eta = lr / mu the step is eta x (an inner product of gradients), whose scale swings by
10-100x between models, corpora, gradient norms and training phases (docs/results.md: "there is no good eta";
the demo's hand-tuned eta collapsed or froze alpha elsewhere). A divergence per update is stated in units a
user can reason about ("each update may shift at most this much of the mixture"; KL 0.02 is a total-variation
move of about 0.1 at most), does not depend on the gradients' scale at all, and is the classical trust region
of mirror descent with the entropy (the exponentiated-gradient family w_eta ~ w exp(eta s) is exactly the
KL-geodesic, so the size and the direction separate cleanly). The lr factor keeps the paper's coupling to
the schedule: steps shrink as the learning rate decays (warm-up counts as peak).

``kl_schedule`` (trust_region only) says whether that lr factor applies: ``lr`` (the default, above) or
``constant`` (every update may move the full ``kl``). Why the second: under a cosine schedule most of the
trust region's budget is spent in the first half of the run, so a target that z only recognises as lagging late
can no longer pull alpha towards it (docs/results.md, "The worst target": 82% of alpha's movement was spent
before z settled on the worst target).

``lr_over_mu`` (the paper) and ``constant`` (the authors' released code) give eta directly.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from grape_stream.simplex import logsumexp

__all__ = ["STEP_SIZES", "KL_SCHEDULES", "DEFAULT_KL", "kl_of_step", "trust_region_eta", "side_eta"]

#: "trust_region": a KL divergence per update (default); "lr_over_mu": the paper's eta = lr / mu; "constant":
#: the authors' released code, eta given directly.
STEP_SIZES = ("trust_region", "lr_over_mu", "constant")
#: trust_region's divergence per update: "lr" (kl x lr_t / peak lr, the default) or "constant" (kl at every update)
KL_SCHEDULES = ("lr", "constant")
#: KL per update at peak lr (nats). z (N tasks) may move faster than alpha, as in the paper (eta_z > eta_alpha).
DEFAULT_KL = {"alpha": 0.02, "z": 0.04}
_BISECTIONS = 80


def kl_of_step(log_w: np.ndarray, s: np.ndarray, eta: float) -> float:
    """KL(w_eta || w) for w_eta ~ w exp(eta s): eta E_{w_eta}[s] - log E_w[exp(eta s)] (>= 0, rising in eta)."""
    if eta <= 0.0:
        return 0.0
    live = np.isfinite(log_w)
    lw, ss = log_w[live], s[live]
    log_norm = logsumexp(lw + eta * ss)
    p_new = np.exp(lw + eta * ss - log_norm)
    return max(float(eta * np.dot(p_new, ss) - log_norm), 0.0)


def trust_region_eta(log_w: np.ndarray, s: np.ndarray, kl: float) -> float:
    """The eta >= 0 with KL(w exp(eta s) / Z || w) = ``kl``; 0 when s is constant on w's support or kl is 0.

    If even an infinite step (all weight on argmax s) stays within ``kl``, the step that moves (1 - 1e-6) of
    the way there in divergence is taken instead of an infinite eta. Deterministic bisection in log eta.
    """
    log_w = np.asarray(log_w, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    order = np.lexsort((log_w, s))  # a canonical summation order: the same eta for any order of the domains
    log_w, s = log_w[order], s[order]
    live = np.isfinite(log_w)
    if kl <= 0.0 or not np.all(np.isfinite(s[live])):
        return 0.0
    w = np.exp(log_w[live] - logsumexp(log_w[live]))
    centred = s[live] - float(np.dot(w, s[live]))
    var = float(np.dot(w, centred ** 2))
    scale = float(np.max(np.abs(centred)))
    if not var > 0.0 or not scale > 0.0 or var <= 1e-24 * scale * scale:
        return 0.0
    top = float(np.max(s[live]))
    lw, ss = log_w[live] - logsumexp(log_w[live]), s[live]
    on_top = ss >= top
    kl_max = -logsumexp(lw[on_top])  # -log w(argmax set): the divergence of an infinite step
    if kl >= kl_max * (1.0 - 1e-6):
        # Saturated: the KL barely changes with eta there (ill-conditioned); take the step that keeps 1e-6 of the
        # mass now off the argmax set instead, an equation in log-mass that stays well-conditioned.
        return _saturated_eta(lw, ss, on_top)
    target = kl
    lo, hi = 0.0, math.sqrt(2.0 * target / var)  # the small-step estimate: KL ~ eta^2 Var_w(s) / 2
    while kl_of_step(log_w, s, hi) < target:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:
            return lo
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi) if lo == 0.0 else math.sqrt(lo * hi)
        if kl_of_step(log_w, s, mid) < target:
            lo = mid
        else:
            hi = mid
    return hi


def _off_top_log_mass(lw: np.ndarray, s: np.ndarray, on_top: np.ndarray, eta: float) -> float:
    return logsumexp(lw[~on_top] + eta * s[~on_top]) - logsumexp(lw + eta * s)


def _saturated_eta(lw: np.ndarray, s: np.ndarray, on_top: np.ndarray) -> float:
    """The eta at which the mass off the argmax set is 1e-6 of what it is now (lw normalised)."""
    if on_top.all():
        return 0.0
    target = logsumexp(lw[~on_top]) + math.log(1e-6)
    lo, hi = 0.0, 1.0 / max(float(np.max(s) - np.max(s[~on_top])), 1e-300)
    while _off_top_log_mass(lw, s, on_top, hi) > target:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:
            return lo
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi) if lo == 0.0 else math.sqrt(lo * hi)
        if _off_top_log_mass(lw, s, on_top, mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


def side_eta(options: Mapping[str, object], side: str, lr: float | None, lr_peak: float | None,
             log_w: np.ndarray, direction: np.ndarray | None) -> float:
    """eta of one side (``alpha`` or ``z``) under the options' step rule; ``direction`` is the exponent vector."""
    rule = options["step_size"]
    if rule == "constant":
        return float(options[f"eta_{side}"])  # type: ignore[arg-type]
    if rule == "lr_over_mu":
        if lr is None:
            raise ValueError("lr is required with step_size='lr_over_mu' (eta = lr / mu)")
        return float(lr) / float(options[f"mu_{side}"])  # type: ignore[arg-type]
    if direction is None:
        return 0.0
    # the full kl under kl_schedule "constant", or when the caller has no schedule (lr None); lr 0: no step, as
    # under the paper's rule
    if lr is None or options.get("kl_schedule") == "constant":
        share = 1.0
    else:
        share = min(float(lr) / float(lr_peak), 1.0) if lr_peak else 0.0
    return trust_region_eta(log_w, direction, float(options[f"kl_{side}"]) * share)  # type: ignore[arg-type]
