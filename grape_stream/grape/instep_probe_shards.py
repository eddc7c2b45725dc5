"""The task probe of ``alignments: steps`` on an FSDP-sharded model (FSDP2 ``fully_shard``, FSDP1
``use_orig_params=True``): task parts, r, S and the target direction v held as shards, never a whole per-task copy.

One forward and one backward over the concatenated task groups through the in-step hooks (tasks as
"domains"), as on one process; what changes is where each task's gradient h_n lives. Each hooked call forms
its N per-task parts of the gathered parameter from this rank's samples and reduce-scatters them at once
(:class:`~grape_stream.grape.gram.instep_shards.ShardedParts`), so a rank keeps N x its shard. With W ranks
and the DDP convention (each rank's probe, averaged over the ranks):

* losses: each task's mean over all ranks' samples (equal group sizes on every rank);
* r_n = (1/W) sum_ranks <h_n^rank, u> = <H_n, u> / W with H_n the summed shards: local dots, one all-reduce;
* S = (1/W) sum_ranks H^rank H^rank^T: each rank's Gram of its own whole parts, formed per call before the
  reduce-scatter (a parameter with several calls, a tied embedding, once its calls are summed), all-reduced;
* v = sum_n c_n H_n / W per shard, shaped like its parameter as the rank holds it (FSDP2: a DTensor placed like
  it; FSDP1: the rank's flat piece, like the parameter and its ``.grad`` outside the forward).

Memory per rank beyond training: N x P / W for the kept shards, plus up to 2 N x the largest hooked call's
parameter while that call's backward runs (its parts and their reduce-scatter), plus N x each parameter with
several calls (held whole until the backward ends). FSDP is held from reducing (``holding_gradients``) and
the hooks hand no gradient back, so ``.grad`` and an accumulating training step are untouched.
``probe_mode: replicated`` gives every rank the same samples, whose average over the ranks is the probe
itself, so the result is the same whether or not ``reduce`` is set.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from grape_stream.grape.collectives import collective_device
from grape_stream.grape.gram.batches import batch_size, concat
from grape_stream.grape.gram.instep import StepAlignments
from grape_stream.grape.gram.instep_shards import ShardedParts
from grape_stream.grape.gram.shard_layout import named_parameters
from grape_stream.grape.gram.sharding import holding_gradients
from grape_stream.models import no_inplace_loss_grad

__all__ = ["direction_of", "sharded_task_probe"]

PerSampleLoss = Callable[[nn.Module, Any], Tensor]
Coefficients = Callable[[np.ndarray, np.ndarray, Optional[np.ndarray]], np.ndarray]


def sharded_task_probe(model: nn.Module, per_sample_loss: PerSampleLoss, groups: Sequence[Any], sa: StepAlignments,
                       fixed: Sequence[Mapping[Any, Tensor]], coefficients: Coefficients
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[nn.Parameter, Tensor]]:
    """(losses, r, S, c, {parameter: v held like the parameter}) of ``task_probe`` under FSDP (every rank calls
    it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    layouts = sa.pieces
    sizes = [batch_size(g, f"groups[{i}]") for i, g in enumerate(groups)]
    n_tasks = len(groups)
    device = layouts[id(params[0])].device
    batch = concat(list(groups))
    task_of = torch.repeat_interleave(torch.arange(n_tasks, device=device), torch.tensor(sizes, device=device))
    inv = 1.0 / torch.tensor(sizes, dtype=torch.float64, device=device)
    world = dist.get_world_size()
    sa.set_directions([])
    store = ShardedParts(n_tasks, gram=True)
    sa.engine.param_grads = False  # the parts are all the probe needs: no whole gradient held to the end
    try:
        with holding_gradients(model), no_inplace_loss_grad():
            with sa.observe(batch, domains=task_of, auto_watch=False, store=store):
                losses = per_sample_loss(model, batch)
                sa.watch(losses)
                # the gathered tensors the hooked calls ran with (FSDP2's unsharded parameters) are the roots
                live = list({id(t): t for u in sa.engine.uses for t in (getattr(u, "live", None) or {}).values()}
                            .values())
                torch.autograd.grad((losses * inv[task_of].to(losses.dtype)).sum(), live, allow_unused=True)
            store.flush(layouts)  # parameters with several calls: their Gram and reduce-scatter
    finally:
        sa.engine.param_grads = True
    h = {id(p): store.grads.get(id(p)) for p in params}
    loss_sums = torch.zeros(n_tasks, dtype=torch.float64, device=device).index_add_(0, task_of,
                                                                                    losses.detach().double())
    r_sums = torch.zeros((n_tasks, len(fixed)), dtype=torch.float64, device=device)
    for j, d in enumerate(fixed):
        for p in params:
            u, t = direction_of(model, d, p), h[id(p)]
            if u is not None and t is not None:  # (HSDP, NO_SHARD: each piece is held by `replicas` ranks)
                lay = layouts[id(p)]
                r_sums[:, j] += t.reshape(n_tasks, -1).double() @ lay.shard(u).reshape(-1).double() / lay.replicas
    assert store.gram is not None
    packed = torch.cat([loss_sums, torch.tensor(sizes, dtype=torch.float64, device=device), r_sums.reshape(-1),
                        store.gram.to(device).reshape(-1)]).to(collective_device(device))
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    packed = packed.cpu()
    mean_losses = (packed[:n_tasks] / packed[n_tasks : 2 * n_tasks]).numpy()
    at = 2 * n_tasks + n_tasks * len(fixed)
    r = (packed[2 * n_tasks : at].reshape(n_tasks, len(fixed)) / world).numpy()
    gram = packed[at:].reshape(n_tasks, n_tasks) / world  # the ranks' Grams, averaged (as under DDP)
    task_gram = ((gram + gram.t()) / 2).numpy()
    c = np.asarray(coefficients(mean_losses, r, task_gram), dtype=np.float64)
    direction = {}
    for p in params:
        lay, t = layouts[id(p)], h[id(p)]
        local = lay.zeros_local()
        v = local if t is None else \
            (torch.tensordot(torch.as_tensor(c, dtype=t.dtype, device=t.device), t, dims=1) / world).to(local.dtype)
        direction[p] = lay.like_param(v.reshape(local.shape))
    return mean_losses, r, task_gram, c, direction


def direction_of(model: nn.Module, direction: Mapping[Any, Tensor], p: nn.Parameter) -> Optional[Tensor]:
    """``direction``'s entry for ``p``, keyed by the parameter or its name (None: absent, a zero)."""
    if p in direction:
        return direction[p]
    for name, q in named_parameters(model):
        if q is p and name in direction:
            return direction[name]
    return None
