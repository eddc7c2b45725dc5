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

import math
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Optional, Sequence

import torch
from torch import Tensor, nn

from grape_stream.grape.gram.accumulators import DEFAULT_BUDGET
from grape_stream.grape.gram.hooks import FAST_PARAM_NAMES, FusedGramEngine, MicroBatch, classify_layout, fast_kind

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


# ---------------------------------------------------------------------------------------------- batches
def _tensor_leaves(obj: Any, path: str = "") -> Iterable[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        yield path or "<batch>", obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensor_leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensor_leaves(v, f"{path}[{i}]")


def _batch_size(batch: Any, where: str) -> int:
    sizes = {(p, t.shape[0] if t.dim() else None) for p, t in _tensor_leaves(batch)}
    if not sizes:
        raise ValueError(f"{where} holds no tensor: a group must be a batch (e.g. a dict of tensors)")
    for p, s in sizes:
        if s is None:
            raise ValueError(f"{where}{p} is a 0-d tensor: every tensor of a batch needs a leading batch dimension")
    distinct = {s for _, s in sizes}
    if len(distinct) != 1:
        raise ValueError(f"{where} mixes batch sizes {sorted(distinct)} across its tensors: {sorted(sizes)}")
    b = distinct.pop()
    if b == 0:
        raise ValueError(f"{where} is empty: the mean loss of a group with no sample is undefined")
    return b


def _concat(batches: Sequence[Any], path: str = "") -> Any:
    first = batches[0]
    if isinstance(first, Tensor):
        for i, t in enumerate(batches):
            if not isinstance(t, Tensor) or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"groups[{i}]{path} has shape {got} ({getattr(t, 'dtype', '?')}) but groups[0]{path} has "
                    f"{tuple(first.shape)} ({first.dtype}): every group must share all non-batch dimensions and "
                    "dtypes; pad sequences to one length (and mask the padding with loss_mask)"
                )
        return torch.cat(list(batches), dim=0)
    if isinstance(first, dict):
        for i, b in enumerate(batches):
            if not isinstance(b, dict) or set(b) != set(first):
                raise ValueError(f"groups[{i}]{path} has keys {sorted(map(str, b))} but groups[0]{path} has "
                                 f"{sorted(map(str, first))}")
        return type(first)((k, _concat([b[k] for b in batches], f"{path}[{k!r}]")) for k in first)
    if isinstance(first, (list, tuple)):
        for i, b in enumerate(batches):
            if type(b) is not type(first) or len(b) != len(first):
                raise ValueError(f"groups[{i}]{path} does not have the structure of groups[0]{path}")
        items = [_concat([b[j] for b in batches], f"{path}[{j}]") for j in range(len(first))]
        return type(first)(items) if not hasattr(first, "_fields") else type(first)(*items)
    for i, b in enumerate(batches):
        if b != first:
            raise ValueError(f"groups[{i}]{path} = {b!r} differs from groups[0]{path} = {first!r}; non-tensor "
                             "entries must be equal across groups")
    return first


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(v, fn) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


# ---------------------------------------------------------------------------------------------- model
def _unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
            # Probing through DDP would trigger its gradient all-reduce hooks; the local module computes
            # the local Gram and we average Grams explicitly.
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(getattr(model, "_orig_mod"), nn.Module):
            model = model._orig_mod  # torch.compile wrapper: hooks need the eager module
        else:
            break
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        fsdp1 = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    except Exception:  # pragma: no cover - distributed not built
        fsdp1 = False
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        DTensor = ()  # type: ignore[assignment]
    sharded = fsdp1 or any(
        type(p).__name__ == "FlatParameter" or getattr(p, "_is_flat_param", False) or isinstance(p, DTensor)
        for p in model.parameters()
    )
    if sharded:
        raise NotImplementedError(
            "group_gram does not support sharded parameters (FSDP FlatParameter / FSDP2 DTensor): each rank "
            "holds only a shard, so per-layer per-group gradients are incomplete. Probe an unsharded replica "
            "(e.g. a DDP model) instead."
        )
    return model


def _check_batch_coupling(model: nn.Module) -> None:
    from torch.nn.modules.batchnorm import _BatchNorm

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


def _batch_signature(batch: Any) -> tuple:
    return tuple((p, tuple(t.shape[1:]), t.dtype) for p, t in _tensor_leaves(batch))


