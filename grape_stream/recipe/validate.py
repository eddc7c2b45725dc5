"""Checks on a merged recipe, each failing with a :class:`~grape_stream.errors.ConfigError` that names the key
(one line on the command line), before any model, data or trainer is built.

* **Types per key** are omegaconf's (the structured config of :mod:`grape_stream.config`, turned into one
  line by :mod:`grape_stream.recipe.schema`) before this module runs.
* **Time strings** (:data:`TIME_KEYS`): Composer time strings in the units the mixer supports, ``<int>ba``,
  ``<int>sp``, ``<int>tok``, and ``<float>dur`` (a fraction of max_duration) for intervals. A bare number
  gets "add a unit"; epochs are refused (the mixer's stream is endless, so an epoch never ends and Composer
  fails later with "Cannot convert time, as state.dataloader_len is None").
* The ``algorithm`` section is checked by the rules the controller itself applies
  (:mod:`grape_stream.grape.algorithm_config`: the method from the registries, ``algorithm.options`` names
  against every method's options dataclass, the values a controller needs), so a new reweighting method
  or option needs no change here.
* ``data.mixer`` is a :class:`~grape_stream.config.MixerConfig`: its keys and types are the schema's.

The data itself (directories, the manifest's vocab_size and seq_len) is checked in :mod:`grape_stream.recipe.data`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from grape_stream.config import DataConfig, RecipeConfig
from grape_stream.errors import ConfigError, ConfigKeyError, ConfigTypeError
from grape_stream.grape.algorithm_config import (
    check_algorithm,
    check_option_names,
    check_reweighter_options,
    signal_source,
)
from grape_stream.recipe.prior import named_prior
from grape_stream.recipe.schema import as_recipe

__all__ = ["ENTRY_KEYS", "MODEL_KINDS", "OPTIMIZERS", "SCHEDULERS", "TIME_KEYS", "check_time", "validate"]

#: Composer time strings of a recipe -> whether a fraction of the run (``dur``) is allowed.
TIME_KEYS = {
    "trainer.max_duration": False,
    "trainer.eval_interval": True,
    "trainer.save_interval": True,
    "trainer.log_interval": True,
    "scheduler.t_warmup": True,
}
_UNITS = {"ba": "batches", "sp": "samples", "tok": "tokens", "dur": "fraction of trainer.max_duration"}
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)\s*$")
_NUMBER = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*$")


def check_time(key: str, value: Any, *, allow_dur: bool = True) -> None:
    """``value`` is a time string the mixer can train with, else a ConfigError naming ``key`` and the fix."""
    units = "'Nba', 'Nsp', 'Ntok'" + (" or a fraction 'F.Fdur'" if allow_dur else "")
    if isinstance(value, (int, float)) and not isinstance(value, bool) or (
            isinstance(value, str) and _NUMBER.match(value)):
        n = float(value)
        shown = str(int(n)) if n.is_integer() else str(value).strip()
        raise ConfigError(f"recipe key {key!r} is {value!r} without a unit; add a unit: '{shown}ba' (batches), "
                          f"or use {units}")
    if not isinstance(value, str):
        raise ConfigTypeError(f"recipe key {key!r} must be a time string such as '1000ba', got {value!r}")
    m = _TIME.match(value)
    if not m:
        raise ConfigError(f"recipe key {key!r} must be a time string such as '1000ba' ({units}), got {value!r}")
    number, unit = float(m.group(1)), m.group(2)
    if unit in ("ep", "iter"):
        raise ConfigError(f"recipe key {key!r} is {value!r}: the mixer's stream is endless (no epochs): "
                          "use 'Nba' or 'Ntok'")
    if unit == "dur" and not allow_dur:
        raise ConfigError(f"recipe key {key!r} is {value!r}: the run's length cannot be a fraction of itself; "
                          "use 'Nba', 'Nsp' or 'Ntok'")
    if unit not in _UNITS:
        raise ConfigError(f"recipe key {key!r} is {value!r}: unit {unit!r} is not one the mixer supports; use {units}")
    if unit != "dur" and not number.is_integer():
        raise ConfigError(f"recipe key {key!r} is {value!r}: {_UNITS[unit]} are counted in whole numbers")
    if number < 0 or (number == 0 and key == "trainer.max_duration"):  # 0 elsewhere: never / no warmup
        raise ConfigError(f"recipe key {key!r} is {value!r}: it must be positive")


#: The keys a mapping entry of data.domains / data.tasks may hold.
ENTRY_KEYS = {
    "domains": {"name", "remote", "local", "split"},
    "tasks": {"name", "remote", "local", "split", "test_split"},
}
MODEL_KINDS = ("gpt", "hf")
SCHEDULERS = ("cosine", "linear", "constant", "wsd")
#: torch's AdamW, and Composer's DecoupledAdamW (llm-foundry's usual; weight decay scaled by lr / peak lr)
OPTIMIZERS = ("adamw", "decoupled_adamw")


def _check_entries(data: DataConfig) -> None:
    if not data.domains:
        raise ConfigError("recipe key 'data.domains' is required: the list of domain names (or {name, local, remote})")
    for group in ("domains", "tasks"):
        entries = getattr(data, group)
        if not isinstance(entries, list):
            raise ConfigTypeError(f"recipe key 'data.{group}' must be a list, got {type(entries).__name__}")
        names = []
        for i, e in enumerate(entries):
            if isinstance(e, str):
                names.append(e)
            elif isinstance(e, Mapping):
                bad = sorted(set(e) - ENTRY_KEYS[group])
                if bad:
                    raise ConfigKeyError(f"unknown recipe key 'data.{group}[{i}].{bad[0]}'; "
                                         f"an entry takes {sorted(ENTRY_KEYS[group])}")
                if not e.get("name"):
                    raise ConfigError(f"recipe key 'data.{group}[{i}]' needs a 'name'")
                names.append(str(e["name"]))
            else:
                raise ConfigTypeError(
                    f"recipe key 'data.{group}[{i}]' must be a name or a mapping, got {type(e).__name__}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"recipe key 'data.{group}' repeats {dup}")


def _check_algorithm(cfg: RecipeConfig) -> None:
    """The controller's own checks, naming the recipe keys (``algorithm.<name>``)."""
    a = cfg.algorithm
    check_option_names(a.options, where="algorithm.options.", what="recipe key")
    check_algorithm(a, prefix="algorithm.")
    k = len(cfg.data.domains)
    if named_prior(a.options):  # checked as the uniform start it stands for: does the method take an alpha0?
        a = dataclasses.replace(a, options={**a.options, "alpha0": [1.0 / k] * k})
    check_reweighter_options(a, k, len(cfg.data.tasks))
    if signal_source(a).probes_tasks and not cfg.data.tasks:
        raise ConfigError(f"algorithm.method={a.method} needs target tasks: set 'data.tasks'")


