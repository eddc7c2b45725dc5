"""The recipe's ``algorithm`` section: an :class:`~grape_stream.config.AlgorithmConfig`, handed as it is to
GRAPE in any trainer (``GrapeAlgorithm(recipe.algorithm, tasks=...)``, the HF / Lightning callbacks, a
``GrapeController``). Every rule about it (which options reach which method, the checks) lives in
:mod:`grape_stream.grape.algorithm_config`, which the recipe's validation and the controller both apply.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from grape_stream.config import AlgorithmConfig, RecipeConfig
from grape_stream.recipe.schema import as_recipe

__all__ = ["algorithm_kwargs", "recipe_algorithm"]


def recipe_algorithm(cfg: RecipeConfig | Mapping[str, Any]) -> AlgorithmConfig:
    """The recipe's ``algorithm`` section, typed."""
    return as_recipe(cfg).algorithm


def algorithm_kwargs(cfg: RecipeConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The same section as keyword arguments (``GrapeAlgorithm(tasks=..., **algorithm_kwargs(cfg))``), for
    callers of the keyword form; passing :func:`recipe_algorithm`'s object is the direct way."""
    return dataclasses.asdict(recipe_algorithm(cfg))
