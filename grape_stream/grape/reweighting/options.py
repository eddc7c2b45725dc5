"""Each reweighting method's options as a dataclass that checks itself, and the checks they share.

A method class names its options dataclass (``Reweighter.Options``); its fields are the options the
method accepts, in one place: the registry derives every list from them (``method_options``,
``all_options``, the recipe's ``algorithm.options`` check). :meth:`ReweighterOptions.resolve` checks the
values and fills the defaults into the JSON-serialisable dict a reweighter keeps in its state: a resumed
run compares it with the saved one (a different mu is a different experiment). Adding an option to a
method is one field (and its check in ``resolve``) in its dataclass.

The classes here are shared: :class:`ReweighterOptions` (every method), :class:`NoiseOptions` (the noise
controls beyond the paper, grape.reweighting.noise) and :class:`StepOptions` (methods that move alpha by
an exponentiated-gradient step). The method files add theirs (``GrapeOptions``, ``StaticOptions``, ...).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from grape_stream.config import PAPER_MU_ALPHA, PAPER_MU_Z  # the one statement of the paper's defaults
from grape_stream.errors import ConfigError
from grape_stream.grape.reweighting.noise import ALIGNMENTS
from grape_stream.grape.reweighting.step_rule import DEFAULT_KL, KL_SCHEDULES, STEP_SIZES
from grape_stream.simplex import check_simplex

__all__ = [
    "PAPER_MU_ALPHA",
    "PAPER_MU_Z",
    "STEP_SIZES",
    "NoiseOptions",
    "ReweighterOptions",
    "StepOptions",
    "option_names",
    "positive_int",
    "real",
    "resolve_history_limit",
]



def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def real(value: Any, name: str) -> float:
    """float(value), refusing bools and non-numbers with a message that names the option."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None


def resolve_history_limit(limit: Any) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0:
        raise ConfigError(f"history_limit must be None (keep all) or an integer >= 0, got {limit!r}")
    return int(limit)


def _beta(value: Any, name: str, what: str) -> float:
    beta = real(value, name)
    if not (math.isfinite(beta) and 0.0 <= beta < 1.0):
        raise ConfigError(f"{name} must lie in [0, 1){what}, got {beta!r}")
    return beta


