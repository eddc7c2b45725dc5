"""The recipe schema: a nested mapping of every key a recipe may hold, derived from :mod:`grape_stream.config`.

The dataclasses state the defaults; this module turns them into the dict form that loading, merging and
overrides walk (:data:`SCHEMA`), and holds the two rules shared by them: unknown keys are errors that name
the key (with the closest valid one), and free-form mappings (:class:`Free`) are passed through unchecked.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from typing import Any, Mapping

from grape_stream.config import RecipeConfig, is_free, is_required
from grape_stream.errors import ConfigKeyError, ConfigTypeError

__all__ = ["REQUIRED", "SCHEMA", "Free", "Required", "dotted_keys", "merge", "schema_of", "unknown_key"]


class Free(dict):
    """Marks a mapping whose keys are free-form (passed through to a library as keyword arguments)."""


class Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED = Required()


def schema_of(cls: type) -> dict[str, Any]:
    """The nested default mapping of a config dataclass: sections become dicts, free maps :class:`Free`,
    required keys :data:`REQUIRED`; field order is the dataclass's (``--print-config`` keeps it)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if is_free(f):
            out[f.name] = Free()
        elif is_required(f):
            out[f.name] = REQUIRED
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            out[f.name] = schema_of(type(value)) if dataclasses.is_dataclass(value) else value
        else:
            out[f.name] = f.default
    return out


#: Every key a recipe may hold, with its default. docs/recipes.md documents each one.
SCHEMA: dict[str, Any] = schema_of(RecipeConfig)


def dotted_keys(schema: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in schema.items():
        path = f"{prefix}{k}"
        out.append(path)
        if isinstance(v, dict) and not isinstance(v, Free):
            out.extend(dotted_keys(v, path + "."))
    return out


def unknown_key(path: str, where: str) -> ConfigKeyError:
    close = difflib.get_close_matches(path, dotted_keys(SCHEMA), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigKeyError(f"unknown recipe key {path!r}{where}{hint}")


def merge(schema: Mapping[str, Any], given: Mapping[str, Any], prefix: str, where: str) -> dict[str, Any]:
    """``given`` checked against ``schema`` with every missing key filled by its default (deep copies)."""
    if not isinstance(given, Mapping):
        raise ConfigTypeError(f"recipe key {prefix.rstrip('.') or '<root>'!r}{where} must be a mapping, "
                              f"got {type(given).__name__}")
    out: dict[str, Any] = {}
    for key in given:
        if key not in schema:
            raise unknown_key(f"{prefix}{key}", where)
    for key, default in schema.items():
        path = f"{prefix}{key}"
        if isinstance(default, Free):
            value = given.get(key) or {}
            if not isinstance(value, Mapping):
                raise ConfigTypeError(f"recipe key {path!r}{where} must be a mapping, got {type(value).__name__}")
            out[key] = dict(value)
        elif isinstance(default, dict):
            out[key] = merge(default, given.get(key) or {}, path + ".", where)
        elif key in given:
            out[key] = copy.deepcopy(given[key])
        else:
            out[key] = copy.deepcopy(default)
    return out