def _check_mixtures(cfg: RecipeConfig) -> None:
    """``algorithm.options.weights`` (method static) and ``alpha0`` (the initial mixture): one finite non-negative
    number per domain, summing to 1, in recipe terms (the options dataclasses check them again, by value)."""
    k = len(cfg.data.domains)
    for name in ("weights", "alpha0"):
        value = cfg.algorithm.options.get(name)
        if value is None or (name == "alpha0" and named_prior(cfg.algorithm.options)):
            continue  # a named prior (alpha0: crisp) becomes weights in the run's set-up (recipe/prior.py)
        key = f"algorithm.options.{name}"
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise ConfigTypeError(f"recipe key {key!r} must be a list of {k} numbers (one per domain), got {value!r}")
        if len(value) != k:
            raise ConfigError(f"recipe key {key!r} has {len(value)} numbers but data.domains has {k} domains")
        if any(not math.isfinite(v) or v < 0 for v in value):
            raise ConfigError(f"recipe key {key!r} must be non-negative finite numbers, got {list(value)}")
        if abs(sum(value) - 1.0) > 1e-6:
            raise ConfigError(f"recipe key {key!r} sums to {sum(value):.6g}, not 1: "
                              f"e.g. {_normalised(value) if sum(value) > 0 else 'uniform'}")


def _normalised(value: Any) -> list[float]:
    """``value`` / its sum, rounded for a message, the last entry absorbing the rounding (so it sums to 1)."""
    w = [round(v / sum(value), 6) for v in value]
    w[-1] = round(1.0 - sum(w[:-1]), 6)
    return w


def validate(cfg: RecipeConfig | Mapping[str, Any]) -> None:
    """Raise a ConfigError (also a KeyError / ValueError / TypeError) naming the offending key; return None
    when the recipe is sound."""
    cfg = as_recipe(cfg)
    _check_entries(cfg.data)
    _check_mixtures(cfg)
    for key, allow_dur in TIME_KEYS.items():
        section, name = key.split(".")
        check_time(key, getattr(getattr(cfg, section), name), allow_dur=allow_dur)
    _check_algorithm(cfg)
    model = cfg.model
    if model.kind not in MODEL_KINDS:
        raise ConfigError(f"recipe key 'model.kind' is {model.kind!r}; choose 'gpt' or 'hf'")
    if model.kind == "hf" and not model.hf_config:
        raise ConfigError(
            "model.kind=hf needs 'model.hf_config' (a model type such as gpt2 or llama, or a local config dir)")
    if cfg.optimizer.name.lower() not in OPTIMIZERS:
        raise ConfigError(f"recipe key 'optimizer.name' is {cfg.optimizer.name!r}; supported: "
                          f"{', '.join(OPTIMIZERS)}")
    if cfg.scheduler.name not in SCHEDULERS:
        raise ConfigError(
            f"recipe key 'scheduler.name' is {cfg.scheduler.name!r}; choose cosine, linear, constant or wsd "
            "(or llm-foundry's cosine_with_warmup, linear_decay_with_warmup, constant_with_warmup)")
    if cfg.data.task_probe_split == cfg.data.task_test_split:
        raise ConfigError(
            "data.task_probe_split and data.task_test_split must differ: never evaluate on the probe split")
    gbs = cfg.trainer.global_train_batch_size
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise ConfigError(f"trainer.global_train_batch_size must be a positive integer, got {gbs!r}")
