"""``grape-stream train``'s command line: parse the recipe and check what can be checked *before* Composer is imported.

Why a module of its own: importing Composer takes 8-20 s on a laptop, and the trainer module needs it at import
time. A misspelt key, a bad value, local data that is not there (``--dry-run`` included), a missing
``trainer.load_path`` or an unknown logger is reported at once, in one line; only then is the Trainer built
(:mod:`grape_stream.integrations.composer.trainer`).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Mapping, Sequence

import yaml

from grape_stream.config import RecipeConfig
from grape_stream.console import LEVELS, add_console_arguments, configure_logging, is_quiet, level_given
from grape_stream.errors import ConfigError, DataError, did_you_mean
from grape_stream.recipe.load import load_config
from grape_stream.recipe.schema import recipe_dict
from grape_stream.world import process_world

__all__ = ["CALLBACK_NAMES", "LOGGER_NAMES", "check_before_build", "describe_lines", "main"]

#: The recipe's ``trainer.loggers`` names (the trainer module maps each to Composer's logger class).
LOGGER_NAMES = ("file", "tensorboard", "wandb", "mlflow", "inmemory")
#: The bucket name the bundled paper recipes hold in ``data.remote``: the user's bucket goes there.
PLACEHOLDER = "YOUR-BUCKET"
#: The recipe's ``callbacks`` names (``recipe_callbacks.CALLBACKS``, which imports Composer; a test keeps them equal).
CALLBACK_NAMES = ("lr_monitor", "speed_monitor", "memory_monitor", "memory_snapshot", "runtime_estimator",
                  "optimizer_monitor", "nan_monitor", "activation_monitor", "system_metrics_monitor", "early_stopper",
                  "threshold_stopper", "oom_observer", "grape_trajectory", "grape_eval_summary")


def check_before_build(cfg: RecipeConfig, *, dry_run: bool) -> None:
    """Everything about a recipe that needs neither Composer nor the model, one line each: the batch divides
    over the ranks, autoresume has a folder, the loggers are known, a local ``trainer.load_path`` exists, and
    every local-only domain and task has its data (a dry run too: a recipe whose data is missing is not valid), and
    a real run's remote is not the bundled recipes' placeholder bucket (a dry run, offline, takes it)."""
    world = process_world().size
    gbs = cfg.trainer.global_train_batch_size
    if gbs % world:
        raise ConfigError(f"recipe key 'trainer.global_train_batch_size' ({gbs}) is not divisible by the {world} ranks")
    if cfg.trainer.autoresume and not cfg.trainer.save_folder:  # Composer would refuse it in Trainer()
        raise ConfigError("recipe key 'trainer.autoresume' is true but 'trainer.save_folder' is not set: "
                          "set trainer.save_folder (where checkpoints go) or trainer.autoresume=false")
    for name in cfg.callbacks or {}:  # a class named 'package.module:Class' is imported (and checked) by build()
        if ":" not in name and name not in CALLBACK_NAMES:
            hint = did_you_mean(name, CALLBACK_NAMES) or ";"
            raise ConfigError(f"unknown callback 'callbacks.{name}'{hint} choose from {sorted(CALLBACK_NAMES)} "
                              "or name a class as 'package.module:ClassName'")
    for name in cfg.trainer.loggers or {}:
        if name not in LOGGER_NAMES:
            hint = did_you_mean(name, LOGGER_NAMES) or ";"
            raise ConfigError(f"unknown logger 'trainer.loggers.{name}'{hint} choose from {sorted(LOGGER_NAMES)}")
    load = cfg.trainer.load_path
    if load and "://" not in str(load) and not os.path.exists(os.path.expanduser(str(load))):
        raise ConfigError(f"recipe key 'trainer.load_path' is {load!r}, which does not exist; to continue a run "
                          "from its trainer.save_folder, set trainer.autoresume=true instead")
    data = cfg.data
    for key, value in (("data.remote", data.remote), ("data.task_remote", data.task_remote)):
        if not dry_run and value is not None and PLACEHOLDER in str(value):
            raise ConfigError(f"recipe key {key!r} is {value!r}: {PLACEHOLDER} is a placeholder; set {key}=s3://<your "
                              "bucket>/<prefix>, where grape-stream convert wrote the data")
    if data.remote is None and data.local is not None and not os.path.isdir(data.local):
        hint = " (`make demo` converts the bundled corpus there)" if cfg.run_name == "demo-cpu" else ""
        raise DataError(f"recipe key 'data.local' is {data.local!r}, which does not exist{hint}: convert a corpus "
                        "there (grape-stream convert) or point data.local / data.remote at one")
    from grape_stream.recipe.data import check_local_data, recipe_streams  # streaming: seconds, after the above

    domains, tasks = recipe_streams(cfg)
    check_local_data(cfg, domains, tasks)


def describe_lines(described: Mapping[str, Any]) -> str:
    """The build's description as JSON, one key a line (lists of names on their line, not one name a line)."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in described.items())
    return "{\n" + body + "\n}"


def _recipe_log_level(level: str | None) -> None:
    """llm-foundry's ``python_log_level``: grape_stream's and Composer's level, unless --log-level was given."""
    if level is None or level_given():
        return
    if str(level).lower() not in LEVELS:
        raise ConfigError(f"recipe key 'python_log_level' must be one of {', '.join(LEVELS)}, got {level!r}")
    configure_logging(str(level).lower(), quiet=is_quiet(), also=("composer",))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grape-stream train",
        description="Train from a YAML recipe (Composer). Overrides: omegaconf dotlist key=value, e.g. "
                    "algorithm.method=uniform model.n_layers=4 (llm-foundry key names are accepted).",
    )
    parser.add_argument("recipe", help="a recipe YAML path, or the name of a bundled recipe (e.g. demo-cpu)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (values are YAML)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate and build (model on meta device), do not train; local data is checked")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved recipe as YAML and exit (nothing is built or trained)")
    parser.add_argument("--resume", metavar="PATH", help=argparse.SUPPRESS)  # answered below with the recipe keys
    add_console_arguments(parser)
    # intermixed: `grape-stream train RECIPE --dry-run key=value` works as well as options first
    args = parser.parse_intermixed_args(list(argv) if argv is not None else None)
    if args.resume is not None:
        raise ConfigError(f"train has no --resume: to continue a run from its checkpoints set trainer.autoresume=true "
                          f"(with trainer.save_folder), or start from one checkpoint with "
                          f"trainer.load_path={args.resume}")
    cfg = load_config(args.recipe, args.overrides)
    _recipe_log_level(cfg.python_log_level)
    if args.print_config:  # print and stop: a user asking to see the recipe did not ask to train
        print(yaml.safe_dump(recipe_dict(cfg), sort_keys=False))
        return 0
    check_before_build(cfg, dry_run=args.dry_run)
    from grape_stream.integrations.composer.trainer import build  # Composer: seconds, after the checks

    built = build(cfg, dry_run=args.dry_run, progress=not is_quiet(), console=not is_quiet())
    print(describe_lines(built.describe()), flush=True)
    if args.dry_run:
        return 0
    try:
        built.trainer.fit()
    finally:
        built.close()
    return 0
