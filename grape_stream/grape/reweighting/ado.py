"""ADO (Jiang, Zhou, Feng, Malladi, Kolter 2025, "Adaptive Data Optimization: Dynamic Sample Selection
with Scaling Laws").

Each domain's training loss is fitted, as a function of the samples of that domain seen so far, by a power
law L_k(n) = eps_k + beta_k n^(-a_k) (grape.reweighting.ado_fit), refitted every ``fit_every`` steps; the
domain's learning speed is the fit's -dL_k/dn at its current n_k. The preference rho_k is proportional to
prior_k * credit_k * speed_k, floored at ``min_prob``; the policy mixes the running average of past
preferences with the newest: pi = gamma2 * pi_bar + (1 - gamma2) * rho. Before ``warmup_steps`` (and until
a first fit exists) the policy is the prior. No probe: updates read the training losses
(grape.reweighting.from_losses). docs/reweighting.md ("ADO") has the equations and the choices.
:func:`ado_step` is the update as a pure function; :class:`AdoReweighter` holds its state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.reweighting.ado_fit import Bins, PowerLaw, add_point, fit_power_law
from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.from_losses import DomainLosses
from grape_stream.grape.reweighting.options import ReweighterOptions, positive_int, real
from grape_stream.grape.reweighting.registry import register
from grape_stream.simplex import check_simplex

__all__ = ["CREDITS", "AdoOptions", "AdoReweighter", "AdoState", "ado_preference", "ado_step"]

#: credit assignment lambda_k from h_k (the smoothed fraction of domain k in the batches): "h": h^s (the
#: paper's text), "h(1-h)": (h (1 - h))^s (the authors' code).
CREDITS = ("h", "h(1-h)")


@dataclass(frozen=True)
class AdoState:
    """Everything an ADO update reads besides its options (plain values; :meth:`to_json` is exact)."""

    steps_seen: int
    n_seen: np.ndarray  # samples of each domain trained on so far
    h: np.ndarray  # EMA (gamma1) of each domain's fraction of the samples trained on
    pi_bar: np.ndarray  # running average of the preferences (the prior until the first fit)
    bins: tuple[Bins, ...]
    fits: tuple[Optional[PowerLaw], ...]
    last_fit: Optional[int]  # the step of the last refit (None: no fit yet)

    @classmethod
    def fresh(cls, prior: np.ndarray) -> "AdoState":
        k = prior.shape[0]
        return cls(0, np.zeros(k), prior.copy(), prior.copy(), (Bins(),) * k, (None,) * k, None)

    def to_json(self) -> dict[str, Any]:
        return {"steps_seen": self.steps_seen, "n_seen": self.n_seen.tolist(), "h": self.h.tolist(),
                "pi_bar": self.pi_bar.tolist(), "bins": [b.to_json() for b in self.bins],
                "fits": [None if f is None else f.to_json() for f in self.fits], "last_fit": self.last_fit}

    @classmethod
    def from_json(cls, state: Mapping[str, Any], k: int) -> "AdoState":
        n_seen, h, pi_bar = (np.array(state[key], dtype=np.float64) for key in ("n_seen", "h", "pi_bar"))
        if any(v.shape != (k,) or not np.all(np.isfinite(v)) for v in (n_seen, h, pi_bar)):
            raise ValueError(f"state_dict['method_state'] of ado must hold {k} finite n_seen, h and pi_bar")
        bins = tuple(Bins.from_json(b) for b in state["bins"])
        fits = tuple(None if f is None else PowerLaw.from_json(f) for f in state["fits"])
        if len(bins) != k or len(fits) != k:
            raise ValueError(f"state_dict['method_state'] of ado must hold {k} loss histories and fits")
        last = state.get("last_fit")
        return cls(int(state["steps_seen"]), n_seen, h, pi_bar, bins, fits, None if last is None else int(last))


def ado_preference(fits: tuple[Optional[PowerLaw], ...], n_seen: np.ndarray, h: np.ndarray, prior: np.ndarray,
                   credit: str, power: float, min_prob: float) -> Optional[np.ndarray]:
    """rho_k proportional to prior_k * lambda_k * (-dL_k/dn)(n_k), then floored at ``min_prob``.

    lambda_k = h_k^s ("h") or (h_k (1 - h_k))^s ("h(1-h)"). A domain without a fit (too few points) or not
    yet sampled gets the median speed of the fitted ones. The floor is the authors' code's:
    rho <- max(rho, min_prob) / sum(max(rho, min_prob)). None when no speed is positive (no preference).
    """
    speed = np.array([np.nan if f is None or n <= 0 else f.speed(float(n)) for f, n in zip(fits, n_seen)])
    known = np.isfinite(speed)
    if not np.any(known):
        return None
    speed = np.where(known, speed, float(np.median(speed[known])))
    lam = (h if credit == "h" else h * (1.0 - h)) ** power
    raw = prior * lam * speed
    total = float(raw.sum())
    if not (math.isfinite(total) and total > 0):
        return None
    clipped = np.maximum(raw / total, min_prob)
    return clipped / clipped.sum()


def ado_step(state: AdoState, losses: DomainLosses, o: Mapping[str, Any],
             prior: np.ndarray) -> tuple[AdoState, np.ndarray, Optional[np.ndarray]]:
    """One ADO update, a pure function: (the state after it, the policy for the next steps, rho or None).

    With m = ``losses.steps`` steps to t: n_k += samples_k; h <- gamma1^m h + (1 - gamma1^m) c (c: the
    interval's sample fractions; the per-step EMA with c held over the m steps); a seen domain's point
    (n_k, L_k) joins its history once t > ignore_steps; at t >= warmup_steps, every fit_every steps, the
    power laws are refitted (a domain whose new fit fails keeps its old one). With a fit: pi = gamma2 pi_bar
    + (1 - gamma2) rho, then pi_bar <- ((t - m + 1) pi_bar + m rho) / (t + 1) (the running mean of the
    prior and the per-step preferences). Without: pi = the prior.
    """
    m = int(losses.steps)
    t = state.steps_seen + m
    samples = np.asarray(losses.samples, dtype=np.float64)
    n_seen = state.n_seen + samples
    h = state.h
    if samples.sum() > 0:
        decay = o["gamma1"] ** m
        h = decay * h + (1.0 - decay) * samples / samples.sum()
    bins = state.bins
    if t > o["ignore_steps"]:
        bins = tuple(add_point(b, n_seen[k], losses.loss[k], o["bins_per_decade"]) if losses.seen[k] else b
                     for k, b in enumerate(bins))
    fits, last_fit = state.fits, state.last_fit
    if t >= o["warmup_steps"] and (last_fit is None or t - last_fit >= o["fit_every"]):
        fits = tuple(fit_power_law(b) or old for b, old in zip(bins, fits))
        last_fit = t if any(f is not None for f in fits) else None
    rho = None if t < o["warmup_steps"] else ado_preference(
        fits, n_seen, h, prior, o["credit"], o["credit_power"], o["min_prob"])
    pi_bar = state.pi_bar
    if rho is None:
        policy = prior.copy()
    else:
        policy = o["gamma2"] * pi_bar + (1.0 - o["gamma2"]) * rho
        pi_bar = ((t - m + 1) * pi_bar + m * rho) / (t + 1)
    new = AdoState(t, n_seen, h, pi_bar, bins, fits, last_fit)
    return new, policy, rho


@dataclass
class AdoOptions(ReweighterOptions):
    """ADO's hyperparameters (Algorithm 1's prior, t_warmup, t_update, gamma1, gamma2, s, delta_min) and the
    history bound. Defaults: the authors' Pile configuration (for runs of 10^4+ steps; see docs/reweighting.md
    for short runs)."""

    prior: Optional[list[float]] = None  # mu: K weights > 0 summing to 1 (None: uniform); the policy until warm-up ends
    warmup_steps: int = 1000  # t_warmup: no fit (policy = prior) before this step
    fit_every: int = 1000  # t_update: steps between refits of the power laws
    ignore_steps: int = 1000  # losses of steps up to this one never enter a fit (the early, non-power-law part)
    gamma1: float = 0.9  # the EMA of the sampled fractions h that credit assignment reads
    gamma2: float = 0.9  # pi = gamma2 * pi_bar + (1 - gamma2) * rho
    credit_power: float = 0.5  # s in lambda = h^s
    credit: str = "h"  # "h": lambda = h^s (paper); "h(1-h)": (h (1 - h))^s (authors' code)
    min_prob: float = 0.01  # delta_min: each preference floored here (<= 1/K)
    bins_per_decade: int = 20  # loss-history bins per factor 10 of n (points in one bin are averaged)

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        out = super().resolve(num_domains, num_tasks)
        prior = None if self.prior is None else check_simplex(self.prior, "prior", num_domains)
        if prior is not None and np.any(prior <= 0):
            raise ConfigError("prior must give every domain a weight > 0 (ADO's preference is proportional to it)")
        out["prior"] = None if prior is None else prior.tolist()
        out["alpha0"] = out["prior"]
        for name in ("warmup_steps", "fit_every", "bins_per_decade"):
            out[name] = positive_int(getattr(self, name), name)
        ignore = self.ignore_steps
        if isinstance(ignore, bool) or not isinstance(ignore, (int, np.integer)) or ignore < 0:
            raise ConfigError(f"ignore_steps must be an integer >= 0, got {ignore!r}")
        out["ignore_steps"] = int(ignore)
        for name, low, high in (("gamma1", 0.0, 1.0), ("gamma2", 0.0, 1.0), ("credit_power", 0.0, math.inf)):
            value = real(getattr(self, name), name)
            if not (math.isfinite(value) and low <= value and (value < high or high == math.inf)):
                raise ConfigError(f"{name} must lie in [{low}, {high}), got {value!r}")
            out[name] = value
        if self.credit not in CREDITS:
            raise ConfigError(f"credit must be one of {', '.join(map(repr, CREDITS))}, got {self.credit!r}")
        out["credit"] = self.credit
        floor = real(self.min_prob, "min_prob")
        if not (0.0 <= floor <= 1.0 / num_domains):
            raise ConfigError(f"min_prob must lie in [0, 1/num_domains] = [0, {1.0 / num_domains!r}], got {floor!r}")
        out["min_prob"] = floor
        return out


@register
class AdoReweighter(Reweighter):
    method = "ado"
    description = "ADO (Jiang et al. 2025): per-domain power-law fits of the training loss, weight by learning speed"
    Options = AdoOptions
    moves_alpha = True
    signal = Signal.training_losses

    _state: AdoState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load_method_state(None)

    @property
    def options(self) -> dict[str, Any]:
        opts = super().options
        opts.pop("alpha0", None)
        return opts

    @property
    def fits(self) -> list[Optional[PowerLaw]]:
        """The current power-law fit of each domain (None: none yet)."""
        return list(self._state.fits)

    def _prior(self) -> np.ndarray:
        prior = self._options["prior"]
        return np.full(self.num_domains, 1.0 / self.num_domains) if prior is None else np.array(prior, dtype=np.float64)

    def _loss_step(self, losses: DomainLosses, lr: float | None,
                   index: int) -> tuple[np.ndarray, np.ndarray | None, float]:
        self._state, policy, rho = ado_step(self._state, losses, self._options, self._prior())
        with np.errstate(divide="ignore"):  # a zero weight (min_prob=0) is an exact -inf log-weight
            log_policy = np.log(policy)
        return log_policy, rho, 0.0 if rho is None else 1.0 - self._options["gamma2"]

    def _method_state(self) -> Optional[dict[str, Any]]:
        return self._state.to_json()

    def _load_method_state(self, state: Optional[Mapping[str, Any]]) -> None:
        self._state = AdoState.fresh(self._prior()) if state is None else AdoState.from_json(state, self.num_domains)

