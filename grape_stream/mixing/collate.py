"""The one collate of grape_stream: per-sample dicts (mixer, probe or task samples) -> a batch of tensors.

Every sample source in the package yields dicts of numpy arrays and Python scalars; the trainer wants
tensors of a dtype every torch op accepts. Keeping the rules here (in particular the widening of
unsigned >8-bit ints, which torch cannot batch on every device) makes all batches look alike.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

__all__ = ["PackedBatch", "SplitBatches", "collate_samples", "to_tensor"]


def to_tensor(value: Any) -> Any:
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
            out[key] = torch.stack([to_tensor(v) for v in vals])
        elif isinstance(v0, (bool, np.bool_)):
            out[key] = torch.tensor(vals, dtype=torch.bool)
        elif isinstance(v0, (int, np.integer)):
            out[key] = torch.tensor([int(v) for v in vals], dtype=torch.int64)
        elif isinstance(v0, (float, np.floating)):
            out[key] = torch.tensor([float(v) for v in vals], dtype=torch.float64)
        else:
            out[key] = vals
    return out


class PackedBatch:
    """Composed batches as numpy arrays: what the mixer's DataLoader workers send to the main process.

    Why: torch sends a tensor from a worker as a shared-memory file descriptor, and receiving one costs
    a socket connection with an authentication handshake in the main process (~0.2-1 ms a batch, more
    than composing a batch of 32). Numpy arrays travel pickled through the worker's pipe instead, at
    their stored width (``uint16`` tokens are a quarter of the ``int64`` tensor), and :meth:`split`
    makes the batches the loader hands out, in the main process. One message may carry ``batches``
    consecutive batches of equal size (rows in order), because every message costs the main process
    ~0.3-0.5 ms of DataLoader bookkeeping and unpickling whatever its size: the columns are widened
    once per message and each batch is a slice of them. Torch's pin-memory thread calls
    :meth:`pin_memory`. Deliberately neither a Mapping nor a Sequence: ``default_convert`` passes it as is.
    """

    __slots__ = ("data", "meta", "meta_keys", "batches")

    def __init__(self, data: dict[str, Any], meta: np.ndarray, meta_keys: Sequence[str], batches: int = 1) -> None:
        self.data = data
        self.meta = meta
        self.meta_keys = tuple(meta_keys)
        self.batches = int(batches)

    def tensors(self) -> dict[str, Any]:
        """All rows as one collated batch: array columns as tensors (see :func:`to_tensor`), the per-sample
        metadata as rows of one int64 tensor."""
        out: dict[str, Any] = {}
        for key, val in self.data.items():
            out[key] = to_tensor(val) if isinstance(val, np.ndarray) else collate_samples([{key: v} for v in val])[key]
        meta = torch.from_numpy(self.meta)
        for i, key in enumerate(self.meta_keys):
            out[key] = meta[i]
        return out

    def split(self, pin: bool = False) -> list[dict[str, Any]]:
        """The ``batches`` collated batches, in order (with ``pin``, in pinned memory).

        Each batch's columns are widened on their own rather than all at once: a batch's tensors are then
        the size of one batch, which the allocator reuses once the trainer drops the batch before last,
        where a whole message's tensors would stay alive until its last batch is dropped and every new
        one would need fresh pages from the kernel (zero-filled: as costly as the widening itself)."""
        parts = [self.tensors()] if self.batches == 1 else [self.batch(j).tensors() for j in range(self.batches)]
        if pin:
            parts = [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in p.items()} for p in parts]
        return parts

    def batch(self, j: int) -> "PackedBatch":
        """Batch ``j`` of the message as its own PackedBatch (views of these arrays; list columns sliced)."""
        if self.batches == 1:
            return self
        n = self.meta.shape[1] // self.batches
        return PackedBatch({k: v[j * n:(j + 1) * n] for k, v in self.data.items()}, self.meta[:, j * n:(j + 1) * n],
                           self.meta_keys)

    def pin_memory(self) -> "SplitBatches":
        return SplitBatches(self.split(pin=True))


class SplitBatches(list):
    """The batches of one :class:`PackedBatch`, collated and pinned by torch's pin-memory thread."""
