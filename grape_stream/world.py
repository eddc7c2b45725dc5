"""Who this process is in a distributed job: rank, world size, local rank, DataLoader worker.

mosaicml-streaming reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE from the environment, while
collectives use torch.distributed's process group; this module is the one place that reads either, so
every component agrees on who it is. It imports torch lazily: the converters use it without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["World", "collective_rank_size", "dist_active", "process_world", "streaming_world", "dataloader_worker"]


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int = 0
    #: ranks on this node (LOCAL_WORLD_SIZE; streaming's default when unset: 1)
    local_size: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        """Physical nodes: what a node-local cache and the mixer's canonical node count are measured against."""
        return max(1, self.size // max(1, self.local_size))

    @property
    def node(self) -> int:
        """This process's node (torchrun's GROUP_RANK): ranks are laid out node after node."""
        return self.rank // max(1, self.local_size)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def dist_active() -> bool:
    """True when a torch.distributed process group is initialised (collectives are needed)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency; converters may run without it
        return False
    return bool(dist.is_available() and dist.is_initialized())


def process_world() -> World:
    """The process group's view (rank 0 of 1 without one): what collectives and rank-0 work use."""
    local = _env_int("LOCAL_RANK", 0)
    if dist_active():
        import torch.distributed as dist

        return World(dist.get_rank(), dist.get_world_size(), local)
    return World(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), local)


def collective_rank_size() -> tuple[int, int]:
    """(rank, size) of the process group, (0, 1) without one: collectives need a group, whatever RANK /
    WORLD_SIZE the environment holds (a single process with WORLD_SIZE=2 set must not wait for a peer)."""
    if not dist_active():
        return 0, 1
    world = process_world()
    return world.rank, world.size


def streaming_world() -> World:
    """The environment's view, which streaming uses, checked against the process group when there is one.

    A process group initialised without RANK / WORLD_SIZE in the environment would make every rank a
    "local leader" inside streaming, so a disagreement is an error, not a silent mis-partition.
    """
    env = World(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0),
                _env_int("LOCAL_WORLD_SIZE", 1))
    if env.size % max(1, env.local_size) or not 0 < env.local_size <= env.size:
        raise ValueError(f"LOCAL_WORLD_SIZE={env.local_size} does not divide WORLD_SIZE={env.size}: every node "
                         "must run the same number of ranks")
    group = os.environ.get("GROUP_RANK")
    if group not in (None, "") and _env_int("GROUP_RANK", 0) != env.node:
        raise ValueError(f"GROUP_RANK={group} but RANK={env.rank} // LOCAL_WORLD_SIZE={env.local_size} = {env.node}: "
                         "ranks must be numbered node after node (torchrun does)")
    if dist_active():
        import torch.distributed as dist

        rank, size = dist.get_rank(), dist.get_world_size()
        if (rank, size) != (env.rank, env.size):
            raise RuntimeError(
                f"torch.distributed says rank {rank} of {size} but the environment says RANK={env.rank} "
                f"WORLD_SIZE={env.size}; streaming reads the environment: set RANK, WORLD_SIZE, LOCAL_RANK "
                "and LOCAL_WORLD_SIZE (torchrun does)"
            )
    return env


def dataloader_worker() -> tuple[int, int] | None:
    """(worker id, number of workers) inside a DataLoader worker; None in the main process (which is not
    "worker 0 of 1": the mixer gives the main process its own slot in the live weight table)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return None if info is None else (info.id, info.num_workers)
