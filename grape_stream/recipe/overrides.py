"""``key=value`` overrides: omegaconf's dotlist (values are YAML, ``${}`` interpolation allowed).

``algorithm.method=uniform``, ``trainer.max_duration=200ba``, ``data.domains=[en, fr]``,
``model.n_layers=4`` (llm-foundry's name, :mod:`grape_stream.recipe.aliases`), ``max_duration=200ba``
(llm-foundry's top-level trainer key); keys inside free-form mappings (``algorithm.options.clip_norm``,
``model.hf_overrides.n_layer``) are accepted, any other unknown key is an error that names it. A whole
section (``algorithm={method: uniform}``) is merged with what is there.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grape_stream.config import RecipeConfig
from grape_stream.errors import ConfigError
from grape_stream.recipe.aliases import canonical_recipe
from grape_stream.recipe.schema import base_config, merge_checked, recipe_dict, resolved

__all__ = ["apply_overrides", "merge_overrides", "parse_override"]

_WHERE = " (command-line override)"


def parse_override(item: str) -> dict[str, Any]:
    """``"a.b=value"`` -> ``{"a": {"b": value}}`` (value parsed as YAML, llm-foundry's names renamed to ours);
    an empty value is None."""
    key = item.split("=", 1)[0].strip()
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. algorithm.method=uniform)")
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(exc).splitlines()[0]})") from None
    assert isinstance(parsed, dict)
    return canonical_recipe({str(k): v for k, v in parsed.items()}, _WHERE)


def merge_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """``cfg`` (a structured recipe) with each override merged in, in order."""
    for item in overrides:
        cfg = merge_checked(cfg, parse_override(item), _WHERE)
    return cfg


def apply_overrides(cfg: RecipeConfig | Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Overrides applied to a loaded recipe (typed, or its plain form); a new dict is returned."""
    base = merge_checked(base_config(), recipe_dict(cfg) if isinstance(cfg, RecipeConfig) else dict(cfg), "")
    return resolved(merge_overrides(base, overrides))
