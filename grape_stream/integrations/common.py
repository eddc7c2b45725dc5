"""What every trainer integration needs, with no trainer imported: find the mixer behind a train
dataloader, tasks from their YAML form, and speak the Hugging Face model convention (``input_ids`` /
``labels`` batches, outputs with ``.logits``) that the HF Trainer and many Lightning modules use. (GRAPE's
settings are :class:`~grape_stream.config.AlgorithmConfig`, read by ``GrapeLoop``; the metrics dict for a
logger is the controller's own: ``GrapeController.metrics(record)``.)
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from grape_stream.grape.tasks import TaskStream
from grape_stream.mixing.loader import MixerDataLoader
from grape_stream.mixing.mixer import WeightedStreamingMixer
from grape_stream.models import causal_lm_kwargs, per_sample_causal_lm_loss

__all__ = [
    "IGNORE_INDEX",
    "BatchTransform",
    "MixerTrainLoader",
    "as_task",
    "causal_lm_inputs",
    "find_mixer",
    "logits_per_sample_loss",
]

#: The label value Hugging Face causal LMs (and torch's cross_entropy default) leave out of the loss.
IGNORE_INDEX = -100

#: Turns a mixer batch into what the model's training step takes (e.g. :func:`causal_lm_inputs`).
BatchTransform = Callable[[Mapping[str, Any]], Mapping[str, Any]]


def find_mixer(dataloader: Any, who: str = "GrapeAlgorithm") -> WeightedStreamingMixer:
    """The WeightedStreamingMixer behind a train dataloader (a DataSpec, a DataLoader, the mixer's own
    loader), or an error that says what was found instead."""
    obj = getattr(dataloader, "dataloader", dataloader)  # DataSpec -> DataLoader
    dataset = getattr(obj, "dataset", None)
    # mixer.dataloader() (MixerDataLoader) keeps the mixer as `.mixer`; a plain DataLoader over the mixer
    # has it as `.dataset`.
    for candidate in (getattr(obj, "mixer", None), dataset, getattr(dataset, "mixer", None), obj):
        if isinstance(candidate, WeightedStreamingMixer):
            return candidate
    raise RuntimeError(
        f"{who} needs the train dataloader to read from a grape_stream.WeightedStreamingMixer "
        f"(DataLoader(dataset=mixer, ...)); the trainer's train dataloader is {type(obj).__name__} over "
        f"{type(dataset).__name__ if dataset is not None else 'no dataset'}"
    )


def as_task(t: Any) -> TaskStream:
    """A TaskStream from itself or from a mapping of its arguments (the form a YAML config gives)."""
    if isinstance(t, TaskStream):
        return t
    if isinstance(t, Mapping):
        return TaskStream(**dict(t))
    raise TypeError(f"a task must be a TaskStream or a mapping of its arguments, got {type(t).__name__}")


def causal_lm_inputs(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A mixer batch as a Hugging Face causal LM takes it: ``input_ids`` = ``tokens`` and ``labels`` = the
    same tokens, with ``loss_mask == 0`` positions set to -100 (ignored), since HF models shift the labels
    themselves. The mixer's bookkeeping columns (``domain``, ``batch_index``, ...) are dropped: an HF
    ``forward`` rejects unknown keyword arguments. Packed sequences need no ``attention_mask``."""
    tokens = batch["tokens"]
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    tokens = tokens.long()
    labels = tokens.clone()
    mask = batch.get("loss_mask")
    if mask is not None:
        labels = labels.masked_fill(torch.as_tensor(mask) == 0, IGNORE_INDEX)
    return {"input_ids": tokens, "labels": labels}


def logits_per_sample_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The GRAPE probe's per-sample LM loss, Tensor[B], for a model called as ``model(input_ids=...)`` that
    returns logits or an output with ``.logits`` (any HF ``*ForCausalLM``). Scores the same loss as
    :func:`grape_stream.models.per_sample_lm_loss` (``loss_mask`` honoured); the KV cache is turned off,
    as a probe never decodes."""
    return per_sample_causal_lm_loss(model, causal_lm_kwargs(model, batch["tokens"].long()[:, :-1]), batch)


class MixerTrainLoader:
    """The mixer's counting DataLoader (``mixer.dataloader()``), each batch passed through ``transform``.

    It has no length (the mixer is an endless stream: the trainer needs a step budget) and keeps the mixer
    as ``.mixer``, where :func:`find_mixer` looks. Batches are counted as handed out, so weight switches
    land on deterministic batches (see docs/mixer.md, "Lag")."""

    def __init__(self, loader: MixerDataLoader, transform: BatchTransform | None = causal_lm_inputs) -> None:
        self.loader = loader
        self.mixer = loader.mixer
        self.transform = transform

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        for batch in self.loader:
            yield batch if self.transform is None else self.transform(batch)
