"""Which slots of which global batch a rank's loader batch holds.

The stream is a sequence of *global batches* of ``G`` samples (``global_batch_size``), the same for
every topology. A rank's DataLoader yields batches of ``B`` samples (``batch_size``); with ``R`` ranks
each global batch is cut into ``R * m`` slices of ``B`` consecutive slots, ``m = G / (B R)`` the
micro-batches a rank takes per global batch (gradient accumulation). Rank ``r``'s loader batch ``j``
is slice ``r * m + j % m`` of global batch ``j // m``: so the ranks' slices of a global batch, in rank
order, are the batch, and one rank with ``B = G`` reads exactly the concatenation of what 8 ranks read.

The slots are also cut into ``C`` *canonical nodes* (``lanes``) of ``G / C`` consecutive slots: lane ``c``
reads only its own share of every domain's shards (:mod:`grape_stream.mixing.epoch_order`), so a physical
node, whose ranks hold consecutive slices, reads only the shares of the lanes it holds. That is why the
physical node count must divide ``C`` (a node holds ``C / nodes`` whole lanes) or be a multiple of it
(``nodes / C`` nodes share one lane): anything else would put a lane's slots on nodes that hold parts of
other lanes too.
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
    lanes: int = 1  # canonical nodes

    @classmethod
    def of(cls, rank: int, world_size: int, batch_size: int, global_batch_size: int | None = None, *,
           lanes: int = 1, nodes: int = 1) -> "Topology":
        """Checked: the global batch must be a whole number of micro-batches of every rank, and of
        ``lanes`` canonical nodes whose count the ``nodes`` physical nodes divide or are a multiple of."""
        per_step = int(batch_size) * int(world_size)
        g = per_step if global_batch_size is None else global_batch_size
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
            raise ConfigError(f"global_batch_size must be a positive integer or None, got {global_batch_size!r}")
        if int(g) % per_step:
            raise ConfigError(
                f"global_batch_size={g} is not a multiple of batch_size={batch_size} x world_size={world_size} "
                f"= {per_step}: every rank must take the same whole number of micro-batches per global batch"
            )
        if isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)) or lanes < 1 or int(g) % lanes:
            raise ConfigError(f"canonical_nodes={lanes!r} must be a positive integer that divides "
                              f"global_batch_size={g}")
        if lanes % nodes and nodes % lanes:
            raise ConfigError(
                f"{nodes} physical nodes cannot read the stream of canonical_nodes={lanes}: the node count must "
                f"divide it or be a multiple of it (run on {_compatible(lanes)} nodes)"
            )
        return cls(int(rank), int(world_size), int(batch_size), int(g), int(lanes))

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

    @property
    def lane_size(self) -> int:
        """Slots of one canonical node in a global batch."""
        return self.global_batch_size // self.lanes

    def my_lanes(self) -> range:
        """The canonical nodes whose slots this rank holds (all its micro-batches)."""
        per_rank = self.global_batch_size // self.world_size
        first = self.rank * per_rank
        return range(first // self.lane_size, (first + per_rank - 1) // self.lane_size + 1)

    def describe(self) -> dict[str, int]:
        """What a checkpoint records about the topology that wrote it (information, never checked)."""
        return {"world_size": self.world_size, "batch_size": self.batch_size, "micro_batches": self.micro}


def _compatible(lanes: int) -> str:
    divisors = [d for d in range(1, lanes + 1) if lanes % d == 0]
    shown = ", ".join(str(d) for d in divisors[:8]) + (", ..." if len(divisors) > 8 else "")
    return f"{shown} or a multiple of {lanes}"


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
        """Lane positions before the global batch of loader batch ``batch + 1`` (where a new iteration starts)."""
        p = self.plan
        return p.end() if self.last_of_global else p.start.copy()
