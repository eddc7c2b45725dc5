"""The trainer-independent half of a GRAPE callback: options, the controller, its checkpoint, the trajectory.

The Hugging Face and Lightning callbacks differ only in *when* the trainer calls them and where its
checkpoints live; what they do at those moments is the same and lives here, with no trainer imported:

* :meth:`GrapeLoop.attach` builds the :class:`~grape_stream.grape.controller.GrapeController` over the
  mixer once (and refuses a different mixer later),
* :meth:`GrapeLoop.after_step` runs ``controller.maybe_update`` after an optimizer step and returns the
  metrics of an update for the trainer's logger (and rewrites the trajectory JSONL on rank 0),
* :meth:`GrapeLoop.state_dict` / :meth:`GrapeLoop.load_state_dict` hold the controller *and* the mixer's
  position together (``"format": "grape_stream.loop/1"``): the data position and the weights that
  composed each batch belong to one checkpoint,
* :meth:`GrapeLoop.finish` writes the trajectory (+ PNG) and calls the ``end_of_run`` hook (rank 0).

Composer's GrapeAlgorithm predates this class and keeps its own event code (Composer saves the mixer
itself through the dataset-state protocol).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
from torch import nn

from grape_stream.config import AlgorithmConfig
from grape_stream.errors import DataError
from grape_stream.grape.controller import GrapeController
from grape_stream.integrations.common import as_task, split_algorithm_options
from grape_stream.integrations.summary import format_summary, summarize_controller
from grape_stream.integrations.trajectory_plot import plot_trajectory
from grape_stream.mixing.mixer import WeightedStreamingMixer
from grape_stream.world import process_world

__all__ = ["LOOP_STATE_FORMAT", "EndOfRun", "GrapeLoop"]

log = logging.getLogger(__name__)

#: The checkpoint entry a GrapeLoop writes: the controller, the mixer's position, and the step they belong to.
LOOP_STATE_FORMAT = "grape_stream.loop/1"

#: Called once at the end of training on rank 0 with the controller and the trajectory path (or None).
EndOfRun = Callable[[GrapeController, "str | None"], None]

PerSampleLoss = Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]

_DEFAULTS = AlgorithmConfig()


class GrapeLoop:
    """GRAPE options, the controller over the mixer, and its checkpoint state, for any trainer's callback.

    ``tasks`` are :class:`~grape_stream.grape.tasks.TaskStream` objects or dicts of their arguments.
    ``mu_alpha`` / ``mu_z`` go only to methods that take them. Other keyword options go to the reweighter
    or the controller (``probe_mode``, ``schedule_path``, ``gram_options``, ...), checked now, not at the
    first update. ``trajectory``: where the update records go as JSONL (None: the integration's default
    folder; ``False``: nowhere). ``plots``: also draw the PNG at the end. ``end_of_run``: a function
    called on rank 0 when training ends, with the controller and the trajectory path (an artifact upload,
    your own table); None (default) prints ``integrations.summary``'s end-of-run table.
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
        per_sample_loss: PerSampleLoss | None = None,
        seed: int = _DEFAULTS.seed,
        log_alignment: bool = True,
        trajectory: str | os.PathLike[str] | bool | None = None,
        plots: bool = True,
        end_of_run: EndOfRun | None = None,
        **options: Any,
    ) -> None:
        self.method = method
        self.tasks = [as_task(t) for t in tasks]
        self.alpha_every = alpha_every
        self.z_every = z_every
        self.probe_domain_batch = probe_domain_batch
        self.probe_task_batch = probe_task_batch
        self.per_sample_loss = per_sample_loss
        self.seed = seed
        self.log_alignment = log_alignment
        self.trajectory = os.fspath(trajectory) if isinstance(trajectory, (str, os.PathLike)) else None
        self.write_trajectory = trajectory is not False
        self.plots = plots
        self.end_of_run = end_of_run
        self.controller_options, self.reweighter_options = split_algorithm_options(method, options, mu_alpha, mu_z)
        self.controller: GrapeController | None = None
        self.mixer: WeightedStreamingMixer | None = None

    # -- the controller --------------------------------------------------------------------------------
    def attach(self, mixer: WeightedStreamingMixer) -> GrapeController:
        """The controller over ``mixer`` (built on the first call; the same mixer is required later)."""
        if self.controller is None:
            self.mixer = mixer
            self.controller = GrapeController(
                mixer, self.tasks, method=self.method, alpha_every=self.alpha_every, z_every=self.z_every,
                probe_domain_batch=self.probe_domain_batch, probe_task_batch=self.probe_task_batch,
                per_sample_loss=self.per_sample_loss, seed=self.seed,
                **self.controller_options, **self.reweighter_options,
            )
            if self.controller.needs_probe:
                for task in self.tasks:  # open the probe splits now: a wrong path fails before training starts
                    task.dataset()
        elif self.controller.mixer is not mixer:
            raise RuntimeError("the train dataloader's mixer changed between runs; build a new GRAPE callback")
        return self.controller

    def start(self) -> None:
        """Push the initial weights to the mixer before its first batch (a no-op after a resume)."""
        self._ctl().start()

    def _ctl(self) -> GrapeController:
        if self.controller is None:
            raise RuntimeError("the GRAPE callback has no mixer yet (training has not started)")
        return self.controller

    def after_step(self, model: nn.Module, step: int, lr: float, *,
                   autocast: Callable[[], ContextManager[Any]] | None = None,
                   optimizer: Any = None) -> dict[str, float] | None:
        """After optimizer step ``step``: the GRAPE update when one is due; its metrics, or None.

        ``optimizer``: the training optimizer, read by ``geometry="adam"`` (its second moment)."""
        ctl = self._ctl()
        rec = ctl.maybe_update(model, step, lr, autocast=autocast, optimizer=optimizer)
        if rec is None:
            return None
        if self.write_trajectory and self.trajectory and process_world().is_leader:
            ctl.write_trajectory(self.trajectory)
        return ctl.metrics(rec, alignment=self.log_alignment)

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self, step: int, mixer_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Plain types (``torch.load(weights_only=True)`` reads it): the controller, the mixer's position
        (``mixer_state``, default ``mixer.state_dict()``: the batches handed out so far) and ``step``."""
        ctl = self._ctl()
        return {
            "format": LOOP_STATE_FORMAT,
            "step": int(step),
            "controller": ctl.state_dict(),
            "mixer": dict(mixer_state) if mixer_state is not None else ctl.mixer.state_dict(),  # the batches so far
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
        """Write the trajectory (+ PNG), call ``end_of_run``; rank 0 only. Returns the trajectory path."""
        ctl = self.controller
        if ctl is None or not process_world().is_leader:
            return None
        path = png = None
        if self.write_trajectory and self.trajectory:
            path = ctl.write_trajectory(self.trajectory)
            if self.plots:
                try:
                    png = plot_trajectory(path, os.path.splitext(path)[0] + ".png")
                except Exception as exc:  # a plotting problem must not fail a finished training run
                    log.warning("could not plot the GRAPE trajectory %s: %s", path, exc)
        if self.end_of_run is not None:
            self.end_of_run(ctl, path)
        else:  # the default: the end-of-run table (last probe losses per target, alpha, where the files are)
            print(format_summary(summarize_controller(ctl, {}, trajectory=path, plot=png)), flush=True)
        return path
