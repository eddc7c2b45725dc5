"""``grape-stream train``: a recipe built into a Composer Trainer (model wrapper, optimizer, scheduler,
GrapeAlgorithm, callbacks, loggers, evaluators).

Everything that needs no Composer (loading, overrides, validation, data streams, mixer, model, GRAPE's
arguments) lives in :mod:`grape_stream.recipe`; this module only assembles Composer's objects from it.

Paper-scale recipes must be checkable on a laptop: :func:`build` with ``dry_run=True`` constructs the
model on the meta device and every other object that needs no data, so a recipe is validated in a
second without a GPU and without its data.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from composer import Trainer
from composer import loggers as composer_loggers
from composer.algorithms import GradientClipping
from composer.core import Evaluator
from composer.optim import DecoupledAdamW
from composer.utils import dist, parse_uri, reproducibility

from grape_stream.config import RecipeConfig
from grape_stream.errors import ConfigError, did_you_mean
from grape_stream.integrations.composer.algorithm import GrapeAlgorithm
from grape_stream.integrations.composer.callbacks import GrapeTrajectoryCallback, JSONLMetricsLogger, TaskEvalSummary
from grape_stream.integrations.composer.checkpoints import (
    SAVE_FILENAME,
    SAVE_LATEST_FILENAME,
    recover_before_autoresume,
)
from grape_stream.integrations.composer.console_log import GrapeConsoleLogger, composer_warnings_filtered
from grape_stream.integrations.composer.model import ComposerGPT, composer_model
from grape_stream.integrations.composer.recipe_callbacks import build_callbacks, check_callback_names
from grape_stream.integrations.composer.schedulers import build_scheduler
from grape_stream.recipe import (
    as_recipe,
    build_mixer,
    build_model,
    check_local_data,
    read_manifest,
    recipe_streams,
    resolve_prior,
    resolved_sizes,
    train_dataloader,
)
from grape_stream.world import process_world

__all__ = ["Built", "build", "build_algorithm", "build_optimizer", "composer_model", "recover_before_autoresume"]

DEVICES = ("cpu", "gpu", "mps")
#: TrainerConfig fields that are Composer Trainer arguments of the same name and meaning, passed as they are.
SAME_NAME_KEYS = ("max_duration", "eval_interval", "eval_subset_num_batches", "save_folder", "save_interval",
                  "save_num_checkpoints_to_keep", "save_overwrite", "autoresume", "load_path", "progress_bar")
#: (train_cli.LOGGER_NAMES holds the names, checked before Composer is imported; a test keeps them equal)
LOGGERS = {
    "file": composer_loggers.FileLogger,
    "tensorboard": composer_loggers.TensorboardLogger,
    "wandb": composer_loggers.WandBLogger,
    "mlflow": composer_loggers.MLFlowLogger,
    "inmemory": composer_loggers.InMemoryLogger,
}


@dataclass
class Built:
    """Everything a recipe builds; ``trainer`` is None in a dry run."""

    cfg: RecipeConfig
    model: Any
    algorithm: Any
    tasks: list[Any]
    domains: list[dict[str, Any]]
    optimizer: Any
    scheduler: Any
    per_rank_batch_size: int
    mixer: Any = None
    train_dataloader: Any = None
    evaluators: list[Any] = field(default_factory=list)
    callbacks: list[Any] = field(default_factory=list)
    loggers: list[Any] = field(default_factory=list)
    #: the prior ``alpha0`` named (recipe/prior.py: weights, seconds, details), or None
    prior: dict[str, Any] | None = None
    trainer: Any = None
    checkpoint_recovery: Any = None  # the Recovery of this rank's checkpoint folder (autoresume, local folder)
    model_kind: str = ""  # what describe() names: the recipe's model.kind, or the class of a prebuilt model

    def close(self) -> None:
        """Close the trainer, then release the streaming resources of the mixer and the tasks."""
        if self.trainer is not None:
            self.trainer.close()
        if self.mixer is not None:
            self.mixer.close()
        for t in self.tasks:
            t.close()

    def describe(self) -> dict[str, Any]:
        n_params = sum(p.numel() for p in self.model.parameters())
        c = self.cfg
        return {
            "run_name": c.run_name,
            "model": f"{self.model_kind or c.model.kind} ({n_params / 1e6:.1f}M parameters)",
            "domains": [d["name"] for d in self.domains],
            "tasks": [t.name for t in self.tasks],
            "method": c.algorithm.method,
            "max_duration": c.trainer.max_duration,
            "global_batch": c.trainer.global_train_batch_size,
            "per_rank_batch": self.per_rank_batch_size,
            "lr": c.optimizer.lr,
            "scheduler": c.scheduler.name,
        }


def _device_name(cfg: RecipeConfig) -> str:
    dev = cfg.trainer.device
    if dev == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if dev not in DEVICES:
        raise ConfigError(f"recipe key 'trainer.device' must be auto, cpu, gpu or mps, got {dev!r}")
    return dev


PerSampleLoss = Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]


def build_algorithm(cfg: RecipeConfig | Mapping[str, Any], tasks: list[Any],
                    per_sample_loss: Optional[PerSampleLoss] = None, progress: bool = True) -> GrapeAlgorithm:
    """GrapeAlgorithm with the recipe's ``algorithm`` section (an AlgorithmConfig, handed over as it is);
    ``progress``: its per-update lines (``--quiet`` and the demo's ``--no-progress`` turn them off)."""
    return GrapeAlgorithm(as_recipe(cfg).algorithm, tasks=tasks, per_sample_loss=per_sample_loss, progress=progress)


def check_names(cfg: RecipeConfig) -> None:
    """Before anything is built, dry run included: callbacks and loggers are known, a local trainer.load_path exists
    (else the real run fails after building everything, with a long traceback)."""
    check_callback_names(cfg.callbacks or {})
    for name in cfg.trainer.loggers or {}:
        if name not in LOGGERS:
            hint = did_you_mean(name, LOGGERS) or ";"
            raise ConfigError(f"unknown logger 'trainer.loggers.{name}'{hint} choose from {sorted(LOGGERS)}")
    load = cfg.trainer.load_path
    if load and not parse_uri(str(load))[0] and not os.path.exists(os.path.expanduser(str(load))):
        raise ConfigError(f"recipe key 'trainer.load_path' is {load!r}, which does not exist; to continue a run "
                          "from its trainer.save_folder, set trainer.autoresume=true instead")


def _loggers(cfg: RecipeConfig, output_dir: str) -> list[Any]:
    out = []
    for name, kwargs in cfg.trainer.loggers.items():
        out.append(LOGGERS[name](**dict(kwargs or {})))
    if cfg.trainer.metrics_jsonl:
        out.append(JSONLMetricsLogger(os.path.join(output_dir, "metrics.jsonl")))
    return out


def _evaluators(cfg: RecipeConfig, tasks: list[Any]) -> list[Evaluator]:
    data = cfg.data
    if not (tasks and data.task_test_split):
        return []
    return [
        Evaluator(
            label=t.name,
            dataloader=t.eval_dataloader(data.eval_batch_size, num_workers=data.eval_num_workers),
            metric_names=["LanguageCrossEntropy", "LanguagePerplexity"],
        )
        for t in tasks
    ]


def build_optimizer(cfg: RecipeConfig | Mapping[str, Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    """``adamw``: torch's AdamW; ``decoupled_adamw``: Composer's DecoupledAdamW (llm-foundry's usual optimizer,
    its weight decay scaled by lr / peak lr rather than by lr)."""
    o = as_recipe(cfg).optimizer
    kwargs: dict[str, Any] = dict(lr=float(o.lr), betas=tuple(o.betas), eps=float(o.eps),
                                  weight_decay=float(o.weight_decay))
    if o.name.lower() == "decoupled_adamw":
        return DecoupledAdamW(model.parameters(), **kwargs)
    return torch.optim.AdamW(model.parameters(), **kwargs)


def build(cfg: RecipeConfig | Mapping[str, Any], *, dry_run: bool = False, extra_callbacks: Sequence[Any] = (),
          extra_loggers: Sequence[Any] = (), model: Optional[torch.nn.Module] = None,
          per_sample_loss: Optional[PerSampleLoss] = None, progress: bool = True, console: bool = True) -> Built:
    """Build a recipe. ``dry_run``: the model on the meta device and no data opened, no Trainer.

    ``model``: a decoder the recipe cannot name (llm-foundry's MPT, a custom class), used instead of the
    recipe's ``model`` section (see :func:`composer_model`; its vocabulary must cover the data's).
    ``per_sample_loss(model, batch) -> Tensor[B]``: what GRAPE probes, when the model's own
    ``per_sample_loss`` (ComposerGPT's) or the default for ComposerModels does not fit. ``progress``: GRAPE's
    per-update lines (stderr, global rank 0). ``console``: the training log on stderr when the recipe's
    ``trainer.log_to_console`` asks for it (``--quiet`` turns it off), cut to what a person reads
    (:class:`~grape_stream.integrations.composer.console_log.GrapeConsoleLogger`).
    """
    cfg = copy.deepcopy(as_recipe(cfg))
    world = process_world().size
    gbs = cfg.trainer.global_train_batch_size
    if gbs % world:
        raise ConfigError(f"recipe key 'trainer.global_train_batch_size' ({gbs}) is not divisible by the {world} ranks")
    per_rank = gbs // world
    if cfg.trainer.autoresume and not cfg.trainer.save_folder:  # Composer would refuse it in Trainer()
        raise ConfigError("recipe key 'trainer.autoresume' is true but 'trainer.save_folder' is not set: "
                          "set trainer.save_folder (where checkpoints go) or trainer.autoresume=false")

    check_names(cfg)
    domains, tasks = recipe_streams(cfg)
    local_data = cfg.data.remote is None and cfg.data.local is not None and os.path.isdir(cfg.data.local)
    check_local_data(cfg, domains, tasks)  # local data is there, dry run too, before anything is built (one line)
    # a dry run reads a local manifest too (model.vocab_size may come from it), never a remote one (offline checks)
    manifest = read_manifest(cfg) if not dry_run or local_data else None
    vocab, seq = resolved_sizes(cfg, manifest)
    # alpha0: crisp -> weights from the data (a dry run stays offline: the recipe checked the name only)
    prior = None if dry_run else resolve_prior(cfg, domains, tasks, manifest)
    if not dry_run:
        # Trainer(seed=) seeds only after the model exists: seed first so initial weights are reproducible.
        reproducibility.seed_all(cfg.seed)
    kind = cfg.model.kind if model is None else f"prebuilt {type(model).__name__}"
    if model is None:
        model = ComposerGPT(build_model(cfg, vocab_size=vocab, seq_len=seq, device="meta" if dry_run else None))
    else:
        model = composer_model(model)
    algorithm = build_algorithm(cfg, tasks, per_sample_loss, progress=progress)
    built = Built(cfg=cfg, model=model, algorithm=algorithm, tasks=tasks, domains=domains,
                  optimizer=build_optimizer(cfg, model), scheduler=build_scheduler(cfg), per_rank_batch_size=per_rank,
                  model_kind=kind, prior=prior)
    if not dry_run:
        _build_trainer(built, world, extra_callbacks, extra_loggers, console=console)
    return built


def _build_trainer(built: Built, world: int, extra_callbacks: Sequence[Any], extra_loggers: Sequence[Any],
                   console: bool = True) -> None:
    """Open the data (mixer, evaluators) and build the Trainer into ``built``."""
    cfg, t = built.cfg, built.cfg.trainer
    assert cfg.run_name is not None, "load_config names every run"
    output_dir = cfg.output_dir.format(run_name=cfg.run_name)
    device = _device_name(cfg)
    if world > 1:
        dist.initialize_dist(device)
    save_filename, latest_filename = SAVE_FILENAME, SAVE_LATEST_FILENAME
    if t.autoresume:
        built.checkpoint_recovery = recover_before_autoresume(
            t.save_folder, cfg.run_name, save_filename=save_filename, latest_filename=latest_filename)
        if world > 1:
            dist.barrier()  # every rank's folder is consistent before any rank reads a `latest`
    mixer = build_mixer(cfg, built.domains, built.per_rank_batch_size, cfg.seed)
    train_dl = train_dataloader(cfg, mixer, built.per_rank_batch_size)
    evaluators = _evaluators(cfg, built.tasks)
    callbacks: list[Any] = []
    a = cfg.algorithm
    if a.trajectory:  # True: <output_dir>/grape_trajectory.jsonl; or a file path
        if isinstance(a.trajectory, (str, os.PathLike)):
            folder, filename = os.path.split(os.fspath(a.trajectory))
            trajectory = GrapeTrajectoryCallback(folder=folder or ".", filename=filename, plots=a.plots,
                                                 summary=a.summary)
        else:
            trajectory = GrapeTrajectoryCallback(folder=output_dir, plots=a.plots, summary=a.summary)
        callbacks.append(trajectory)
    if evaluators:
        callbacks.append(TaskEvalSummary([task.name for task in built.tasks]))
    callbacks.extend(build_callbacks(cfg.callbacks or {}))
    callbacks.extend(extra_callbacks)
    loggers = _loggers(cfg, output_dir) + list(extra_loggers)
    if t.log_to_console and console and not t.progress_bar:
        loggers.append(GrapeConsoleLogger(log_interval=t.log_interval, stream="stderr"))
    with composer_warnings_filtered():
        trainer = _trainer(built, cfg, train_dl, evaluators, callbacks, loggers, device)
    built.mixer, built.train_dataloader, built.evaluators = mixer, train_dl, evaluators
    built.callbacks, built.loggers, built.trainer = callbacks, loggers, trainer


def _trainer(built: Built, cfg: RecipeConfig, train_dl: Any, evaluators: list[Any], callbacks: list[Any],
             loggers: list[Any], device: str) -> Any:
    """Composer's Trainer with the recipe's values (``log_to_console``: our console logger is in ``loggers``)."""
    t = cfg.trainer
    algorithms: list[Any] = [built.algorithm]
    if t.grad_clip_norm is not None:
        algorithms.append(GradientClipping(clipping_type="norm", clipping_threshold=float(t.grad_clip_norm)))
    return Trainer(
        run_name=cfg.run_name,
        model=built.model,
        train_dataloader=train_dl,
        eval_dataloader=evaluators or None,
        optimizers=built.optimizer,
        schedulers=built.scheduler,
        algorithms=algorithms,
        callbacks=callbacks,
        loggers=loggers,
        device=device,
        precision=t.precision or ("amp_bf16" if device == "gpu" else "fp32"),
        device_train_microbatch_size=t.device_train_microbatch_size or built.per_rank_batch_size,
        seed=cfg.seed,
        save_filename=SAVE_FILENAME,
        save_latest_filename=SAVE_LATEST_FILENAME,
        python_log_level=None,
        log_to_console=False,
        **{key: getattr(t, key) for key in SAME_NAME_KEYS},
    )
