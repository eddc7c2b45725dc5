"""GrapeLightningCallback: GRAPE in a Lightning ``Trainer`` (lightning 2.6, ``import lightning.pytorch``).

Why these hooks: ``on_train_batch_end`` runs after the optimizer step and after the step-interval LR
schedulers have stepped, so the probe sees the model the next step starts from and the learning rate the
next step will use (as in the Composer and HF integrations); it runs once per batch, so with
``accumulate_grad_batches`` the callback acts only when ``trainer.global_step`` (optimizer steps) moved.
Lightning calls callbacks before its ModelCheckpoint (checkpoint callbacks run last), so a checkpoint
taken at an update step already holds the new weights.

Checkpoints: the callback's ``state_dict`` (Lightning stores it under ``checkpoint["callbacks"]``) holds
the controller and the mixer's position. The position is the number of batches *trained on*, counted here,
not the number the loader handed out: Lightning's data fetcher reads one batch ahead, and that batch has not
been trained on when a checkpoint is taken. Lightning restores callbacks before the fit loop creates its
data iterator, so ``load_state_dict`` restores the mixer in time; this is why the callback is given the
mixer when it is built rather than finding it in the train dataloader later.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning.pytorch import Callback, LightningModule, Trainer

from grape_stream.config import AlgorithmConfig
from grape_stream.errors import DataError
from grape_stream.integrations.common import find_mixer
from grape_stream.integrations.grape_loop import GrapeLoop
from grape_stream.mixing.mixer import WeightedStreamingMixer

__all__ = ["GrapeLightningCallback"]

class GrapeLightningCallback(Callback):
    """Every ``alpha_every`` / ``z_every`` optimizer steps, probe the K domains and N tasks on the
    LightningModule, update alpha and z and hand alpha to ``mixer``; log the update's metrics to every
    logger of the Trainer; keep the controller and the mixer's position in Lightning checkpoints.

    ``mixer`` must be the one behind the train dataloader (``MixerDataModule(mixer)`` or the module's
    ``train_dataloader`` returning ``mixer.dataloader()``). The probe differentiates the LightningModule: its
    ``forward(tokens)`` must return logits (the default ``per_sample_loss``), or pass ``per_sample_loss``
    (e.g. :func:`~grape_stream.integrations.common.logits_per_sample_loss` for a module whose forward takes
    ``input_ids``). Other arguments are :class:`~grape_stream.integrations.grape_loop.GrapeLoop`'s (``config``,
    an :class:`~grape_stream.config.AlgorithmConfig`, or keyword overrides of its fields; ``tasks``;
    ``end_of_run``; ...); the trajectory JSONL defaults to ``<default_root_dir>/grape_trajectory.jsonl``.
    """

    def __init__(self, mixer: WeightedStreamingMixer, config: AlgorithmConfig | Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(mixer, WeightedStreamingMixer):
            raise TypeError("GrapeLightningCallback needs a grape_stream.WeightedStreamingMixer, "
                            f"got {type(mixer).__name__}")
        self.mixer = mixer
        self.loop = GrapeLoop(config=config, **kwargs)
        self.loop.attach(mixer)
        self._batches = 0  # batches trained on (the mixer's position in a checkpoint)
        self._step = 0  # the optimizer step the last on_train_batch_end saw
        self._restored_step: int | None = None

    @property
    def controller(self) -> Any:
        """The GrapeController."""
        return self.loop.controller

    # -- hooks -----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.loop.check_model(pl_module)  # what this method cannot differentiate fails here, before the first step
        self.loop.default_trajectory(trainer.default_root_dir)
        self.loop.start()  # a no-op after a resume: the checkpoint's weight schedule is in force

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if find_mixer(trainer.train_dataloader, who="GrapeLightningCallback") is not self.mixer:
            raise RuntimeError("the Trainer's train dataloader reads from another mixer than GrapeLightningCallback's")
        if self._restored_step is not None and self._restored_step != trainer.global_step:
            raise DataError(f"the checkpoint's GRAPE state is of step {self._restored_step} but the Trainer resumes at "
                            f"step {trainer.global_step}")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # alignments: steps observes this (micro-)batch's forward + backward (the step being trained is 1-based)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self.loop.begin_step(pl_module, int(trainer.global_step) + 1, batch, optimizer=optimizer,
                             autocast=trainer.precision_plugin.forward_context)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.loop.end_step()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batches += 1
        step = int(trainer.global_step)
        if step == self._step:  # accumulating gradients: no optimizer step yet
            return
        self._step = step
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else 0.0
        metrics = self.loop.after_step(pl_module, step, lr, autocast=trainer.precision_plugin.forward_context,
                                       optimizer=optimizer)
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.loop.finish()

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        per = self.mixer.batch_size * self.mixer.world_size
        position = self.mixer.state_dict(num_samples=self._batches * per, from_beginning=True)
        return {**self.loop.state_dict(self._step, position), "batches": self._batches}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.loop.load_state_dict(state_dict, where="the Lightning checkpoint")
        # the loader batches of *this* topology up to the saved global batch (a resume may change world
        # size or micro-batches; the checkpoint's "batches" counted the writer's)
        self._batches = self.mixer.consumed_batches
        self._step = self._restored_step = int(state_dict["step"])
