"""GrapeAlgorithm: GRAPE in a Composer Trainer, a thin Composer shell over
:class:`~grape_stream.integrations.grape_loop.GrapeLoop` (the trainer-independent loop the HF and Lightning
callbacks use too), which drives :class:`~grape_stream.grape.controller.GrapeController`.

Why these events (Composer 0.32.1): there is no BEFORE_OPTIMIZER_STEP event, and AFTER_TRAIN_BATCH runs
inside the optimizer closure where ``.grad`` holds the live step's gradient. GRAPE therefore updates at
BATCH_END, after the optimizer step and the scheduler step, where nothing of the step is left to
disturb: it differentiates the unwrapped module with ``torch.autograd.grad`` (``.grad``, gradient
accumulation, microbatching and the optimizer state are untouched) and reads the learning rate the
next step will use. BATCH_END runs before BATCH_CHECKPOINT, so a checkpoint taken at an update step
already holds the new weights. With ``alignments: steps`` it also puts an observed step's batch in domain
order (AFTER_DATALOADER) and observes each micro-batch's forward + backward (BEFORE_FORWARD / AFTER_BACKWARD:
``GrapeLoop.begin_step`` / ``end_step``); the step's sums join the interval's at BATCH_END.

FSDP (``fsdp_config`` / ``parallelism_config``, FSDP1 with ``use_orig_params: true`` or FSDP2): every rank probes
the sharded model itself, one FSDP unit at a time while FSDP has its parameters gathered for the probe's own
forward and backward (:mod:`grape_stream.grape.gram.sharding`); no replica of the weights is built.

Algorithm state is keyed by ``type(self).__qualname__`` in Composer checkpoints: keep the class name
``GrapeAlgorithm`` stable. The state is plain Python types (weights_only-safe). The mixer's position and
weights are saved by Composer itself through the train dataset's ``state_dict(num_samples, from_beginning)``;
the trajectory is written by :class:`~grape_stream.integrations.composer.callbacks.GrapeTrajectoryCallback`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from composer.core import Algorithm, Event, State
from composer.core.precision import get_precision_context
from composer.loggers import Logger

from grape_stream.config import AlgorithmConfig
from grape_stream.grape.controller import GrapeController
from grape_stream.grape.gram.instep import sort_by_domain
from grape_stream.integrations.common import find_mixer
from grape_stream.integrations.composer.model import composer_per_sample_loss
from grape_stream.integrations.grape_loop import GrapeLoop, PerSampleLoss

__all__ = ["GrapeAlgorithm"]

#: The events of an observed training step (alignments: steps): the batch, each micro-batch's forward and backward.
_STEP_EVENTS = (Event.AFTER_DATALOADER, Event.BEFORE_FORWARD, Event.AFTER_BACKWARD)


class GrapeAlgorithm(Algorithm):
    """GRAPE inside a Composer Trainer: every ``alpha_every`` / ``z_every`` optimizer steps (at BATCH_END),
    probe the K domains and N tasks, update alpha and z, and hand alpha to the mixer.

    Arguments are :class:`~grape_stream.integrations.grape_loop.GrapeLoop`'s: ``config`` (an
    :class:`~grape_stream.config.AlgorithmConfig`, e.g. a recipe's ``algorithm`` section) or keyword
    overrides of its fields and of the reweighter's options (the form an llm-foundry YAML gives:
    ``algorithms: {grape: {method: grape, alpha_every: 50, tasks: [...]}}``), ``tasks`` (TaskStream objects or
    dicts of their arguments), ``per_sample_loss`` (default: the model's own, see
    :func:`~grape_stream.integrations.composer.model.composer_per_sample_loss`). ``progress`` prints a
    progress line during each update and its timing after it (global rank 0, stderr).
    """

    def __init__(self, config: AlgorithmConfig | Mapping[str, Any] | None = None, *,
                 per_sample_loss: PerSampleLoss | None = None, progress: bool = True, **kwargs: Any) -> None:
        self.loop = GrapeLoop(config=config, per_sample_loss=per_sample_loss or composer_per_sample_loss,
                              progress=progress, **kwargs)
        self.loop.write_trajectory = False  # GrapeTrajectoryCallback writes it (the run's folder, artifacts)

    @property
    def config(self) -> AlgorithmConfig:
        return self.loop.config

    @property
    def controller(self) -> GrapeController | None:
        """The GrapeController (None before FIT_START)."""
        return self.loop.controller

    @property
    def method(self) -> str:
        return self.loop.config.method

    @property
    def tasks(self) -> list[Any]:
        return self.loop.tasks

    @property
    def reweighter_options(self) -> dict[str, Any]:
        return self.loop.reweighter_options

    def __repr__(self) -> str:
        c = self.config
        return (f"GrapeAlgorithm(method={c.method!r}, tasks={[t.name for t in self.tasks]}, "
                f"alpha_every={c.alpha_every}, z_every={c.z_every})")

    # -- Composer hooks ------------------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        if event in _STEP_EVENTS:  # alignments: steps / a loss-driven method observes the training forward + backward
            return self.controller is not None and self.controller.signal.kind.watches_steps
        return event in (Event.FIT_START, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Logger) -> Optional[int]:
        if event == Event.FIT_START:
            self._fit_start(state)
            return None
        if event in _STEP_EVENTS:
            self._observe(event, state)
            return None
        step = int(state.timestamp.batch)
        if not self.loop.acts_at(step):
            return None
        optimizer = state.optimizers[0] if state.optimizers else None
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else 0.0
        metrics = self.loop.after_step(state.model, step, lr, autocast=self._autocast(state), optimizer=optimizer,
                                       consumed_batches=int(state.timestamp.batch_in_epoch))
        if metrics is not None:
            logger.log_metrics(metrics)
        return None

    def _observe(self, event: Event, state: State) -> None:
        """alignments: steps and the loss-driven methods (grape.loss_mode: every step). alignments: steps puts the
        batch of an observed step in domain order (its samples' order within the batch: contiguous rows per domain
        make the per-domain gradients plain matmuls of views); each micro-batch's forward + backward is observed
        (step = the optimizer step being trained, 1-based)."""
        assert self.controller is not None
        signal = self.controller.signal
        step = int(state.timestamp.batch) + 1
        if event == Event.AFTER_DATALOADER:
            sortable = isinstance(state.batch, Mapping) and "domain" in state.batch
            if signal.kind.reads_step_gradients and signal.observed(step) and sortable:
                state.batch = sort_by_domain(state.batch)
        elif event == Event.BEFORE_FORWARD:
            self.loop.begin_step(state.model, step, state.batch,
                                 optimizer=state.optimizers[0] if state.optimizers else None,
                                 autocast=self._autocast(state))
        else:
            self.loop.end_step()

    def _fit_start(self, state: State) -> None:
        """What this method cannot take exactly on this (possibly FSDP-sharded) model is refused here, in one
        line, before the first step (GrapeLoop.check_model: the probe, the in-step engine, the loss methods)."""
        self.loop.attach(find_mixer(state.train_dataloader))
        self.loop.check_model(state.model)
        self.loop.start()

    @staticmethod
    def _autocast(state: State) -> Callable[[], Any]:
        precision = state.precision
        config = getattr(state, "precision_config", None)
        return lambda: get_precision_context(precision, config)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"controller": self.loop.controller_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ctl = state.get("controller") if isinstance(state, Mapping) else None
        if ctl is not None:
            self.loop.load_controller_state(ctl)