def _probe_layouts(
    engine: FusedGramEngine, model: nn.Module, per_sample_loss: PerSampleLoss, batch: Any, total: int
) -> dict[tuple[int, int], tuple[str, Optional[tuple[int, ...]]]]:
    """Which leading dimension of each hooked module call is the batch (see `classify_layout`).

    Runs the loss under no_grad on the first sample and on the first two samples and compares each
    call's leading shape; a call computed once for the whole batch (positional embeddings of arange(T))
    is then re-run expanded per sample and kept on the fast path only if the losses are unchanged.
    Cached per model and batch signature: a few no-grad forwards of <= 2 samples, once.
    """
    if total < 2:
        return {}
    one = _map_tensors(batch, lambda t: t[:1])
    two = _map_tensors(batch, lambda t: t[:2])
    rng = torch.get_rng_state()
    cuda_dev = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    cuda_rng = torch.cuda.get_rng_state(cuda_dev) if cuda_dev is not None else None

    def reset_rng() -> None:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, cuda_dev)

    engine.capturing = True
    try:
        with torch.no_grad():
            engine.begin(None, "probe")
            per_sample_loss(model, one)
            rec1, engine.recorded = engine.recorded, {}
            reset_rng()
            engine.begin(None, "probe")
            ref = per_sample_loss(model, two)
            rec2, engine.recorded = engine.recorded, {}
            layouts = {k: (classify_layout(rec1.get(k), rec2.get(k)), rec1.get(k)) for k in set(rec1) | set(rec2)}
            ref = ref.detach()
            tol = math.sqrt(torch.finfo(ref.dtype).eps) if ref.is_floating_point() else 0.0
            for key, (layout, lead1) in sorted(layouts.items()):
                if layout not in ("shared", "shared1"):
                    continue
                reset_rng()
                engine.begin(None, "verify")
                engine.expand_keys, engine.probe_batch = {key: layout}, 2
                try:
                    out = per_sample_loss(model, two)
                    same = isinstance(out, Tensor) and out.shape == ref.shape and bool(
                        torch.allclose(out.detach(), ref, rtol=tol, atol=tol, equal_nan=True)
                    )
                except Exception:
                    same = False
                if not same:
                    layouts[key] = ("unsupported", lead1)
    finally:
        engine.capturing = False
        engine.mode = None
        engine.expand_keys = {}
        engine.recorded = {}
    return layouts


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _scan_graph(root: Tensor) -> tuple[set[int], list[Tensor], list[Any]]:
    """Node ids reachable from `root`, the leaf tensors at the end of the graph, and the node objects
    (kept alive so that ids stay unique while they are compared)."""
    seen: set[int] = set()
    keep: list[Any] = []
    leaves: list[Tensor] = []
    stack = [root.grad_fn] if root.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        var = getattr(node, "variable", None)
        if isinstance(var, Tensor):
            leaves.append(var)
            seen.add(id(var))
            keep.append(var)
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                stack.append(nxt)
    return seen, leaves, keep


# ---------------------------------------------------------------------------------------------- main
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
    model = _unwrap(model)
    _check_batch_coupling(model)

    sizes = [_batch_size(b, f"groups[{i}]") for i, b in enumerate(groups)]
    num_groups = len(groups)

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
    device = scope[0].device
    batch = _concat(list(groups))
    batch = _map_tensors(batch, lambda t: t.to(device, non_blocking=True) if t.device != device else t)
    total = sum(sizes)
    sample_groups = torch.repeat_interleave(torch.arange(num_groups, device=device), torch.tensor(sizes, device=device))
    mb = micro_batch_size or total
    spans = [(a, min(total, a + mb)) for a in range(0, total, mb)]

    forced: dict[int, str] = {}
    for _attempt in range(4):
        try:
            gram, loss_sums, info = _run(
                model, per_sample_loss, batch, sizes, sample_groups, spans, scope, forced, device,
                chunk_elements, ghost,
            )
            break
        except _Retry as retry:
            forced.update(retry.reasons)
    else:  # pragma: no cover - each retry adds at least one parameter to the fallback
        raise RuntimeError("group_gram: could not settle which parameters need the fallback")

    gram = (gram + gram.t()) / 2  # exactly symmetric (BLAS need not give M M^T bitwise symmetric)
    losses = loss_sums / torch.tensor(sizes, dtype=torch.float64, device=loss_sums.device)
    world = 1
    t_reduce = time.perf_counter()
    if reduce == "mean" and torch.distributed.is_available() and torch.distributed.is_initialized():
        gram, losses, world = _all_reduce_mean(gram, losses, process_group)
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


