"""Composer adapters: GrapeAlgorithm (over :class:`~grape_stream.grape.controller.GrapeController`), the trajectory
and evaluation-summary callbacks, and ComposerGPT (a ComposerModel for any tokens -> logits decoder).

Why these events (Composer 0.32.1): there is no BEFORE_OPTIMIZER_STEP event, and AFTER_TRAIN_BATCH runs
inside the optimizer closure where ``.grad`` holds the live step's gradient. GRAPE therefore updates at
BATCH_END, after the optimizer step and the scheduler step, where nothing of the step is left to
disturb: it differentiates the unwrapped module with ``torch.autograd.grad`` (``.grad``, gradient
accumulation, microbatching and the optimizer state are untouched) and reads the learning rate the
next step will use. BATCH_END runs before BATCH_CHECKPOINT, so a checkpoint taken at an update step
already holds the new weights.

Algorithm state is keyed by ``type(self).__qualname__`` in Composer checkpoints: keep the class name
``GrapeAlgorithm`` stable. The state is plain Python types (weights_only-safe). The mixer's position and
weights are saved by Composer itself through the train dataset's ``state_dict(num_samples, from_beginning)``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from composer.core import Algorithm, Callback, Event, State
from composer.loggers import Logger, LoggerDestination
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from composer.models import ComposerModel
from torch import nn

from grape_stream.grape.controller import GrapeController, filter_reweighter_options
from grape_stream.models import lm_targets, per_sample_lm_loss, per_sample_lm_loss_from_logits
from grape_stream.grape.tasks import TaskStream

__all__ = [
    "GrapeAlgorithm",
    "GrapeTrajectoryCallback",
    "TaskEvalSummary",
    "JSONLMetricsLogger",
    "ComposerGPT",
    "find_mixer",
    "build_grape_mixture_dataloader",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------
class ComposerGPT(ComposerModel):
    """A ComposerModel around any decoder ``module(tokens (B, T)) -> logits (B, T, V)``.

    The training loss is the mean over samples of the per-sample LM loss of
    :func:`grape_stream.models.per_sample_lm_loss` (padding never counts), the same loss the GRAPE probe
    differentiates, so alignments measure the objective being trained. Metrics are token-level
    cross-entropy (log-perplexity) and perplexity, honouring ``loss_mask``.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.model = module
        self.train_metrics = {"LanguageCrossEntropy": LanguageCrossEntropy()}
        self.val_metrics = {"LanguageCrossEntropy": LanguageCrossEntropy(), "LanguagePerplexity": LanguagePerplexity()}

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["tokens"].long()[:, :-1])

    def per_sample_loss_from_logits(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return per_sample_lm_loss_from_logits(logits, batch)

    def per_sample_loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """What the GRAPE probe differentiates: Tensor[B]."""
        return self.per_sample_loss_from_logits(self.forward(batch), batch)

    def loss(self, outputs: torch.Tensor, batch: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.per_sample_loss_from_logits(outputs, batch).mean()

    def eval_forward(self, batch: Mapping[str, torch.Tensor], outputs: Optional[Any] = None) -> torch.Tensor:
        return outputs if outputs is not None else self.forward(batch)

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        targets, mask = lm_targets(batch)
        targets = targets.clone()
        if mask is not None:
            targets[mask == 0] = -100
        metric.update(outputs, targets)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return self.train_metrics if is_train else self.val_metrics


def composer_per_sample_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Default probe loss: Tensor[B] of mean next-token cross-entropy (``loss_mask`` honoured).

    * a model with ``per_sample_loss(batch)`` (ComposerGPT) uses it;
    * another ComposerModel (llm-foundry's ComposerHFCausalLM / ComposerMPTCausalLM) is called the way
      its trainer calls it, with ``{"input_ids", "attention_mask"}``, and its logits are scored here;
    * a plain ``tokens -> logits`` module goes through :func:`grape_stream.models.per_sample_lm_loss`.
    """
    fn = getattr(model, "per_sample_loss", None)
    if callable(fn):
        return fn(batch)
    if isinstance(model, ComposerModel):
        tokens = batch["tokens"].long()
        out = model({"input_ids": tokens, "attention_mask": torch.ones_like(tokens)})
        logits = out.logits if hasattr(out, "logits") else out
        if isinstance(logits, Mapping):
            logits = logits["logits"]
        return per_sample_lm_loss_from_logits(logits[:, :-1], batch)
    return per_sample_lm_loss(model, batch)


# ---------------------------------------------------------------------------------------------------
# the algorithm
# ---------------------------------------------------------------------------------------------------
def find_mixer(dataloader: Any) -> Any:
    """The WeightedStreamingMixer behind a (Composer) train dataloader, or a clear error."""
    from grape_stream.mixing.mixer import WeightedStreamingMixer

    obj = getattr(dataloader, "dataloader", dataloader)  # DataSpec -> DataLoader
    dataset = getattr(obj, "dataset", None)
    # mixer.dataloader() (MixerDataLoader) keeps the mixer as `.mixer`; a plain DataLoader over the mixer
    # has it as `.dataset`.
    for candidate in (getattr(obj, "mixer", None), dataset, getattr(dataset, "mixer", None), obj):
        if isinstance(candidate, WeightedStreamingMixer):
            return candidate
    raise RuntimeError(
        "GrapeAlgorithm needs the train dataloader to read from a grape_stream.WeightedStreamingMixer "
        f"(DataLoader(dataset=mixer, ...)); the trainer's train dataloader is {type(obj).__name__} over "
        f"{type(dataset).__name__ if dataset is not None else 'no dataset'}"
    )


def _as_task(t: Any) -> TaskStream:
    if isinstance(t, TaskStream):
        return t
    if isinstance(t, Mapping):
        return TaskStream(**dict(t))
    raise TypeError(f"a task must be a TaskStream or a mapping of its arguments, got {type(t).__name__}")


class GrapeAlgorithm(Algorithm):
    """GRAPE inside a Composer Trainer: every ``alpha_every`` / ``z_every`` optimizer steps (at BATCH_END),
    probe the K domains and N tasks, update alpha and z, and hand alpha to the mixer.

    ``tasks`` are :class:`~grape_stream.grape.tasks.TaskStream` objects or dicts of their arguments (the form
    an llm-foundry YAML gives). ``mu_alpha`` / ``mu_z`` are passed only to methods that take them, so
    ``method="uniform"`` works with the same arguments. Other keyword options go to the reweighter
    (see ``grape_stream.grape.reweighting``) or the controller (``probe_mode``, ``schedule_path``, ...).
    """

    def __init__(
        self,
        method: str = "grape",
        tasks: Sequence[Any] = (),
        alpha_every: int = 100,
        z_every: int = 100,
        probe_domain_batch: int = 8,
        probe_task_batch: int = 8,
        mu_alpha: float | None = 1e-4,
        mu_z: float | None = 1.5e-5,
        per_sample_loss: Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
        seed: int = 0,
        log_alignment: bool = True,
        **options: Any,
    ) -> None:
        self.method = method
        self.tasks = [_as_task(t) for t in tasks]
        self.alpha_every = alpha_every
        self.z_every = z_every
        self.probe_domain_batch = probe_domain_batch
        self.probe_task_batch = probe_task_batch
        self.per_sample_loss = per_sample_loss or composer_per_sample_loss
        self.seed = seed
        self.log_alignment = log_alignment
        controller_keys = {"probe_mode", "probe_train_mode", "schedule_path", "schedule_stretch", "gram_options"}
        self.controller_options = {k: options.pop(k) for k in list(options) if k in controller_keys}
        defaults = {"mu_alpha": mu_alpha, "mu_z": mu_z}
        defaults = {k: v for k, v in defaults.items() if v is not None and k not in options}
        if options.get("step_size") == "constant":
            defaults = {}
        kept_defaults, _ = filter_reweighter_options(method, defaults, strict=False)
        self.reweighter_options = {**kept_defaults, **options}
        # Validate now (wrong option names fail at construction, not at FIT_START an hour later).
        filter_reweighter_options(method, self.reweighter_options, strict=True)
        self.controller: GrapeController | None = None
        self._pending_state: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return (f"GrapeAlgorithm(method={self.method!r}, tasks={[t.name for t in self.tasks]}, "
                f"alpha_every={self.alpha_every}, z_every={self.z_every})")

    # -- Composer hooks ------------------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Logger) -> Optional[int]:
        if event == Event.FIT_START:
            self._fit_start(state)
            return None
        assert self.controller is not None, "FIT_START builds the controller"
        step = int(state.timestamp.batch)
        if not any(self.controller.due(step)) and self.controller.method != "schedule":
            return None
        lr = float(state.optimizers[0].param_groups[0]["lr"]) if state.optimizers else 0.0
        autocast = self._autocast(state)
        rec = self.controller.maybe_update(state.model, step, lr, autocast=autocast,
                                           consumed_batches=int(state.timestamp.batch_in_epoch))
        if rec is not None:
            logger.log_metrics(self._metrics(rec))
        return None

    def _fit_start(self, state: State) -> None:
        if getattr(state, "fsdp_enabled", False):
            raise NotImplementedError(
                "GrapeAlgorithm does not support FSDP yet: its probe needs full (unsharded) gradients. "
                "Train with DDP (no fsdp_config / parallelism_config) or without GrapeAlgorithm."
            )
        mixer = find_mixer(state.train_dataloader)
        if self.controller is None:
            self.controller = GrapeController(
                mixer,
                self.tasks,
                method=self.method,
                alpha_every=self.alpha_every,
                z_every=self.z_every,
                probe_domain_batch=self.probe_domain_batch,
                probe_task_batch=self.probe_task_batch,
                per_sample_loss=self.per_sample_loss,
                seed=self.seed,
                **self.controller_options,
                **self.reweighter_options,
            )
        elif self.controller.mixer is not mixer:
            raise RuntimeError("the train dataloader's mixer changed between fit() calls; build a new GrapeAlgorithm")
        if self._pending_state is not None:
            self.controller.load_state_dict(self._pending_state)
            self._pending_state = None
        if self.controller.needs_probe:
            for task in self.tasks:  # open the probe splits now: a wrong path fails before training starts
                task.dataset()
        self.controller.start()

    @staticmethod
    def _autocast(state: State) -> Callable[[], Any] | None:
        try:
            from composer.core.precision import get_precision_context
        except Exception:  # pragma: no cover
            return None
        precision = state.precision
        config = getattr(state, "precision_config", None)
        return lambda: get_precision_context(precision, config)

    def _metrics(self, rec: Mapping[str, Any]) -> dict[str, float]:
        c = self.controller
        assert c is not None
        m: dict[str, float] = {}
        for name, a in zip(c.domain_names, rec["alpha"]):
            m[f"grape/alpha/{name}"] = a
        if rec.get("z") is not None:
            for name, z in zip(c.task_names, rec["z"]):
                m[f"grape/z/{name}"] = z
        for name, v in zip(c.task_names, rec.get("task_loss") or []):
            m[f"grape/task_loss/{name}"] = v
        for name, v in zip(c.domain_names, rec.get("domain_loss") or []):
            m[f"grape/domain_loss/{name}"] = v
        for name, v in zip(c.domain_names, rec.get("domain_alignment") or []):
            m[f"grape/domain_alignment/{name}"] = v
        for name, v in zip(c.task_names, rec.get("task_alignment") or []):
            m[f"grape/task_alignment/{name}"] = v
        if self.log_alignment and rec.get("alignment"):
            for dname, row in zip(c.domain_names, rec["alignment"]):
                for tname, v in zip(c.task_names, row):
                    m[f"grape/alignment/{dname}/{tname}"] = v
        secs = rec.get("seconds") or {}
        for k, v in secs.items():
            m[f"grape/seconds/{k}"] = v
        if "lr" in rec:
            m["grape/lr"] = rec["lr"]
        return {k: float(v) for k, v in m.items() if v is not None and math.isfinite(float(v))}

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.controller is not None:
            return {"controller": self.controller.state_dict()}
        return {"controller": self._pending_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ctl = state.get("controller") if isinstance(state, Mapping) else None
        if ctl is None:
            return
        if self.controller is not None:
            self.controller.load_state_dict(ctl)
        else:
            self._pending_state = dict(ctl)


def grape_algorithm_of(state: State) -> GrapeAlgorithm | None:
    for algo in state.algorithms:
        if isinstance(algo, GrapeAlgorithm):
            return algo
    return None


# ---------------------------------------------------------------------------------------------------
# callbacks
# ---------------------------------------------------------------------------------------------------
class GrapeTrajectoryCallback(Callback):
    """Writes the GRAPE trajectory as JSONL after every update (atomic rewrite: survives a kill) and the
    PNG plots (stacked areas of alpha and z, the domain-task alignment heatmap, per-task losses) at fit end.

    ``folder`` may contain ``{run_name}``. Only global rank 0 writes.
    """

    def __init__(self, folder: str = "{run_name}", filename: str = "grape_trajectory.jsonl", plots: bool = True) -> None:
        self.folder = folder
        self.filename = filename
        self.plots = plots
        self._written_updates = -1
        self.path: str | None = None

    def _path(self, state: State) -> str:
        return os.path.join(self.folder.format(run_name=state.run_name), self.filename)

    def _write(self, state: State) -> str | None:
        from composer.utils import dist

        algo = grape_algorithm_of(state)
        if algo is None or algo.controller is None:
            return None
        self.path = self._path(state)
        if dist.get_global_rank() == 0:
            algo.controller.write_trajectory(self.path)
        self._written_updates = algo.controller.num_updates
        return self.path

    def fit_start(self, state: State, logger: Logger) -> None:
        if grape_algorithm_of(state) is None:
            log.warning("GrapeTrajectoryCallback: no GrapeAlgorithm in this trainer; nothing will be written")

    def batch_end(self, state: State, logger: Logger) -> None:
        algo = grape_algorithm_of(state)
        if algo is not None and algo.controller is not None and algo.controller.num_updates != self._written_updates:
            self._write(state)

    def fit_end(self, state: State, logger: Logger) -> None:
        from composer.utils import dist

        path = self._write(state)
        if path is None or not self.plots or dist.get_global_rank() != 0:
            return
        from grape_stream.apps.plots import plot_trajectory

        try:
            plot_trajectory(path, os.path.splitext(path)[0] + ".png")
        except Exception as exc:  # a plotting problem must not fail a finished training run
            log.warning("could not plot the GRAPE trajectory %s: %s", path, exc)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class TaskEvalSummary(Callback):
    """After each evaluation round, log the average and the worst log-perplexity over the target tasks
    (``metrics/grape/avg_log_ppl``, ``metrics/grape/worst_log_ppl``) — the paper's two headline numbers."""

    def __init__(self, labels: Sequence[str], metric: str = "LanguageCrossEntropy") -> None:
        self.labels = list(labels)
        self.metric = metric
        self.last: dict[str, float] = {}

    def eval_after_all(self, state: State, logger: Logger) -> None:
        values = {}
        for label in self.labels:
            metric = state.eval_metrics.get(label, {}).get(self.metric)
            if metric is None:
                continue
            values[label] = float(metric.compute())
        if not values:
            return
        self.last = values
        logger.log_metrics({
            "metrics/grape/avg_log_ppl": sum(values.values()) / len(values),
            "metrics/grape/worst_log_ppl": max(values.values()),
        })

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class JSONLMetricsLogger(LoggerDestination):
    """Every logged metric as one JSON line ``{"step": batch, name: value, ...}`` (global rank 0 only).

    Lines are flushed as they are written, so a run killed mid-way keeps what it logged; a resumed run
    appends (a reader keeps the last value per step and name).
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._file: Any = None

    def _open(self) -> Any:
        from composer.utils import dist

        if dist.get_global_rank() != 0:
            return None
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        return self._file

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        f = self._open()
        if f is None:
            return
        row: dict[str, Any] = {"step": step}
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:
                    continue
                v = v.item()
            if isinstance(v, (int, float)):
                row[k] = float(v)
        import json

        f.write(json.dumps(row) + "\n")
        f.flush()

    def close(self, state: State, logger: Logger) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------------------------------
# llm-foundry dataloader (entry point `llmfoundry_dataloaders: grape_mixture`)
# ---------------------------------------------------------------------------------------------------
def build_grape_mixture_dataloader(
    tokenizer: Any = None,
    device_batch_size: int | float = 8,
    *,
    domains: Sequence[Any],
    remote: str | None = None,
    local: str | None = None,
    split: str | None = "train",
    weights: Sequence[float] | None = None,
    seed: int = 0,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    pin_memory: bool = False,
    **mixer_kwargs: Any,
) -> Any:
    """A Composer ``DataSpec`` over a :class:`~grape_stream.mixing.mixer.WeightedStreamingMixer`, built the way
    llm-foundry builds a train loader (``train_loader: {name: grape_mixture, ...}``).

    ``domains`` are names (read from ``<remote or local>/<name>/<split>``) or mappings of
    :class:`~grape_stream.mixing.mixer.DomainStream` arguments. Batches hold ``tokens`` and, for llm-foundry's
    models, ``input_ids`` and ``labels`` (the same ids; the models shift labels themselves). ``tokenizer``
    is accepted for the registry's signature and unused: the data is already tokenized.
    """
    from composer.core import DataSpec

    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    if int(device_batch_size) != device_batch_size or device_batch_size < 1:
        raise ValueError(f"grape_mixture needs a whole device_batch_size >= 1, got {device_batch_size!r}")

    def _join(base: str | None, name: str) -> str | None:
        if base is None:
            return None
        return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)

    streams = []
    for d in domains:
        if isinstance(d, str):
            streams.append(DomainStream(d, remote=_join(remote, d), local=_join(local, d), split=split))
        elif isinstance(d, Mapping):
            d = dict(d)
            name = d.pop("name")
            d.setdefault("remote", _join(remote, name))
            d.setdefault("local", _join(local, name))
            d.setdefault("split", split)
            streams.append(DomainStream(name, **d))
        else:
            raise TypeError(f"grape_mixture: a domain is a name or a mapping, got {type(d).__name__}")
    mixer = WeightedStreamingMixer(domains=streams, weights=weights, batch_size=int(device_batch_size), seed=seed,
                                   **mixer_kwargs)

    def add_model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
        batch["input_ids"] = batch["tokens"]
        batch["labels"] = batch["tokens"]
        return batch

    kwargs: dict[str, Any] = {"pin_memory": pin_memory}
    if num_workers > 0:
        kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    loader = mixer.dataloader(num_workers=num_workers, **kwargs)
    return DataSpec(loader, batch_transforms=add_model_inputs,
                    get_num_tokens_in_batch=lambda b: int(b["tokens"].numel()))
