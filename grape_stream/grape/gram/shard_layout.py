"""Where each rank holds its piece of a parameter-shaped stack, under FSDP2 and under FSDP1: one interface.

The in-step engine keeps three kinds of (L, *parameter shape) stacks sharded like the parameters instead of
whole: the fixed directions u_d, R&B's per-domain sums, and the task probe's per-task parts. The two FSDP
versions shard a parameter differently:

* FSDP2 (``fully_shard``): the parameter is a DTensor; a stack is a DTensor with the parameter's mesh and
  placements shifted past the leading dimension (:class:`DTensorLayout`, the functions of ``instep_shards``).
* FSDP1 (``use_orig_params=True``): FSDP concatenates a unit's parameters, flattened, into one FlatParameter
  and gives each rank one contiguous chunk of it, so each rank holds one contiguous piece (possibly empty) of
  each parameter's flattened elements, in rank order. Outside the forward the parameter (and its ``.grad``)
  IS that piece, a 1-D tensor. A stack is held as (L, piece) on each rank (:class:`FlatLayout`), so a
  direction "shaped like the parameter" is what FSDP1 users already see: a tensor of ``p``'s local shape.
  The pieces have different lengths on different ranks: the collectives pad every piece to the longest
  (all-gather, reduce-scatter), which costs at most one piece of padding per rank.

Every method that moves data between ranks is a collective over the parameter's group: every rank calls it
for the same parameters in the same order (the engine calls them from the backward of a hooked call, in the
graph's order, or from a loop over the parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from grape_stream.errors import ConfigError
from grape_stream.grape.collectives import collective_device
from grape_stream.grape.gram import instep_shards as dt

__all__ = ["DTensorLayout", "FlatLayout", "ShardLayout", "check_fsdp1", "named_parameters", "shard_layouts"]

_FSDP1_PREFIX = "_fsdp_wrapped_module."


class ShardLayout(Protocol):
    """How one parameter's (L, *shape) stacks are split over the ranks."""

    shape: torch.Size  # the parameter's whole shape
    device: torch.device  # where this rank's piece lives
    replicas: int  # ranks holding each piece (HSDP's replicate dimension; 1 otherwise)

    def stack(self, ts: list[Optional[Tensor]]) -> Tensor:
        """The held (L, ...) stack from L tensors each whole or already this rank's piece (None: zeros)."""
        ...

    def gather(self, held: Tensor) -> Tensor:
        """The whole (L, *shape) from every rank's held stack (an all-gather)."""
        ...

    def reduce_scatter(self, full: Tensor) -> Tensor:
        """This rank's local piece of the sum over ranks of every rank's whole (L, *shape) ``full``."""
        ...

    def whole(self, local: Tensor) -> Tensor:
        """The whole (L, *shape) from every rank's local (L, ...) piece (an all-gather)."""
        ...

    def local_of(self, full: Tensor) -> Tensor:
        """This rank's local piece (L, ...) of a whole (L, *shape) tensor (no collective)."""
        ...

    def local(self, held: Tensor) -> Tensor:
        """The plain local tensor behind a held stack (its elements on this rank)."""
        ...

    def shard(self, t: Tensor) -> Tensor:
        """This rank's local piece of ``t``, one tensor whole or already a piece (no collective)."""
        ...

    def like_param(self, local: Tensor) -> Tensor:
        """A tensor shaped like the parameter as the user sees it from this rank's local piece."""
        ...

    def zeros_local(self) -> Tensor:
        """A zero local piece of one parameter."""
        ...


class DTensorLayout:
    """FSDP2: a DTensor parameter (see ``instep_shards.py``)."""

    def __init__(self, p: Any) -> None:
        self.p = p
        self.shape = p.shape
        self.device = p.to_local().device
        self.replicas = dt.replicas(p)

    def stack(self, ts: list[Optional[Tensor]]) -> Tensor:
        return dt.stack_sharded(self.p, ts)

    def gather(self, held: Tensor) -> Tensor:
        return dt.gather(held)

    def reduce_scatter(self, full: Tensor) -> Tensor:
        return dt.reduce_scatter_parts(self.p, full)

    def whole(self, local: Tensor) -> Tensor:
        return dt.whole_of(self.p, local)

    def local_of(self, full: Tensor) -> Tensor:
        return dt.local_of(self.p, full)

    def local(self, held: Tensor) -> Tensor:
        return held.to_local() if dt.is_dtensor(held) else held  # type: ignore[attr-defined]

    def shard(self, t: Tensor) -> Tensor:
        return dt.local_shard(self.p, t)

    def like_param(self, local: Tensor) -> Tensor:
        return dt.like_param(self.p, local)

    def zeros_local(self) -> Tensor:
        return torch.zeros_like(self.p.to_local())


