"""Checks on a merged recipe that the schema alone cannot express, each failing with the key it is about.

The method choices come from the registries (:func:`grape_stream.grape.controller.controller_methods`,
:func:`grape_stream.grape.reweighting.method_needs_probe`), so a new reweighting method needs no change here.
"""

from __future__ import annotations

from typing import Any, Mapping

from grape_stream.grape.controller import REPLAY_METHOD, controller_methods
from grape_stream.grape.reweighting import method_needs_probe
from grape_stream.recipe.schema import Required

__all__ = ["ENTRY_KEYS", "MODEL_KINDS", "SCHEDULERS", "validate"]

#: The keys a mapping entry of data.domains / data.tasks may hold.
ENTRY_KEYS = {
    "domains": {"name", "remote", "local", "split"},
    "tasks": {"name", "remote", "local", "split", "test_split"},
}
MODEL_KINDS = ("gpt", "hf")
SCHEDULERS = ("cosine", "linear", "constant", "wsd")


def _check_entries(data: Mapping[str, Any]) -> None:
    if isinstance(data["domains"], Required) or not data["domains"]:
        raise ValueError("recipe key 'data.domains' is required: the list of domain names (or {name, local, remote})")
    for group in ("domains", "tasks"):
        entries = data[group]
        if not isinstance(entries, list):
            raise TypeError(f"recipe key 'data.{group}' must be a list, got {type(entries).__name__}")
        names = []
        for i, e in enumerate(entries):
            if isinstance(e, str):
                names.append(e)
            elif isinstance(e, Mapping):
                bad = sorted(set(e) - ENTRY_KEYS[group])
                if bad:
                    raise KeyError(f"unknown recipe key 'data.{group}[{i}].{bad[0]}'; "
                                   f"an entry takes {sorted(ENTRY_KEYS[group])}")
                if not e.get("name"):
                    raise ValueError(f"recipe key 'data.{group}[{i}]' needs a 'name'")
                names.append(str(e["name"]))
            else:
                raise TypeError(f"recipe key 'data.{group}[{i}]' must be a name or a mapping, got {type(e).__name__}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"recipe key 'data.{group}' repeats {dup}")


def _check_method(cfg: Mapping[str, Any]) -> None:
    method = cfg["algorithm"]["method"]
    choices = controller_methods()
    if method not in choices:
        raise ValueError(f"recipe key 'algorithm.method' is {method!r}; choose one of {', '.join(choices)}")
    if method != REPLAY_METHOD and method_needs_probe(method) and not cfg["data"]["tasks"]:
        raise ValueError(f"algorithm.method={method} needs target tasks: set 'data.tasks'")


def validate(cfg: Mapping[str, Any]) -> None:
    """Raise KeyError / ValueError / TypeError naming the offending key; return None when the recipe is sound."""
    _check_entries(cfg["data"])
    _check_method(cfg)
    model = cfg["model"]
    if model["kind"] not in MODEL_KINDS:
        raise ValueError(f"recipe key 'model.kind' is {model['kind']!r}; choose 'gpt' or 'hf'")
    if model["kind"] == "hf" and not model["hf_config"]:
        raise ValueError("model.kind=hf needs 'model.hf_config' "
                         "(a model type such as gpt2 or llama, or a local config dir)")
    if cfg["optimizer"]["name"].lower() != "adamw":
        raise ValueError(f"recipe key 'optimizer.name' is {cfg['optimizer']['name']!r}; supported: adamw")
    if cfg["scheduler"]["name"] not in SCHEDULERS:
        raise ValueError(f"recipe key 'scheduler.name' is {cfg['scheduler']['name']!r}; "
                         "choose cosine, linear, constant or wsd")
    if cfg["data"]["task_probe_split"] == cfg["data"]["task_test_split"]:
        raise ValueError("data.task_probe_split and data.task_test_split must differ: "
                         "never evaluate on the probe split")
    gbs = cfg["trainer"]["global_train_batch_size"]
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise ValueError(f"trainer.global_train_batch_size must be a positive integer, got {gbs!r}")
