"""Per-group gradients summed over the ranks and kept sharded: the micro-batched fused Gram on an FSDP model.

Why: with micro-batches a group's gradient is complete only after the last micro-batch, so something of the
size of G per-group gradients must live between micro-batches. Unsharded that is every parameter's per-group
gradient (``accumulators.RowAccumulator``: G x P); under FSDP that would be a full replica per group. Here
each leaf call's per-group contribution of the gathered (unsharded) parameter is reduce-scattered as soon as
it is formed: summed over the ranks, each rank keeping 1/W of the elements. A rank holds G x P / W between
micro-batches (plus the chunk being sent); after the last micro-batch the Gram is local dot products and one
G x G all-reduce.

What it computes (the semantics differ from the one-pass FSDP probe, by necessity): the Gram of each group's
gradient averaged over the ranks, i.e. of the mean over ranks of each rank's mean-loss gradient; with equal
group sizes on every rank (checked) that is what ONE process gives probing every rank's samples together.
The one-pass probe (and DDP) give the mean over ranks of each rank's own Gram (sharding.py); that needs each
rank's whole per-group gradient at once, which micro-batches can only hold as a replica. When every rank
probes the same samples (``probe_mode: replicated``) the two coincide.

Layout: a parameter's gradient, flattened, is cut into chunks of whole rows (at most ``budget`` elements for
all G groups, at least one row); each chunk is padded to W equal pieces and rank r keeps piece r of every
chunk. The layout depends only on the parameter's shape, G, W and the budget, so it is the same on every rank
and for every call; every rank joins every reduce-scatter, in the autograd order of the backward (the same on
every rank; FSDP issues its own collectives the same way).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from grape_stream.grape.collectives import collective_device
from grape_stream.grape.gram.accumulators import DenseContribution, SparseRowContribution
from grape_stream.grape.gram.batches import tensor_leaves
from grape_stream.grape.gram.gram_ops import as_range

__all__ = ["ShardedGroupSums", "reduce_sharded_gram", "same_samples"]

Contribution = Union[DenseContribution, SparseRowContribution]

# torch 2.14 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns); torch 2.6 has only the old
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Shard:
    """One parameter's layout and this rank's (G, chunks x piece) share of its per-group gradient sum."""

    def __init__(self, shape: torch.Size, num_groups: int, world: int, budget: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_rows = shape[0] if len(shape) else 1
        self.row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
        self.rows_per_chunk = min(self.num_rows, max(1, budget // max(1, num_groups * self.row_numel)))
        self.piece = -(-self.rows_per_chunk * self.row_numel // world)  # ceil: each rank's elements of a chunk
        self.chunks = -(-self.num_rows // self.rows_per_chunk)
        self.local = torch.zeros((num_groups, self.chunks * self.piece), dtype=dtype, device=device)


def _rows(c: Contribution, r0: int, r1: int) -> Tensor:
    """(G_c, r1 - r0, *row_shape) per-group gradient of rows [r0, r1) (G_c: the contribution's groups)."""
    if isinstance(c, DenseContribution):
        return c.materialize(slice(r0, r1))
    sel = ((c.pair_row >= r0) & (c.pair_row < r1)).nonzero().squeeze(1)
    out = torch.zeros((c.groups.numel(), r1 - r0, *c.row_shape), dtype=c.dtype, device=c.pair_vec.device)
    out[c.pair_local[sel], c.pair_row[sel] - r0] = c.pair_vec[sel]  # (group, row) pairs are unique
    return out


class ShardedGroupSums:
    """Every scope parameter's per-group gradient, summed over the ranks, sharded over them (module docstring)."""

    def __init__(self, num_groups: int, budget: int, group: Any = None) -> None:
        self.num_groups, self.budget, self.group = num_groups, budget, group
        self.world = dist.get_world_size(group)
        self.shards: dict[int, _Shard] = {}
        # chunks formed but not yet sent, coalesced into one reduce-scatter of up to budget / 2 elements (few
        # collectives per micro-batch instead of one per parameter and call): (shard, chunk, (W, G_m, piece))
        self.pending: list[tuple[_Shard, int, Tensor]] = []
        self.pending_groups: Optional[Tensor] = None

    def add(self, key: int, shape: torch.Size, contrib: Contribution, groups: Tensor, device: torch.device) -> None:
        """One call's contribution to parameter ``key`` (full ``shape``), to be summed over the ranks into this
        rank's share. ``groups``: the micro-batch's groups (the same on every rank), a superset of the
        contribution's. The caller flushes after each micro-batch's backward (:meth:`flush`)."""
        sh = self.shards.get(key)
        if sh is None:
            sh = self.shards[key] = _Shard(shape, self.num_groups, self.world, self.budget, contrib.dtype, device)
        if self.pending and (self.pending_groups is not groups or self.pending[0][2].dtype != sh.local.dtype):
            self.flush()
        gc, w = contrib.groups.numel(), self.world
        where = torch.searchsorted(groups, contrib.groups)  # the contribution's groups among the micro-batch's
        for s in range(sh.chunks):
            r0 = s * sh.rows_per_chunk
            r1 = min(sh.num_rows, r0 + sh.rows_per_chunk)
            # rank r receives rows [r G_m, (r + 1) G_m) of (W x G_m, piece): its piece of the chunk, for every group
            send = torch.zeros((w, groups.numel(), sh.piece), dtype=sh.local.dtype, device=device)
            if gc:
                block = _rows(contrib, r0, r1).reshape(gc, -1).to(send.dtype)
                block = F.pad(block, (0, w * sh.piece - block.shape[1]))
                send.permute(1, 0, 2)[where] = block.view(gc, w, sh.piece)
                del block
            self.pending.append((sh, s, send))
            self.pending_groups = groups
            if sum(t.numel() for _, _, t in self.pending) >= self.budget // 2:
                self.flush()

    def flush(self) -> None:
        """Sum the pending chunks over the ranks in one reduce-scatter; each rank adds its pieces to its shares.
        Every rank flushes at the same points (the same parameters, shapes and budget)."""
        if not self.pending or self.pending_groups is None:
            return
        groups, w = self.pending_groups, self.world
        gm, device = groups.numel(), self.pending[0][2].device
        parts = [(sh, s, t.shape[2]) for sh, s, t in self.pending]
        send = torch.cat([t for _, _, t in self.pending], dim=2) if len(self.pending) > 1 else self.pending[0][2]
        self.pending, self.pending_groups = [], None
        comm = collective_device(device, self.group)
        mine = torch.empty((gm, send.shape[2]), dtype=send.dtype, device=comm)
        _reduce_scatter(mine, send.reshape(w * gm, -1).to(comm), op=dist.ReduceOp.SUM, group=self.group)
        del send
        mine = mine.to(device)
        dest, a = as_range(groups), 0
        for sh, s, width in parts:
            sh.local[dest, s * sh.piece : (s + 1) * sh.piece] += mine[:, a : a + width]
            a += width

    def local_gram(self) -> Tensor:
        """(G, G) float64 sum over parameters of this rank's shares' inner products (to be summed over ranks)."""
        self.flush()
        gram = torch.zeros((self.num_groups, self.num_groups), dtype=torch.float64)
        step = max(1, self.budget // max(1, self.num_groups))
        for sh in self.shards.values():
            for a in range(0, sh.local.shape[1], step):
                block = sh.local[:, a : a + step].to(torch.float64)
                gram += (block @ block.t()).cpu()
        return gram

    def elements(self) -> int:
        return sum(sh.local.numel() for sh in self.shards.values())


def reduce_sharded_gram(local: Tensor, losses: Tensor, reduce: Optional[str],
                        group: Any = None) -> tuple[Tensor, Tensor, int]:
    """(Gram of the rank-mean per-group gradient, losses, world) from each rank's local dots, in one all-reduce.

    sum over ranks of the local dots = <sum_r g_r,i, sum_r g_r,j>, so / W^2 gives the mean's Gram. ``reduce``
    "mean" averages the losses over the ranks; None keeps this rank's (every rank probed the same samples).
    """
    world = dist.get_world_size(group)
    g = local.shape[0]
    packed = torch.cat([local.reshape(-1), losses.to(local.device)]).to(collective_device(None, group), torch.float64)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    gram = packed[: g * g].reshape(g, g) / (world * world)
    mean_losses = packed[g * g :] / world if reduce == "mean" else losses.to(torch.float64)
    return gram, mean_losses, world


def same_samples(batch: Any, sizes: list[int], group: Any = None) -> bool:
    """Whether every rank holds the same probe (content and group sizes); one tiny all-reduce."""
    code = zlib.crc32(repr(sizes).encode())
    for path, t in tensor_leaves(batch):
        code = zlib.crc32(path.encode(), code)
        code = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), code)
    t = torch.tensor([code, -code], dtype=torch.int64, device=collective_device(None, group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0]) == code and int(-t[1]) == code
