"""Gram matrix of per-group gradients from ONE fused forward/backward pass.

GRAPE (and DoGE, PCGrad) need only the inner products between the gradients of K domain probes and N
task probes, never the gradients themselves. `group_gram` runs the concatenated probe groups through the
model once and, inside that single backward pass, forms each layer's per-group gradient contributions
from the layer's input and output gradient (module hooks), adds their inner products to a G x G Gram
and drops them: no full gradient copy, let alone G of them, is ever held. See docs/alignment.md.

    gram, losses = group_gram(model, per_sample_lm_loss, groups)           # K domain batches, then N tasks
    gram, losses, info = group_gram(model, loss_fn, groups, return_info=True)

`group_gram` unwraps the model (grape.probes.unwrap_for_probe); :func:`fused_gram` is the same on a model
already unwrapped (the controller's probe stage unwraps once) with the settings as one
:class:`~grape_stream.config.GramConfig`. The plan (which parameters take which path) is gram/plan.py.
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Optional, Sequence, overload

import torch
from torch import Tensor, nn

from grape_stream.config import GramConfig, with_overrides
from grape_stream.grape.collectives import all_reduce_mean
from grape_stream.grape.gram.batches import MicroBatch, batch_signature, batch_size, concat, map_tensors
from grape_stream.grape.gram.graph import fallback_backward, scan_graph
from grape_stream.grape.gram.head_chunks import HeadChunks
from grape_stream.grape.gram.hooks import FusedGramEngine
from grape_stream.grape.gram.layout_probe import probe_layouts
from grape_stream.grape.gram.plan import GramInfo, check_batch_coupling, param_scope, plan_pass
from grape_stream.grape.gram.precondition import Precondition, resolve_precondition
from grape_stream.grape.gram.shard_sums import ShardedGroupSums, reduce_sharded_gram, same_samples
from grape_stream.grape.gram.sharding import (
    ShardedGramError,
    agree_on_shape,
    check_sharded,
    holding_gradients,
    refuse_stray,
)
from grape_stream.grape.probes import unwrap_for_probe
from grape_stream.models import no_inplace_loss_grad
from grape_stream.models.head_loss import HeadGradientMismatch, observing_lm_head
from grape_stream.world import dist_active

__all__ = ["GramInfo", "fused_gram", "group_gram"]

PerSampleLoss = Callable[[nn.Module, Any], Tensor]


# model -> {(batch signature, hooked modules): {(module id, call ordinal): layout}}
_LAYOUT_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


class _Retry(Exception):
    def __init__(self, reasons: dict[int, str]) -> None:
        super().__init__("retry with fallback")
        self.reasons = reasons


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass
class _Pass:
    """What every attempt at the fused pass reads (fixed for one call; attempts differ only in which
    parameters are forced onto the fallback and whether the head is chunked)."""

    model: nn.Module
    per_sample_loss: PerSampleLoss
    batch: Any  # the groups concatenated, on the device
    sizes: list[int]  # samples per group
    sample_groups: Tensor  # the group of each sample
    spans: list[tuple[int, int]]  # micro-batches [a, b)
    scope: list[nn.Parameter]  # the parameters the Gram covers
    device: torch.device
    settings: GramConfig
    scales: dict[int, Tensor]  # id(parameter) -> sqrt of its preconditioner weight
    sharded: bool = False  # an FSDP model (gram/sharding.py): no fallback, no chunked head, ranks in step
    process_group: Any = None
    summed: bool = False  # FSDP with micro-batches: group gradients summed over the ranks, sharded (shard_sums.py)


# ---------------------------------------------------------------------------------------------- main
@overload
def group_gram(model: nn.Module, per_sample_loss: PerSampleLoss, groups: Sequence[Any], *,
               params: Optional[Iterable[nn.Parameter]] = ..., micro_batch_size: Optional[int] = ...,
               reduce: Optional[Literal["mean"]] = ..., return_info: Literal[False] = ..., process_group: Any = ...,
               chunk_elements: Optional[int] = ..., ghost: Optional[bool] = ...,
               precondition: Optional[Precondition] = ...) -> tuple[Tensor, Tensor]: ...
@overload
def group_gram(model: nn.Module, per_sample_loss: PerSampleLoss, groups: Sequence[Any], *,
               params: Optional[Iterable[nn.Parameter]] = ..., micro_batch_size: Optional[int] = ...,
               reduce: Optional[Literal["mean"]] = ..., return_info: Literal[True], process_group: Any = ...,
               chunk_elements: Optional[int] = ..., ghost: Optional[bool] = ...,
               precondition: Optional[Precondition] = ...) -> tuple[Tensor, Tensor, GramInfo]: ...
def group_gram(
    model: nn.Module,
    per_sample_loss: PerSampleLoss,
    groups: Sequence[Any],
    *,
    params: Optional[Iterable[nn.Parameter]] = None,
    micro_batch_size: Optional[int] = None,
    reduce: Optional[Literal["mean"]] = "mean",
    return_info: bool = False,
    process_group: Any = None,
    chunk_elements: Optional[int] = None,
    ghost: Optional[bool] = None,
    precondition: Optional[Precondition] = None,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, GramInfo]:
    """Gram matrix of the groups' mean-loss gradients and the groups' mean losses.

    Args:
        model: the model (a DDP or torch.compile wrapper is unwrapped; an FSDP1 (use_orig_params) or FSDP2 model
            is probed as it is, one unit at a time while FSDP has it gathered: gram/sharding.py, every rank
            calls). It runs in whatever train/eval mode
            it is in: for exact per-group gradients, dropout should be off (eval mode or p=0); that is the
            caller's choice. Its parameters, their `.grad`, requires_grad flags and mode are left untouched.
        per_sample_loss: `per_sample_loss(model, batch) -> Tensor[B]`, one loss per sample. A sample's loss
            must depend on that sample only (no batch statistics).
        groups: G batches (the K domain probes, then the N task probes), each what `per_sample_loss` takes
            (typically a dict of tensors), with the same keys and non-batch shapes; sizes may differ.
        params: restrict the Gram to these parameters (default: every parameter with requires_grad).
        micro_batch_size: run the concatenated probe in chunks of at most this many samples. The result is
            exact (group gradients are summed across chunks before any inner product) at the cost of holding
            each parameter's per-group gradient between chunks (G x its size); None = one fused pass. Under
            FSDP they are summed over the ranks and kept sharded (G x P / W per rank, gram/shard_sums.py), and
            the Gram is that of the rank-mean group gradients (one process probing every rank's samples), not
            the mean of the ranks' Grams; with ``reduce=None`` every rank must probe the same samples.
        reduce: "mean": when torch.distributed is initialised, average Gram and losses over the ranks (one
            all-reduce; every rank returns identical tensors). None: this rank's probe only.
        return_info: also return a `GramInfo` (fast paths used, fallback modules, timings).
        process_group: the process group for `reduce` (default: the world).
        chunk_elements: at most this many per-group gradient elements are materialised at once per layer.
        ghost: allow the token-pair ("ghost") form for matmul layers when it is cheaper than materialising.
            (micro_batch_size, chunk_elements, ghost: None = grape_stream.config.GramConfig's default.)
        precondition: {parameter or name: w_p (its shape, >= 0)}: gram[i, j] = sum_p <g_i,p, w_p * g_j,p>,
            e.g. w_p = 1 / (sqrt(v_p) + eps) from AdamW's second moment (Adam's geometry). Parameters without
            an entry use w = 1. Preconditioned matmul layers use the per-group weight-gradient form.

    Returns:
        gram: (G, G) float64 on CPU, gram[i, j] = <grad L_i, grad L_j> with L_i the mean per-sample loss of
            groups[i]; losses: (G,) float64 on CPU, the L_i; and the GramInfo when asked.
    """
    given = {"micro_batch_size": micro_batch_size, "chunk_elements": chunk_elements, "ghost": ghost}
    settings = with_overrides(None, GramConfig, {k: v for k, v in given.items() if v is not None}, where="group_gram")
    gram, losses, info = fused_gram(unwrap_for_probe(model, sharded_ok=True), per_sample_loss, groups,
                                    settings=settings, params=params, reduce=reduce, process_group=process_group,
                                    precondition=precondition)
    return (gram, losses, info) if return_info else (gram, losses)


def fused_gram(
    model: nn.Module,
    per_sample_loss: PerSampleLoss,
    groups: Sequence[Any],
    *,
    settings: GramConfig,
    reduce: Optional[str] = "mean",
    params: Optional[Iterable[nn.Parameter]] = None,
    process_group: Any = None,
    precondition: Optional[Precondition] = None,
) -> tuple[Tensor, Tensor, GramInfo]:
    """:func:`group_gram` (with its info) of a model already unwrapped by ``unwrap_for_probe``."""
    t_start = time.perf_counter()
    if reduce not in ("mean", None):
        raise ValueError(f"reduce must be 'mean' or None, got {reduce!r}")
    mbs = settings.micro_batch_size
    if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
        raise ValueError(f"micro_batch_size must be a positive int or None, got {mbs!r}")
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)) or len(groups) == 0:
        raise ValueError("groups must be a non-empty list of batches (K domain probes, then N task probes)")
    check_batch_coupling(model)
    sharded = check_sharded(model) is not None
    if sharded and precondition is not None:
        raise ShardedGramError("geometry='adam' (a preconditioned Gram) is not available under FSDP: the optimizer's "
                               "second moments are sharded like the parameters; use geometry='sgd' (the paper)")
    sizes = [batch_size(b, f"groups[{i}]") for i, b in enumerate(groups)]
    scope = param_scope(model, params)
    device = scope[0].device
    batch = map_tensors(concat(list(groups)), lambda t: t.to(device, non_blocking=True) if t.device != device else t)
    total = sum(sizes)
    mb = mbs or total
    run = _Pass(
        model=model, per_sample_loss=per_sample_loss, batch=batch, sizes=sizes,
        sample_groups=torch.repeat_interleave(torch.arange(len(sizes), device=device),
                                              torch.tensor(sizes, device=device)),
        spans=[(a, min(total, a + mb)) for a in range(0, total, mb)], scope=scope, device=device,
        settings=settings, scales=resolve_precondition(model, precondition, _compute_dtype),
        sharded=sharded, process_group=process_group, summed=sharded and mbs is not None,
    )
    if run.summed and reduce is None and not same_samples(batch, sizes, process_group):
        raise ShardedGramError("reduce=None (this rank's probe alone) with micro_batch_size under FSDP needs the same "
                               "probe samples on every rank (probe_mode: replicated): the micro-batched Gram is formed "
                               "from group gradients summed over the ranks")
    forced: dict[int, str] = {}
    chunked_head = not sharded  # the chunked head calls the body directly, past FSDP's root hooks
    for _attempt in range(5):
        try:
            with holding_gradients(model) if sharded else contextlib.nullcontext():
                gram, loss_sums, info = _run(run, forced, chunked_head)
            break
        except _Retry as retry:
            forced.update(retry.reasons)
        except HeadGradientMismatch:  # the loss was not used as sum_i w_i loss_i: head through its hooks
            chunked_head = False
    else:  # pragma: no cover - each retry adds at least one parameter to the fallback
        raise RuntimeError("group_gram: could not settle which parameters need the fallback")

    gram = (gram + gram.t()) / 2  # exactly symmetric (BLAS need not give M M^T bitwise symmetric)
    losses = loss_sums / torch.tensor(sizes, dtype=torch.float64, device=loss_sums.device)
    world = 1
    t_reduce = time.perf_counter()
    if run.summed:  # each rank's dots of its shards: the Gram of the rank-mean group gradients
        gram, losses, world = reduce_sharded_gram(gram, losses, reduce, process_group)
    elif reduce == "mean" and dist_active():
        gram, losses, world = all_reduce_mean(gram, losses, process_group)
    info.timings["reduce_s"] = time.perf_counter() - t_reduce
    info.world_size = world
    info.timings["total_s"] = time.perf_counter() - t_start
    gram, losses = gram.cpu(), losses.cpu()
    if not torch.isfinite(losses).all():
        bad = [i for i, v in enumerate(losses.tolist()) if not math.isfinite(v)]
        raise FloatingPointError(f"group_gram: non-finite mean loss in groups {bad}")
    if not torch.isfinite(gram).all():
        raise FloatingPointError("group_gram: the Gram matrix has non-finite entries (gradients overflow?)")
    return gram, losses, info


def _check_losses(losses: Any, n: int) -> None:
    if not isinstance(losses, Tensor) or losses.dim() != 1 or losses.shape[0] != n:
        got = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(f"per_sample_loss must return one loss per sample, shape ({n},); got {got}")


def _run(run: _Pass, forced: dict[int, str], chunked_head: bool) -> tuple[Tensor, Tensor, GramInfo]:
    """One attempt at the fused pass (the caller retries with more fallback parameters on `_Retry`).

    Long because one try/finally must cover the whole micro-batch loop: it
    restores the parameters' requires_grad flags and removes the hooks whatever happens inside.
    """
    model, per_sample_loss, batch, sizes, device = run.model, run.per_sample_loss, run.batch, run.sizes, run.device
    spans, settings = run.spans, run.settings
    num_groups = len(sizes)
    fast_modules, fb_params, info = plan_pass(model, run.scope, forced, sizes, len(spans))
    if run.sharded and fb_params:
        raise ShardedGramError("under FSDP every parameter must take the fused fast path (the per-group fallback "
                               "is not available on sharded models); not: " + "; ".join(
                                   f"{n} ({r})" for n, r in sorted(info.fallback_reasons.items())))
    fast_ids = {id(p) for _, _, _, ps in fast_modules for p in ps.values()}
    in_scope = {id(p) for p in run.scope}
    weights = 1.0 / torch.tensor(sizes, dtype=torch.float64, device=device)
    sums = ShardedGroupSums(num_groups, settings.chunk_elements, run.process_group) if run.summed else None
    engine = FusedGramEngine(fast_modules, num_groups, device, _compute_dtype, budget=settings.chunk_elements,
                             allow_ghost=settings.ghost, scales=run.scales, sharded=run.sharded, sums=sums)
    # our GPT's head + loss in sample chunks (head_loss.py); not with the fallback (it backpropagates per group)
    head = HeadChunks(engine, weights, enabled=chunked_head and not fb_params)
    fb_acc = [
        torch.zeros((num_groups, p.numel()), dtype=_compute_dtype(p.dtype), device=p.device) for p in fb_params
    ]
    loss_sums = torch.zeros(num_groups, dtype=torch.float64, device=device)
    timings = {"forward_s": 0.0, "fallback_s": 0.0, "backward_s": 0.0}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    devices = [device] if device.type == "cuda" else []
    try:
        for p, _ in flags:
            p.requires_grad_(id(p) in in_scope)
        engine.install()
        with torch.random.fork_rng(devices=devices), torch.inference_mode(False), torch.enable_grad(), \
                observing_lm_head(head):
            cache = _LAYOUT_CACHE.setdefault(model, {})
            ckey = (batch_signature(batch), frozenset(id(m) for _, m, _, _ in fast_modules))
            if run.sharded:  # each forward gathers parameters collectively: every rank runs the same ones
                agree_on_shape((ckey[0], len(spans), ckey in cache, run.summed and sizes), run.process_group)
            if ckey not in cache:
                cache[ckey] = probe_layouts(engine, model, per_sample_loss, batch, sum(sizes))
            engine.use_layouts(*cache[ckey])
            for m_idx, (a, b) in enumerate(spans):
                micro = MicroBatch(run.sample_groups[a:b], is_last=m_idx == len(spans) - 1)
                mb = map_tensors(batch, operator.itemgetter(slice(a, b)))  # t -> t[a:b]
                t0 = time.perf_counter()
                engine.begin(micro, None)
                with no_inplace_loss_grad() if fb_params else contextlib.nullcontext():  # fallback: >1 backward
                    losses = per_sample_loss(model, mb)
                engine.end_forward()
                timings["forward_s"] += time.perf_counter() - t0
                _check_losses(losses, b - a)
                if engine.layout_errors and run.sharded:
                    raise ShardedGramError("under FSDP the fused Gram cannot attribute these calls to samples (the "
                                           "per-group fallback is not available on sharded models): "
                                           + "; ".join(sorted(set(engine.layout_errors.values()))))
                if engine.layout_errors:
                    raise _Retry(engine.layout_errors)
                loss_sums.index_add_(0, micro.sample_groups, losses.detach().to(torch.float64))
                if not losses.requires_grad:
                    engine.finish_micro()
                    continue
                w = weights[micro.sample_groups].to(losses.dtype)
                total = (losses * w).sum()
                reachable, leaves, _alive = scan_graph(total)
                if run.sharded:
                    refuse_stray(leaves, engine.roots)
                stray = {id(v): "used outside its module's forward (functional use)"
                         for v in leaves if id(v) in fast_ids}
                if stray:
                    raise _Retry(stray)
                engine.drop_unreachable(reachable)

                t0 = time.perf_counter()
                if fb_params:
                    fallback_backward(losses, w, micro, fb_params, fb_acc, run.scales)
                timings["fallback_s"] += time.perf_counter() - t0

                t0 = time.perf_counter()
                with engine.forming_contributions():
                    torch.autograd.grad(total, leaves, allow_unused=True)
                if sums is not None:
                    sums.flush()
                timings["backward_s"] += time.perf_counter() - t0
                engine.check_all_fired()
                del total, losses, leaves, _alive, w
                engine.finish_micro()
    finally:
        engine.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
    gram = engine.gram if sums is None else sums.local_gram().to(device)
    if fb_acc:
        flat = torch.cat(fb_acc, dim=1)
        with torch.autocast(device_type=flat.device.type, enabled=False):
            gram = gram + (flat @ flat.t()).to(torch.float64)
    info.fast_path = engine.strategies()
    info.accumulator_elements = engine.peak_accumulator_elements() + sum(t.numel() for t in fb_acc)
    timings["hooks_s"] = engine.hook_seconds  # part of backward_s: forming per-group contributions
    timings["head_s"] = head.seconds  # part of forward_s: the chunked head's per-group gradient
    info.timings.update(timings)
    return gram, loss_sums, info
