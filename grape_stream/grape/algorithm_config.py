"""AlgorithmConfig as the controller reads it: keyword overrides, checks, and the reweighter's options.

Every GRAPE entry point (``GrapeController``, ``GrapeLoop`` and the Composer / HF / Lightning adapters over
it, a recipe's ``algorithm`` section) ends in :func:`algorithm_config`, so each rule below is written once:

* a keyword that is a field of :class:`~grape_stream.config.AlgorithmConfig` sets it; any other keyword is a
  reweighter option (``clip_norm=1.0``) and joins ``config.options``; a name that is neither is one
  :class:`~grape_stream.errors.UnknownOptionError` naming the closest valid one;
* :func:`reweighter_options`: ``mu_alpha`` / ``mu_z`` go only to methods that take them (and not with
  ``step_size="constant"``), options of another method are dropped with a log line (a recipe written for
  GRAPE runs unchanged with ``method=uniform``), an option no method knows is an error naming
  ``algorithm.options.<key>`` and the closest;
* :func:`check_algorithm`: the values the controller needs (positive periods and probe sizes, a known
  method, probe mode and alignments mode, a schedule to replay); :func:`check_reweighter_options`: the option values, by
  the method's options dataclass.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

from grape_stream.config import AlgorithmConfig, field_names, with_overrides
from grape_stream.config.choices import ProbeMode, Signal, values
from grape_stream.errors import ConfigError, UnknownOptionError, did_you_mean
from grape_stream.grape.geometry import GEOMETRIES
from grape_stream.grape.instep_mode import ALIGNMENTS
from grape_stream.grape.replay import REPLAY_METHOD
from grape_stream.grape.reweighting import REWEIGHTERS, all_options, available_methods, method_options
from grape_stream.grape.reweighting.registry import canonical_method, method_options_class

__all__ = ["PROBE_MODES", "algorithm_config", "check_algorithm", "check_option_names", "check_reweighter_options",
           "controller_methods", "filter_reweighter_options", "reweighter_options", "signal_source"]

log = logging.getLogger(__name__)

PROBE_MODES = values(ProbeMode)


def controller_methods() -> list[str]:
    """Every `method` a GrapeController (and so a recipe) accepts: the reweighter registry plus replay."""
    return [*available_methods(), REPLAY_METHOD]


def check_option_names(options: Mapping[str, Any], *, where: str = "algorithm.options.",
                       what: str = "option") -> None:
    """Every name is an option of some reweighting method, else one UnknownOptionError naming it (as
    ``<where><name>``) and the closest option (or, with none close, every option)."""
    everything = all_options()
    for name in options:
        if name not in everything:
            hint = did_you_mean(name, everything, prefix=where) or f"; options: {', '.join(sorted(everything))}"
            raise UnknownOptionError(f"unknown {what} {where + name!r}{hint}")


def filter_reweighter_options(
    method: str, options: Mapping[str, Any], *, strict: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split options into (kept, dropped) for ``method``.

    An option no reweighter knows is always an error that names it. With ``strict=False`` an option that
    belongs to *another* method (``mu_z`` under ``method=doge``) is dropped instead of failing, so a recipe
    written for GRAPE runs unchanged with ``algorithm.method=uniform``. ``schedule`` takes none.
    """
    check_option_names(options, where="")
    accepted = set() if method == REPLAY_METHOD else set(method_options(method))
    kept = {k: v for k, v in options.items() if k in accepted}
    dropped = {k: v for k, v in options.items() if k not in accepted}
    if dropped and strict:
        raise UnknownOptionError(
            f"option(s) {', '.join(map(repr, sorted(dropped)))} do not apply to method {method!r}; "
            f"its options: {', '.join(sorted(accepted)) or 'none'}"
        )
    return kept, dropped


def algorithm_config(config: AlgorithmConfig | Mapping[str, Any] | None, overrides: Mapping[str, Any], *,
                     where: str = "GRAPE") -> AlgorithmConfig:
    """``config`` (default: the defaults) with keyword ``overrides``: AlgorithmConfig fields set, reweighter
    options (``clip_norm=1.0``) added to ``options``; every option name checked."""
    if isinstance(config, Mapping):
        overrides = {**config, **overrides}
        config = None
    fields = set(field_names(AlgorithmConfig))
    extra = {k: v for k, v in overrides.items() if k not in fields}
    everything = all_options()
    for name in extra:
        if name not in everything:
            raise UnknownOptionError(f"{where} got an unexpected option {name!r}"
                                     f"{did_you_mean(name, fields | everything)}")
    out = with_overrides(config, AlgorithmConfig, {k: v for k, v in overrides.items() if k in fields}, where=where)
    if extra:
        out = dataclasses.replace(out, options={**out.options, **extra})
    check_option_names(out.options)
    return out


