"""The recipe's learning-rate schedules as Composer schedulers (``scheduler.name``), including WSD, which
Composer does not ship."""

from __future__ import annotations

from typing import Any, Mapping

from composer.optim import (
    ConstantWithWarmupScheduler,
    CosineAnnealingWithWarmupScheduler,
    LinearWithWarmupScheduler,
)
from composer.optim.scheduler import _convert_time

from grape_stream.config import RecipeConfig
from grape_stream.recipe.schema import as_recipe

__all__ = ["WarmupStableDecayScheduler", "build_scheduler"]


class WarmupStableDecayScheduler:
    """WSD (MiniCPM; the paper's 0.7B runs): linear warmup, constant, then linear decay to ``alpha_f`` over
    the last ``decay_fraction`` of training. A Composer scheduler: ``(state, ssr) -> lr multiplier``."""

    def __init__(self, t_warmup: str = "0.01dur", decay_fraction: float = 0.2, alpha_f: float = 0.1) -> None:
        if not 0.0 <= decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must lie in [0, 1], got {decay_fraction}")
        self.t_warmup = t_warmup
        self.decay_fraction = decay_fraction
        self.alpha_f = alpha_f

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        assert state.max_duration is not None
        warm = _convert_time(self.t_warmup, state)
        now = state.timestamp.get(warm.unit).value
        if warm.value > 0 and now < warm.value:
            return now / warm.value
        frac = state.get_elapsed_duration()
        frac = 0.0 if frac is None else float(frac.value) / ssr
        start = 1.0 - self.decay_fraction
        if frac <= start or self.decay_fraction == 0:
            return 1.0
        p = min(1.0, (frac - start) / self.decay_fraction)
        return 1.0 - p * (1.0 - self.alpha_f)


def build_scheduler(cfg: RecipeConfig | Mapping[str, Any]) -> Any:
    """The scheduler the recipe's ``scheduler`` section names (validated: cosine | linear | constant | wsd)."""
    s = as_recipe(cfg).scheduler
    if s.name == "cosine":
        return CosineAnnealingWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)
    if s.name == "linear":
        return LinearWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)
    if s.name == "constant":
        return ConstantWithWarmupScheduler(t_warmup=s.t_warmup)
    return WarmupStableDecayScheduler(t_warmup=s.t_warmup, decay_fraction=s.decay_fraction, alpha_f=s.alpha_f)
