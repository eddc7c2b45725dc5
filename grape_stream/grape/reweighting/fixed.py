"""Baselines whose weights never move: uniform and a static (e.g. published) mixture.

They still take the reweighter interface so a run can switch method by name; they never need a probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.options import ReweighterOptions
from grape_stream.grape.reweighting.registry import register
from grape_stream.simplex import check_simplex

__all__ = ["StaticOptions", "StaticReweighter", "UniformReweighter"]


@register
class UniformReweighter(Reweighter):
    method = "uniform"
    description = "alpha fixed at 1/K (baseline); alignments are still logged"
    signal = Signal.none


@dataclass
class StaticOptions(ReweighterOptions):
    weights: Optional[list[float]] = None  # the K domain weights (required)

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        if self.weights is None:
            raise ConfigError(f"method 'static' needs weights=[...] ({num_domains} domain weights summing to 1)")
        out = super().resolve(num_domains, num_tasks)
        out["weights"] = check_simplex(self.weights, "weights", num_domains).tolist()
        out["alpha0"] = out["weights"]
        return out


@register
class StaticReweighter(Reweighter):
    method = "static"
    description = "alpha fixed at given weights, e.g. a published mixture (weights=...)"
    Options = StaticOptions
    signal = Signal.none

    @property
    def options(self) -> dict[str, Any]:
        opts = super().options
        opts.pop("alpha0", None)
        return opts
