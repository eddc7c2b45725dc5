"""The two collectives GRAPE issues: average a probe's Gram over ranks, broadcast rank 0's weights.

Both pick the device the backend needs (NCCL: the current CUDA device; gloo: CPU) and are only
called when a process group is active (``grape_stream.world.dist_active()``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["agree_with_rank_zero", "all_reduce_mean", "broadcast_from_zero", "collective_device"]


def collective_device(fallback: torch.device | None = None, group: Any = None) -> torch.device:
    """Where a tensor must live for a collective on `group`'s backend."""
    if dist.get_backend(group) == "nccl":
        if fallback is not None and fallback.type == "cuda":
            return fallback
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_zero(x: np.ndarray, device: torch.device) -> np.ndarray:
    """Rank 0's copy of `x` (float64), on every rank."""
    t = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float64)).to(collective_device(device))
    dist.broadcast(t, src=0)
    return t.cpu().numpy()


def agree_with_rank_zero(mine: np.ndarray, device: torch.device) -> tuple[np.ndarray, float]:
    """(rank 0's values, max |rank 0's - mine|): every rank then uses rank 0's."""
    agreed = broadcast_from_zero(mine, device)
    diff = 0.0 if np.array_equal(agreed, mine) else float(np.max(np.abs(agreed - mine)))
    return agreed, diff


def all_reduce_mean(gram: torch.Tensor, losses: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The mean over `group`'s ranks of a (G, G) Gram and (G,) losses, in one all-reduce.

    The world size comes from the explicit group (not necessarily the whole job).
    """
    world = dist.get_world_size(group)
    g = gram.shape[0]
    packed = torch.cat([gram.reshape(-1), losses]).to(collective_device(None, group), torch.float64)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    packed /= world
    return packed[: g * g].reshape(g, g), packed[g * g :], world
