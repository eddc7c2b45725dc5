"""Option checks shared by the reweighting methods, and the paper's defaults (stated here only).

Options are resolved once, at construction, into a JSON-serialisable dict that goes into the state:
a resumed run compares it with the saved one (a different mu is a different experiment).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from grape_stream.config import PAPER_MU_ALPHA, PAPER_MU_Z  # the one statement of the paper's defaults
from grape_stream.grape.reweighting.step_rule import DEFAULT_KL, STEP_SIZES
from grape_stream.simplex import check_simplex

__all__ = [
    "PAPER_MU_ALPHA",
    "PAPER_MU_Z",
    "STEP_SIZES",
    "positive_int",
    "real",
    "resolve_history_limit",
    "resolve_step_options",
]



def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def real(value: Any, name: str) -> float:
    """float(value), refusing bools and non-numbers with a message that names the option."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def resolve_history_limit(limit: Any) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0:
        raise ValueError(f"history_limit must be None (keep all) or an integer >= 0, got {limit!r}")
    return int(limit)


def _side_kl(opts: dict[str, Any], side: str) -> float:
    """kl_<side> of step_size='trust_region' (mu and eta belong to the other rules)."""
    for other in (f"mu_{side}", f"eta_{side}"):
        if opts.pop(other, None) is not None:
            rule = "lr_over_mu" if other.startswith("mu") else "constant"
            raise ValueError(
                f"{other} is used only with step_size='{rule}'; step_size='trust_region' sizes each "
                f"update by kl_{side} (a KL divergence per update, default {DEFAULT_KL[side]}); set "
                f"step_size='{rule}' for {'the paper' if rule == 'lr_over_mu' else 'the authors'}'s step"
            )
    kl = real(opts.pop(f"kl_{side}", DEFAULT_KL[side]), f"kl_{side}")
    if not (math.isfinite(kl) and kl >= 0):
        raise ValueError(f"kl_{side} must be a finite number >= 0 (nats per update), got {kl!r}")
    return kl


def _side_step(opts: dict[str, Any], side: str, step_size: str) -> tuple[float | None, float | None]:
    """(mu, eta) of one side: exactly one of them is set, the one `step_size` uses."""
    defaults = {"alpha": PAPER_MU_ALPHA, "z": PAPER_MU_Z}
    if opts.pop(f"kl_{side}", None) is not None:
        raise ValueError(f"kl_{side} is used only with step_size='trust_region', not {step_size!r}")
    mu, eta = opts.pop(f"mu_{side}", None), opts.pop(f"eta_{side}", None)
    if step_size == "lr_over_mu":
        if eta is not None:
            raise ValueError(
                f"eta_{side} is only used with step_size='constant'; with 'lr_over_mu' the step is lr / mu_{side}"
            )
        mu = defaults[side] if mu is None else real(mu, f"mu_{side}")
        if not (math.isfinite(mu) and mu > 0):
            raise ValueError(f"mu_{side} must be a finite number > 0, got {mu!r}")
        return mu, None
    if mu is not None:
        raise ValueError(f"mu_{side} is not used with step_size='constant'; give eta_{side} instead")
    if eta is None:
        raise ValueError(
            f"step_size='constant' needs eta_{side} (the paper's peak value is lr/mu: "
            f"eta_alpha=1.5, eta_z=10; the authors' ClimbLab configs use eta_alpha=1.5, eta_z=5.0)"
        )
    eta = real(eta, f"eta_{side}")
    if not (math.isfinite(eta) and eta >= 0):
        raise ValueError(f"eta_{side} must be a finite number >= 0, got {eta!r}")
    return None, eta


def resolve_step_options(opts: dict[str, Any], sides: tuple[str, ...], num_domains: int) -> dict[str, Any]:
    """Pop and check the options of a method that moves `sides`: step sizes, clipping, alpha0, floor."""
    out: dict[str, Any] = {}
    # unset: giving mu (the paper's knob) asks for the paper's step; otherwise the trust region (the default)
    given_mu = any(opts.get(f"mu_{side}") is not None for side in sides)
    step_size = opts.pop("step_size", None) or ("lr_over_mu" if given_mu else STEP_SIZES[0])
    if step_size not in STEP_SIZES:
        raise ValueError(f"step_size must be 'trust_region' (default: a KL divergence per update), 'lr_over_mu' "
                         f"(paper) or 'constant' (authors' code), got {step_size!r}")
    out["step_size"] = step_size
    for side in sides:
        if step_size == "trust_region":
            out[f"kl_{side}"] = _side_kl(opts, side)
        else:
            out[f"mu_{side}"], out[f"eta_{side}"] = _side_step(opts, side, step_size)
    clip = opts.pop("clip_norm", None)
    if clip is not None:
        clip = real(clip, "clip_norm")
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"clip_norm must be None (no clipping) or a finite number > 0, got {clip!r}")
    out["clip_norm"] = clip
    alpha0 = opts.pop("alpha0", None)
    out["alpha0"] = None if alpha0 is None else check_simplex(alpha0, "alpha0", num_domains).tolist()
    floor = real(opts.pop("alpha_floor", 0.0), "alpha_floor")
    if not (0.0 <= floor <= 1.0 / num_domains):
        raise ValueError(f"alpha_floor must lie in [0, 1/num_domains] = [0, {1.0 / num_domains!r}], got {floor!r}")
    out["alpha_floor"] = floor
    return out