@dataclass(eq=False)
class FlatLayout:
    """FSDP1 (``use_orig_params=True``): this rank holds elements [starts[rank], starts[rank] + counts[rank]) of
    the parameter's flattened whole, the ranks' pieces contiguous in rank order."""

    shape: torch.Size
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    rank: int
    group: Any
    device: torch.device
    dtype: torch.dtype
    local_shape: torch.Size  # the parameter as this rank holds it outside the forward ((count,) when sharded)
    replicas: int = 1  # NO_SHARD (FSDP1's choice on one rank): every rank holds the whole, ``replicas`` = ranks

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def count(self) -> int:
        return self.counts[self.rank]

    def _piece(self, flat: Tensor, r: int) -> Tensor:
        return flat[:, self.starts[r] : self.starts[r] + self.counts[r]]

    def stack(self, ts: list[Optional[Tensor]]) -> Tensor:
        return torch.stack([self.zeros_local() if t is None else self.shard(t.detach()).to(self.device, self.dtype)
                            for t in ts])

    def gather(self, held: Tensor) -> Tensor:
        if self.replicas > 1 or len(self.counts) == 1:
            return held.reshape(held.shape[0], *self.shape)
        n, width, world = held.shape[0], max(self.counts), len(self.counts)
        dev = collective_device(held.device, self.group)
        mine = torch.zeros((n, width), dtype=held.dtype, device=dev)
        mine[:, : self.count] = held.reshape(n, -1)
        out = torch.empty(world * n * width, dtype=held.dtype, device=dev)  # (flat: gloo takes no stacked output)
        dist.all_gather_into_tensor(out, mine.reshape(-1), group=self.group)
        out = out.reshape(world, n, width)
        flat = torch.cat([out[r, :, : self.counts[r]] for r in range(world)], dim=1)
        return flat.reshape(n, *self.shape).to(held.device)

    def whole(self, local: Tensor) -> Tensor:
        return self.gather(local)

    def reduce_scatter(self, full: Tensor) -> Tensor:
        n, width, world = full.shape[0], max(self.counts), len(self.counts)
        if self.replicas > 1 or world == 1:
            total = full.reshape(n, -1).to(collective_device(full.device, self.group), copy=True)
            if world > 1:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
            return total.to(full.device)
        flat = full.reshape(n, -1)
        dev = collective_device(full.device, self.group)
        blocks = torch.zeros((world, n, width), dtype=full.dtype, device=dev)
        for r in range(world):
            blocks[r, :, : self.counts[r]] = self._piece(flat, r)
        out = torch.empty(n * width, dtype=full.dtype, device=dev)
        dist.reduce_scatter_tensor(out, blocks.reshape(-1), op=dist.ReduceOp.SUM, group=self.group)
        return out.reshape(n, width)[:, : self.count].to(full.device).contiguous()

    def local_of(self, full: Tensor) -> Tensor:
        return self._piece(full.reshape(full.shape[0], -1), self.rank).to(self.device).clone()

    def local(self, held: Tensor) -> Tensor:
        return held

    def shard(self, t: Tensor) -> Tensor:
        if t.numel() == self.numel:
            return self._piece(t.reshape(1, -1), self.rank)[0]
        if t.numel() == self.count:
            return t.reshape(self.count)
        raise ValueError(f"a tensor of shape {tuple(t.shape)} is neither the parameter's whole {tuple(self.shape)} "
                         f"nor this rank's piece of it ({self.count} elements under FSDP1)")

    def like_param(self, local: Tensor) -> Tensor:
        return local.reshape(self.local_shape)

    def zeros_local(self) -> Tensor:
        return torch.zeros(self.count, dtype=self.dtype, device=self.device)


