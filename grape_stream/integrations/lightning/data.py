"""MixerDataModule: a WeightedStreamingMixer as a LightningDataModule's train dataloader."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule

from grape_stream.integrations.common import BatchTransform, MixerTrainLoader
from grape_stream.mixing.mixer import WeightedStreamingMixer

__all__ = ["MixerDataModule"]


class MixerDataModule(LightningDataModule):
    """``trainer.fit(module, datamodule=MixerDataModule(mixer))``: train on the mixer's batches.

    The loader is the mixer's own (``mixer.dataloader(num_workers)``: whole batches composed in the workers,
    consumed batches counted, so weight switches land on deterministic batches); ``transform`` optionally
    maps each batch (e.g. :func:`~grape_stream.integrations.common.causal_lm_inputs` for an HF model).
    The mixer is an endless stream: give the Trainer ``max_steps``. The mixer's position is checkpointed by
    :class:`~grape_stream.integrations.lightning.callback.GrapeLightningCallback`, not here.
    """

    def __init__(self, mixer: WeightedStreamingMixer, num_workers: int = 0, transform: BatchTransform | None = None,
                 **loader_kwargs: Any) -> None:
        super().__init__()
        self.mixer = mixer
        self.num_workers = num_workers
        self.transform = transform
        self.loader_kwargs = loader_kwargs

    def train_dataloader(self) -> Any:
        loader = self.mixer.dataloader(num_workers=self.num_workers, **self.loader_kwargs)
        return loader if self.transform is None else MixerTrainLoader(loader, self.transform)
