"""Which slots of which global batch a rank's loader batch holds.

The stream is a sequence of *global batches* of ``G`` samples (``global_batch_size``), the same for
every topology. A rank's DataLoader yields batches of ``B`` samples (``batch_size``); with ``R`` ranks
each global batch is cut into ``R * m`` slices of ``B`` consecutive slots, ``m = G / (B R)`` the
micro-batches a rank takes per global batch (gradient accumulation). Rank ``r``'s loader batch ``j``
is slice ``r * m + j % m`` of global batch ``j // m``: so the ranks' slices of a global batch, in rank
order, are the batch, and one rank with ``B = G`` reads exactly the concatenation of what 8 ranks read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grape_stream.errors import ConfigError
from grape_stream.mixing.quotas import BatchPlan

__all__ = ["RankBatch", "Topology"]


@dataclass(frozen=True)
class Topology:
    """This rank's place in the global stream: ``rank`` of ``world_size``, ``batch_size`` samples a loader
    batch, ``global_batch_size`` samples a global batch (all ranks, all micro-batches)."""

    rank: int
    world_size: int
    batch_size: int
    global_batch_size: int

    @classmethod
    def of(cls, rank: int, world_size: int, batch_size: int, global_batch_size: int | None = None) -> "Topology":
        """Checked: the global batch must be a whole number of micro-batches of every rank."""
        per_step = int(batch_size) * int(world_size)
        g = per_step if global_batch_size is None else global_batch_size
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
            raise ConfigError(f"global_batch_size must be a positive integer or None, got {global_batch_size!r}")
        if int(g) % per_step:
            raise ConfigError(
                f"global_batch_size={g} is not a multiple of batch_size={batch_size} x world_size={world_size} "
                f"= {per_step}: every rank must take the same whole number of micro-batches per global batch"
            )
        return cls(int(rank), int(world_size), int(batch_size), int(g))

    @property
    def micro(self) -> int:
        """Loader batches (micro-batches) this rank takes per global batch."""
        return self.global_batch_size // (self.batch_size * self.world_size)

    def global_batch(self, loader_batch: int) -> int:
        return int(loader_batch) // self.micro

    def first_slot(self, loader_batch: int) -> int:
        """The first slot of the global batch that loader batch ``loader_batch`` holds."""
        m = self.micro
        return (self.rank * m + int(loader_batch) % m) * self.batch_size

    def ends_global_batch(self, loader_batch: int) -> bool:
        """Whether loader batch ``loader_batch`` is this rank's last slice of its global batch."""
        return (int(loader_batch) + 1) % self.micro == 0

    def describe(self) -> dict[str, int]:
        """What a checkpoint records about the topology that wrote it (information, never checked)."""
        return {"world_size": self.world_size, "batch_size": self.batch_size, "micro_batches": self.micro}


@dataclass
class RankBatch:
    """Loader batch ``batch`` of this rank: slots ``first_slot ... first_slot + B - 1`` of ``plan``'s global batch."""

    batch: int
    plan: BatchPlan
    first_slot: int
    last_of_global: bool

    @property
    def version(self) -> int:
        return self.plan.version

    @property
    def next_counts(self) -> np.ndarray:
        """Domain positions before the global batch of loader batch ``batch + 1`` (where a new iteration starts)."""
        p = self.plan
        return p.start + p.quota if self.last_of_global else p.start.copy()
