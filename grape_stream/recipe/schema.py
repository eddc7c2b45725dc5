"""The recipe schema: omegaconf's structured config of :class:`grape_stream.config.RecipeConfig`.

omegaconf does the merging, typing, ``${}`` interpolation and dotlist parsing; this module only keeps
the rule that every error is one line naming the recipe key: an unknown key becomes a
:class:`~grape_stream.errors.ConfigKeyError` with the closest valid key, a value of the wrong type a
:class:`~grape_stream.errors.ConfigTypeError` saying what the key takes (omegaconf's own messages span
four lines and name dataclasses, not keys).
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError as OmegaKeyError
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from grape_stream.config import RecipeConfig, is_free
from grape_stream.errors import ConfigError, ConfigKeyError, ConfigTypeError, did_you_mean
from grape_stream.recipe.aliases import ALIASES, FOUNDRY_ONLY

__all__ = ["as_recipe", "base_config", "dotted_keys", "field_type", "merge_checked", "one_line_error",
           "recipe_dict", "section_classes", "resolved", "type_name", "unknown_key"]


def base_config() -> DictConfig:
    """Every key a recipe may hold, with its default (the dataclasses of :mod:`grape_stream.config`)."""
    return OmegaConf.structured(RecipeConfig)


def section_classes(cls: type = RecipeConfig, prefix: str = "") -> dict[str, type]:
    """Dotted path of each nested section (``""`` for the root) -> its dataclass."""
    out = {prefix.rstrip("."): cls}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.update(section_classes(tp, f"{prefix}{f.name}."))
    return out


def dotted_keys(cls: type = RecipeConfig, prefix: str = "") -> list[str]:
    """Every schema key as a dotted path, sections included (free-form maps: only their own key)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append(f"{prefix}{f.name}")
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and not is_free(f):
            out.extend(dotted_keys(tp, f"{prefix}{f.name}."))
    return out


def field_type(path: str) -> Any:
    """The annotated type of a schema key (``model.n_layer`` -> int), or None for a key outside the schema."""
    section, _, name = path.rpartition(".")
    name = name.split("[")[0]
    cls = section_classes().get(section.split("[")[0])
    if cls is None:
        return None
    return typing.get_type_hints(cls).get(name)


def unknown_key(path: str, where: str = "") -> ConfigKeyError:
    """The error for a key outside the schema, with the closest key of the same section (a typo) or, under a
    misspelt section, the closest section holding that key; none when nothing is close (errors.did_you_mean)."""
    keys = dotted_keys() + sorted(ALIASES)
    section, _, name = path.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    hint = did_you_mean(name, siblings, prefix=f"{section}." if section else "")
    if not hint and section and not siblings:  # the section itself is misspelt: trainr.max_duration
        hint = did_you_mean(path, [k for k in keys if k.rpartition(".")[2] == name])
    if path.split(".")[0] in FOUNDRY_ONLY:
        hint = ("; it is llm-foundry's: run such a YAML with llm-foundry's train script and "
                "train_loader: {name: grape_mixture} (docs/composer.md)")
    return ConfigKeyError(f"unknown recipe key {path!r}{where}{hint}")


_TYPE_NAMES = {int: "an int", float: "a number", bool: "true or false", str: "a string", list: "a list",
               dict: "a mapping"}


def type_name(tp: Any) -> str:
    """``int`` -> "an int", ``Optional[float]`` -> "a number (or null)", ``list[float]`` -> "a list of numbers"."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        names = [type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(names) + " (or null)"
    if origin is list:
        args = typing.get_args(tp)
        return f"a list of {type_name(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "a mapping"
    return _TYPE_NAMES.get(origin or tp, getattr(tp, "__name__", str(tp)))


def one_line_error(exc: OmegaConfBaseException, where: str = "") -> ConfigError:
    """omegaconf's multi-line error -> one line naming the recipe key (and the closest key, or the type)."""
    key = getattr(exc, "full_key", None) or ""
    if isinstance(exc, OmegaKeyError) and not isinstance(exc, InterpolationResolutionError):
        return unknown_key(key, where)
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, InterpolationResolutionError):
        return ConfigError(f"recipe key {key!r}{where}: {first}")
    value = getattr(exc, "value", None)
    base = key.split("[")[0]
    tp = field_type(base)
    if tp is not None:
        at = f" at {key}" if base != key else ""  # an element of a typed list
        return ConfigTypeError(f"recipe key {base!r} must be {type_name(tp)}, got {value!r}{at}{where}")
    return ConfigTypeError(f"recipe key {key!r}{where}: {first}")


def merge_checked(cfg: DictConfig, given: Mapping[str, Any] | DictConfig, where: str) -> DictConfig:
    """``cfg`` merged with ``given`` (omegaconf's merge), every failure one line naming the key."""
    try:
        return typing.cast(DictConfig, OmegaConf.merge(cfg, given))
    except OmegaConfBaseException as exc:
        raise one_line_error(exc, where) from None


def resolved(cfg: DictConfig, where: str = "") -> dict[str, Any]:
    """The recipe as a plain dict with every ``${}`` resolved (a required key left unset stays ``"???"``)."""
    try:
        out = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as exc:
        raise one_line_error(exc, where) from None
    assert isinstance(out, dict)
    return typing.cast(dict[str, Any], out)


def as_recipe(cfg: RecipeConfig | DictConfig | Mapping[str, Any], where: str = "") -> RecipeConfig:
    """The typed recipe: ``cfg`` itself, the structured config being loaded (``${}`` resolved), or a loaded
    recipe's plain form (``load_recipe``'s dict) checked against the schema; every error one line naming the key."""
    if isinstance(cfg, RecipeConfig):
        return cfg
    merged = cfg if isinstance(cfg, DictConfig) else merge_checked(base_config(), dict(cfg), where)
    if OmegaConf.is_missing(merged.data, "domains"):
        raise ConfigError("recipe key 'data.domains' is required: the list of domain names (or {name, local, remote})")
    try:
        return typing.cast(RecipeConfig, OmegaConf.to_object(merged))
    except OmegaConfBaseException as exc:
        raise one_line_error(exc, where) from None


def recipe_dict(recipe: RecipeConfig) -> dict[str, Any]:
    """The plain form of a typed recipe (what ``--print-config`` prints and ``load_recipe`` returns): the
    choice settings' str-Enums become their words, so YAML and JSON writers take it as it is."""
    return dataclasses.asdict(recipe, dict_factory=lambda items: {k: v.value if isinstance(v, Enum) else v
                                                                   for k, v in items})
