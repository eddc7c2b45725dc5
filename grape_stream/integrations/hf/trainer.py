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
* ``compute_loss``, for a loss-driven method (DoReMi, ODM, ADO: grape/loss_mode.py) only: the model is called
  without labels and the loss is built from each sample's loss on its logits, as the observed steps' below
  (the same number as the model's own loss, one cross-entropy instead of two); the method reads those
  per-sample losses with the mixer batch, which the loader carries beside the model's inputs (``grape_batch``:
  the model never sees it). Where the Trainer's loss is not the plain token mean (label smoothing,
  ``compute_loss_func``, an MoE router loss) the model keeps computing its own and each sample's loss is
  recomputed from the logits under no_grad.
* ``training_step``, for a method that reads the training steps' own backward (``alignments: steps``, R&B)
  and only on its observed steps: the batch is put in domain order, the forward + backward run inside the
  controller's observation, and the loss is computed here: each sample's loss from the callback's
  ``per_sample_loss`` (the probe's, default the causal LM loss of ``model(input_ids=tokens[:, :-1])``)
  weighted by its counted tokens over the Trainer's own denominator -- the same number as the causal LM's
  token-mean loss (``num_items_in_batch`` and gradient accumulation included), now with each sample's loss in
  the graph, where the in-step engine reads its weight. Other steps are the Trainer's, untouched.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, cast

import torch
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from grape_stream.errors import ConfigError
from grape_stream.grape.gram.instep import domain_order, reorder_rows
from grape_stream.integrations.common import IGNORE_INDEX, BatchTransform, MixerTrainLoader, causal_lm_inputs
from grape_stream.integrations.hf.callback import GrapeTrainerCallback
from grape_stream.mixing.mixer import WeightedStreamingMixer
from grape_stream.models import lm_targets, per_sample_lm_loss_from_full_logits

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
            if mixer.batch_size != _HF_DEFAULT_BATCH:  # TrainingArguments' default, or the caller's 8: say which wins
                log.warning("GrapeTrainer: per_device_train_batch_size=%d (TrainingArguments' default) set to the "
                            "mixer's batch_size=%d; pass per_device_train_batch_size=%d to say so",
                            _HF_DEFAULT_BATCH, mixer.batch_size, mixer.batch_size)
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
        #: the mixer batch of the (micro-)batch whose step the in-step engine observes now (None: none)
        self._observed_batch: dict[str, Any] | None = None

    def grape_callbacks(self) -> list[GrapeTrainerCallback]:
        return [cb for cb in self.callback_handler.callbacks if isinstance(cb, GrapeTrainerCallback)]

    def get_train_dataloader(self) -> MixerTrainLoader:
        loader = self.mixer.dataloader(num_workers=self.args.dataloader_num_workers,
                                       pin_memory=self.args.dataloader_pin_memory)
        transform = self.batch_transform
        if transform is not None and (self._loss_callbacks() or self._step_callbacks()):
            inner = transform

            def transform(batch: Mapping[str, Any]) -> Mapping[str, Any]:
                return {**inner(batch), GRAPE_BATCH: dict(batch)}
        return MixerTrainLoader(loader, transform)

    def _loss_callbacks(self) -> list[GrapeTrainerCallback]:
        return [cb for cb in self.grape_callbacks() if cb.loop.signal_kind.reads_training_losses]

    def _step_callbacks(self) -> list[GrapeTrainerCallback]:
        return [cb for cb in self.grape_callbacks() if cb.loop.signal_kind.reads_step_gradients]

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
                      ) -> torch.Tensor:
        """The Trainer's step; on a step that ``alignments: steps`` or R&B observes, its forward + backward inside
        the controller's observation, the batch in domain order (the loss, a mean, is unchanged)."""
        callbacks = self._step_callbacks()
        batch = inputs.get(GRAPE_BATCH) if isinstance(inputs, dict) and callbacks else None
        step = self.state.global_step + 1
        ctl = callbacks[0].controller if callbacks else None
        if batch is None or ctl is None or not ctl.signal.observed(step):
            return super().training_step(model, inputs, num_items_in_batch)
        order = domain_order(batch)
        inputs = reorder_rows({k: v for k, v in inputs.items() if k != GRAPE_BATCH}, order)
        # on the training device, as the Trainer puts the model's inputs (it never sees this one)
        self._observed_batch = batch = cast(dict[str, Any], self._prepare_input(reorder_rows(batch, order)))
        try:
            with callbacks[0].loop.observe(model, step, batch, optimizer=self.optimizer,
                                           autocast=self.autocast_smart_context_manager):
                return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._observed_batch = None

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The Trainer's loss; for a loss-driven method also each sample's loss, shown to it (grape.loss_mode);
        on a step the in-step engine observes, the token-mean loss built from each sample's (see the module)."""
        batch = inputs.pop(GRAPE_BATCH, None) if isinstance(inputs, dict) else None
        if self._observed_batch is not None:
            return self._observed_step_loss(model, inputs, return_outputs, num_items_in_batch)
        callbacks = self._loss_callbacks() if batch is not None else []
        if not callbacks:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        loop = callbacks[0].loop
        with loop.observe(model, self.state.global_step + 1, batch, autocast=self.autocast_smart_context_manager):
            scored = _labels_as_batch(inputs.get("labels"), batch)
            if self._own_loss_is_the_token_mean(model):  # one cross-entropy: the loss from each sample's
                outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
                per_sample = per_sample_lm_loss_from_full_logits(_logits(outputs, loop.method), scored)
                loss = self._token_mean_loss(per_sample, scored, num_items_in_batch)
            else:  # the model's own loss (smoothed, custom, or with an auxiliary term); samples' scored again
                loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                     num_items_in_batch=num_items_in_batch)
                with torch.no_grad():
                    per_sample_lm_loss_from_full_logits(_logits(outputs, loop.method).detach(), scored)
        return (loss, outputs) if return_outputs else loss

    def _own_loss_is_the_token_mean(self, model: Any) -> bool:
        """Whether the Trainer's loss is the plain causal-LM token mean, which :meth:`_token_mean_loss` rebuilds
        from each sample's: no label smoothing, no ``compute_loss_func``, no MoE router loss added by the model."""
        config = getattr(self.accelerator.unwrap_model(model), "config", None)
        return (self.label_smoother is None and self.compute_loss_func is None
                and not getattr(config, "output_router_logits", False))

    def _observed_step_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool,
                            num_items_in_batch: Any) -> Any:
        """The observed step's loss from each sample's: the callback's ``per_sample_loss`` (the probe's call, from
        which the in-step engine learns the model's layout), watched by the engine."""
        batch = self._observed_batch
        assert batch is not None
        per_sample = self._step_callbacks()[0].controller.per_sample_loss(model, batch)
        loss = self._token_mean_loss(per_sample, batch, num_items_in_batch)
        return (loss, None) if return_outputs else loss

    def _token_mean_loss(self, per_sample: torch.Tensor, batch: Mapping[str, Any], num_items_in_batch: Any
                         ) -> torch.Tensor:
        """The causal LM's loss (sum of counted token losses / the Trainer's denominator) from each sample's mean
        token loss times its counted tokens, so that each sample's loss is in the graph."""
        targets, mask = lm_targets(batch)
        counted = (mask.to(per_sample.dtype).sum(dim=1) if mask is not None
                   else torch.full_like(per_sample, float(targets.shape[1])))
        total = (per_sample * counted.to(per_sample.device)).sum()
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = total / torch.as_tensor(num_items_in_batch, device=total.device).to(total.dtype)
            if self.args.average_tokens_across_devices:
                loss = loss * (self.accelerator.num_processes if self.args.n_gpu <= 1 else self.args.n_gpu)
        else:
            loss = total / counted.sum().clamp_min(1.0).to(total.device)
        return loss

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a resume (a folder, or True: the newest ``checkpoint-N`` in ``output_dir``) also
        restores the GRAPE controller and the mixer's position from that folder's ``grape_stream.pt``."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ConfigError(f"resume_from_checkpoint=True but {self.args.output_dir} has no checkpoint-N folder")
        folder = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        steps = self._step_callbacks()
        if steps and not self._own_loss_is_the_token_mean(self.model):
            raise ConfigError(f"method {steps[0].loop.method!r} with alignments from the training steps has "
                              "GrapeTrainer compute the observed steps' loss itself (the causal LM's token mean), "
                              "which cannot honour label_smoothing_factor, compute_loss_func or an MoE router loss "
                              "(output_router_logits); use alignments: probe (docs/hf.md)")
        for cb in self.grape_callbacks():
            cb.bind(self)
            cb.resume_from = folder
        return super().train(folder, *args, **kwargs)


def _logits(outputs: Any, method: str) -> torch.Tensor:
    """The (B, T, V) logits of an HF model's output, or one line saying the model gives none."""
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ConfigError(f"method {method!r} reads each sample's training loss, which GrapeTrainer "
                          "recomputes from the model output's .logits (B, T, V): this model returns none; "
                          "use a causal LM or pass per-sample losses in your own loop (docs/hf.md)")
    return logits


def _labels_as_batch(labels: Any, batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """What the loss scores: the model's ``labels`` (HF's convention, ``IGNORE_INDEX`` where nothing counts) as
    ``tokens`` / ``loss_mask``, so that a ``batch_transform`` masking other positions than ``loss_mask`` keeps its
    objective; the mixer batch when the inputs carry no labels."""
    if not isinstance(labels, torch.Tensor):
        return batch
    return {**batch, "tokens": labels.clamp_min(0), "loss_mask": labels != IGNORE_INDEX}
