"""The fused Gram on an FSDP-sharded model: one unit's parameters at a time, while FSDP has them gathered.

Why this works without a replica: the engine's hooks sit on leaf modules (Linear, Embedding, norms). FSDP
(FSDP1 with ``use_orig_params=True``, FSDP2 ``fully_shard``) gathers a unit's parameters in its pre-forward
and registers the unsharded tensors on the leaf modules (``module._parameters[name]``) for the duration of
the unit's forward, and gathers them again before the unit's backward. The engine's pre-hook therefore sees
the unsharded tensor (not the scope's sharded parameter) and detaches it for the call, exactly as it detaches
a plain parameter; the per-group contributions are formed from the call's input and output gradient, which
are whole on every rank. So each rank forms the Gram of ITS OWN probe samples, as under DDP, while no more
than the units FSDP itself gathers are ever whole, and the Grams are averaged over the ranks with the same
one all-reduce as under DDP (``reduce="mean"``): the result equals DDP's (and the single-process average of
the per-rank Grams) exactly. Extra memory per rank: the engine's chunk budget, plus the per-group
gradient of a tied embedding's used rows (see docs/alignment.md); never a parameter's full per-group copy.

What cannot be exact is refused in one line (:func:`check_sharded`): FSDP1 without ``use_orig_params``
(its modules see views of a FlatParameter that autograd reaches only whole), DTensor parameters not placed
by FSDP2 (tensor parallel: a module's forward sees a shard), the exact fallback, the Adam geometry (the
optimizer state is sharded). With ``micro_batch_size`` the per-group gradients are summed over the ranks and kept
sharded between micro-batches instead (``shard_sums.py``; the Gram of the rank-mean group gradients).
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from grape_stream.errors import ConfigError
from grape_stream.grape.collectives import collective_device
from grape_stream.grape.probes import sharded_parameter

__all__ = ["ShardedGramError", "agree_on_shape", "check_sharded", "common_length", "fsdp_kind", "holding_gradients",
           "is_sharded", "refuse_stray"]


class ShardedGramError(ConfigError):
    """What the fused Gram cannot compute exactly on this sharded model (one line)."""


def _fsdp1_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp2_sharded_params(modules: list[nn.Module]) -> set[int]:
    """ids of the sharded parameters FSDP2 manages. torch 2.4-2.14 keep them on the module's state's param
    group (``FSDPParam.sharded_param``); there is no public accessor, so this is the one place that reads it."""
    out: set[int] = set()
    for m in modules:
        state = m._get_fsdp_state()  # type: ignore[operator]
        group = getattr(state, "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", None) or []:
            out.add(id(fp.sharded_param))
    return out


def fsdp_kind(model: nn.Module) -> Optional[str]:
    """"fsdp1", "fsdp2" or None (no FSDP module in ``model``)."""
    if _fsdp1_modules(model):
        return "fsdp1"
    if _fsdp2_modules(model):
        return "fsdp2"
    return None


def is_sharded(model: nn.Module) -> bool:
    """True for a model holding FSDP1 or FSDP2 modules or DTensor / FlatParameter parameters."""
    return fsdp_kind(model) is not None or sharded_parameter(model) is not None


def check_sharded(model: nn.Module) -> Optional[str]:
    """The FSDP kind the fused Gram runs on ("fsdp1", "fsdp2"), None for a plain model; a
    :class:`ShardedGramError` (one line) for sharding it cannot probe exactly."""
    fsdp1 = _fsdp1_modules(model)
    for m in fsdp1:
        if not getattr(m, "_use_orig_params", False):
            raise ShardedGramError(
                "the alignment Gram under FSDP1 needs use_orig_params=True (Composer: fsdp_config "
                "use_orig_params: true): without it the modules compute with views of a FlatParameter that "
                "autograd reaches only as a whole, so per-module per-group gradients cannot be attributed")
    if fsdp1:
        return "fsdp1"
    fsdp2 = _fsdp2_modules(model)
    managed = _fsdp2_sharded_params(fsdp2)
    for name, p in model.named_parameters():
        if id(p) not in managed and sharded_parameter(_Holder(p)) is not None:
            raise ShardedGramError(
                f"parameter {name!r} is a sharded DTensor not placed by FSDP2's fully_shard (tensor parallel?): "
                "its module computes with a shard, so its per-group gradient is not the full one the alignment "
                "Gram needs; shard the model with FSDP1 (use_orig_params=True) or FSDP2 only")
    return "fsdp2" if fsdp2 else None


class _Holder(nn.Module):
    """One parameter as a module (``sharded_parameter`` inspects modules)."""

    def __init__(self, p: nn.Parameter) -> None:
        super().__init__()
        self.p = p


@contextlib.contextmanager
def holding_gradients(model: nn.Module) -> Iterator[None]:
    """Around the probe's backward: FSDP neither reduces nor finalises gradients, as inside a gradient-accumulation
    micro-batch (FSDP1 ``no_sync()``, FSDP2 ``set_requires_gradient_sync(False)``). The probe forms no ``.grad``;
    this keeps FSDP from reducing or finalising a training gradient being accumulated when the probe runs between
    micro-batches, so the training step is bitwise the same with or without the probe."""
    with contextlib.ExitStack() as stack:
        for m in _fsdp1_modules(model):
            if not any(o is not m and m in o.modules() for o in _fsdp1_modules(model)):  # the roots only
                stack.enter_context(m.no_sync())  # type: ignore[operator]
        for m in _fsdp2_modules(model):  # torch 2.4-2.14: the flag lives on the state's param group
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)  # type: ignore[operator]
            if group is not None and group.reduce_grads:
                fsdp2: Any = m
                fsdp2.set_requires_gradient_sync(False, recurse=False)
                stack.callback(fsdp2.set_requires_gradient_sync, True, recurse=False)
        yield


def agree_on_shape(signature: Any, process_group: Any = None) -> None:
    """Every rank must run the same forwards (each gathers the units' parameters, a collective): check that
    all ranks probe batches of one signature (non-batch shapes, dtypes, samples, micro-batches) before any
    forward, so a mismatch is one clear error on every rank instead of a hang."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    code = zlib.crc32(repr(signature).encode())
    t = torch.tensor([code, -code], dtype=torch.int64, device=collective_device(None, process_group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=process_group)
    if int(t[0]) != code or int(-t[1]) != code:
        raise ShardedGramError(
            "under FSDP every rank must probe batches of the same shapes (sequence length, group sizes): each "
            "forward gathers the sharded parameters collectively; pad the probe groups to one length on all ranks")


def common_length(groups: list[dict[str, Tensor]], device: torch.device, process_group: Any = None) -> int:
    """The longest probe sequence over all ranks (one tiny all-reduce): FSDP ranks must run forwards of one shape."""
    t = torch.tensor([max(g["tokens"].shape[1] for g in groups)], dtype=torch.int64,
                     device=collective_device(device, process_group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=process_group)
    return int(t.item())


def refuse_stray(leaves: list[Tensor], roots: list[Tensor]) -> None:
    """Under FSDP the only leaves the probe's backward may reach are the engine's own roots: any other is a
    parameter used outside its module's forward, which only the per-group fallback could attribute."""
    known = {id(r) for r in roots}
    stray = [t for t in leaves if id(t) not in known]
    if stray:
        shapes = ", ".join(str(tuple(t.shape)) for t in stray[:3])
        raise ShardedGramError(
            f"under FSDP the probe reaches {len(stray)} parameter(s) outside the forward of a module the fused Gram "
            f"hooks (shapes {shapes}; functional use, or a module kind it does not support): their per-group "
            "gradients would need the per-group fallback, which is not available on sharded models")
