"""Checks on a merged recipe, each failing with a :class:`~grape_stream.errors.ConfigError` that names the key
(one line on the command line), before any model, data or trainer is built.

* **Types per key**, read from the dataclasses of :mod:`grape_stream.config`: ``model.n_layer=two`` ->
  "recipe key 'model.n_layer' must be an int, got 'two'". An int is accepted for a float, a bool is not an
  int, ``Optional[...]`` accepts null, ``Any`` and free-form mappings are not checked.
* **Time strings** (:data:`TIME_KEYS`): Composer time strings in the units the mixer supports, ``<int>ba``,
  ``<int>sp``, ``<int>tok``, and ``<float>dur`` (a fraction of max_duration) for intervals. A bare number
  gets "add a unit"; epochs are refused (the mixer's stream is endless, so an epoch never ends and Composer
  fails later with "Cannot convert time, as state.dataloader_len is None").
* The method choices come from the registries (:func:`grape_stream.grape.controller.controller_methods`,
  :func:`grape_stream.grape.reweighting.method_needs_probe`), so a new reweighting method needs no change here.

The data itself (directories, the manifest's vocab_size and seq_len) is checked in :mod:`grape_stream.recipe.data`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Mapping

from grape_stream.config import RecipeConfig, is_free
from grape_stream.errors import ConfigError, ConfigKeyError, ConfigTypeError
from grape_stream.grape.controller import REPLAY_METHOD, controller_methods
from grape_stream.grape.reweighting import method_needs_probe
from grape_stream.recipe.schema import Required

__all__ = ["ENTRY_KEYS", "MODEL_KINDS", "SCHEDULERS", "TIME_KEYS", "check_time", "check_types", "validate"]

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


_TYPE_NAMES = {int: "an int", float: "a number", bool: "true or false", str: "a string", list: "a list",
               dict: "a mapping"}


def _type_ok(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is typing.Union:
        return any(_type_ok(a, value) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is list or tp is list:
        args = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(args[0], v) for v in value) if args else isinstance(value, list)
    if origin is dict or tp is dict:
        return isinstance(value, Mapping)
    return True  # a type this checker does not know: accept


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        names = [_type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(names) + " (or null)"
    if origin is list:
        args = typing.get_args(tp)
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    return _TYPE_NAMES.get(origin or tp, getattr(tp, "__name__", str(tp)))


def check_types(cfg: Mapping[str, Any], cls: type = RecipeConfig, prefix: str = "") -> None:
    """Every key's value against its dataclass field's type (time strings: :func:`check_time`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, value, tp = f"{prefix}{f.name}", cfg.get(f.name), hints[f.name]
        if key in TIME_KEYS or is_free(f) or isinstance(value, Required):
            continue
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigTypeError(f"recipe key {key!r} must be a mapping, got {value!r}")
            check_types(value, tp, key + ".")
        elif not _type_ok(tp, value):
            raise ConfigTypeError(f"recipe key {key!r} must be {_type_name(tp)}, got {value!r}")

#: The keys a mapping entry of data.domains / data.tasks may hold.
ENTRY_KEYS = {
    "domains": {"name", "remote", "local", "split"},
    "tasks": {"name", "remote", "local", "split", "test_split"},
}
MODEL_KINDS = ("gpt", "hf")
SCHEDULERS = ("cosine", "linear", "constant", "wsd")


def _check_entries(data: Mapping[str, Any]) -> None:
    if isinstance(data["domains"], Required) or not data["domains"]:
        raise ConfigError("recipe key 'data.domains' is required: the list of domain names (or {name, local, remote})")
    for group in ("domains", "tasks"):
        entries = data[group]
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


def _check_method(cfg: Mapping[str, Any]) -> None:
    method = cfg["algorithm"]["method"]
    choices = controller_methods()
    if method not in choices:
        raise ConfigError(f"recipe key 'algorithm.method' is {method!r}; choose one of {', '.join(choices)}")
    if method != REPLAY_METHOD and method_needs_probe(method) and not cfg["data"]["tasks"]:
        raise ConfigError(f"algorithm.method={method} needs target tasks: set 'data.tasks'")


def validate(cfg: Mapping[str, Any]) -> None:
    """Raise a ConfigError (also a KeyError / ValueError / TypeError) naming the offending key; return None
    when the recipe is sound."""
    _check_entries(cfg["data"])
    check_types(cfg)
    for key, allow_dur in TIME_KEYS.items():
        section, name = key.split(".")
        check_time(key, cfg[section][name], allow_dur=allow_dur)
    _check_method(cfg)
    model = cfg["model"]
    if model["kind"] not in MODEL_KINDS:
        raise ConfigError(f"recipe key 'model.kind' is {model['kind']!r}; choose 'gpt' or 'hf'")
    if model["kind"] == "hf" and not model["hf_config"]:
        raise ConfigError(
            "model.kind=hf needs 'model.hf_config' (a model type such as gpt2 or llama, or a local config dir)")
    if cfg["optimizer"]["name"].lower() != "adamw":
        raise ConfigError(f"recipe key 'optimizer.name' is {cfg['optimizer']['name']!r}; supported: adamw")
    if cfg["scheduler"]["name"] not in SCHEDULERS:
        raise ConfigError(
            f"recipe key 'scheduler.name' is {cfg['scheduler']['name']!r}; choose cosine, linear, constant or wsd")
    if cfg["data"]["task_probe_split"] == cfg["data"]["task_test_split"]:
        raise ConfigError(
            "data.task_probe_split and data.task_test_split must differ: never evaluate on the probe split")
    gbs = cfg["trainer"]["global_train_batch_size"]
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise ConfigError(f"trainer.global_train_batch_size must be a positive integer, got {gbs!r}")
