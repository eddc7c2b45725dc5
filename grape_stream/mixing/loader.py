"""The DataLoader side of the mixer: whole batches across processes, consumed batches counted.

:class:`MixerDataLoader` is a plain ``torch.utils.data.DataLoader`` whose workers compose and collate
whole batches (no per-sample objects cross the process boundary) and which counts the batches it
hands out, so that the mixer knows exactly how far the trainer is (see docs/mixer.md, "Lag").
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Mapping, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from grape_stream.mixing.collate import PackedBatch, SplitBatches
from grape_stream.mixing.ring import MessageRing, RingOwner

__all__ = ["SAMPLES_PER_MESSAGE", "BatchSource", "MixerDataLoader", "message_depth"]


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

    def iter_batches(self, packed: bool = False, per_message: int = 1) -> Iterator[Any]:
        """Whole collated batches, composed in this process or DataLoader worker; with ``packed``, as
        :class:`~grape_stream.mixing.collate.PackedBatch` (numpy arrays; ``.split()`` collates them), in a
        worker ``per_message`` consecutive batches to a PackedBatch."""
        ...

    def note_consumed(self, batches: int) -> None:
        """The trainer has taken ``batches`` batches in all (never decreases the count)."""
        ...


class _Batches(IterableDataset):
    """The mixer yielding whole collated batches (what :class:`MixerDataLoader` iterates).

    Attribute access falls through to the mixer, so code that looks at ``loader.dataset`` (Composer's
    dataset-state protocol: ``state_dict`` / ``load_state_dict``) reaches the mixer.
    """

    def __init__(self, mixer: BatchSource, per_message: int, ring_slots: int) -> None:
        super().__init__()
        self.mixer = mixer
        self.per_message = per_message
        self.ring_slots = ring_slots
        self.rings = RingOwner(self)

    def __iter__(self) -> Iterator[Any]:
        # In a worker: arrays through a shared-memory ring (or the pipe), collated by the main process.
        info = get_worker_info()
        if info is None:
            return self.mixer.iter_batches()
        return self._send(info.id)

    def _send(self, worker: int) -> Iterator[Any]:
        ring = MessageRing(self.rings.token, worker, self.per_message * self.mixer.batch_size, self.ring_slots)
        inner = self.mixer.iter_batches(packed=True, per_message=self.per_message)
        try:
            for packed in inner:
                yield ring.pack(packed)
        finally:
            close = getattr(inner, "close", None)
            if close is not None:
                close()

    def __getattr__(self, name: str) -> Any:
        if name in ("mixer", "per_message", "ring_slots", "rings"):
            raise AttributeError(name)
        return getattr(self.mixer, name)


#: Default for ``batches_per_message``: about this many samples to a worker message (measured: bench/loader.py).
SAMPLES_PER_MESSAGE = 512
#: ... but with no fixed ``lag``, the default keeps the loader's depth (how many batches after the last one
#: handed out a weight switch lands) at most this: many workers times many small batches a message would
#: otherwise delay every GRAPE update by hundreds of batches
DEFAULT_MAX_DEPTH = 64


def message_depth(batches_in_flight: int, per_message: int) -> int:
    """The loader's depth in batches: after ``consumed`` batches were handed out, no batch from
    ``consumed + depth`` on has been composed yet (the ``lag`` the mixer uses; docs/mixer.md, "Lag").

    Torch keeps ``batches_in_flight`` (``num_workers * prefetch_factor``) messages requested beyond the
    one the loader is splitting. Right after the first batch of message ``s`` is handed out (``consumed
    = s * m + 1``), messages up to ``s + in_flight`` may be composed, whose last batch is
    ``(s + in_flight + 1) * m - 1 = consumed + (in_flight + 1) * m - 2``. With ``m = 1`` this is torch's
    ``num_workers * prefetch_factor``. The ramp-up of the first messages (``compose.message_size``) only
    makes messages smaller, so the bound holds from the start.
    """
    return (batches_in_flight + 1) * per_message - 1 if batches_in_flight > 0 else 0


class MixerDataLoader(DataLoader):
    """A DataLoader over a :class:`WeightedStreamingMixer` that knows how many batches were consumed.

    Workers compose and collate whole batches (no per-sample objects cross the process boundary),
    ``batches_per_message`` consecutive batches to a message (default: ``512 // batch_size``, fewer
    when the mixer's ``lag`` does not allow more or, with no fixed lag, when the depth would pass
    ``DEFAULT_MAX_DEPTH`` = 64 batches; 1 means one batch a message as torch does; with more
    than one, ``prefetch_factor`` defaults to 1), which the loader splits again. The prefetch depth in batches
    (``(num_workers * prefetch_factor + 1) * batches_per_message - 1``, :func:`message_depth`) is told to
    the mixer, and the batches handed out are counted. So ``mixer.set_weights(alpha)`` takes effect
    exactly ``lag`` batches after the last batch handed out, whatever the workers' timing, and a new
    ``iter(loader)`` continues where the last one stopped (also mid-message). Neither affects which
    samples a batch holds. ``loader.dataset`` forwards to the mixer (``state_dict``, ``load_state_dict``, ...).
    """

    def __init__(self, mixer: BatchSource, num_workers: int = 0, batches_per_message: int | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(mixer, BatchSource):
            raise TypeError(f"MixerDataLoader needs a WeightedStreamingMixer, got {type(mixer).__name__}")
        bs = kwargs.pop("batch_size", mixer.batch_size)
        if bs != mixer.batch_size:
            raise ValueError(f"batch_size {bs} differs from the mixer's batch_size {mixer.batch_size}")
        for bad in ("sampler", "batch_sampler", "shuffle", "drop_last", "collate_fn"):
            if kwargs.get(bad):
                raise ValueError(f"{bad}= does not apply to the mixer (it composes and collates batches itself)")
        if batches_per_message is not None and (isinstance(batches_per_message, bool) or
                                                not isinstance(batches_per_message, int) or batches_per_message < 1):
            raise ValueError(f"batches_per_message must be a positive integer or None, got {batches_per_message!r}")
        per = 1
        if num_workers > 0:
            pf = kwargs.get("prefetch_factor")
            per = _per_message(batches_per_message, mixer.batch_size, num_workers * (pf or 1), mixer.fixed_lag)
            # A message of several batches is itself a prefetch: one message ahead per worker is enough.
            kwargs["prefetch_factor"] = pf or (1 if per > 1 else 2)
        # Slots per worker: its prefetch_factor messages in flight, the one being unpickled, one spare.
        slots = (kwargs.get("prefetch_factor") or 2) + 2
        super().__init__(_Batches(mixer, per, slots), batch_size=None, num_workers=num_workers, **kwargs)
        pf = self.prefetch_factor if num_workers > 0 else 0
        in_flight = num_workers * (pf or 2) if num_workers > 0 else 0
        lag = mixer.fixed_lag
        if lag is not None and lag < in_flight:
            raise ValueError(
                f"the mixer's lag={lag} is smaller than this loader's prefetch depth {in_flight} "
                f"(num_workers={num_workers} x prefetch_factor={pf}): weight switches would land on batches "
                "already composed. Raise lag, or leave it None to use the prefetch depth."
            )
        self.batches_per_message = per
        self.prefetch_depth = message_depth(in_flight, per)
        self.mixer = mixer

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.mixer.begin_tracked_iteration(self.prefetch_depth)
        if self.num_workers == 0 and not self.pin_memory:
            # torch's single-process iterator would only pass each batch through ``default_convert`` (an
            # identity on a dict of tensors) inside a profiler range: ~20-40 us a batch, skipped here.
            return _CountingIterator(iter(self.mixer.iter_batches()), self.mixer)
        return _CountingIterator(super().__iter__(), self.mixer)


def _per_message(asked: int | None, batch_size: int, in_flight: int, lag: int | None) -> int:
    """Batches per worker message: ``asked``, or the default; never more than a fixed ``lag`` allows."""
    if in_flight == 0:
        return 1  # no workers: nothing crosses a process boundary
    most = None if lag is None else (lag + 1) // (in_flight + 1)
    if asked is None:
        per = max(1, SAMPLES_PER_MESSAGE // batch_size)
        cap = (DEFAULT_MAX_DEPTH + 1) // (in_flight + 1) if most is None else most
        return max(1, min(per, cap))
    if most is not None and asked > most:
        raise ValueError(
            f"batches_per_message={asked} needs lag >= {message_depth(in_flight, asked)} (the prefetch depth in "
            f"batches: ({in_flight} messages in flight + 1) x {asked} - 1), but the mixer's lag is {lag}. Raise "
            f"lag, or pass batches_per_message <= {max(1, most)}."
        )
    return asked


class _CountingIterator:
    """Counts the batches handed to the trainer and checks that they arrive in order; splits messages."""

    def __init__(self, inner: Iterator[Any], mixer: BatchSource) -> None:
        self._inner = inner
        self._mixer = mixer
        self._next = mixer.consumed_batches
        self._ready: deque[Any] = deque()

    def __iter__(self) -> "_CountingIterator":
        return self

    def __next__(self) -> Any:
        if self._ready:
            batch = self._ready.popleft()
        else:
            batch = next(self._inner)
            if isinstance(batch, (PackedBatch, SplitBatches)):
                parts = batch.split() if isinstance(batch, PackedBatch) else batch
                batch = parts[0]
                self._ready.extend(parts[1:])
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
