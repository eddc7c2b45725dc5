"""GrapeTrainer: a ``transformers.Trainer`` whose train dataloader is a WeightedStreamingMixer.

A callback cannot replace the Trainer's train dataloader, so three small overrides live here, and only
these:

* ``get_train_dataloader`` returns the mixer's own counting loader (``mixer.dataloader()``), its batches
  turned into ``input_ids`` / ``labels`` (:func:`~grape_stream.integrations.common.causal_lm_inputs`).
  It is not passed through ``accelerator.prepare``: the mixer already gives every rank its own disjoint
  batches, and accelerate's wrapper would read one batch ahead of the trainer.
* ``ignore_data_skip`` is forced on: on resume the Trainer would otherwise re-read (and throw away) every
  batch since the start through a new loader; the mixer restores its position itself.
* ``train`` tells the GrapeTrainerCallback which checkpoint folder it resumes from.
* ``compute_loss``, for a loss-driven method (DoReMi, ODM, ADO: grape/loss_mode.py) only: the model still
  computes its own loss (the training objective is unchanged); the per-sample losses the method reads are
  recomputed from the output's logits (detached, no gradient) with the mixer batch, which the loader
  carries beside the model's inputs (``grape_batch``: the model never sees it).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from grape_stream.errors import ConfigError
from grape_stream.integrations.common import BatchTransform, MixerTrainLoader, causal_lm_inputs
from grape_stream.integrations.hf.callback import GrapeTrainerCallback
from grape_stream.mixing.mixer import WeightedStreamingMixer
from grape_stream.models import per_sample_lm_loss_from_logits

__all__ = ["GRAPE_BATCH", "GrapeTrainer"]

log = logging.getLogger(__name__)


#: the key under which a loss-driven method's loader carries the mixer batch (domains, tokens, loss_mask)
GRAPE_BATCH = "grape_batch"

#: TrainingArguments' default per_device_train_batch_size: left there, the mixer's batch_size is used instead
_HF_DEFAULT_BATCH = 8


class GrapeTrainer(Trainer):
    """``Trainer(..., train_dataset=mixer, callbacks=[GrapeTrainerCallback(...)])``: train on the mixer's batches.

    ``train_dataset`` (or ``mixer``, the same): the WeightedStreamingMixer. The per-device batch size is the
    mixer's ``batch_size``: ``args.per_device_train_batch_size`` left at its default is set from it, any other
    value must equal it. ``args.max_steps`` must be set. ``batch_transform`` turns a mixer batch into the
    model's keyword arguments (default: ``input_ids`` and ``labels`` from ``tokens`` and ``loss_mask``; None
    passes the mixer's batch as it is). ``args.dataloader_num_workers`` / ``dataloader_pin_memory`` are
    honoured. Evaluation datasets work as in any Trainer.
    """

    def __init__(self, *args: Any, mixer: WeightedStreamingMixer | None = None,
                 batch_transform: BatchTransform | None = causal_lm_inputs, **kwargs: Any) -> None:
        dataset = kwargs.pop("train_dataset", None)
        if mixer is not None and dataset is not None and dataset is not mixer:
            raise ConfigError("GrapeTrainer trains on one mixer: pass it as train_dataset= (or mixer=), not both")
        mixer = mixer if mixer is not None else dataset
        if not isinstance(mixer, WeightedStreamingMixer):
            raise ConfigError("GrapeTrainer needs train_dataset= a grape_stream.WeightedStreamingMixer, "
                              f"got {type(mixer).__name__}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and training_args.per_device_train_batch_size == _HF_DEFAULT_BATCH:
            training_args.per_device_train_batch_size = mixer.batch_size  # before Trainer reads train_batch_size
        super().__init__(*args, **kwargs)
        if self.args.per_device_train_batch_size != mixer.batch_size:
            raise ConfigError(f"per_device_train_batch_size={self.args.per_device_train_batch_size} differs from the "
                              f"mixer's batch_size={mixer.batch_size}; leave it out (the mixer's is used) or set "
                              "them equal")
        per_step = self.args.per_device_train_batch_size * self.args.world_size * self.args.gradient_accumulation_steps
        if per_step != mixer.global_batch_size:
            raise ConfigError(
                f"per_device_train_batch_size={self.args.per_device_train_batch_size} x {self.args.world_size} ranks x "
                f"gradient_accumulation_steps={self.args.gradient_accumulation_steps} = {per_step} samples a step, but "
                f"the mixer's global_batch_size is {mixer.global_batch_size}; pass global_batch_size={per_step} to "
                "the mixer (keep it fixed to resume on another number of ranks)"
            )
        if self.args.max_steps <= 0:
            raise ConfigError("GrapeTrainer needs max_steps > 0 in TrainingArguments: the mixer is an endless stream")
        if not self.args.ignore_data_skip:
            log.info("GrapeTrainer sets ignore_data_skip=True: the mixer restores its own position on resume")
            self.args.ignore_data_skip = True
        self.mixer = mixer
        self.batch_transform = batch_transform

    def grape_callbacks(self) -> list[GrapeTrainerCallback]:
        return [cb for cb in self.callback_handler.callbacks if isinstance(cb, GrapeTrainerCallback)]

    def get_train_dataloader(self) -> MixerTrainLoader:  # type: ignore[override]
        loader = self.mixer.dataloader(num_workers=self.args.dataloader_num_workers,
                                       pin_memory=self.args.dataloader_pin_memory)
        transform = self.batch_transform
        if transform is not None and self._loss_callbacks():
            inner = transform

            def transform(batch: Mapping[str, Any]) -> Mapping[str, Any]:
                return {**inner(batch), GRAPE_BATCH: dict(batch)}
        return MixerTrainLoader(loader, transform)

    def _loss_callbacks(self) -> list[GrapeTrainerCallback]:
        return [cb for cb in self.grape_callbacks() if cb.loop.needs_training_losses]

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The Trainer's loss; for a loss-driven method also each sample's loss, shown to it (grape.loss_mode)."""
        batch = inputs.pop(GRAPE_BATCH, None) if isinstance(inputs, dict) else None
        callbacks = self._loss_callbacks() if batch is not None else []
        if not callbacks:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        loop = callbacks[0].loop
        with loop.observe(model, self.state.global_step + 1, batch, autocast=self.autocast_smart_context_manager):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            logits = getattr(outputs, "logits", None)
            if logits is None and isinstance(outputs, Mapping):
                logits = outputs.get("logits")
            if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
                raise ConfigError(f"method {loop.method!r} reads each sample's training loss, which GrapeTrainer "
                                  "recomputes from the model output's .logits (B, T, V): this model returns none; "
                                  "use a causal LM or pass per-sample losses in your own loop (docs/hf.md)")
            with torch.no_grad():
                per_sample_lm_loss_from_logits(logits[:, :-1].detach(), batch)
        return (loss, outputs) if return_outputs else loss

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a resume (a folder, or True: the newest ``checkpoint-N`` in ``output_dir``) also
        restores the GRAPE controller and the mixer's position from that folder's ``grape_stream.pt``."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ConfigError(f"resume_from_checkpoint=True but {self.args.output_dir} has no checkpoint-N folder")
        folder = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        for cb in self.grape_callbacks():
            cb.bind(self)
            cb.resume_from = folder
        return super().train(folder, *args, **kwargs)
