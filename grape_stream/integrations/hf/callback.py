"""GrapeTrainerCallback: GRAPE in a Hugging Face ``transformers.Trainer`` (run it with GrapeTrainer).

Why these events (transformers 4.57): ``on_step_end`` runs after the optimizer step, the scheduler
step and ``zero_grad``, once per optimizer step (not per gradient-accumulation micro-batch), so the probe
differentiates the model the next step starts from, with ``torch.autograd.grad`` (``.grad`` and the
optimizer state are untouched), and reads the learning rate the next step will use. The Trainer's
DefaultFlowCallback (always first in the list) has already decided ``control.should_save`` for this step,
so the GRAPE state is written into ``checkpoint-N/`` right there, *before* the Trainer writes the
folder's ``trainer_state.json`` last: a folder that a resume accepts always holds ``grape_stream.pt``.
``on_save`` writes it again if another callback asked for the save later. The state is restored at
``on_train_begin`` (after the Trainer has loaded the checkpoint, before the first batch is drawn).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Mapping

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from grape_stream.atomic import atomic_open
from grape_stream.config import AlgorithmConfig
from grape_stream.errors import ConfigError, DataError
from grape_stream.integrations.common import find_mixer, logits_per_sample_loss
from grape_stream.integrations.grape_loop import GrapeLoop, PerSampleLoss
from grape_stream.mixing.mixer import WeightedStreamingMixer

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["STATE_FILE", "GrapeTrainerCallback"]

log = logging.getLogger(__name__)

#: The file in each ``checkpoint-N/`` folder that holds the controller and the mixer's position.
STATE_FILE = "grape_stream.pt"

def _output_dir(args: TrainingArguments) -> str:
    """``args.output_dir`` (TrainingArguments fills in ``trainer_output`` when it is None)."""
    return args.output_dir or "trainer_output"


class GrapeTrainerCallback(TrainerCallback):
    """Every ``alpha_every`` / ``z_every`` optimizer steps, probe the K domains and N tasks on the model being
    trained, update alpha and z, and hand alpha to the mixer; log the update's metrics through the
    Trainer's ``log`` (every ``report_to`` integration sees them); keep the controller and the mixer's
    position in ``checkpoint-N/grape_stream.pt`` and restore them on ``resume_from_checkpoint``.

    Use it with :class:`~grape_stream.integrations.hf.trainer.GrapeTrainer` (the mixer as the train
    dataloader). Arguments are :class:`~grape_stream.integrations.grape_loop.GrapeLoop`'s (``config``, an
    :class:`~grape_stream.config.AlgorithmConfig`, or keyword overrides of its fields; ``tasks``;
    ``end_of_run``; ...). The probe's default loss calls ``model(input_ids=...)`` and reads ``.logits`` (any
    HF causal LM). The trajectory JSONL defaults to ``<output_dir>/grape_trajectory.jsonl``.
    """

    def __init__(self, config: AlgorithmConfig | Mapping[str, Any] | None = None, *,
                 per_sample_loss: PerSampleLoss | None = None, **kwargs: Any) -> None:
        self.loop = GrapeLoop(config=config, per_sample_loss=per_sample_loss or logits_per_sample_loss, **kwargs)
        #: set by GrapeTrainer: the checkpoint folder this run resumes from (None: a fresh start)
        self.resume_from: str | None = None
        self._trainer: Trainer | None = None

    @property
    def controller(self) -> Any:
        """The GrapeController (None before training starts)."""
        return self.loop.controller

    def bind(self, trainer: Trainer) -> None:
        """Log through ``trainer.log`` and probe under its autocast (GrapeTrainer calls this)."""
        self._trainer = trainer

    # -- events ----------------------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self._trainer is None and _batched_by_trainer(kwargs.get("train_dataloader")):
            raise ConfigError("GrapeTrainerCallback in a plain transformers.Trainer, whose sampler and collator batch "
                              "the mixer's samples (accelerate then fails): train with "
                              "grape_stream.integrations.hf.GrapeTrainer(train_dataset=mixer, ...) (docs/hf.md)")
        mixer = find_mixer(kwargs.get("train_dataloader"), who="GrapeTrainerCallback")
        self.loop.default_trajectory(_output_dir(args))
        ctl = self.loop.attach(mixer)
        self.loop.check_model(kwargs["model"])  # what this method cannot differentiate fails here, before step 1
        if ctl.signal.kind.reads_step_gradients and self._trainer is None:
            raise ConfigError("alignments: steps and method rnb read the training steps' own backward, with each "
                              "sample's loss in its graph: train with grape_stream.integrations.hf.GrapeTrainer, "
                              "which computes the step's loss that way (docs/hf.md)")
        if ctl.signal.kind.reads_training_losses and self._trainer is None:
            raise ConfigError(f"method {self.loop.method!r} reads each sample's training loss: train with "
                              "grape_stream.integrations.hf.GrapeTrainer, which shows it (docs/hf.md)")
        folder = self.resume_from
        if folder is None and state.global_step > 0:  # resumed by a Trainer that did not say from where
            folder = os.path.join(_output_dir(args), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if folder is not None:
            self._restore(folder, state.global_step)
        self.loop.start()

    def _restore(self, folder: str, step: int) -> None:
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            raise DataError(f"{folder} has no {STATE_FILE}: it was not written with GrapeTrainerCallback (or was cut "
                            "short); resume from a checkpoint that has it, or start without resume_from_checkpoint")
        self.loop.load_state_dict(torch.load(path, weights_only=True), step=step, where=path)
        log.info("GRAPE state restored from %s (step %d)", path, step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else 0.0
        trainer = self._trainer
        autocast = trainer.autocast_smart_context_manager if trainer is not None else None
        metrics = self.loop.after_step(kwargs["model"], state.global_step, lr, autocast=autocast,
                                       optimizer=optimizer)
        if metrics:
            if trainer is not None:
                should_log = control.should_log  # Trainer.log clears it: keep this step's own loss log
                trainer.log(dict(metrics))
                control.should_log = should_log
            else:  # a plain Trainer: at least keep them in trainer_state.json's log history
                state.log_history.append({**metrics, "step": state.global_step})
        if control.should_save:
            self._save(args, state)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not os.path.isfile(os.path.join(self._folder(args, state), STATE_FILE)):
            self._save(args, state)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.loop.finish()

    # -- checkpoints -----------------------------------------------------------------------------------
    @staticmethod
    def _folder(args: TrainingArguments, state: TrainerState) -> str:
        return os.path.join(_output_dir(args), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def _save(self, args: TrainingArguments, state: TrainerState) -> None:
        if not args.should_save or self.loop.controller is None:
            return
        payload = self.state_dict(state.global_step)
        with atomic_open(os.path.join(self._folder(args, state), STATE_FILE), "wb") as f:
            torch.save(payload, f)

    def state_dict(self, step: int) -> dict[str, Any]:
        """What ``grape_stream.pt`` holds: the controller and the mixer's position after ``step`` steps."""
        return self.loop.state_dict(step)

    def load_state_dict(self, state: Mapping[str, Any], step: int | None = None) -> None:
        self.loop.load_state_dict(state, step=step)


def _batched_by_trainer(dataloader: Any) -> bool:
    """A Trainer's own DataLoader over the mixer (``train_dataset=mixer`` in a plain Trainer), not the mixer's
    counting loader (``mixer.dataloader()``, ``MixerTrainLoader``: they keep it as ``.mixer``)."""
    obj = getattr(dataloader, "base_dataloader", dataloader)  # accelerate's DataLoaderShard keeps the original
    return getattr(obj, "mixer", None) is None and isinstance(getattr(obj, "dataset", None), WeightedStreamingMixer)
