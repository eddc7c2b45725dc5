"""Reading a recipe: a YAML path, the name of a bundled recipe, or a mapping -> a validated, complete dict.

A recipe is a nested mapping with a fixed schema (:data:`grape_stream.recipe.schema.SCHEMA`): every key
has a default, an unknown key is an error that names it (with the closest valid key), and ``key=value``
overrides address keys by their dotted path.
"""

from __future__ import annotations

import importlib.resources
import os
from typing import Any, Mapping, Sequence

import yaml

from grape_stream.errors import ConfigError
from grape_stream.recipe.overrides import apply_overrides
from grape_stream.recipe.schema import SCHEMA, merge
from grape_stream.recipe.validate import validate
from grape_stream.recipe.yaml_values import yaml_load

__all__ = ["RecipeNotFoundError", "bundled_recipes", "load_recipe", "resolve_recipe_path"]


class RecipeNotFoundError(ConfigError, FileNotFoundError):
    """No such recipe file and no bundled recipe of that name (still a FileNotFoundError)."""


def bundled_recipes() -> dict[str, str]:
    """name -> path of the recipes shipped in ``grape_stream.recipes``."""
    root = importlib.resources.files("grape_stream.recipes")
    return {p.name[:-5]: str(p) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_recipe_path(name_or_path: str) -> str:
    """An existing file wins; else a bundled recipe by name (``demo-cpu``, ``demo-cpu.yaml``)."""
    if os.path.exists(name_or_path):
        return name_or_path
    bundled = bundled_recipes()
    key = name_or_path[:-5] if name_or_path.endswith(".yaml") else name_or_path
    key = os.path.basename(key)
    if key in bundled:
        return bundled[key]
    raise RecipeNotFoundError(f"no recipe {name_or_path!r}: not a file, and not one of the bundled recipes "
                              f"{sorted(bundled)}")


def load_recipe(source: str | os.PathLike[str] | Mapping[str, Any], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read (path, bundled name or mapping), validate against the schema, fill defaults, apply overrides."""
    if isinstance(source, Mapping):
        given, where, stem = dict(source), "", None
    else:
        path = resolve_recipe_path(os.fspath(source))
        with open(path, encoding="utf-8") as f:
            try:
                given = yaml_load(f) or {}
            except yaml.YAMLError as exc:
                first = " ".join(str(exc).split())
                raise ConfigError(f"{path}: not valid YAML: {first}") from None
        where, stem = f" in {path}", os.path.splitext(os.path.basename(path))[0]
    cfg = merge(SCHEMA, given, "", where)
    cfg = apply_overrides(cfg, overrides)
    if cfg["run_name"] is None:
        cfg["run_name"] = stem or "grape-run"
    validate(cfg)
    return cfg
