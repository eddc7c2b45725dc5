"""The recipe's ``callbacks:`` section -> Composer callbacks, named as llm-foundry names them.

``callbacks: {lr_monitor: {}, speed_monitor: {window_size: 10}}`` builds Composer's own callbacks under
llm-foundry's registry names; ``grape_trajectory`` / ``grape_eval_summary`` are ours; any other callback
is ``"package.module:ClassName": {kwargs}``. An unknown name is one line with the closest name.

A recipe is trusted code (it names classes to import and call), but a name must still be a Composer
``Callback`` subclass: ``"os:system": {...}`` or any other callable is refused before it is called.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from composer import callbacks as cc
from composer.core import Callback

from grape_stream.errors import ConfigError, did_you_mean
from grape_stream.integrations.composer.callbacks import GrapeTrajectoryCallback, TaskEvalSummary

__all__ = ["CALLBACKS", "build_callbacks", "check_callback_names"]

#: name -> callback class (llm-foundry's registry names for Composer's callbacks)
CALLBACKS: dict[str, type] = {
    "lr_monitor": cc.LRMonitor,
    "speed_monitor": cc.SpeedMonitor,
    "memory_monitor": cc.MemoryMonitor,
    "memory_snapshot": cc.MemorySnapshot,
    "runtime_estimator": cc.RuntimeEstimator,
    "optimizer_monitor": cc.OptimizerMonitor,
    "nan_monitor": cc.NaNMonitor,
    "activation_monitor": cc.ActivationMonitor,
    "system_metrics_monitor": cc.SystemMetricsMonitor,
    "early_stopper": cc.EarlyStopper,
    "threshold_stopper": cc.ThresholdStopper,
    "oom_observer": cc.OOMObserver,
    "grape_trajectory": GrapeTrajectoryCallback,
    "grape_eval_summary": TaskEvalSummary,
}


def _import(name: str) -> type:
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"recipe key 'callbacks.{name}': cannot import it ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise ConfigError(f"recipe key 'callbacks.{name}': {name} is not a Composer Callback class "
                          f"(got {type(cls).__name__}); a callback must subclass composer.core.Callback")
    return cls


def _callback_class(name: str) -> type:
    if ":" in name:
        return _import(name)
    if name in CALLBACKS:
        return CALLBACKS[name]
    hint = did_you_mean(name, CALLBACKS) or ";"
    raise ConfigError(f"unknown callback 'callbacks.{name}'{hint} choose from {sorted(CALLBACKS)} "
                      "or name a class as 'package.module:ClassName'")


def check_callback_names(section: Mapping[str, Any]) -> None:
    """Every callback of the section names a known or importable class (a dry run builds none of them)."""
    for name in section:
        _callback_class(name)


def build_callbacks(section: Mapping[str, Any]) -> list[Any]:
    """One callback per entry of the recipe's ``callbacks`` section, in order."""
    out = []
    for name, kwargs in section.items():
        cls = _callback_class(name)
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ConfigError(f"recipe key 'callbacks.{name}' must be a mapping of keyword arguments, got {kwargs!r}")
        try:
            out.append(cls(**dict(kwargs or {})))
        except TypeError as exc:
            raise ConfigError(f"recipe key 'callbacks.{name}': {exc}") from None
    return out
