"""Gram matrix of per-group gradients from ONE fused forward/backward pass.

GRAPE (and DoGE, PCGrad) need only the inner products between the gradients of K domain probes and N
task probes, never the gradients themselves. `group_gram` runs the concatenated probe groups through the
model once and, inside that single backward pass, forms each layer's per-group gradient contributions
from the layer's input and output gradient (module hooks), adds their inner products to a G x G Gram
and drops them: no full gradient copy, let alone G of them, is ever held. See docs/alignment.md.

    gram, losses = group_gram(model, per_sample_lm_loss, groups)           # K domain batches, then N tasks
    gram, losses, info = group_gram(model, loss_fn, groups, return_info=True)
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Optional, Sequence, overload

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from grape_stream.grape.collectives import all_reduce_mean
from grape_stream.grape.gram.accumulators import DEFAULT_BUDGET
from grape_stream.grape.gram.batches import (
    MicroBatch,
    batch_signature,
    batch_size,
    concat,
    map_tensors,
)
from grape_stream.grape.gram.graph import fallback_backward, scan_graph
from grape_stream.grape.gram.head_chunks import HeadChunks
from grape_stream.grape.gram.hooks import FusedGramEngine
from grape_stream.grape.gram.layouts import FAST_PARAM_NAMES, fallback_reason, fast_kind, probe_layouts
from grape_stream.grape.gram.precondition import Precondition, resolve_precondition
from grape_stream.grape.probes import unwrap_for_probe
from grape_stream.head_loss import HeadGradientMismatch, observing_lm_head
from grape_stream.models import no_inplace_loss_grad
from grape_stream.world import dist_active

__all__ = ["GramInfo", "group_gram"]

PerSampleLoss = Callable[[nn.Module, Any], Tensor]


@dataclass
class GramInfo:
    """What one `group_gram` call did (returned with `return_info=True`)."""

    num_groups: int
    group_sizes: list[int]
    num_micro_batches: int
    world_size: int
    #: parameter name -> how its Gram terms were formed: "dense" (per-group gradient row blocks),
    #: "ghost" (token-pair inner products, nothing materialised), "rows" (embedding rows), or combinations
    #: for tied / reused parameters (e.g. "dense+rows" for an embedding tied to the LM head).
    fast_path: dict[str, str] = field(default_factory=dict)
    #: modules whose parameters went through the exact (slow: one extra backward per group) fallback
    fallback_modules: list[str] = field(default_factory=list)
    fallback_params: list[str] = field(default_factory=list)
    fallback_reasons: dict[str, str] = field(default_factory=dict)
    #: peak elements held in per-parameter cross-use accumulators (tied weights, micro-batches)
    accumulator_elements: int = 0
    timings: dict[str, float] = field(default_factory=dict)


# model -> {(batch signature, hooked modules): {(module id, call ordinal): layout}}
_LAYOUT_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


class _Retry(Exception):
    def __init__(self, reasons: dict[int, str]) -> None:
        super().__init__("retry with fallback")
        self.reasons = reasons


def _check_batch_coupling(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if isinstance(m, _BatchNorm) and (m.training or not m.track_running_stats):
            raise ValueError(
                f"module {name!r} ({type(m).__name__}) normalises with batch statistics, so one sample's loss "
                "depends on the other samples and group gradients are not separable; call model.eval() "
                "(running statistics) for the probe"
            )
        if isinstance(m, nn.Embedding) and m.scale_grad_by_freq and any(p.requires_grad for p in m.parameters()):
            raise ValueError(
                f"embedding {name!r} uses scale_grad_by_freq: its gradient depends on token counts of the whole "
                "batch, so per-group gradients are not defined by the fused batch"
            )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ---------------------------------------------------------------------------------------------- main
@overload
def group_gram(model: nn.Module, per_sample_loss: PerSampleLoss, groups: Sequence[Any], *,
               params: Optional[Iterable[nn.Parameter]] = ..., micro_batch_size: Optional[int] = ...,
               reduce: Optional[Literal["mean"]] = ..., return_info: Literal[False] = ..., process_group: Any = ...,
               chunk_elements: int = ..., ghost: bool = ...,
               precondition: Optional[Precondition] = ...) -> tuple[Tensor, Tensor]: ...
@overload
def group_gram(model: nn.Module, per_sample_loss: PerSampleLoss, groups: Sequence[Any], *,
               params: Optional[Iterable[nn.Parameter]] = ..., micro_batch_size: Optional[int] = ...,
               reduce: Optional[Literal["mean"]] = ..., return_info: Literal[True], process_group: Any = ...,
               chunk_elements: int = ..., ghost: bool = ...,
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
    chunk_elements: int = DEFAULT_BUDGET,
    ghost: bool = True,
    precondition: Optional[Precondition] = None,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, GramInfo]:
    """Gram matrix of the groups' mean-loss gradients and the groups' mean losses.

    Args:
        model: the model (a DDP or torch.compile wrapper is unwrapped). It runs in whatever train/eval mode
            it is in: for exact per-group gradients, dropout should be off (eval mode or p=0); that is the
            caller's choice. Its parameters, their `.grad`, requires_grad flags and mode are left untouched.
        per_sample_loss: `per_sample_loss(model, batch) -> Tensor[B]`, one loss per sample. A sample's loss
            must depend on that sample only (no batch statistics).
        groups: G batches (the K domain probes, then the N task probes), each what `per_sample_loss` takes
            (typically a dict of tensors), with the same keys and non-batch shapes; sizes may differ.
        params: restrict the Gram to these parameters (default: every parameter with requires_grad).
        micro_batch_size: run the concatenated probe in chunks of at most this many samples. The result is
            exact (group gradients are summed across chunks before any inner product) at the cost of holding
            each parameter's per-group gradient between chunks (G x its size); None = one fused pass.
        reduce: "mean": when torch.distributed is initialised, average Gram and losses over the ranks (one
            all-reduce; every rank returns identical tensors). None: this rank's probe only.
        return_info: also return a `GramInfo` (fast paths used, fallback modules, timings).
        process_group: the process group for `reduce` (default: the world).
        chunk_elements: at most this many per-group gradient elements are materialised at once per layer.
        ghost: allow the token-pair ("ghost") form for matmul layers when it is cheaper than materialising.
        precondition: {parameter or name: w_p (its shape, >= 0)}: gram[i, j] = sum_p <g_i,p, w_p * g_j,p>,
            e.g. w_p = 1 / (sqrt(v_p) + eps) from AdamW's second moment (Adam's geometry). Parameters without
            an entry use w = 1. Preconditioned matmul layers use the per-group weight-gradient form.

    Returns:
        gram: (G, G) float64 on CPU, gram[i, j] = <grad L_i, grad L_j> with L_i the mean per-sample loss of
            groups[i]; losses: (G,) float64 on CPU, the L_i; and the GramInfo when asked.
    """
    t_start = time.perf_counter()
    if reduce not in ("mean", None):
        raise ValueError(f"reduce must be 'mean' or None, got {reduce!r}")
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ValueError(f"micro_batch_size must be a positive int or None, got {micro_batch_size!r}")
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)) or len(groups) == 0:
        raise ValueError("groups must be a non-empty list of batches (K domain probes, then N task probes)")
    model = unwrap_for_probe(model)
    _check_batch_coupling(model)

    sizes = [batch_size(b, f"groups[{i}]") for i, b in enumerate(groups)]
    num_groups = len(groups)

    scope = _param_scope(model, params)
    scales = resolve_precondition(model, precondition, _compute_dtype)
    device = scope[0].device
    batch = concat(list(groups))
    batch = map_tensors(batch, lambda t: t.to(device, non_blocking=True) if t.device != device else t)
    total = sum(sizes)
    sample_groups = torch.repeat_interleave(torch.arange(num_groups, device=device), torch.tensor(sizes, device=device))
    mb = micro_batch_size or total
    spans = [(a, min(total, a + mb)) for a in range(0, total, mb)]

    forced: dict[int, str] = {}
    chunked_head = True
    for _attempt in range(5):
        try:
            gram, loss_sums, info = _run(
                model, per_sample_loss, batch, sizes, sample_groups, spans, scope, forced, device,
                chunk_elements, ghost, scales, chunked_head,
            )
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
    if reduce == "mean" and dist_active():
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
    return (gram, losses, info) if return_info else (gram, losses)


def _param_scope(model: nn.Module, params: Optional[Iterable[nn.Parameter]]) -> list[nn.Parameter]:
    """The parameters the Gram covers: `params` (deduplicated, checked to be the model's) or every
    parameter with requires_grad."""
    all_params = list(model.parameters())
    model_ids = {id(p) for p in all_params}
    if params is None:
        scope = [p for p in all_params if p.requires_grad]
    else:
        scope, seen = [], set()
        for p in params:
            if not isinstance(p, Tensor) or id(p) not in model_ids:
                raise ValueError("params must be parameters of the model (got a tensor that is not one of them)")
            if id(p) not in seen:
                seen.add(id(p))
                scope.append(p)
    if not scope:
        raise ValueError("no parameter to probe: the model has no parameter with requires_grad (or params is empty)")
    return scope


def _classify(
    model: nn.Module, scope: list[nn.Parameter], forced: dict[int, str]
) -> tuple[list[tuple[str, nn.Module, str, dict[str, nn.Parameter]]], list[nn.Parameter], dict[int, tuple[str, str]]]:
    """Split the in-scope parameters into fast-path (per module) and fallback ones."""
    in_scope = {id(p) for p in scope}
    fallback: dict[int, tuple[str, str]] = {}  # id -> (module name, reason)
    candidates: list[tuple[str, nn.Module, str, dict[str, nn.Parameter]]] = []
    names: dict[int, str] = {}
    for mname, module in model.named_modules():
        kind = fast_kind(module)
        fast: dict[str, nn.Parameter] = {}
        for pname, p in module._parameters.items():
            if p is None or id(p) not in in_scope:
                continue
            names.setdefault(id(p), f"{mname}.{pname}" if mname else pname)
            if id(p) in forced:
                fallback.setdefault(id(p), (mname, forced[id(p)]))
            elif kind is None:
                fallback.setdefault(id(p), (mname, fallback_reason(module)))
            elif pname not in FAST_PARAM_NAMES[kind]:
                fallback.setdefault(id(p), (mname, f"parameter {pname!r} of {type(module).__name__}"))
            else:
                fast[pname] = p
        if fast and kind is not None:  # fast is only filled when kind is not None
            candidates.append((mname, module, kind, fast))
    fast_modules = []
    for mname, module, kind, fast in candidates:
        kept = {k: p for k, p in fast.items() if id(p) not in fallback}
        if kept:
            fast_modules.append((mname, module, kind, kept))
    fb_params = [p for p in scope if id(p) in fallback]
    return fast_modules, fb_params, fallback


def _plan(
    model: nn.Module, scope: list[nn.Parameter], forced: dict[int, str], sizes: list[int], num_micro: int
) -> tuple[list[tuple[str, nn.Module, str, dict[str, nn.Parameter]]], list[nn.Parameter], GramInfo]:
    """Fast-path modules, fallback parameters, and a GramInfo that names the fallbacks (with a warning:
    the fallback costs one extra backward per group)."""
    fast_modules, fb_params, fb_reasons = _classify(model, scope, forced)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    info = GramInfo(num_groups=len(sizes), group_sizes=list(sizes), num_micro_batches=num_micro, world_size=1)
    info.fallback_params = [names.get(id(p), "?") for p in fb_params]
    info.fallback_modules = sorted({m for m, _ in fb_reasons.values()})
    info.fallback_reasons = {names.get(k, "?"): r for k, (_, r) in fb_reasons.items()}
    if fb_params:
        warnings.warn(
            "group_gram: exact fallback (one extra backward per group) for "
            + "; ".join(f"{n} ({r})" for n, r in sorted(info.fallback_reasons.items())),
            stacklevel=4,
        )
    return fast_modules, fb_params, info


def _check_losses(losses: Any, n: int) -> None:
    if not isinstance(losses, Tensor) or losses.dim() != 1 or losses.shape[0] != n:
        got = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(f"per_sample_loss must return one loss per sample, shape ({n},); got {got}")


def _run(
    model: nn.Module,
    per_sample_loss: PerSampleLoss,
    batch: Any,
    sizes: list[int],
    sample_groups: Tensor,
    spans: list[tuple[int, int]],
    scope: list[nn.Parameter],
    forced: dict[int, str],
    device: torch.device,
    chunk_elements: int,
    ghost: bool,
    scales: dict[int, Tensor],
    chunked_head: bool,
) -> tuple[Tensor, Tensor, GramInfo]:
    """One attempt at the fused pass (the caller retries with more fallback parameters on `_Retry`).

    Long because one try/finally must cover the whole micro-batch loop: it
    restores the parameters' requires_grad flags and removes the hooks whatever happens inside.
    """
    num_groups = len(sizes)
    fast_modules, fb_params, info = _plan(model, scope, forced, sizes, len(spans))
    fast_ids = {id(p) for _, _, _, ps in fast_modules for p in ps.values()}
    in_scope = {id(p) for p in scope}
    weights = 1.0 / torch.tensor(sizes, dtype=torch.float64, device=device)
    engine = FusedGramEngine(fast_modules, num_groups, device, _compute_dtype, chunk_elements, ghost, scales)
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
            if ckey not in cache:
                cache[ckey] = probe_layouts(engine, model, per_sample_loss, batch, sum(sizes))
            engine.layouts, engine.call_kinds = cache[ckey]
            for m_idx, (a, b) in enumerate(spans):
                micro = MicroBatch(sample_groups[a:b], is_last=m_idx == len(spans) - 1)
                mb = map_tensors(batch, operator.itemgetter(slice(a, b)))  # t -> t[a:b]
                t0 = time.perf_counter()
                engine.begin(micro, None)
                with no_inplace_loss_grad() if fb_params else contextlib.nullcontext():  # fallback: >1 backward
                    losses = per_sample_loss(model, mb)
                engine.end_forward()
                timings["forward_s"] += time.perf_counter() - t0
                _check_losses(losses, b - a)
                if engine.layout_errors:
                    raise _Retry(engine.layout_errors)
                loss_sums.index_add_(0, micro.sample_groups, losses.detach().to(torch.float64))
                if not losses.requires_grad:
                    engine.finish_micro()
                    continue
                w = weights[micro.sample_groups].to(losses.dtype)
                total = (losses * w).sum()
                reachable, leaves, _alive = scan_graph(total)
                stray = {id(v): "used outside its module's forward (functional use)"
                         for v in leaves if id(v) in fast_ids}
                if stray:
                    raise _Retry(stray)
                engine.drop_unreachable(reachable)

                t0 = time.perf_counter()
                if fb_params:
                    fallback_backward(losses, w, micro, fb_params, fb_acc, scales)
                timings["fallback_s"] += time.perf_counter() - t0

                t0 = time.perf_counter()
                engine.processing = True
                try:
                    torch.autograd.grad(total, leaves, allow_unused=True)
                finally:
                    engine.processing = False
                timings["backward_s"] += time.perf_counter() - t0
                engine.check_all_fired()
                del total, losses, leaves, _alive, w
                engine.finish_micro()
    finally:
        engine.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
    gram = engine.gram
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
