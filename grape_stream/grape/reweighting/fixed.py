"""Baselines whose weights never move: uniform and a static (e.g. published) mixture.

They still take the reweighter interface so a run can switch method by name; they never need a probe.
"""

from __future__ import annotations

from typing import Any

from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.registry import register
from grape_stream.simplex import check_simplex

__all__ = ["StaticReweighter", "UniformReweighter"]


@register
class UniformReweighter(Reweighter):
    method = "uniform"
    description = "alpha fixed at 1/K (baseline); alignments are still logged"
    needs_probe = False


@register
class StaticReweighter(Reweighter):
    method = "static"
    description = "alpha fixed at given weights, e.g. a published mixture (weights=...)"
    options_accepted = ("weights", "history_limit")
    needs_probe = False

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        weights = opts.pop("weights", None)
        if weights is None:
            raise ValueError(f"method 'static' needs weights=[...] ({self.num_domains} domain weights summing to 1)")
        out = super()._resolve_options(opts)
        out["weights"] = check_simplex(weights, "weights", self.num_domains).tolist()
        out["alpha0"] = out["weights"]
        return out

    @property
    def options(self) -> dict[str, Any]:
        opts = super().options
        opts.pop("alpha0", None)
        return opts
