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
rank's shard) or sums (K x the rank's shard). FSDP1 holds its pieces differently (one contiguous piece of each
flattened parameter per rank); ``shard_layout.py`` puts both behind one interface, which :func:`scatter_parts`
and :class:`ShardedParts` use. Tensor parallel and FSDP1's hybrid sharding are refused (``instep_scope``).

The task probe of ``alignments: steps`` keeps its N task parts the same way (:class:`ShardedParts`), and also
needs the task Gram under the DDP convention: each rank's Gram of its own samples, averaged over the ranks. A
sum over ranks of parts cannot give that (it is the Gram of the summed parts), so each rank adds its own
parts' Gram before the reduce-scatter. A parameter with several hooked calls (a tied embedding: the head
and the token lookup) has its whole per-rank parts summed over its calls first, held until the backward
ends (:meth:`ShardedParts.flush`): N x that parameter while the backward runs.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from grape_stream.grape.gram.instep_grads import PartStore

__all__ = ["ShardedParts", "gather", "is_dtensor", "like_param", "local_of", "local_shard",
           "reduce_scatter_parts", "replicas", "scatter_parts", "shard_like", "sharded_gram", "stack_sharded",
           "whole_of"]


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


def local_shard(p: Any, t: Tensor) -> Tensor:
    """This rank's shard of ``t`` (p's shape) as ``p`` holds it: a DTensor placed like ``p`` as it is (no
    collective), another DTensor redistributed, a whole tensor sliced."""
    if is_dtensor(t):
        if t.device_mesh != p.device_mesh or tuple(t.placements) != tuple(p.placements):  # type: ignore[attr-defined]
            t = t.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
        return t.to_local()  # type: ignore[attr-defined]
    return local_of(p, t.unsqueeze(0))[0]


def like_param(p: Any, local: Tensor) -> Tensor:
    """A DTensor of ``p``'s shape and placements from this rank's shard ``local`` (no collective)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def stack_sharded(p: Any, ts: list[Optional[Tensor]]) -> Tensor:
    """The (L, *p.shape) DTensor sharded like ``p`` past the leading dim from L tensors of p's shape (DTensors
    placed like ``p``, or whole; None: zeros): each rank stacks its own shards, nothing is gathered."""
    from torch.distributed.tensor import DTensor

    local = p.to_local()
    parts = [torch.zeros_like(local) if t is None else local_shard(p, t.detach()).to(local.device, local.dtype)
             for t in ts]
    shape = torch.Size((len(ts), *p.shape))
    return DTensor.from_local(torch.stack(parts), p.device_mesh, _shifted(p), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def replicas(p: Any) -> int:
    """How many ranks hold each shard of ``p`` (HSDP's replicate dimension; 1 under plain FSDP2)."""
    from torch.distributed.tensor import Replicate

    mesh = p.device_mesh
    return int(torch.prod(torch.tensor([mesh.size(i) for i, pl in enumerate(p.placements)
                                        if isinstance(pl, Replicate)] or [1])))


class ShardedParts(PartStore):
    """The kept parts summed over the ranks as shards (``grads``, as :func:`scatter_parts` forms them), and,
    with ``gram``, each rank's own (K, K) Gram of its whole parts (float64), formed before the reduce-scatter.

    Parameters with several hooked calls are held whole (summed over their calls) until :meth:`flush`, which
    runs after the backward on every rank: their per-rank Gram needs the sum of the calls' parts."""

    def __init__(self, num_domains: int, keep: Optional[set[int]] = None, gram: bool = False) -> None:
        super().__init__(num_domains, keep)
        self.gram = torch.zeros((num_domains, num_domains), dtype=torch.float64) if gram else None
        self.shared: Optional[set[int]] = None  # ids of the parameters with several calls (from the forward)
        self.held: dict[int, tuple[Any, Tensor]] = {}

    def know_calls(self, uses: list[Any]) -> None:
        if self.shared is None:
            seen: set[int] = set()
            self.shared = set()
            for u in uses:
                for p in u.params.values():
                    (self.shared if id(p) in seen else seen).add(id(p))

    def take(self, p: Any, full: Tensor) -> Optional[Tensor]:
        """``full`` when it is p's whole per-rank part (its Gram counted), None when held for later calls."""
        if self.gram is None:
            return full
        if self.shared is not None and id(p) in self.shared:
            mine = self.held.get(id(p))
            self.held[id(p)] = (p, full if mine is None else mine[1].add_(full))
            return None
        self._add_gram(full)
        return full

    def _add_gram(self, full: Tensor) -> None:
        assert self.gram is not None
        flat = full.reshape(self.num_domains, -1).to(torch.float64)
        self.gram += (flat @ flat.t()).cpu()

    def flush(self, layouts: Mapping[int, Any]) -> None:
        """The held parameters' Gram and reduce-scatter (every rank, in the order their first call ran)."""
        held, self.held = self.held, {}
        for p, full in held.values():
            self._add_gram(full)
            self._keep(p, layouts[id(p)].reduce_scatter(full))

    def _keep(self, p: Any, mine: Tensor) -> None:
        buf = self.grads.get(id(p))
        self.grads[id(p)] = mine if buf is None else buf.add_(mine)


def scatter_parts(params: dict[str, Any], live: dict[str, Any], local: Any, store: Any, num_domains: int,
                  compute_dtype: Callable[[torch.dtype], torch.dtype], layouts: Mapping[int, Any],
                  uses: Optional[list[Any]] = None) -> None:
    """One call's (K, *shape) parts of each parameter (``local``, keyed by the gathered tensors) summed over the
    ranks into ``store``, each rank keeping its piece (keyed by the sharded parameter, placed as ``layouts`` say,
    shard_layout.py); zeros where this rank
    had no part: every rank joins every reduce-scatter. ``store`` a :class:`ShardedParts` with a Gram: each
    rank's Gram of its own parts first (``uses``: the forward's hooked calls, to tell parameters with several)."""
    gram = isinstance(store, ShardedParts) and store.gram is not None
    if gram and uses is not None:
        store.know_calls(uses)
    for n, t in live.items():
        p = params[n]
        if store.keep is not None and id(p) not in store.keep:
            continue
        full = local.grads.get(id(t))
        if full is None:
            full = torch.zeros((num_domains, *t.shape), dtype=compute_dtype(t.dtype), device=t.device)
        if gram:
            full = store.take(p, full)
            if full is None:
                continue
        mine = layouts[id(p)].reduce_scatter(full)
        buf = store.grads.get(id(p))
        store.grads[id(p)] = mine if buf is None else buf.add_(mine)


def sharded_gram(sums: Mapping[Any, Tensor], num_domains: int, group: Optional[Any] = None,
                 copies: Optional[Mapping[Any, int]] = None) -> Tensor:
    """(K, K) float64 sum over parameters of <A_i, A_j> from each rank's shards, summed over the ranks.
    ``copies``: per key, how many ranks hold the same shard (HSDP's replicate dimension, :func:`replicas`),
    each counted once."""
    from grape_stream.grape.collectives import collective_device

    g = torch.zeros((num_domains, num_domains), dtype=torch.float64)
    for k, t in sums.items():
        flat = t.reshape(num_domains, -1).to(torch.float64)
        g += (flat @ flat.t()).cpu() / (copies or {}).get(k, 1)
    out = g.to(collective_device(None, group))
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.cpu()
