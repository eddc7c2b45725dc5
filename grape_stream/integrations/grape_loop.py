"""GrapeLoop: GRAPE in any training loop, with no trainer imported. The Composer, HF and Lightning adapters
are thin shells over it: they differ only in *when* the trainer calls them and where its checkpoints live.

* the settings are one :class:`~grape_stream.config.AlgorithmConfig` (or keyword overrides of its fields and
  of the reweighter's options, checked now, not at the first update an hour into training);
* :meth:`GrapeLoop.attach` builds the :class:`~grape_stream.grape.controller.GrapeController` over the
  mixer once (and refuses a different mixer later), restoring a controller state loaded before it;
* :meth:`GrapeLoop.after_step` runs the update when one is due (with the optional progress line) and
  returns its metrics for the trainer's logger (and rewrites the trajectory JSONL on rank 0);
* :meth:`GrapeLoop.state_dict` / :meth:`GrapeLoop.load_state_dict` hold the controller *and* the mixer's
  position together (``"format": "grape_stream.loop/1"``: the HF and Lightning checkpoints);
  :meth:`controller_state` / :meth:`load_controller_state` the controller alone (Composer saves the mixer
  itself through the dataset-state protocol);
* :meth:`GrapeLoop.finish` writes the trajectory (+ PNG) and calls the ``end_of_run`` hook (rank 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
from torch import nn

from grape_stream.config import AlgorithmConfig
from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError, DataError
from grape_stream.grape.algorithm_config import algorithm_config, reweighter_options, signal_source
from grape_stream.grape.controller import GrapeController
from grape_stream.grape.gram.instep_scope import refuse_sharded
from grape_stream.grape.gram.sharding import check_sharded
from grape_stream.grape.probes import unwrap_for_probe
from grape_stream.grape.trajectory import TRAJECTORY_FILE
from grape_stream.integrations.common import as_task
from grape_stream.integrations.progress import UpdateProgress
from grape_stream.integrations.run_end import write_run_end
from grape_stream.mixing.mixer import WeightedStreamingMixer
from grape_stream.models import per_sample_lm_loss
from grape_stream.world import process_world

__all__ = ["LOOP_STATE_FORMAT", "EndOfRun", "GrapeLoop"]

log = logging.getLogger(__name__)

#: The checkpoint entry a GrapeLoop writes: the controller, the mixer's position, and the step they belong to.
LOOP_STATE_FORMAT = "grape_stream.loop/1"

#: Called once at the end of training on rank 0 with the controller and the trajectory path (or None).
EndOfRun = Callable[[GrapeController, "str | None"], None]

PerSampleLoss = Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]


class GrapeLoop:
    """GRAPE's settings, the controller over the mixer, and its checkpoint state, for any trainer's callback.

    Args:
        config: GRAPE's settings (:class:`~grape_stream.config.AlgorithmConfig`, a mapping of its fields, or
            None for the paper's); ``config.trajectory``: True writes the update records as JSONL where the
            integration says (:meth:`default_trajectory`), False nowhere, a path there; ``config.plots``
            also draws the PNG at the end; ``config.summary`` prints the end-of-run table.
        tasks: :class:`~grape_stream.grape.tasks.TaskStream` objects or dicts of their arguments.
        per_sample_loss: what the probe differentiates, ``f(model, batch) -> Tensor[B]`` (default: the LM loss
            of :mod:`grape_stream.models`).
        end_of_run: called on rank 0 when training ends, with the controller and the trajectory path (an
            artifact upload, your own table); None prints ``integrations.summary``'s end-of-run table.
        progress: print a progress line during each update and its timing after it (global rank 0, stderr).
        **overrides: AlgorithmConfig fields and reweighter options over ``config`` (``alpha_every=50``,
            ``clip_norm=1.0``, ...), as :class:`~grape_stream.grape.controller.GrapeController` takes them.
    """

    def __init__(self, config: AlgorithmConfig | Mapping[str, Any] | None = None, *, tasks: Sequence[Any] = (),
                 per_sample_loss: PerSampleLoss | None = None, end_of_run: EndOfRun | None = None,
                 progress: bool = False, **overrides: Any) -> None:
        self.config = algorithm_config(config, overrides)
        self.tasks = [as_task(t) for t in tasks]
        self.progress = UpdateProgress(enabled=progress)
        if progress:  # the probe's forward passes tick the progress bar
            per_sample_loss = self.progress.wrap_loss(per_sample_loss or per_sample_lm_loss)
        self.per_sample_loss = per_sample_loss
        self.end_of_run = end_of_run
        target = self.config.trajectory
        #: where the update records go (None: nowhere yet; an integration sets its default folder)
        self.trajectory: str | None = os.fspath(target) if isinstance(target, (str, os.PathLike)) else None
        self.write_trajectory = target is not False
        self.controller: GrapeController | None = None
        self.mixer: WeightedStreamingMixer | None = None
        self._pending_state: dict[str, Any] | None = None

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def reweighter_options(self) -> dict[str, Any]:
        """The options this config gives the method's reweighter (grape.algorithm_config's rule)."""
        return reweighter_options(self.config)

    @property
    def signal_kind(self) -> Signal:
        """Where this run's updates read their numbers from (grape.algorithm_config.signal_source), known before the
        controller is built: ``.reads_training_losses`` -- the trainer must show each (micro-)batch's per-sample
        loss and domains (grape.loss_mode); ``.reads_step_gradients`` (``alignments: steps``, R&B's Gram) -- it must
        run each observed (micro-)batch's forward + backward inside :meth:`observe` with each sample's loss in that
        backward's graph."""
        return signal_source(self.config)

    def default_trajectory(self, folder: str | os.PathLike[str]) -> None:
        """Write the trajectory into ``folder`` (``TRAJECTORY_FILE``) unless the config says otherwise."""
        if self.trajectory is None and self.write_trajectory:
            self.trajectory = os.path.join(os.fspath(folder), TRAJECTORY_FILE)

    # -- the controller --------------------------------------------------------------------------------
    def attach(self, mixer: WeightedStreamingMixer) -> GrapeController:
        """The controller over ``mixer`` (built on the first call; the same mixer is required later)."""
        if self.controller is None:
            self.mixer = mixer
            self.controller = GrapeController(mixer, self.tasks, config=self.config,
                                              per_sample_loss=self.per_sample_loss)
            if self.controller.signal.kind.probes_tasks:
                for task in self.tasks:  # open the probe splits now: a wrong path fails before training starts
                    task.dataset()
        elif self.controller.mixer is not mixer:
            raise RuntimeError("the train dataloader's mixer changed between runs; build a new GRAPE callback")
        if self._pending_state is not None:
            self.controller.load_state_dict(self._pending_state)
            self._pending_state = None
        return self.controller

    def check_model(self, model: nn.Module) -> None:
        """Refuse, before the first step and in one line, a sharded model (FSDP1, FSDP2) this method cannot
        differentiate exactly: the probe takes FSDP1 (use_orig_params) and FSDP2 models unit by unit
        (grape.gram.sharding), R&B's step Gram and ``alignments: steps`` FSDP2 and FSDP1 models (gram.shard_layout,
        the task probe in grape.instep_probe_shards). The loss-driven methods (DoReMi, ODM, ADO) read each sample's
        training loss and never differentiate the model: any model."""
        kind = self._ctl().signal.kind
        if kind.reads_step_gradients:  # R&B's step Gram and alignments: steps: FSDP2 / FSDP1 (shard_layout.py)
            refuse_sharded(unwrap_for_probe(model, sharded_ok=True))
        elif kind is Signal.probe and check_sharded(unwrap_for_probe(model, sharded_ok=True)) is not None:
            if self.config.geometry != "sgd":  # (what the layer-by-layer probe cannot take: ShardedGramError above)
                raise ConfigError("geometry='adam' is not supported under FSDP: the optimizer's second moments are "
                                  "sharded like the parameters; use geometry='sgd' (the paper) or train with DDP")

    def start(self) -> None:
        """Push the initial weights to the mixer before its first batch (a no-op after a resume)."""
        self._ctl().start()

    def _ctl(self) -> GrapeController:
        if self.controller is None:
            raise RuntimeError("the GRAPE callback has no mixer yet (training has not started)")
        return self.controller

    def acts_at(self, step: int) -> bool:
        """Whether :meth:`after_step` does anything after ``step`` (see GrapeController.acts_at)."""
        return self._ctl().acts_at(step)

    def begin_step(self, model: nn.Module, step: int, batch: Any, *, optimizer: Any = None,
                   autocast: Callable[[], ContextManager[Any]] | None = None) -> None:
        """``alignments: steps`` and the loss-driven methods: before the forward of each (micro-)batch of optimizer
        step ``step`` (1-based: the step being trained); :meth:`end_step` after its backward. A no-op otherwise
        and on unobserved steps."""
        self._ctl().signal.begin(model, step, batch, optimizer=optimizer, autocast=autocast)

    def observe(self, model: nn.Module, step: int, batch: Any, *, optimizer: Any = None,
                autocast: Callable[[], ContextManager[Any]] | None = None) -> ContextManager[Any]:
        """:meth:`begin_step` ... :meth:`end_step` as a context manager around one (micro-)batch."""
        return self._ctl().observe(model, step, batch, optimizer=optimizer, autocast=autocast)

    def end_step(self) -> None:
        """After the backward of the (micro-)batch :meth:`begin_step` began."""
        self._ctl().signal.end()

    def after_step(self, model: nn.Module, step: int, lr: float, *,
                   autocast: Callable[[], ContextManager[Any]] | None = None, optimizer: Any = None,
                   consumed_batches: int | None = None) -> dict[str, float] | None:
        """After optimizer step ``step``: the GRAPE update when one is due; its metrics, or None.

        ``lr``: the learning rate the next step uses; ``autocast``: the training precision context for the
        probe's forward; ``optimizer``: the training optimizer, read by ``geometry="adam"``;
        ``consumed_batches``: batches taken from the mixer's loader, when the loop knows (Composer does)."""
        ctl = self._ctl()
        index = ctl.num_updates + 1
        with self._progress(index, step):
            rec = ctl.maybe_update(model, step, lr, autocast=autocast, consumed_batches=consumed_batches,
                                   optimizer=optimizer)
        if rec is None:
            return None
        if ctl.signal.kind.probes_tasks:
            self.progress.finished(index, step, rec)
        if self.write_trajectory and self.trajectory and process_world().is_leader:
            ctl.write_trajectory(self.trajectory)
        return ctl.metrics(rec, alignment=self.config.log_alignment)

    def _progress(self, index: int, step: int) -> ContextManager[Any]:
        """The progress context of the update at ``step`` (nothing for methods that do not probe)."""
        ctl = self._ctl()
        kind = ctl.signal.kind
        if not kind.probes_tasks or not any(ctl.due(step)):
            return contextlib.nullcontext()
        k, n = 0 if kind is Signal.step_alignments else len(ctl.domain_names), len(ctl.task_names)  # steps: tasks
        domain_batch, task_batch = ctl.probe.sizes()
        return self.progress.update(index, step, k, n, k * domain_batch + n * task_batch)

    # -- checkpoints -----------------------------------------------------------------------------------
    def controller_state(self) -> dict[str, Any] | None:
        """The controller's state (plain types), or the one loaded before :meth:`attach` (None: neither)."""
        return self.controller.state_dict() if self.controller is not None else self._pending_state

    def load_controller_state(self, state: Mapping[str, Any]) -> None:
        """Restore the controller now, or at :meth:`attach` when it is not built yet."""
        if self.controller is not None:
            self.controller.load_state_dict(state)
        else:
            self._pending_state = dict(state)

    def state_dict(self, step: int, mixer_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Plain types (``torch.load(weights_only=True)`` reads it): the controller, the mixer's position
        (``mixer_state``, default ``mixer.state_dict()``: the batches handed out so far) and ``step``."""
        ctl = self._ctl()
        return {
            "format": LOOP_STATE_FORMAT,
            "step": int(step),
            "controller": ctl.state_dict(),
            "mixer": dict(mixer_state) if mixer_state is not None else ctl.mixer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], step: int | None = None,
                        where: str = "the checkpoint") -> None:
        """Restore the controller and the mixer's position (before the mixer's loader iterates).

        ``step``: the trainer's restored step, which must be the one the state was saved at."""
        if not isinstance(state, Mapping) or state.get("format") != LOOP_STATE_FORMAT:
            got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise DataError(f"{where} holds no grape_stream loop state (format {got!r}, "
                            f"expected {LOOP_STATE_FORMAT!r})")
        if step is not None and int(state["step"]) != int(step):
            raise DataError(f"{where} holds the GRAPE state of step {state['step']} but the trainer resumes at step "
                            f"{step}: the checkpoint was not written by one run")
        ctl = self._ctl()
        assert self.mixer is not None, "attach() set both"
        ctl.load_state_dict(state["controller"])
        self.mixer.load_state_dict(state["mixer"])

    # -- the end ---------------------------------------------------------------------------------------
    def finish(self) -> str | None:
        """Write the trajectory, then the run's end (:func:`~grape_stream.integrations.run_end.write_run_end`: the
        PNG and the summary table + ``grape_summary.txt``) or the caller's ``end_of_run``; rank 0 only. Returns the
        trajectory path."""
        ctl = self.controller
        if ctl is None or not process_world().is_leader:
            return None
        path = None
        if self.write_trajectory and self.trajectory:
            path = ctl.write_trajectory(self.trajectory)
        # the plot, and the summary unless the caller's own end_of_run replaces it
        write_run_end(ctl, path, plots=self.config.plots, summary=self.config.summary and self.end_of_run is None)
        if self.end_of_run is not None:
            self.end_of_run(ctl, path)
        return path