def _fsdp1_units(model: nn.Module) -> list[tuple[Any, list[nn.Parameter], list[torch.Size]]]:
    """(FSDP1 module, the original parameters of its FlatParameter, their whole shapes), one per unit.

    torch 2.4-2.14 keep these on the FlatParameter (``_params``, ``_shapes``, with ``use_orig_params=True``);
    there is no public accessor, so this is the one place that reads them."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    out = []
    for m in model.modules():
        if not isinstance(m, FullyShardedDataParallel):
            continue
        fp = getattr(m, "_flat_param", None)
        if fp is None:
            continue
        params, shapes = getattr(fp, "_params", None), getattr(fp, "_shapes", None)
        if params is None or shapes is None:
            raise ConfigError("in-step alignments under FSDP1 need use_orig_params=True (Composer: fsdp_config "
                              "use_orig_params: true)")
        out.append((m, list(params), [torch.Size(s) for s in shapes]))
    return out


def check_fsdp1(model: nn.Module) -> None:
    """One line for FSDP1 sharding the in-step engine cannot hold pieces of: a unit sharded over fewer than all
    ranks (HYBRID_SHARD, which FSDP1 turns into NO_SHARD over one rank when a node has one device)."""
    from torch.distributed.fsdp import ShardingStrategy

    for m, _, _ in _fsdp1_units(model):
        strategy = getattr(m, "sharding_strategy", None)
        group = getattr(m, "process_group", None)
        if dist.get_world_size(group) != dist.get_world_size() or strategy not in (
                ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
            raise ConfigError(f"alignments: steps and R&B's step Gram under FSDP1 need a unit sharded over all "
                              f"{dist.get_world_size()} ranks (FULL_SHARD or SHARD_GRAD_OP), not "
                              f"{getattr(strategy, 'name', strategy)} over {dist.get_world_size(group)} (HYBRID_SHARD "
                              "replicates shards across groups): use FSDP2 (fully_shard on a 2-D mesh, HSDP), or "
                              "alignments: probe")


def _fsdp1_layouts(model: nn.Module) -> dict[int, ShardLayout]:
    from torch.distributed.fsdp import ShardingStrategy

    check_fsdp1(model)
    layouts: dict[int, ShardLayout] = {}
    for m, params, shapes in _fsdp1_units(model):
        group = getattr(m, "process_group", None)
        if getattr(m, "sharding_strategy", None) == ShardingStrategy.NO_SHARD:  # every rank holds each whole
            for p, shape in zip(params, shapes):
                layouts[id(p)] = FlatLayout(shape, (0,) * dist.get_world_size(group),
                                            (shape.numel(),) * dist.get_world_size(group), dist.get_rank(group),
                                            group, p.device, p.dtype, p.shape,
                                            replicas=dist.get_world_size(group))
            continue
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        dev = params[0].device if params else torch.device("cpu")
        mine = torch.tensor([p.numel() for p in params], dtype=torch.int64, device=collective_device(dev, group))
        every = torch.empty(world * len(params), dtype=torch.int64, device=mine.device)
        dist.all_gather_into_tensor(every, mine, group=group)
        every = every.reshape(world, len(params)).cpu()
        for j, (p, shape) in enumerate(zip(params, shapes)):
            counts = tuple(int(c) for c in every[:, j])
            starts = tuple(int(s) for s in torch.cumsum(torch.tensor((0,) + counts[:-1]), 0))
            if sum(counts) != shape.numel():
                raise ConfigError(f"in-step alignments under FSDP1: a parameter of shape {tuple(shape)} is split "
                                  f"into {sum(counts)} elements over the ranks (an unexpected FlatParameter layout)")
            layouts[id(p)] = FlatLayout(shape, starts, counts, rank, group, p.device, p.dtype, p.shape)
    return layouts


def shard_layouts(model: nn.Module) -> dict[int, ShardLayout]:
    """id(parameter) -> its layout for every parameter FSDP1 or FSDP2 shards in ``model``; empty for a model that
    is not sharded. Under FSDP1 one small all-gather per unit (every rank calls it)."""
    from grape_stream.grape.gram.sharding import fsdp_kind

    kind = fsdp_kind(model)
    if kind == "fsdp1":
        return _fsdp1_layouts(model)
    return {id(p): DTensorLayout(p) for p in model.parameters() if dt.is_dtensor(p)}


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` under the names of the unwrapped model: FSDP1 puts its wrapper
    (``_fsdp_wrapped_module.``) into every name inside a unit; directions, checkpointed sums and kept-parameter
    patterns use the names the user's model has, so that they load on any sharding or none."""
    return [(n.replace(_FSDP1_PREFIX, ""), p) for n, p in model.named_parameters()]
