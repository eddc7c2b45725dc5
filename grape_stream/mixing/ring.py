"""Worker messages through shared memory: the columns of a PackedBatch skip the pickle and the pipe.

Why: a DataLoader worker's message is pickled (one copy), written through a 64 KiB pipe (a kernel copy
and a wake-up per 64 KiB), read into a buffer and unpickled in the main process (two more copies): at
batch 256 of 1024-token sequences that was ~1.5 us a sample in the worker and ~0.8 us in the main
process, a third of all the CPU the loader spends. Here each worker owns a small ring of slots in one
shared-memory block (a torch tensor: file-descriptor backed, so nothing is left in /dev/shm even after a
SIGKILL). It writes a message's array columns into a free slot and sends only their shapes; the block
itself travels once, with the worker's first message of an iteration. The main process copies the
columns out while unpickling, so the slot is free again before the loader even sees the message.

Correctness never depends on timing: a worker that finds its next slot still in use, or a message that
does not fit its slots, sends the arrays in-band as before. Slot flags are written by the worker after
the data (then the message goes through the pipe, a full barrier) and cleared by the main process after
its copy.
"""

from __future__ import annotations

import itertools
import os
import uuid
import weakref
from typing import Any

import numpy as np
import torch

from grape_stream.mixing.collate import PackedBatch

__all__ = ["MessageRing", "RingOwner"]

_HEADER = 64  # bytes before the slots: one int64 "in use" flag per slot (at most 8 slots)
_ALIGN = 64

#: Main process: token of a loader -> worker id -> (ring serial, shared tensor). Bounded: one entry per
#: worker of each live loader (a new iteration's ring replaces the last), dropped with the loader.
_RINGS: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
_SERIAL = itertools.count()


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // _ALIGN) * _ALIGN


class RingOwner:
    """The main-process side of one loader's rings: a token the workers name, and the cleanup."""

    def __init__(self, owner: object) -> None:
        self.token = uuid.uuid4().hex
        _RINGS[self.token] = {}
        weakref.finalize(owner, _RINGS.pop, self.token, None)


class MessageRing:
    """One worker's ring (created lazily, sized by its first message of up to ``rows`` rows)."""

    def __init__(self, token: str, worker: int, rows: int, slots: int) -> None:
        self.token, self.worker, self.rows, self.slots = token, worker, int(rows), max(1, min(8, int(slots)))
        self.serial = next(_SERIAL) * 100_000 + os.getpid() % 100_000
        self.buf: torch.Tensor | None = None
        self.slot_bytes = 0
        self.next = 0
        self.sent_buf = False

    def _ensure(self, packed: PackedBatch) -> bool:
        if self.buf is not None:
            return True
        n = packed.meta.shape[1]
        if not n or not packed.data or not all(isinstance(v, np.ndarray) for v in packed.data.values()):
            return False  # list columns (strings, ragged arrays) go in-band
        self.slot_bytes = sum(_aligned(v.nbytes // n * self.rows) for v in packed.data.values())
        self.buf = torch.zeros(_HEADER + self.slots * self.slot_bytes, dtype=torch.uint8).share_memory_()
        return True

    def pack(self, packed: PackedBatch) -> Any:
        """What the worker sends: a :class:`_RingMessage` when the columns fit a free slot, else ``packed``."""
        if not self._ensure(packed) or not all(isinstance(v, np.ndarray) for v in packed.data.values()):
            return packed
        assert self.buf is not None
        raw = self.buf.numpy()
        flags = raw[:_HEADER].view(np.int64)
        slot = self.next
        if flags[slot] != 0:
            return packed  # the main process has not copied this slot out yet: in-band this once
        base = _HEADER + slot * self.slot_bytes
        pos, specs = base, []
        for key, val in packed.data.items():
            nb = val.nbytes
            if pos + nb > base + self.slot_bytes:
                return packed
            raw[pos:pos + nb].view(val.dtype).reshape(val.shape)[...] = val
            specs.append((key, pos, val.dtype.str, val.shape))
            pos += _aligned(nb)
        flags[slot] = 1
        self.next = (slot + 1) % self.slots
        first = not self.sent_buf
        self.sent_buf = True
        return _RingMessage(self.token, self.worker, self.serial, self.buf if first else None, slot, specs,
                            packed.meta, packed.meta_keys, packed.batches)


class _RingMessage:
    """A PackedBatch whose array columns wait in a ring slot; unpickles into the PackedBatch itself."""

    __slots__ = ("args",)

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _receive, self.args


def _receive(token: str, worker: int, serial: int, buf: torch.Tensor | None, slot: int,
             specs: list[tuple[str, int, str, tuple[int, ...]]], meta: np.ndarray, meta_keys: tuple[str, ...],
             batches: int) -> PackedBatch:
    """Main process: copy the columns out of the slot (freeing it) and return the PackedBatch."""
    rings = _RINGS.setdefault(token, {})
    if buf is not None:
        rings[worker] = (serial, buf)
    got = rings.get(worker)
    if got is None or got[0] != serial:
        raise RuntimeError(f"a worker message names shared-memory ring {serial} of worker {worker}, which this "
                           "process never received (a message from an older iteration?)")
    raw = got[1].numpy()
    data = {key: raw[pos:pos + int(np.prod(shape)) * np.dtype(dt).itemsize].view(dt).reshape(shape).copy()
            for key, pos, dt, shape in specs}
    raw[:_HEADER].view(np.int64)[slot] = 0
    return PackedBatch(data, meta, meta_keys, batches)
