"""llm-foundry's names for recipe keys and values that mean the same thing as ours: the one alias table.

An llm-foundry user writes ``n_layers``, ``max_seq_len``, ``console_log_interval``, ``global_seed`` and
the trainer's keys at the top level (``max_duration: 1000ba``); a recipe accepts each of them, in a file
and as a command-line override, and stores it under our key (``--print-config`` shows ours). Setting a
key both ways is an error naming both. Names whose meaning differs (MPT's ``expansion_ratio``, ``*_pdrop``)
are not aliased: they stay unknown keys, reported with the closest valid key.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from grape_stream.errors import ConfigError, ConfigTypeError

__all__ = ["ALIASES", "FOUNDRY_ONLY", "VALUE_ALIASES", "canonical_key", "canonical_recipe"]

#: llm-foundry's dotted key -> ours.
ALIASES: dict[str, str] = {
    "model.n_layers": "model.n_layer",
    "model.n_heads": "model.n_head",
    "model.max_seq_len": "model.seq_len",
    "global_seed": "seed",
    "max_seq_len": "data.seq_len",
    "device_eval_batch_size": "data.eval_batch_size",
    "trainer.console_log_interval": "trainer.log_interval",
    "console_log_interval": "trainer.log_interval",
    "loggers": "trainer.loggers",
    **{k: f"trainer.{k}" for k in (
        "max_duration", "global_train_batch_size", "device_train_microbatch_size", "eval_interval",
        "eval_subset_num_batches", "precision", "save_folder", "save_interval", "save_num_checkpoints_to_keep",
        "save_overwrite", "autoresume", "load_path", "log_to_console", "progress_bar")},
}

#: Top-level keys of an llm-foundry YAML with no recipe equivalent: such a YAML is run by llm-foundry itself,
#: with grape_stream's loader and algorithm in it (docs/composer.md, "llm-foundry").
FOUNDRY_ONLY = frozenset({"train_loader", "eval_loader", "tokenizer", "algorithms", "fsdp_config",
                          "parallelism_config", "icl_tasks", "eval_gauntlet", "dist_timeout",
                          "device_train_batch_size"})

#: key -> {llm-foundry's value -> ours}: Composer's schedulers under llm-foundry's registry names.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "scheduler.name": {"cosine_with_warmup": "cosine", "linear_decay_with_warmup": "linear",
                       "constant_with_warmup": "constant"},
}


def canonical_key(key: str) -> str:
    """Our dotted key for an override's key (``model.n_layers=4`` -> ``model.n_layer``)."""
    return ALIASES.get(key, key)


def canonical_value(key: str, value: Any) -> Any:
    names = VALUE_ALIASES.get(key)
    return names.get(value, value) if names and isinstance(value, str) else value


def _pop(d: dict[str, Any], path: str) -> tuple[bool, Any]:
    *parents, last = path.split(".")
    node: Any = d
    for p in parents:
        node = node.get(p) if isinstance(node, Mapping) else None
    if isinstance(node, dict) and last in node:
        return True, node.pop(last)
    return False, None


def _set(d: dict[str, Any], path: str, value: Any, alias: str, where: str) -> None:
    *parents, last = path.split(".")
    node = d
    for i, p in enumerate(parents):
        child = node.setdefault(p, {})
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigTypeError(f"recipe key {'.'.join(parents[:i + 1])!r}{where} must be a mapping, "
                                  f"got {type(child).__name__}")
        node = child
    if last in node:
        raise ConfigError(f"recipe keys {alias!r} and {path!r}{where} are the same setting (llm-foundry's name "
                          "and ours): keep one")
    node[last] = value


def canonical_recipe(given: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """A copy of a recipe mapping with llm-foundry's keys and values renamed to ours."""
    out = copy.deepcopy(dict(given))
    for alias, key in ALIASES.items():
        found, value = _pop(out, alias)
        if found:
            _set(out, key, value, alias, where)
    for key in VALUE_ALIASES:
        section, name = key.split(".")
        node = out.get(section)
        if isinstance(node, dict) and name in node:
            node[name] = canonical_value(key, node[name])
    return out