def option_names(cls: type) -> tuple[str, ...]:
    """The fields of an options dataclass, the most specific class's own first (what an error lists)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    out: list[str] = []
    for klass in cls.__mro__:
        out.extend(n for n in vars(klass).get("__annotations__", {}) if n in fields and n not in out)
    return tuple(out)


@dataclass
class ReweighterOptions:
    """The options of every method (uniform takes only these)."""

    history_limit: Optional[int] = None  # update records kept in ``history`` (None: all)

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        """Checked values with the defaults filled in: the dict a reweighter keeps in its state."""
        return {"history_limit": resolve_history_limit(self.history_limit)}


@dataclass
class NoiseOptions:
    """Noise controls beyond the paper, off by default (grape.reweighting.noise): ``alignment="cosine"``
    (unit-length gradients), ``gram_ema`` (an EMA of the Gram), ``alpha_ema`` (a damped alpha step)."""

    alignment: str = "inner"
    gram_ema: float = 0.0
    alpha_ema: float = 0.0

    def resolve_noise(self) -> dict[str, Any]:
        """Only the values that differ from the default (paper): checkpoints written before these options
        existed still load strictly."""
        out: dict[str, Any] = {}
        if self.alignment not in ALIGNMENTS:
            raise ConfigError(
                f"alignment must be 'inner' (paper) or 'cosine' (unit-length gradients), got {self.alignment!r}")
        if self.alignment != "inner":
            out["alignment"] = self.alignment
        for name in ("gram_ema", "alpha_ema"):
            beta = _beta(getattr(self, name), name, " (0: off, the paper)")
            if beta > 0.0:
                out[name] = beta
        return out


@dataclass
class StepOptions(NoiseOptions, ReweighterOptions):
    """The options of a method that moves alpha (DoGE) by a log-space step; :class:`GrapeOptions` adds z's."""

    #: the weights this method moves; each has a ``kl_<side>``, a ``mu_<side>`` and an ``eta_<side>``
    sides: ClassVar[tuple[str, ...]] = ("alpha",)

    # the step rule (grape.reweighting.step_rule): "trust_region" (the default: a KL divergence per update),
    # "lr_over_mu" (the paper: eta = lr / mu; chosen when mu is given and step_size is not) or "constant"
    # (eta given: the authors' code). None (step_size): unset, resolved by that rule.
    mu_alpha: Optional[float] = None  # step_size="lr_over_mu" only: eta_alpha = lr / mu_alpha (None: PAPER_MU_ALPHA)
    step_size: Optional[str] = None
    eta_alpha: Optional[float] = None  # step_size="constant" only
    kl_alpha: Optional[float] = None  # step_size="trust_region" only: KL per update at peak lr (None: 0.02)
    # step_size="trust_region" only: "lr" (None, the default: the KL per update scales with lr / peak lr) or
    # "constant" (the full kl_* at every update, however far the learning rate has decayed)
    kl_schedule: Optional[str] = None
    clip_norm: Optional[float] = None  # clip every probe gradient to this norm (None: no clipping)
    alpha0: Optional[list[float]] = None  # initial domain weights (None: uniform)
    alpha_floor: float = 0.0  # no domain weight below this (<= 1/K)

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        step_size = self.resolved_step_size()
        out: dict[str, Any] = {"step_size": step_size}
        for side in self.sides:
            if step_size == "trust_region":
                out[f"kl_{side}"] = self._side_kl(side)
            else:
                out[f"mu_{side}"], out[f"eta_{side}"] = self._side_step(side, step_size)
        if self.kl_schedule is not None:
            if self.kl_schedule not in KL_SCHEDULES:
                raise ConfigError(f"kl_schedule must be 'lr' (the default: the KL per update scales with lr / peak lr) "
                                  f"or 'constant' (the full KL at every update), got {self.kl_schedule!r}")
            if step_size != "trust_region":
                raise ConfigError(f"kl_schedule is used only with step_size='trust_region', not {step_size!r}")
            if self.kl_schedule != KL_SCHEDULES[0]:  # only a non-default value: older checkpoints load strictly
                out["kl_schedule"] = self.kl_schedule
        clip = self.clip_norm
        if clip is not None:
            clip = real(clip, "clip_norm")
            if not (math.isfinite(clip) and clip > 0):
                raise ConfigError(f"clip_norm must be None (no clipping) or a finite number > 0, got {clip!r}")
        out["clip_norm"] = clip
        if isinstance(self.alpha0, str):  # a recipe's named prior reaches here only outside a recipe run
            raise ConfigError(f"alpha0={self.alpha0!r} names a prior that a recipe run computes from its data "
                              "(grape-stream train, or integrations.composer.build); elsewhere compute it with "
                              "grape_stream.mixture.prior.crisp_prior(...) and pass its 'weights' as alpha0")
        out["alpha0"] = None if self.alpha0 is None else check_simplex(self.alpha0, "alpha0", num_domains).tolist()
        floor = real(self.alpha_floor, "alpha_floor")
        if not (0.0 <= floor <= 1.0 / num_domains):
            raise ConfigError(
                f"alpha_floor must lie in [0, 1/num_domains] = [0, {1.0 / num_domains!r}], got {floor!r}")
        out["alpha_floor"] = floor
        out.update(self.resolve_noise())
        out.update(ReweighterOptions.resolve(self, num_domains, num_tasks))
        return out

    def resolved_step_size(self) -> str:
        """The step rule: ``step_size`` if given; unset, giving mu (the paper's knob) asks for the paper's step
        (lr_over_mu), otherwise the trust region (the default)."""
        if self.step_size is None:
            given_mu = any(getattr(self, f"mu_{side}") is not None for side in self.sides)
            return "lr_over_mu" if given_mu else STEP_SIZES[0]
        if self.step_size not in STEP_SIZES:
            raise ConfigError(f"step_size must be 'trust_region' (default: a KL divergence per update), "
                              f"'lr_over_mu' (paper) or 'constant' (authors' code), got {self.step_size!r}")
        return self.step_size

    def _side_kl(self, side: str) -> float:
        """kl_<side> of step_size='trust_region' (mu and eta belong to the other rules)."""
        for other in (f"mu_{side}", f"eta_{side}"):
            if getattr(self, other) is not None:
                rule = "lr_over_mu" if other.startswith("mu") else "constant"
                raise ConfigError(
                    f"{other} is used only with step_size='{rule}'; step_size='trust_region' sizes each "
                    f"update by kl_{side} (a KL divergence per update, default {DEFAULT_KL[side]}); set "
                    f"step_size='{rule}' for {'the paper' if rule == 'lr_over_mu' else 'the authors'}'s step"
                )
        given = getattr(self, f"kl_{side}")
        kl = DEFAULT_KL[side] if given is None else real(given, f"kl_{side}")
        if not (math.isfinite(kl) and kl >= 0):
            raise ConfigError(f"kl_{side} must be a finite number >= 0 (nats per update), got {kl!r}")
        return kl

    def _side_step(self, side: str, step_size: str) -> tuple[float | None, float | None]:
        """(mu, eta) of one side: exactly one of them is set, the one `step_size` uses."""
        if getattr(self, f"kl_{side}") is not None:
            raise ConfigError(f"kl_{side} is used only with step_size='trust_region', not {step_size!r}")
        mu, eta = getattr(self, f"mu_{side}"), getattr(self, f"eta_{side}")
        if step_size == "lr_over_mu":
            if eta is not None:
                raise ConfigError(f"eta_{side} is only used with step_size='constant'; with 'lr_over_mu' the step is "
                                  f"lr / mu_{side}")
            mu = {"alpha": PAPER_MU_ALPHA, "z": PAPER_MU_Z}[side] if mu is None else real(mu, f"mu_{side}")
            if not (math.isfinite(mu) and mu > 0):
                raise ConfigError(f"mu_{side} must be a finite number > 0, got {mu!r}")
            return mu, None
        if mu is not None:
            raise ConfigError(f"mu_{side} is not used with step_size='constant'; give eta_{side} instead")
        if eta is None:
            raise ConfigError(
                f"step_size='constant' needs eta_{side} (the paper's peak value is lr/mu: "
                f"eta_alpha=1.5, eta_z=10; the authors' ClimbLab configs use eta_alpha=1.5, eta_z=5.0)"
            )
        eta = real(eta, f"eta_{side}")
        if not (math.isfinite(eta) and eta >= 0):
            raise ConfigError(f"eta_{side} must be a finite number >= 0, got {eta!r}")
        return None, eta
