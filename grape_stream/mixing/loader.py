"""The DataLoader side of the mixer: whole batches across processes, consumed batches counted.

:class:`MixerDataLoader` is a plain ``torch.utils.data.DataLoader`` whose workers compose and collate
whole batches (no per-sample objects cross the process boundary) and which counts the batches it
hands out, so that the mixer knows exactly how far the trainer is (see docs/mixer.md, "Lag").
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from grape_stream.mixing.collate import PackedBatch

__all__ = ["BatchSource", "MixerDataLoader"]


@runtime_checkable
class BatchSource(Protocol):
    """The loader protocol: what :class:`MixerDataLoader` needs from the mixer, and nothing more.

    The loader drives the mixer only through these names (it does not import the mixer module), so the
    mixer's internals can change without touching the loader, and a test double can stand in for it.
    """

    @property
    def batch_size(self) -> int:
        """Samples per batch (the loader's batch size must equal it)."""
        ...

    @property
    def fixed_lag(self) -> int | None:
        """The lag the mixer was built with, or None when it follows the loader's prefetch depth."""
        ...

    @property
    def consumed_batches(self) -> int:
        """Batches the trainer has taken so far (where a new iteration starts)."""
        ...

    def begin_tracked_iteration(self, depth: int) -> None:
        """A counting loader starts iterating with up to ``depth`` batches in flight."""
        ...

    def iter_batches(self, packed: bool = False) -> Iterator[Any]:
        """Whole collated batches, composed in this process or DataLoader worker; with ``packed``, as
        :class:`~grape_stream.mixing.collate.PackedBatch` (numpy arrays; ``.tensors()`` collates them)."""
        ...

    def note_consumed(self, batches: int) -> None:
        """The trainer has taken ``batches`` batches in all (never decreases the count)."""
        ...


class _Batches(IterableDataset):
    """The mixer yielding whole collated batches (what :class:`MixerDataLoader` iterates).

    Attribute access falls through to the mixer, so code that looks at ``loader.dataset`` (Composer's
    dataset-state protocol: ``state_dict`` / ``load_state_dict``) reaches the mixer.
    """

    def __init__(self, mixer: BatchSource) -> None:
        super().__init__()
        self.mixer = mixer

    def __iter__(self) -> Iterator[Any]:
        # In a worker: arrays through the pipe, collated by the main process (see PackedBatch).
        return self.mixer.iter_batches(packed=get_worker_info() is not None)

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

    def __init__(self, mixer: BatchSource, num_workers: int = 0, **kwargs: Any) -> None:
        if not isinstance(mixer, BatchSource):
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
        lag = mixer.fixed_lag
        if lag is not None and lag < self.prefetch_depth:
            raise ValueError(
                f"the mixer's lag={lag} is smaller than this loader's prefetch depth {self.prefetch_depth} "
                f"(num_workers={num_workers} x prefetch_factor={pf}): weight switches would land on batches "
                "already composed. Raise lag, or leave it None to use the prefetch depth."
            )
        self.mixer = mixer

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.mixer.begin_tracked_iteration(self.prefetch_depth)
        if self.num_workers == 0 and not self.pin_memory:
            # torch's single-process iterator would only pass each batch through ``default_convert`` (an
            # identity on a dict of tensors) inside a profiler range: ~20-40 us a batch, skipped here.
            return _CountingIterator(iter(self.mixer.iter_batches()), self.mixer)
        return _CountingIterator(super().__iter__(), self.mixer)


class _CountingIterator:
    """Counts the batches handed to the trainer and checks that they arrive in order."""

    def __init__(self, inner: Iterator[Any], mixer: BatchSource) -> None:
        self._inner = inner
        self._mixer = mixer
        self._next = mixer.consumed_batches

    def __iter__(self) -> "_CountingIterator":
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        if isinstance(batch, PackedBatch):
            batch = batch.tensors()
        expected = self._next
        idx = batch.get("batch_index") if isinstance(batch, Mapping) else None
        if isinstance(idx, torch.Tensor) and idx.numel():
            # A sample stream's batch indices never decrease, so first == last means all are equal.
            flat = idx.reshape(-1)
            lo, hi = int(flat[0]), int(flat[-1])
            if lo != hi or lo != expected:
                raise RuntimeError(
                    f"the loader returned samples of batches {lo}..{hi} where batch {expected} was expected: the "
                    "DataLoader's batch_size must equal the mixer's and its batches must arrive in order"
                )
        self._next = expected + 1
        self._mixer.note_consumed(expected + 1)
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
