"""The one collate of grape_stream: per-sample dicts (mixer, probe or task samples) -> a batch of tensors.

Every sample source in the package yields dicts of numpy arrays and Python scalars; the trainer wants
tensors of a dtype every torch op accepts. Keeping the rules here (in particular the widening of
unsigned >8-bit ints, which torch cannot batch on every device) makes all batches look alike.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

__all__ = ["PackedBatch", "collate_samples", "to_tensor"]


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
    """A composed batch as numpy arrays: what the mixer's DataLoader workers send to the main process.

    Why: torch sends a tensor from a worker as a shared-memory file descriptor, and receiving one costs
    a socket connection with an authentication handshake in the main process (~0.2-1 ms a batch, more
    than composing a batch of 32). Numpy arrays travel pickled through the worker's pipe instead, at
    their stored width (``uint16`` tokens are a quarter of the ``int64`` tensor), and :meth:`tensors`
    makes the batch the loader hands out, in the main process. Torch's pin-memory thread calls
    :meth:`pin_memory`. Deliberately neither a Mapping nor a Sequence: ``default_convert`` passes it as is.
    """

    __slots__ = ("data", "meta", "meta_keys")

    def __init__(self, data: dict[str, Any], meta: np.ndarray, meta_keys: Sequence[str]) -> None:
        self.data = data
        self.meta = meta
        self.meta_keys = tuple(meta_keys)

    def tensors(self) -> dict[str, Any]:
        """The collated batch: array columns as tensors (see :func:`to_tensor`), the per-sample metadata as
        rows of one int64 tensor."""
        out: dict[str, Any] = {}
        for key, val in self.data.items():
            out[key] = to_tensor(val) if isinstance(val, np.ndarray) else collate_samples([{key: v} for v in val])[key]
        meta = torch.from_numpy(self.meta)
        for i, key in enumerate(self.meta_keys):
            out[key] = meta[i]
        return out

    def pin_memory(self) -> dict[str, Any]:
        return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in self.tensors().items()}
