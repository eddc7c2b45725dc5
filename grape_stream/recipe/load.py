"""Reading a recipe: a YAML path, the name of a bundled recipe, or a mapping -> the typed, validated recipe.

The YAML is read by omegaconf (``1e-4`` is a float, ``${model.d_model}`` and ``${variables.x}`` are
interpolations) and merged onto the structured config of :class:`grape_stream.config.RecipeConfig`: every
key has a default, an unknown key is an error that names it (with the closest valid key), a wrong type
is an error that says what the key takes, llm-foundry's key names are accepted
(:mod:`grape_stream.recipe.aliases`), and ``key=value`` overrides are omegaconf's dotlist.

:func:`load_config` returns the typed :class:`~grape_stream.config.RecipeConfig` whose sections travel to
their consumers; :func:`load_recipe` its plain form (a dict: what ``--print-config`` prints).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import typing
from typing import Any, Mapping, Sequence

import yaml
from omegaconf import OmegaConf

from grape_stream.config import RecipeConfig, is_free
from grape_stream.errors import ConfigError, ConfigTypeError
from grape_stream.recipe.aliases import canonical_recipe
from grape_stream.recipe.overrides import merge_overrides
from grape_stream.recipe.schema import as_recipe, base_config, merge_checked, recipe_dict
from grape_stream.recipe.validate import validate

__all__ = ["RecipeNotFoundError", "bundled_recipes", "load_config", "load_recipe", "resolve_recipe_path"]


class RecipeNotFoundError(ConfigError, FileNotFoundError):
    """No such recipe file and no bundled recipe of that name (still a FileNotFoundError)."""


#: The folder of the bundled recipe YAMLs inside the package (data, not code: no ``__init__.py``).
BUNDLED_DIR = "recipe_yaml"


def bundled_recipes() -> dict[str, str]:
    """name -> path of the recipes shipped in ``grape_stream/recipe_yaml/``."""
    root = importlib.resources.files("grape_stream").joinpath(BUNDLED_DIR)
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


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigTypeError(f"{path}: a recipe is a mapping of keys, got a {type(data).__name__}")
    return {str(k): v for k, v in data.items()}


def _sections_as_mappings(given: dict[str, Any], cls: type, prefix: str, where: str) -> None:
    """An empty section (``model:`` with nothing under it) is ``{}``; a section that is not a mapping is
    one line naming it (omegaconf would report the dataclass, not the key)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        section = isinstance(tp, type) and dataclasses.is_dataclass(tp)
        if f.name not in given or not (section or is_free(f)):
            continue
        if given[f.name] is None:
            given[f.name] = {}
        elif not isinstance(given[f.name], Mapping):
            raise ConfigTypeError(f"recipe key {prefix + f.name!r}{where} must be a mapping, got {given[f.name]!r}")
        elif section:
            given[f.name] = dict(given[f.name])
            _sections_as_mappings(given[f.name], tp, f"{prefix}{f.name}.", where)


def load_config(source: str | os.PathLike[str] | Mapping[str, Any], overrides: Sequence[str] = ()) -> RecipeConfig:
    """Read (path, bundled name or mapping), merge onto the schema's defaults, apply overrides, resolve
    ``${}``, validate: the typed recipe."""
    if isinstance(source, Mapping):
        raw, where, stem = dict(source), "", None
    else:
        path = resolve_recipe_path(os.fspath(source))
        raw, where, stem = _read_yaml(path), f" in {path}", os.path.splitext(os.path.basename(path))[0]
    given = canonical_recipe(raw, where)
    _sections_as_mappings(given, RecipeConfig, "", where)
    cfg = merge_overrides(merge_checked(base_config(), given, where), overrides)
    if cfg.run_name is None:
        cfg.run_name = stem or "grape-run"
    recipe = as_recipe(cfg, where)  # omegaconf's structured config -> the RecipeConfig object, ${} resolved
    validate(recipe)
    return recipe


def load_recipe(source: str | os.PathLike[str] | Mapping[str, Any], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """:func:`load_config` in plain form: a dict of plain values (every consumer also takes it)."""
    return recipe_dict(load_config(source, overrides))
