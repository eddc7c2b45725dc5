"""The task probe of in-step alignments: task losses, their alignment with fixed directions, the task Gram,
and the target direction for the next interval, from the N task groups.

With ``alignments: steps`` the domain side of an update comes from the training steps
(:mod:`grape_stream.grape.gram.instep`); what still needs a probe is the task side: each task's mean loss
l_n, its alignment r_n = <h_n, d> with the update direction d (the z step), the task Gram S (PCGrad), and the
direction v = sum_n c_n h_n that the next interval's training steps are aligned with (c from the method and
the *updated* z, so only known once l, r and S are). Two ways, the same numbers:

* ``keep_gradients=True`` (default): one forward and one backward over the concatenated task groups through
  the in-step hooks with tasks as "domains", each task's part of every gradient kept (N gradient copies
  while the probe runs): r, S and then v are inner products and a weighted sum of them.
* ``keep_gradients=False``: no copies beyond v. The graph is kept and backpropagated twice: first through the
  hooks for r (no S: PCGrad needs the copies), then, after ``coefficients``, for sum_n c_n L_n.

Exact: losses, r, S and v against explicit per-task autograd gradients (tests/test_instep_probe.py).
Under FSDP (FSDP2, and FSDP1 with ``use_orig_params``) the task parts, r, S and v are formed from shards
(``instep_probe_shards.py``, the same numbers under DDP's convention; ``keep_gradients=False`` is refused there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from grape_stream.errors import ConfigError
from grape_stream.grape.gram.batches import batch_size, concat
from grape_stream.grape.gram.instep import StepAlignments
from grape_stream.grape.gram.instep_grads import PartStore
from grape_stream.grape.instep_probe_shards import direction_of, sharded_task_probe
from grape_stream.grape.probes import unwrap_for_probe
from grape_stream.models import no_inplace_loss_grad
from grape_stream.world import dist_active

__all__ = ["TaskProbe", "task_probe"]

PerSampleLoss = Callable[[nn.Module, Any], Tensor]
Coefficients = Callable[[np.ndarray, np.ndarray, Optional[np.ndarray]], np.ndarray]


@dataclass
class TaskProbe:
    losses: np.ndarray  # (N,) mean loss of each task's probe samples (all ranks)
    alignments: np.ndarray  # (N, D) <h_n, u_d> for the fixed directions u_d
    task_gram: Optional[np.ndarray]  # (N, N) <h_n, h_m> (mean over ranks; None with keep_gradients=False)
    coefficients: np.ndarray  # (N,) c: direction = sum_n c_n h_n
    direction: dict[nn.Parameter, Tensor]  # the target direction, one entry per trainable parameter


def _all_reduce_sum(tensors: list[Tensor]) -> list[Tensor]:
    import torch.distributed as dist

    from grape_stream.grape.collectives import collective_device

    flat = torch.cat([t.reshape(-1) for t in tensors]).to(collective_device(tensors[0].device))
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].reshape(t.shape).to(t.device))
        at += t.numel()
    return out


def task_probe(model: nn.Module, per_sample_loss: PerSampleLoss, groups: Sequence[Any], *,
               fixed: Sequence[Mapping[Any, Tensor]], coefficients: Coefficients, reduce: bool = True,
               keep_gradients: bool = True, engine: Optional[StepAlignments] = None) -> TaskProbe:
    """Losses, alignments with the ``fixed`` directions and (when kept) the Gram of the N task gradients,
    then the direction sum_n c_n h_n with c = ``coefficients(losses, alignments, task_gram)``. ``reduce``: over
    ranks when torch.distributed is initialised (every rank must call it; each rank's groups are its own
    samples, of the same sizes). Leaves ``.grad`` untouched; run it in the probe's mode / RNG context.
    ``engine``: hooks to reuse across calls (built for this model with one "domain" per task).

    FSDP (every rank calls it, ``reduce`` or not): the task parts are reduce-scattered as they form, r and v come
    from the shards, and the direction is held like its parameter (FSDP2: a DTensor placed like it; FSDP1: the
    rank's flat piece, as the parameter itself outside the forward).
    """
    model = unwrap_for_probe(model, sharded_ok=True)
    sa = engine if engine is not None else StepAlignments(model, per_sample_loss, len(groups))
    if sa.sharded:
        if not keep_gradients:
            raise ConfigError("task_probe(keep_gradients=False) does not run under FSDP: its second backward "
                              "forms every parameter's whole gradient at once; keep the task parts (the default), "
                              "which are sharded like the parameters")
        return TaskProbe(*sharded_task_probe(model, per_sample_loss, groups, sa, fixed, coefficients))
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [batch_size(g, f"groups[{i}]") for i, g in enumerate(groups)]
    n_tasks = len(groups)
    device = params[0].device
    batch = concat(list(groups))
    task_of = torch.repeat_interleave(torch.arange(n_tasks, device=device), torch.tensor(sizes, device=device))
    inv = 1.0 / torch.tensor(sizes, dtype=torch.float64, device=device)
    world = 1
    if reduce and dist_active():
        import torch.distributed as dist

        world = dist.get_world_size()
    sa.set_directions([] if keep_gradients else fixed)
    store = PartStore(n_tasks) if keep_gradients else None
    with no_inplace_loss_grad():  # (the second backward of keep_gradients=False reads the logits again)
        with sa.observe(batch, domains=task_of, auto_watch=False, retain_graph=not keep_gradients, store=store):
            losses = per_sample_loss(model, batch)
            sa.watch(losses)
            torch.autograd.grad((losses * inv[task_of].to(losses.dtype)).sum(), params,
                                retain_graph=not keep_gradients, allow_unused=True)
    loss_sums = torch.zeros(n_tasks, dtype=torch.float64, device=device).index_add_(0, task_of,
                                                                                    losses.detach().double())
    counts = torch.tensor(sizes, dtype=torch.float64, device=device)
    if store is not None:  # h_n = the kept parts (the backward weighted each sample by 1 / its task's size)
        h = [store.grads.get(id(p), torch.zeros((n_tasks, *p.shape), dtype=p.dtype, device=device)) for p in params]
        flat = [t.reshape(n_tasks, -1).double() for t in h]
        r_sums = torch.zeros((n_tasks, len(fixed)), dtype=torch.float64, device=device)
        for j, d in enumerate(fixed):
            for f, p in zip(flat, params):
                r_sums[:, j] += f @ _flat(direction_of(model, d, p), p).double()
        r_weights = torch.ones(n_tasks, dtype=torch.float64, device=device)
        gram = torch.zeros((n_tasks, n_tasks), dtype=torch.float64, device=device)
        for f in flat:
            gram += f @ f.t()
    else:
        r_sums, r_weights, gram = sa.sums.clone(), sa.weights.clone(), torch.zeros((n_tasks, n_tasks),
                                                                                   dtype=torch.float64, device=device)
    if world > 1:
        loss_sums, counts, r_sums, r_weights, gram = _all_reduce_sum([loss_sums, counts, r_sums, r_weights, gram])
        if store is not None:  # (r: per-rank means with weight 1 each, so sums / weights is their mean)
            gram = gram / world  # the Grams of the ranks' probes, averaged (as the fused probe does)
    mean_losses = (loss_sums / counts).cpu().numpy()
    r = (r_sums / r_weights.unsqueeze(1)).cpu().numpy()
    task_gram = gram.cpu().numpy() if store is not None else None
    c = np.asarray(coefficients(mean_losses, r, task_gram), dtype=np.float64)
    if store is not None:
        ct = torch.as_tensor(c, device=device)
        grads = [torch.tensordot(ct.to(t.dtype), t, dims=1) / world for t in h]
    else:
        weights = torch.as_tensor(c, device=device)[task_of] * inv[task_of] / world
        out = torch.autograd.grad((losses * weights.to(losses.dtype)).sum(), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(out, params)]
    if world > 1:
        grads = _all_reduce_sum(grads)
    return TaskProbe(mean_losses, r, task_gram, c, dict(zip(params, grads)))


def _flat(t: Optional[Tensor], p: nn.Parameter) -> Tensor:
    return torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if t is None else t.reshape(-1).to(p.device)
