"""A memory-mapped raw MDS shard, and its samples as strided numpy arrays when they allow it.

Why: the mixer reads a few samples of many shards per batch. Decoding sample by sample
(``shard.decode_sample``) costs microseconds of Python per sample; but a shard of packed token
sequences (the converters' output) holds samples of one byte length whose columns are numpy arrays
with identical headers. Such a shard *is* a 2-D array: column ``c`` of sample ``i`` starts at
``first + i * length + offset_c``. :func:`uniform_layout` proves that for a whole shard once (every
sample's header bytes compared in one vectorised pass), and :class:`MappedShard` then exposes each
column as a strided view, so reading any set of samples is one numpy fancy index per shard, without
per-sample Python. Shards that do not qualify (variable lengths, non-array columns) are read sample by
sample by the caller.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Column", "MappedShard", "sample_layout", "uniform_layout"]


@dataclass(frozen=True)
class Column:
    """Where one array column lies inside a sample: ``count`` values of ``dtype`` at byte ``offset``.

    ``headers`` are the byte ranges before the values (per-column sizes, dtype / shape headers) with the
    bytes every sample read through this layout must have there.
    """

    name: str
    offset: int
    count: int
    dtype: np.dtype
    shape: tuple[int, ...]
    headers: tuple[tuple[int, int, bytes], ...]


class MappedShard:
    """One raw MDS shard file, memory-mapped read-only, with its sample offsets."""

    __slots__ = ("mm", "offsets", "columns", "signature", "_views")

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self.mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)  # the mapping keeps the file (and its disk space) alive until it is closed
        n = int(np.frombuffer(self.mm, np.uint32, count=1, offset=0)[0])
        self.offsets = np.frombuffer(self.mm, np.uint32, count=n + 1, offset=4).astype(np.int64)
        self.columns: tuple[Column, ...] | None = None
        #: What must agree between shards whose samples share one batch: names, dtypes, shapes.
        self.signature: tuple | None = None
        self._views: dict[str, np.ndarray] | None = None

    def sample(self, i: int) -> bytes:
        return self.mm[int(self.offsets[i]):int(self.offsets[i + 1])]

    def set_uniform(self, columns: tuple[Column, ...]) -> None:
        """Expose the columns as (samples,) arrays of raw records (``columns`` from :func:`uniform_layout`).

        Each record is one sample's values of the column as an opaque ``void`` item: numpy copies such
        items with one ``memcpy`` each whatever their alignment (a strided ``uint16`` view of an odd
        offset would take a slow element-wise path); :meth:`as_values` reinterprets the copy.
        """
        n = len(self.offsets) - 1
        first = int(self.offsets[0])
        length = (int(self.offsets[-1]) - first) // max(n, 1)
        self._views = {c.name: np.ndarray((n,), dtype=np.dtype((np.void, c.count * c.dtype.itemsize)),
                                          buffer=self.mm, offset=first + c.offset, strides=(length,))
                       for c in columns}
        self.columns = columns
        self.signature = tuple((c.name, c.dtype.str, c.shape) for c in columns)

    def take(self, local: np.ndarray) -> dict[str, np.ndarray] | None:
        """Columns of the samples ``local`` (indices inside the shard) as new arrays, or None (not uniform)."""
        if self._views is None or self.columns is None:
            return None
        return self.as_values({name: view[local] for name, view in self._views.items()})

    def take_into(self, local: np.ndarray, out: dict[str, np.ndarray], rows: slice | np.ndarray) -> None:
        """Copy the records of samples ``local`` to rows ``rows`` of ``out`` (from :meth:`empty_batch`)."""
        assert self._views is not None
        for name, view in self._views.items():
            out[name][rows] = view[local]

    def empty_batch(self, n: int) -> dict[str, np.ndarray]:
        """Record arrays of ``n`` rows for :meth:`take_into`."""
        assert self._views is not None
        return {name: np.empty(n, view.dtype) for name, view in self._views.items()}

    def as_values(self, records: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Record arrays (contiguous) -> ``(n, *shape)`` arrays of the columns' dtypes (no copy)."""
        assert self.columns is not None
        return {c.name: records[c.name].view(c.dtype).reshape(len(records[c.name]), *c.shape)
                for c in self.columns}

    def close(self) -> None:
        self._views = None  # the views export the mapping's buffer: drop them before closing it
        self.mm.close()


def sample_layout(shard: Any, sample: bytes) -> tuple[Column, ...] | None:
    """Byte layout of one sample whose columns are all numpy arrays (e.g. ``tokens``, ``loss_mask``).

    In every MDS encoding of an array the values are the last bytes of the column; everything before
    them (the per-column sizes and the dtype / shape headers) is returned as headers that another sample
    must match byte for byte to share this layout. None when a column is not a numeric array.
    """
    decoded = shard.decode_sample(sample)
    sizes = []
    idx = 0
    for size in shard.column_sizes:
        if size:
            sizes.append(int(size))
        else:
            sizes.append(int(np.frombuffer(sample[idx:idx + 4], np.uint32)[0]))
            idx += 4
    columns: list[Column] = []
    prefix = idx  # the per-column sizes: part of the first column's header
    for name, size in zip(shard.column_names, sizes):
        value = decoded[name]
        end = idx + size
        if not isinstance(value, np.ndarray) or value.dtype.hasobject:
            return None
        begin_values = end - value.nbytes
        hs = 0 if not columns else idx
        header = ((hs, begin_values, bytes(sample[hs:begin_values])),) if begin_values > hs else ()
        columns.append(Column(name, begin_values, int(value.size), value.dtype, tuple(value.shape), header))
        idx = end
    if idx != len(sample) or (not columns and prefix):
        return None
    return tuple(columns)


def uniform_layout(shard: Any, mapped: MappedShard) -> tuple[Column, ...] | None:
    """The layout every sample of the shard shares, or None.

    Qualifies when all samples have the same byte length, all columns are arrays and every sample's
    header bytes equal the first sample's (checked for the whole shard in one vectorised pass, so that
    a later read needs no per-sample check).
    """
    offsets = mapped.offsets
    n = len(offsets) - 1
    if n == 0:
        return None
    lengths = np.diff(offsets)
    length = int(lengths[0])
    if length <= 0 or not (lengths == length).all():
        return None
    columns = sample_layout(shard, mapped.sample(0))
    if columns is None:
        return None
    rows: np.ndarray = np.ndarray((n, length), dtype=np.uint8, buffer=mapped.mm, offset=int(offsets[0]))
    try:
        for c in columns:
            for hs, he, ref in c.headers:
                if not (rows[:, hs:he] == np.frombuffer(ref, np.uint8)).all():
                    return None
    finally:
        del rows
    return columns
