"""Which parameters the fused Gram covers and how: the fast path per module, or the exact fallback.

Planned once per attempt of a ``group_gram`` call (``group_gram`` retries with more parameters on the
fallback when a layout or a functional use shows that the fast path cannot attribute them). The plan also
names every fallback in the :class:`GramInfo` and warns once: the fallback costs one extra backward per group.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from grape_stream.grape.gram.layouts import FAST_PARAM_NAMES, fallback_reason, fast_kind

__all__ = ["FastModule", "GramInfo", "check_batch_coupling", "param_scope", "plan_pass"]

#: (module name, module, fast-path kind, {parameter name: parameter}) of a module on the fast path.
FastModule = tuple[str, nn.Module, str, dict[str, nn.Parameter]]


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


def check_batch_coupling(model: nn.Module) -> None:
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


def param_scope(model: nn.Module, params: Optional[Iterable[nn.Parameter]]) -> list[nn.Parameter]:
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
) -> tuple[list[FastModule], list[nn.Parameter], dict[int, tuple[str, str]]]:
    """Split the in-scope parameters into fast-path (per module) and fallback ones."""
    in_scope = {id(p) for p in scope}
    fallback: dict[int, tuple[str, str]] = {}  # id -> (module name, reason)
    candidates: list[FastModule] = []
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


def plan_pass(
    model: nn.Module, scope: list[nn.Parameter], forced: dict[int, str], sizes: list[int], num_micro: int
) -> tuple[list[FastModule], list[nn.Parameter], GramInfo]:
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
            stacklevel=5,
        )
    return fast_modules, fb_params, info
