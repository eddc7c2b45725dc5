"""The DataLoader side of the mixer: whole batches across processes, consumed batches counted.

:class:`MixerDataLoader` is a plain ``torch.utils.data.DataLoader`` whose workers compose and collate
whole batches (no per-sample objects cross the process boundary) and which counts the batches it
hands out, so that the mixer knows exactly how far the trainer is (see docs/mixer.md, "Lag").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

if TYPE_CHECKING:  # pragma: no cover
    from grape_stream.mixing.mixer import WeightedStreamingMixer

__all__ = ["MixerDataLoader", "collate_samples"]


def _convert(value: Any) -> Any:
    """Numpy columns -> torch tensors (unsigned >8-bit ints widened: torch cannot batch them everywhere)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "u" and value.dtype.itemsize > 1 or value.dtype.kind == "i":
            return torch.from_numpy(value.astype(np.int64))
        return torch.from_numpy(np.array(value))
    return value


def collate_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Collate mixer samples (or probe samples) into a batch dict of tensors.

    Tensors are stacked, numpy arrays converted (unsigned 16/32/64-bit ints become int64), Python ints
    become int64 tensors, anything else is kept as a list.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    out: dict[str, Any] = {}
    for key in samples[0]:
        vals = [s[key] for s in samples]
        v0 = vals[0]
        if isinstance(v0, torch.Tensor):
            out[key] = torch.stack(vals)
        elif isinstance(v0, np.ndarray):
            out[key] = torch.stack([_convert(v) for v in vals])
        elif isinstance(v0, (bool, np.bool_)):
            out[key] = torch.tensor(vals, dtype=torch.bool)
        elif isinstance(v0, (int, np.integer)):
            out[key] = torch.tensor([int(v) for v in vals], dtype=torch.int64)
        elif isinstance(v0, (float, np.floating)):
            out[key] = torch.tensor([float(v) for v in vals], dtype=torch.float64)
        else:
            out[key] = vals
    return out



class _Batches(IterableDataset):
    """The mixer yielding whole collated batches (what :class:`MixerDataLoader` iterates).

    Attribute access falls through to the mixer, so code that looks at ``loader.dataset`` (Composer's
    dataset-state protocol: ``state_dict`` / ``load_state_dict``) reaches the mixer.
    """

    def __init__(self, mixer: "WeightedStreamingMixer") -> None:
        super().__init__()
        self.mixer = mixer

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.mixer._iter(batched=True)

    def __getattr__(self, name: str) -> Any:
        if name == "mixer":
            raise AttributeError(name)
        return getattr(self.mixer, name)


class MixerDataLoader(DataLoader):
    """A DataLoader over a :class:`WeightedStreamingMixer` that knows how many batches were consumed.

    Workers compose and collate whole batches (no per-sample objects cross the process boundary), the
    prefetch depth (``num_workers * prefetch_factor``) is told to the mixer, and the batches handed out
    are counted. So ``mixer.set_weights(alpha)`` takes effect exactly ``lag`` batches after the last batch
    handed out, whatever the workers' timing, and a new ``iter(loader)`` continues where the last one
    stopped. ``loader.dataset`` forwards to the mixer (``state_dict``, ``load_state_dict``, ...).
    """

    def __init__(self, mixer: "WeightedStreamingMixer", num_workers: int = 0, **kwargs: Any) -> None:
        from grape_stream.mixing.mixer import WeightedStreamingMixer

        if not isinstance(mixer, WeightedStreamingMixer):
            raise TypeError(f"MixerDataLoader needs a WeightedStreamingMixer, got {type(mixer).__name__}")
        bs = kwargs.pop("batch_size", mixer.batch_size)
        if bs != mixer.batch_size:
            raise ValueError(f"batch_size {bs} differs from the mixer's batch_size {mixer.batch_size}")
        for bad in ("sampler", "batch_sampler", "shuffle", "drop_last", "collate_fn"):
            if kwargs.get(bad):
                raise ValueError(f"{bad}= does not apply to the mixer (it composes and collates batches itself)")
        super().__init__(_Batches(mixer), batch_size=None, num_workers=num_workers, **kwargs)
        pf = self.prefetch_factor if num_workers > 0 else 0
        self.prefetch_depth = num_workers * (pf or 2) if num_workers > 0 else 0
        if mixer._lag is not None and mixer._lag < self.prefetch_depth:
            raise ValueError(
                f"the mixer's lag={mixer._lag} is smaller than this loader's prefetch depth {self.prefetch_depth} "
                f"(num_workers={num_workers} x prefetch_factor={pf}): weight switches would land on batches "
                "already composed. Raise lag, or leave it None to use the prefetch depth."
            )
        self.mixer = mixer

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.mixer._begin_tracked_iteration(self.prefetch_depth)
        return _CountingIterator(super().__iter__(), self.mixer)


class _CountingIterator:
    def __init__(self, inner: Iterator[Any], mixer: "WeightedStreamingMixer") -> None:
        self._inner = inner
        self._mixer = mixer
        self._next = mixer._consumed

    def __iter__(self) -> "_CountingIterator":
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        expected = self._next
        idx = batch.get("batch_index") if isinstance(batch, Mapping) else None
        if isinstance(idx, torch.Tensor) and idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo != hi or lo != expected:
                raise RuntimeError(
                    f"the loader returned samples of batches {lo}..{hi} where batch {expected} was expected: the "
                    "DataLoader's batch_size must equal the mixer's and its batches must arrive in order"
                )
        self._next = expected + 1
        self._mixer._consumed = max(self._mixer._consumed, expected + 1)
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
