"""The weight schedule and the data cursor in shared memory, visible to DataLoader workers.

One torch ``uint8`` storage moved to shared memory before any worker starts. Forked workers inherit
it; spawned workers receive it through torch's multiprocessing reductions (a file descriptor, not a
name), so nothing is left in /dev/shm even after a SIGKILL. Layout (all little-endian, aligned)::

    header  int64[16]    0: entries published   1: cursor (first batch of the next iteration)
                         2: anchor batch          3: generation (bumped on every cursor write)
                         4: base (the entry in force at the cursor: a reader needs none before it)
    claimed int64[S]     highest batch each process has started composing (slot 0 = the main
                         process, 1 + w = DataLoader worker w), -1 = none
    anchor  int64[P]     read positions (every canonical node's of every domain) before the anchor batch
    seq     int64[C]     ring of schedule entries: sequence number held by each slot (-1 = empty)
    from    int64[C]     first batch of the entry
    version int64[C]
    alpha   float64[C,K]

Only the main process writes the ring and the cursor; workers only write their own claimed slot.
An entry is written data first, sequence number last, then published by bumping ``header[0]``; a
reader re-checks the sequence number after copying, so a torn read (an overwritten slot) is detected,
never used. No lock is needed because an entry never concerns a batch that a worker may be composing
(the mixer schedules it beyond the loader's prefetch depth; see docs/mixer.md).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
import torch

__all__ = ["SharedWeightTable", "ScheduleOverflow", "MAX_SLOTS"]

MAX_SLOTS = 257  # the main process + up to 256 DataLoader workers per rank
_HEADER = 16


class ScheduleOverflow(RuntimeError):
    """A reader fell more than the ring's capacity behind the writer."""


class ScheduleSink(Protocol):
    """Where a reader puts the entries it reads (an :class:`~grape_stream.mixing.schedule.EffectiveSchedule`)."""

    def add(self, version: int, from_batch: int, alpha: np.ndarray) -> None: ...


