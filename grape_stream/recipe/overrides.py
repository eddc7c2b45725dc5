"""``key=value`` overrides: dotted paths into a validated recipe, values parsed as YAML.

``algorithm.method=uniform``, ``trainer.max_duration=200ba``, ``data.domains=[en, fr]``; keys inside
free-form mappings (``algorithm.options.clip_norm``, ``model.hf_overrides.n_layer``) are accepted, any
other unknown key is an error that names it. The format is omegaconf's dotlist, so a later move onto
omegaconf keeps command lines working.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import yaml

from grape_stream.errors import ConfigError
from grape_stream.recipe.schema import SCHEMA, Free, merge, unknown_key
from grape_stream.recipe.yaml_values import yaml_load

__all__ = ["apply_overrides", "parse_override"]

_WHERE = " (command-line override)"


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=value"`` -> ``("a.b", parsed value)``; an empty value is None."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. algorithm.method=uniform)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({' '.join(str(exc).split())})") from None
    return key, value


def _set(cfg: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = cfg
    schema: Any = SCHEMA
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(schema, Free):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
                schema = Free()
            continue
        if not isinstance(schema, dict) or part not in schema:
            raise unknown_key(key, _WHERE)
        if last:
            sub = schema[part]
            if isinstance(sub, dict) and not isinstance(sub, Free):
                node[part] = merge(sub, value or {}, ".".join(parts) + ".", _WHERE)
            else:
                node[part] = value
        else:
            schema = schema[part]
            node = node[part]


def apply_overrides(cfg: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set dotted keys in a *validated* recipe (a copy is returned). Unknown keys are errors that name
    the key; keys inside free-form mappings are accepted; a whole section (``algorithm={...}``) is merged
    with its defaults."""
    cfg = copy.deepcopy(cfg)
    for item in overrides:
        key, value = parse_override(item)
        _set(cfg, key, value)
    return cfg
