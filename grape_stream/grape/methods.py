"""What a controller (and so a recipe) accepts: the reweighter registry plus replay, and which
options go to which method.
"""

from __future__ import annotations

from typing import Any, Mapping

from grape_stream.grape.replay import REPLAY_METHOD
from grape_stream.grape.reweighting import (
    all_options,
    available_methods,
    method_options,
)

__all__ = ["controller_methods", "filter_reweighter_options"]


def controller_methods() -> list[str]:
    """Every `method` a GrapeController (and so a recipe) accepts: the reweighter registry plus replay."""
    return [*available_methods(), REPLAY_METHOD]


def filter_reweighter_options(
    method: str, options: Mapping[str, Any], *, strict: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split options into (kept, dropped) for ``method``.

    An option no reweighter knows is always an error that names it. With ``strict=False`` an option that
    belongs to *another* method (``mu_z`` under ``method=doge``) is dropped instead of failing, so a recipe
    written for GRAPE runs unchanged with ``algorithm.method=uniform``. ``schedule`` takes none.
    """
    everything = all_options()
    unknown = sorted(set(options) - everything)
    if unknown:
        raise TypeError(
            f"unknown reweighting option(s) {', '.join(map(repr, unknown))}; "
            f"known options: {', '.join(sorted(everything))}"
        )
    accepted = set() if method == REPLAY_METHOD else set(method_options(method))
    kept = {k: v for k, v in options.items() if k in accepted}
    dropped = {k: v for k, v in options.items() if k not in accepted}
    if dropped and strict:
        raise TypeError(
            f"option(s) {', '.join(map(repr, sorted(dropped)))} do not apply to method {method!r}; "
            f"its options: {', '.join(sorted(accepted)) or 'none'}"
        )
    return kept, dropped