class SharedWeightTable:
    """The schedule ring and the cursor in one shared buffer (layout in the module docstring)."""

    def __init__(self, num_domains: int, capacity: int = 1024, positions: int | None = None) -> None:
        if capacity < 2:
            raise ValueError(f"schedule capacity must be >= 2, got {capacity}")
        self.K = int(num_domains)
        self.C = int(capacity)
        self.P = self.K if positions is None else int(positions)
        n_int = _HEADER + MAX_SLOTS + self.P + 3 * self.C
        n_float = self.C * self.K
        self._buf = torch.zeros(8 * (n_int + n_float), dtype=torch.uint8)
        self._buf.share_memory_()
        self._views: dict[str, np.ndarray] | None = None
        v = self._v
        v["header"][:] = 0
        v["claimed"][:] = -1
        v["seq"][:] = -1

    # -- pickling: keep the shared tensor, rebuild numpy views lazily ------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"K": self.K, "C": self.C, "P": self.P, "_buf": self._buf}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.K, self.C, self.P, self._buf = state["K"], state["C"], state["P"], state["_buf"]
        self._views = None

    @property
    def _v(self) -> dict[str, np.ndarray]:
        if self._views is None:
            raw = self._buf.numpy()
            ints = raw[: 8 * (_HEADER + MAX_SLOTS + self.P + 3 * self.C)].view(np.int64)
            floats = raw[8 * ints.size:].view(np.float64)
            o = 0
            views: dict[str, np.ndarray] = {}
            for name, size in (("header", _HEADER), ("claimed", MAX_SLOTS), ("anchor", self.P),
                               ("seq", self.C), ("from", self.C), ("version", self.C)):
                views[name] = ints[o:o + size]
                o += size
            views["alpha"] = floats.reshape(self.C, self.K)
            self._views = views
        return self._views

    # -- writer side (main process) -----------------------------------------------------------------
    def publish(self, seq: int, version: int, from_batch: int, alpha: np.ndarray) -> None:
        v = self._v
        slot = seq % self.C
        v["seq"][slot] = -1
        v["from"][slot] = from_batch
        v["version"][slot] = version
        v["alpha"][slot, :] = alpha
        v["seq"][slot] = seq
        v["header"][0] = seq + 1

    def publish_many(self, first: int, froms: Sequence[int], alphas: np.ndarray) -> None:
        """Entries ``first, first + 1, ...`` (sequence number = version) in one write: a restore."""
        n = len(froms)
        if n > self.C:
            raise ValueError(f"{n} entries do not fit a schedule table of capacity {self.C}")
        v = self._v
        seqs = np.arange(first, first + n, dtype=np.int64)
        slots = seqs % self.C
        v["seq"][slots] = -1
        v["from"][slots] = np.asarray(froms, dtype=np.int64)
        v["version"][slots] = seqs
        v["alpha"][slots, :] = alphas
        v["seq"][slots] = seqs
        v["header"][0] = first + n

    def reset(self) -> None:
        v = self._v
        v["seq"][:] = -1
        v["header"][0] = 0
        v["header"][4] = 0
        v["claimed"][:] = -1

    def set_base(self, seq: int) -> None:
        """Readers that start from now on need no entry before ``seq`` (it is in force at the cursor)."""
        self._v["header"][4] = seq

    @property
    def base(self) -> int:
        return int(self._v["header"][4])

    def set_cursor(self, batch: int, counts: np.ndarray) -> None:
        v = self._v
        v["anchor"][:] = counts
        v["header"][2] = batch
        v["header"][1] = batch
        v["header"][3] += 1

    def reset_claims(self, below: int) -> None:
        """A new position: batches before ``below`` count as composed (by the main process), none after."""
        c = self._v["claimed"]
        c[1:] = -1
        c[0] = below - 1 if below > 0 else -1

    @property
    def published(self) -> int:
        return int(self._v["header"][0])

    @property
    def cursor(self) -> int:
        return int(self._v["header"][1])

    def max_claimed(self, workers_only: bool = False) -> int:
        c = self._v["claimed"]
        return int(c[1:].max() if workers_only else c.max())

    def active_workers(self) -> int:
        """DataLoader workers that have started composing since the last position change."""
        return int(np.count_nonzero(self._v["claimed"][1:] >= 0))

    # -- reader side ---------------------------------------------------------------------------------
    def read_anchor(self) -> tuple[int, np.ndarray, int]:
        v = self._v
        for _ in range(1000):
            gen = int(v["header"][3])
            batch = int(v["header"][2])
            counts = v["anchor"].copy()
            if int(v["header"][3]) == gen:
                return batch, counts, gen
        raise RuntimeError("the mixer's cursor kept changing while a worker started")  # pragma: no cover

    def claim(self, slot: int, batch: int) -> int:
        """Record that ``slot`` starts composing ``batch``; returns the previous claim."""
        c = self._v["claimed"]
        prev = int(c[slot])
        c[slot] = batch
        return prev

    def read_into(self, schedule: ScheduleSink, next_seq: int) -> int:
        """Add entries ``next_seq ...`` that are published to ``schedule``; return the next seq to read."""
        v = self._v
        n = int(v["header"][0])
        if n <= next_seq:
            return next_seq
        if n - next_seq > self.C:
            raise ScheduleOverflow(
                f"{n - next_seq} weight changes were published since this worker last looked, more than the "
                f"schedule capacity {self.C}; raise schedule_capacity"
            )
        for seq in range(next_seq, n):
            slot = seq % self.C
            if int(v["seq"][slot]) != seq:
                raise ScheduleOverflow(f"schedule entry {seq} was overwritten before it was read")
            version = int(v["version"][slot])
            from_batch = int(v["from"][slot])
            alpha = v["alpha"][slot].copy()
            if int(v["seq"][slot]) != seq:
                raise ScheduleOverflow(f"schedule entry {seq} was overwritten while it was read")
            schedule.add(version, from_batch, alpha)
        return n
