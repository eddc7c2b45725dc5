"""In-step alignments and R&B's step Gram on an FSDP2-sharded model: directions and kept parts stay sharded.

The in-step engine (``instep.py``) hooks the training backward on leaf modules. Under FSDP2 (``fully_shard``)
a leaf module computes with its unit's gathered (unsharded) parameters, registered on it for the unit's
forward and again for its backward, and the call's input and output gradient are whole on every rank: each
rank forms the per-domain parts of ITS OWN samples' gradient for the full parameter, exactly as under DDP,
and hands their sum to the gathered parameter, whose gradient FSDP reduce-scatters as usual.

What stays sharded like the parameters (a DTensor with the parameter's mesh, the placements shifted past
the leading (D,) or (K,) dimension):

* the fixed directions u_d (D per parameter): one parameter's (D, *shape) is all-gathered inside the
  backward of its call, dotted with the K per-domain parts, and dropped. The per-rank sums are additive, so
  the existing one all-reduce (``StepAlignments.reduce``) gives the exact result;
* R&B's kept parts (K per parameter): one call's (K, *shape) parts are reduce-scattered (summed over the
  ranks, each rank keeping its shard) as soon as they are formed; the Gram is then local dots plus one
  all-reduce of K x K (:func:`sharded_gram`).

Every collective is issued from the backward of a hooked call, in the autograd order of the graph, which is
the same on every rank (FSDP2 issues its own all-gathers and reduce-scatters the same way). Extra memory per
rank: D (or K) x the largest parameter of a hooked call while it runs, plus the sharded directions (D x the
rank's shard) or sums (K x the rank's shard). FSDP1 and tensor parallel are refused (``instep_scope``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["fsdp2_scope", "gather", "is_dtensor", "local_of", "reduce_scatter_parts", "scatter_parts", "shard_like",
           "sharded_gram", "whole_of"]


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _shifted(p: Any) -> list[Any]:
    """The parameter's placements for a tensor with one extra leading dimension."""
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = []
    for pl in p.placements:
        if type(pl) is Shard:
            out.append(Shard(pl.dim + 1))
        elif isinstance(pl, Replicate):
            out.append(pl)
        else:
            raise ValueError(f"unsupported placement {pl!r} of a sharded parameter")
    return out


def shard_like(p: Any, full: Tensor) -> Tensor:
    """(L, *p.shape) held whole on every rank -> a DTensor sharded as ``p`` past the leading dim (no collective:
    every rank slices its own shard)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(p.to_local().device), p.device_mesh, _shifted(p), src_data_rank=None)


def gather(t: Tensor) -> Tensor:
    """The whole (L, *shape) tensor of a sharded stack (an all-gather), a plain tensor as it is."""
    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]


def reduce_scatter_parts(p: Any, full: Tensor) -> Tensor:
    """This rank's (K, *local shape) shard of the sum over ranks of every rank's (K, *p.shape) ``full``."""
    from torch.distributed.tensor import DTensor, Partial

    part = DTensor.from_local(full, p.device_mesh, [Partial()] * p.device_mesh.ndim, run_check=False,
                              shape=torch.Size(full.shape), stride=full.stride())
    return part.redistribute(p.device_mesh, _shifted(p)).to_local()


def whole_of(p: Any, local: Tensor) -> Tensor:
    """The whole (L, *p.shape) tensor from every rank's (L, *local shape) shard (an all-gather)."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size((local.shape[0], *p.shape))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, p.device_mesh, _shifted(p), run_check=False, shape=shape,
                              stride=stride).full_tensor()


def local_of(p: Any, full: Tensor) -> Tensor:
    """This rank's (L, *local shape) shard of a whole (L, *p.shape) tensor (no collective)."""
    return shard_like(p, full).to_local()  # type: ignore[attr-defined]


def scatter_parts(params: dict[str, Any], live: dict[str, Any], local: Any, store: Any, num_domains: int,
                  compute_dtype: Callable[[torch.dtype], torch.dtype]) -> None:
    """One call's (K, *shape) parts of each parameter (``local``, keyed by the gathered tensors) summed over the
    ranks into ``store``, each rank keeping its shard (keyed by the sharded parameter); zeros where this rank
    had no part: every rank joins every reduce-scatter."""
    for n, t in live.items():
        p = params[n]
        if store.keep is not None and id(p) not in store.keep:
            continue
        full = local.grads.get(id(t))
        if full is None:
            full = torch.zeros((num_domains, *t.shape), dtype=compute_dtype(t.dtype), device=t.device)
        mine = reduce_scatter_parts(p, full)
        buf = store.grads.get(id(p))
        store.grads[id(p)] = mine if buf is None else buf.add_(mine)


def sharded_gram(sums: Mapping[Any, Tensor], num_domains: int, group: Optional[Any] = None) -> Tensor:
    """(K, K) float64 sum over parameters of <A_i, A_j> from each rank's shards, summed over the ranks."""
    from grape_stream.grape.collectives import collective_device

    g = torch.zeros((num_domains, num_domains), dtype=torch.float64)
    for t in sums.values():
        flat = t.reshape(num_domains, -1).to(torch.float64)
        g += (flat @ flat.t()).cpu()
    out = g.to(collective_device(None, group))
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.cpu()


def fsdp2_scope(model: nn.Module) -> bool:
    """True when the in-step engine's parameters are FSDP2 DTensors (hooks see the gathered tensors)."""
    return any(is_dtensor(p) for p in model.parameters())