def reweighter_options(config: AlgorithmConfig) -> dict[str, Any]:
    """The keyword options ``config.method``'s reweighter is built with (the one rule, module docstring)."""
    options = dict(config.options)
    mus = {} if options.get("step_size") == "constant" else {
        k: v for k in ("mu_alpha", "mu_z") if (v := getattr(config, k)) is not None}
    kept, dropped = filter_reweighter_options(config.method, {**mus, **options}, strict=False)
    given = sorted(k for k in dropped if k in options)
    if given:
        log.info("algorithm.method=%s ignores options that belong to other methods: %s", config.method, given)
    return kept


def check_algorithm(config: AlgorithmConfig, *, prefix: str = "") -> None:
    """The values a controller needs, each failure a ConfigError naming the setting (``<prefix><name>``)."""
    for name in ("alpha_every", "z_every", "probe_domain_batch", "probe_task_batch"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{prefix}{name} must be a positive integer, got {value!r}")
    if config.method != REPLAY_METHOD:
        try:
            canonical_method(config.method)  # '-' and '_' are interchangeable, case is ignored
        except (TypeError, ValueError):
            raise ConfigError(f"{prefix}method is {config.method!r}; choose one of "
                              f"{', '.join(controller_methods())}") from None
    if config.probe_mode not in PROBE_MODES:
        raise ConfigError(f"{prefix}probe_mode must be 'sharded' or 'replicated', got {config.probe_mode!r}")
    if config.alignments not in ALIGNMENTS:
        raise ConfigError(f"{prefix}alignments must be 'probe' (the paper's domain probes) or 'steps' (from the "
                          f"training steps), got {config.alignments!r}")
    steps = config.alignment_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"{prefix}alignment_steps (training steps observed per update) must be an integer >= 1, "
                          f"got {steps!r}")
    if config.geometry not in GEOMETRIES:
        raise ConfigError(f"{prefix}geometry must be 'sgd' (paper) or 'adam' (AdamW's preconditioner), "
                          f"got {config.geometry!r}")
    if config.schedule_stretch <= 0:
        raise ConfigError(f"{prefix}schedule_stretch must be > 0, got {config.schedule_stretch}")
    if config.method == REPLAY_METHOD and not config.schedule_path:
        raise ConfigError(f"{prefix}method=schedule needs {prefix}schedule_path (a trajectory JSONL)")
    if config.alignments == "steps" and signal_source(config) is Signal.training_losses:
        raise ConfigError(f"{prefix}alignments: steps does not apply to method {config.method!r}: it reads the "
                          "training losses, not alignments; leave alignments at 'probe'")


def signal_source(config: AlgorithmConfig) -> Signal:
    """Where this run's updates read their numbers from: the method class's ``signal``, except that ``method:
    schedule`` is :attr:`Signal.replay` and ``alignments: steps`` turns a probing method's :attr:`Signal.probe` into
    :attr:`Signal.step_alignments` (the domain side from the training steps; other methods keep theirs: a method
    that never moves, R&B, the loss-driven ones, which check_algorithm refuses with steps). The one rule for the
    controller, which builds the source, and for GrapeLoop, the trainer integrations and the recipe checks, which
    must know it before a controller exists."""
    if config.method == REPLAY_METHOD:
        return Signal.replay
    signal = REWEIGHTERS[canonical_method(config.method)].signal
    if config.alignments == "steps" and signal is Signal.probe:
        return Signal.step_alignments
    return signal


def check_reweighter_options(config: AlgorithmConfig, num_domains: int, num_tasks: int) -> None:
    """The values of the options ``config.method``'s reweighter gets, checked by its options dataclass now
    (before any model or data is opened), each failure one ConfigError naming the method."""
    if config.method == REPLAY_METHOD:
        return
    options = method_options_class(config.method)(**reweighter_options(config))
    try:
        options.resolve(num_domains, max(num_tasks, 1))
    except ConfigError as exc:
        raise type(exc)(f"algorithm (method {config.method}): {exc}") from None
