"""GrapeAlgorithm: GRAPE in a Composer Trainer, a thin Algorithm over
:class:`~grape_stream.grape.controller.GrapeController` (which decides when to update and does the work).

Why these events (Composer 0.32.1): there is no BEFORE_OPTIMIZER_STEP event, and AFTER_TRAIN_BATCH runs
inside the optimizer closure where ``.grad`` holds the live step's gradient. GRAPE therefore updates at
BATCH_END, after the optimizer step and the scheduler step, where nothing of the step is left to
disturb: it differentiates the unwrapped module with ``torch.autograd.grad`` (``.grad``, gradient
accumulation, microbatching and the optimizer state are untouched) and reads the learning rate the
next step will use. BATCH_END runs before BATCH_CHECKPOINT, so a checkpoint taken at an update step
already holds the new weights.

FSDP (``fsdp_config`` / ``parallelism_config``): at INIT, before Composer wraps the model, a meta-device
skeleton of it is kept; at each update every rank probes an unsharded replica rebuilt from the full
weights (:mod:`grape_stream.integrations.sharded`), exactly as under DDP.

Algorithm state is keyed by ``type(self).__qualname__`` in Composer checkpoints: keep the class name
``GrapeAlgorithm`` stable. The state is plain Python types (weights_only-safe). The mixer's position and
weights are saved by Composer itself through the train dataset's ``state_dict(num_samples, from_beginning)``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from composer.core import Algorithm, Event, State
from composer.core.precision import get_precision_context
from composer.loggers import Logger
from torch import nn

from grape_stream.config import AlgorithmConfig
from grape_stream.errors import ConfigError
from grape_stream.grape.controller import REPLAY_METHOD, GrapeController
from grape_stream.grape.gram.instep import sort_by_domain
from grape_stream.integrations.common import as_task, find_mixer, split_algorithm_options
from grape_stream.integrations.composer.model import composer_per_sample_loss
from grape_stream.integrations.progress import UpdateProgress
from grape_stream.integrations.sharded import is_sharded, probe_skeleton, unsharded_replica

__all__ = ["GrapeAlgorithm"]

#: The events of an observed training step (alignments: steps): the batch, each micro-batch's forward and backward.
_STEP_EVENTS = (Event.AFTER_DATALOADER, Event.BEFORE_FORWARD, Event.AFTER_BACKWARD)

#: The constructor's defaults are the recipe's (grape_stream.config), stated once.
_DEFAULTS = AlgorithmConfig()


class GrapeAlgorithm(Algorithm):
    """GRAPE inside a Composer Trainer: every ``alpha_every`` / ``z_every`` optimizer steps (at BATCH_END),
    probe the K domains and N tasks, update alpha and z, and hand alpha to the mixer.

    ``tasks`` are :class:`~grape_stream.grape.tasks.TaskStream` objects or dicts of their arguments (the form
    an llm-foundry YAML gives). ``mu_alpha`` / ``mu_z`` are passed only to methods that take them, so
    ``method="uniform"`` works with the same arguments. Other keyword options go to the reweighter
    (see ``grape_stream.grape.reweighting``) or the controller (``probe_mode``, ``schedule_path``, ...).
    ``progress`` prints a progress line during each update and its timing after it (global rank 0, stderr).
    """

    def __init__(
        self,
        method: str = _DEFAULTS.method,
        tasks: Sequence[Any] = (),
        alpha_every: int = _DEFAULTS.alpha_every,
        z_every: int = _DEFAULTS.z_every,
        probe_domain_batch: int = _DEFAULTS.probe_domain_batch,
        probe_task_batch: int = _DEFAULTS.probe_task_batch,
        mu_alpha: float | None = _DEFAULTS.mu_alpha,
        mu_z: float | None = _DEFAULTS.mu_z,
        per_sample_loss: Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
        seed: int = _DEFAULTS.seed,
        log_alignment: bool = True,
        progress: bool = True,
        **options: Any,
    ) -> None:
        self.method = method
        self.tasks = [as_task(t) for t in tasks]
        self.alpha_every = alpha_every
        self.z_every = z_every
        self.probe_domain_batch = probe_domain_batch
        self.probe_task_batch = probe_task_batch
        self.per_sample_loss = per_sample_loss or composer_per_sample_loss
        self.seed = seed
        self.log_alignment = log_alignment
        self.progress = UpdateProgress(enabled=progress)
        self.controller_options, self.reweighter_options = split_algorithm_options(method, options, mu_alpha, mu_z)
        self.controller: GrapeController | None = None
        self._pending_state: dict[str, Any] | None = None
        self._skeleton: nn.Module | None = None  # FSDP: the model's architecture on meta, taken at INIT

    def __repr__(self) -> str:
        return (f"GrapeAlgorithm(method={self.method!r}, tasks={[t.name for t in self.tasks]}, "
                f"alpha_every={self.alpha_every}, z_every={self.z_every})")

    # -- Composer hooks ------------------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        if event in _STEP_EVENTS:  # alignments: steps observes the training forward / backward itself
            return self.controller is not None and self.controller.instep is not None
        return event in (Event.INIT, Event.FIT_START, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Logger) -> Optional[int]:
        if event == Event.INIT:
            if getattr(state, "fsdp_config", None) is not None and not is_sharded(state.model):
                self._skeleton = probe_skeleton(state.model)
            return None
        if event == Event.FIT_START:
            self._fit_start(state)
            return None
        assert self.controller is not None, "FIT_START builds the controller"
        if event in _STEP_EVENTS:
            self._observe(event, state)
            return None
        step = int(state.timestamp.batch)
        if self.controller.instep is not None:
            self.controller.instep.after_step()  # an observed step's sums join the interval's (over ranks)
        if not any(self.controller.due(step)) and self.controller.method != REPLAY_METHOD:
            return None
        lr = float(state.optimizers[0].param_groups[0]["lr"]) if state.optimizers else 0.0
        autocast = self._autocast(state)
        ctl = self.controller
        index = ctl.num_updates + 1
        model = state.model
        if self._skeleton is not None and ctl.needs_probe and is_sharded(model):
            model = unsharded_replica(model, self._skeleton)  # a collective: every rank is here at this step
        with self._progress(index, step):
            rec = ctl.maybe_update(model, step, lr, autocast=autocast,
                                   consumed_batches=int(state.timestamp.batch_in_epoch),
                                   optimizer=state.optimizers[0] if state.optimizers else None)
        if rec is not None:
            if ctl.needs_probe:
                self.progress.finished(index, step, rec)
            logger.log_metrics(self._metrics(rec))
        return None

    def _observe(self, event: Event, state: State) -> None:
        """alignments: steps. The batch of an observed step is put in domain order (its samples' order within
        the batch: contiguous rows per domain make the per-domain gradients plain matmuls of views); each
        micro-batch's forward + backward is observed (step = the optimizer step being trained, 1-based)."""
        instep = self.controller.instep if self.controller is not None else None
        assert instep is not None
        step = int(state.timestamp.batch) + 1
        if event == Event.AFTER_DATALOADER:
            if instep.observed(step) and isinstance(state.batch, Mapping) and "domain" in state.batch:
                state.batch = sort_by_domain(state.batch)
        elif event == Event.BEFORE_FORWARD:
            instep.begin(state.model, step, state.batch, optimizer=state.optimizers[0] if state.optimizers else None,
                         autocast=self._autocast(state))
        else:
            instep.end()

    def _progress(self, index: int, step: int) -> Any:
        """The progress context of the update at ``step`` (nothing for methods that do not probe)."""
        ctl = self.controller
        assert ctl is not None
        if not ctl.needs_probe or not any(ctl.due(step)):
            return contextlib.nullcontext()
        K, N = 0 if ctl.instep is not None else len(ctl.domain_names), len(ctl.task_names)  # steps: tasks only
        return self.progress.update(index, step, K, N, K * ctl.probe_domain_batch + N * ctl.probe_task_batch)

    def _fit_start(self, state: State) -> None:
        if self._skeleton is None and is_sharded(state.model):
            raise NotImplementedError(
                "GrapeAlgorithm under FSDP must see the model before it is sharded: pass it in the Trainer's "
                "algorithms= (it keeps the architecture at Event.INIT), not to a Trainer whose model is already "
                "wrapped."
            )
        if self._skeleton is not None and self.controller_options.get("alignments", "probe") != "probe":
            raise ConfigError("alignments: steps is not supported under FSDP: each rank's backward sees a shard of "
                              "every weight gradient; use alignments: probe (docs/alignment.md, 'In-step alignments')")
        if self._skeleton is not None and self.controller_options.get("geometry", "sgd") != "sgd":
            raise ConfigError(
                "geometry='adam' is not supported under FSDP: the probe runs on an unsharded replica whose "
                "parameters have no optimizer state; use geometry='sgd' (the paper) or train with DDP"
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
                per_sample_loss=self.progress.wrap_loss(self.per_sample_loss),
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
        precision = state.precision
        config = getattr(state, "precision_config", None)
        return lambda: get_precision_context(precision, config)

    def _metrics(self, rec: Mapping[str, Any]) -> dict[str, float]:
        assert self.controller is not None
        return self.controller.metrics(rec, alignment=self.log_alignment)

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