def _all_reduce_mean(gram: Tensor, losses: Tensor, group: Any) -> tuple[Tensor, Tensor, int]:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    g = gram.shape[0]
    backend = dist.get_backend(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    packed = torch.cat([gram.reshape(-1), losses]).to(dev, torch.float64)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    packed /= world
    return packed[: g * g].reshape(g, g), packed[g * g :], world


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
                fallback.setdefault(id(p), (mname, f"no fast path for {type(module).__name__}"))
            elif pname not in FAST_PARAM_NAMES[kind]:
                fallback.setdefault(id(p), (mname, f"parameter {pname!r} of {type(module).__name__}"))
            else:
                fast[pname] = p
        if fast:
            candidates.append((mname, module, kind, fast))
    fast_modules = []
    for mname, module, kind, fast in candidates:
        kept = {k: p for k, p in fast.items() if id(p) not in fallback}
        if kept:
            fast_modules.append((mname, module, kind, kept))
    fb_params = [p for p in scope if id(p) in fallback]
    return fast_modules, fb_params, fallback


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
) -> tuple[Tensor, Tensor, GramInfo]:
    num_groups = len(sizes)
    fast_modules, fb_params, fb_reasons = _classify(model, scope, forced)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    info = GramInfo(num_groups=num_groups, group_sizes=list(sizes), num_micro_batches=len(spans), world_size=1)
    info.fallback_params = [names.get(id(p), "?") for p in fb_params]
    info.fallback_modules = sorted({m for m, _ in fb_reasons.values()})
    info.fallback_reasons = {names.get(k, "?"): r for k, (_, r) in fb_reasons.items()}
    if fb_params:
        warnings.warn(
            "group_gram: exact fallback (one extra backward per group) for "
            + "; ".join(f"{n} ({r})" for n, r in sorted(info.fallback_reasons.items())),
            stacklevel=3,
        )

    fast_ids = {id(p) for _, _, _, ps in fast_modules for p in ps.values()}
    in_scope = {id(p) for p in scope}
    weights = 1.0 / torch.tensor(sizes, dtype=torch.float64, device=device)
    engine = FusedGramEngine(fast_modules, num_groups, device, _compute_dtype, chunk_elements, ghost)
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
        with torch.random.fork_rng(devices=devices), torch.inference_mode(False), torch.enable_grad():
            cache = _LAYOUT_CACHE.setdefault(model, {})
            ckey = (_batch_signature(batch), frozenset(id(m) for _, m, _, _ in fast_modules))
            if ckey not in cache:
                cache[ckey] = _probe_layouts(engine, model, per_sample_loss, batch, sum(sizes))
            engine.layouts = cache[ckey]
            for m_idx, (a, b) in enumerate(spans):
                micro = MicroBatch(sample_groups[a:b], is_last=m_idx == len(spans) - 1)
                mb = _map_tensors(batch, lambda t: t[a:b])
                t0 = time.perf_counter()
                engine.begin(micro, None)
                losses = per_sample_loss(model, mb)
                engine.end_forward()
                timings["forward_s"] += time.perf_counter() - t0
                if not isinstance(losses, Tensor) or losses.dim() != 1 or losses.shape[0] != b - a:
                    got = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
                    raise ValueError(
                        f"per_sample_loss must return one loss per sample, shape ({b - a},); got {got}"
                    )
                if engine.layout_errors:
                    raise _Retry(engine.layout_errors)
                loss_sums.index_add_(0, micro.sample_groups, losses.detach().to(torch.float64))
                if not losses.requires_grad:
                    engine.finish_micro()
                    continue
                w = weights[micro.sample_groups].to(losses.dtype)
                total = (losses * w).sum()
                reachable, leaves, _alive = _scan_graph(total)
                stray = {id(v): "used outside its module's forward (functional use)" for v in leaves if id(v) in fast_ids}
                if stray:
                    raise _Retry(stray)
                engine.drop_unreachable(reachable)

                t0 = time.perf_counter()
                if fb_params:
                    for li, (sa, sb) in enumerate(micro.sample_segments):
                        mask = torch.zeros_like(w)
                        mask[sa:sb] = w[sa:sb]
                        grads = torch.autograd.grad(
                            (losses * mask).sum(), fb_params, retain_graph=True, allow_unused=True
                        )
                        g = int(micro.groups[li])
                        for acc, gr in zip(fb_acc, grads):
                            if gr is not None:
                                acc[g] += gr.reshape(-1).to(acc.dtype)
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
    info.timings.update(timings)
    return gram, loss_sums, info
