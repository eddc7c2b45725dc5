"""Recipes without a trainer: load (YAML via omegaconf, bundled names) into the typed
:class:`~grape_stream.config.RecipeConfig`, overrides (``key=value`` dotlist), llm-foundry's key names
(:mod:`~grape_stream.recipe.aliases`), validation, and the parts a run is built from (data streams, mixer,
model; the ``algorithm`` section goes to GRAPE as it is). No Composer import here: each trainer integration
(``grape_stream.integrations.<trainer>``) builds its Trainer from these. Every function here takes the typed
recipe or its plain form (``load_recipe``'s dict).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grape_stream.lazy import lazy_exports

if TYPE_CHECKING:
    from grape_stream.recipe.data import (
        build_mixer,
        check_local_data,
        read_manifest,
        recipe_streams,
        resolved_sizes,
        train_dataloader,
    )
    from grape_stream.recipe.load import bundled_recipes, load_config, load_recipe, resolve_recipe_path
    from grape_stream.recipe.model import build_model
    from grape_stream.recipe.overrides import apply_overrides
    from grape_stream.recipe.prior import resolve_prior
    from grape_stream.recipe.schema import as_recipe, base_config, recipe_dict
    from grape_stream.recipe.validate import validate

# Lazy (grape_stream.lazy): reading and checking a recipe (load, overrides, validate) must not import torch's data
# stack and streaming (seconds) before a mistake in it is reported; the data parts import them when used.
_LAZY = {
    **dict.fromkeys(["build_mixer", "check_local_data", "read_manifest", "recipe_streams", "resolved_sizes",
                     "train_dataloader"], "grape_stream.recipe.data"),
    **dict.fromkeys(["bundled_recipes", "load_config", "load_recipe", "resolve_recipe_path"],
                    "grape_stream.recipe.load"),
    "build_model": "grape_stream.recipe.model",
    "apply_overrides": "grape_stream.recipe.overrides",
    "resolve_prior": "grape_stream.recipe.prior",
    **dict.fromkeys(["as_recipe", "base_config", "recipe_dict"], "grape_stream.recipe.schema"),
    "validate": "grape_stream.recipe.validate",
}

__all__ = [
    "apply_overrides",
    "as_recipe",
    "base_config",
    "build_mixer",
    "build_model",
    "check_local_data",
    "bundled_recipes",
    "load_config",
    "load_recipe",
    "read_manifest",
    "recipe_dict",
    "recipe_streams",
    "resolve_prior",
    "resolve_recipe_path",
    "resolved_sizes",
    "train_dataloader",
    "validate",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
