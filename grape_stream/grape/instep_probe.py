"""The task probe of in-step alignments: task losses, their alignment with fixed directions, and the target
direction for the next interval, from one forward and two backwards over the N task groups.

With ``alignments: steps`` the domain side of an update comes from the training steps
(:mod:`grape_stream.grape.gram.instep`); what still needs a probe is the task side: each task's mean loss
l_n, its alignment r_n = <h_n, d> with the update direction d (the z step), and the direction v = sum_n c_n h_n
that the next interval's training steps are aligned with (c from the method and the *updated* z). The
coefficients depend on r and l, which are only known after a backward, so:

1. forward over the concatenated task groups (the graph kept), backward of sum_n L_n through the in-step
   hooks (task n as "domain" n): r_n and l_n, summed over ranks;
2. ``coefficients(l, r)`` -> c (the caller's update of z happens there);
3. backward of sum_n c_n L_n on the same graph: v, one gradient-sized copy, summed over ranks.

Cost: one forward and two backwards over N x b samples (the fused probe: one forward, one backward over
(K + N) x b). Exact: r and v against explicit per-task autograd gradients (tests/test_instep_probe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from grape_stream.grape.gram.batches import batch_size, concat
from grape_stream.grape.gram.instep import StepAlignments
from grape_stream.grape.probes import unwrap_for_probe
from grape_stream.models import no_inplace_loss_grad
from grape_stream.world import dist_active

__all__ = ["TaskProbe", "task_probe"]

PerSampleLoss = Callable[[nn.Module, Any], Tensor]
Coefficients = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass
class TaskProbe:
    losses: np.ndarray  # (N,) mean loss of each task's probe samples (all ranks)
    alignments: np.ndarray  # (N, D) <h_n, u_d> for the fixed directions u_d
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
               alignments: Optional[StepAlignments] = None) -> TaskProbe:
    """Losses and alignments of the N task groups with the ``fixed`` directions, then the direction
    sum_n c_n h_n with c = ``coefficients(losses, alignments)``. ``reduce``: sum over ranks when
    torch.distributed is initialised (every rank must call it). ``alignments``: an engine to reuse
    (its directions are replaced). Leaves ``.grad`` untouched; run it in the probe's mode / RNG context.
    """
    model = unwrap_for_probe(model)
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [batch_size(g, f"groups[{i}]") for i, g in enumerate(groups)]
    n_tasks = len(groups)
    device = params[0].device
    batch = concat(list(groups))
    task_of = torch.repeat_interleave(torch.arange(n_tasks, device=device), torch.tensor(sizes, device=device))
    inv = 1.0 / torch.tensor(sizes, dtype=torch.float64, device=device)
    distributed = reduce and dist_active()
    r_sums = torch.zeros((n_tasks, len(fixed)), dtype=torch.float64, device=device)
    r_weights = torch.ones(n_tasks, dtype=torch.float64, device=device)
    with no_inplace_loss_grad():  # the graph is backpropagated twice
        if fixed:
            sa = alignments or StepAlignments(model, per_sample_loss, n_tasks)
            sa.set_directions(fixed)
            with sa.observe(batch, domains=task_of, auto_watch=False, retain_graph=True):
                losses = per_sample_loss(model, batch)
                sa.watch(losses)
                torch.autograd.grad((losses * inv[task_of].to(losses.dtype)).sum(), params, retain_graph=True,
                                    allow_unused=True)
            r_sums, r_weights = sa.sums.clone(), sa.weights.clone()
        else:
            losses = per_sample_loss(model, batch)
    loss_sums = torch.zeros(n_tasks, dtype=torch.float64, device=device).index_add_(0, task_of,
                                                                                    losses.detach().double())
    counts = torch.tensor(sizes, dtype=torch.float64, device=device)
    world = 1
    if distributed:
        import torch.distributed as dist

        world = dist.get_world_size()
        loss_sums, counts, r_sums, r_weights = _all_reduce_sum([loss_sums, counts, r_sums, r_weights])
    mean_losses = (loss_sums / counts).cpu().numpy()
    r = (r_sums / r_weights.unsqueeze(1)).cpu().numpy()
    c = np.asarray(coefficients(mean_losses, r), dtype=np.float64)
    weights = torch.as_tensor(c, device=device)[task_of] * inv[task_of] / world
    grads = torch.autograd.grad((losses * weights.to(losses.dtype)).sum(), params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]
    if distributed:
        grads = _all_reduce_sum(grads)
    return TaskProbe(mean_losses, r, c, dict(zip(params, grads)))
