"""Fast paths by capability: which function a module's call computes of its `weight` / `bias`.

The fused Gram needs, for each hooked call, the per-token form of the parameters' gradient. That is
known for four functions of a module's direct `weight` (and optional `bias`):

* ``linear``:    y = x W^T + b     (nn.Linear and anything computing F.linear of its first input)
* ``conv1d``:    y = x W + b       (HF Conv1D and other transposed linears)
* ``embedding``: y = W[ids]        (lookups, including subclasses such as llm-foundry's SharedEmbedding)
* ``affine``:    y = w * n(x) + b  (element-wise affine over the trailing dims: LayerNorm / RMSNorm
  variants such as LPLayerNorm, HF LlamaRMSNorm, torchtitan RMSNorm, weight-only norms). n(x) is not
  recomputed from a formula: it is the module's own output with weight 1 and bias 0, so internal casts
  (HF Llama normalises in float32) are reproduced exactly.

Classes whose forward *is* a known function (nn.Linear.forward ...) are trusted as before. Any other
module whose direct parameters are `weight` (+ `bias`) is a candidate (kind ``AUTO``): on the layout
probe's one-sample batch each of its calls is checked once, the output against the functional form and
the parameters' vector-Jacobian product (autograd through the module's own forward) against the
formula the fast path uses. A call may match different functions (a tied embedding used as lookup and
as unembedding). A module with any call that matches none is demoted to the exact fallback for as long
as it lives, with the reason kept for the fallback report; nothing is ever guessed.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["AUTO", "demoted_reason", "is_candidate", "unit_output", "verify_call"]

AUTO = "auto"  # fast_kind of a candidate module: each call's kind is verified on the probe batch

_DEMOTED: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
_PARAM_NAMES = ("weight", "bias")


def is_candidate(module: nn.Module) -> bool:
    """Direct parameters are exactly a `weight` and an optional `bias` (the rest goes to the fallback)."""
    params = {k: p for k, p in module._parameters.items() if p is not None}
    return "weight" in params and set(params) <= set(_PARAM_NAMES) and module not in _DEMOTED


def demoted_reason(module: nn.Module) -> Optional[str]:
    """Why an earlier capability check sent this module to the exact fallback, or None."""
    return _DEMOTED.get(module)


def demote(module: nn.Module, reason: str) -> None:
    _DEMOTED.setdefault(module, reason)


def _detached(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    return obj


def unit_output(module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """The module's own output with weight 1 and bias 0: n(x) of an element-wise affine call."""
    saved: dict[str, Any] = {k: p for k in _PARAM_NAMES if (p := module._parameters.get(k)) is not None}
    # FSDP1 (use_orig_params) also holds the gathered tensor as a plain attribute, which attribute lookup reads first
    shadows: dict[str, Any] = {k: t for k in saved if isinstance(t := module.__dict__.get(k), Tensor)}
    try:
        for k, p in saved.items():
            fill = torch.ones_like if k == "weight" else torch.zeros_like
            module._parameters[k] = fill(p.detach())  # type: ignore[assignment]  # plain tensor, no grad
            if k in shadows:
                module.__dict__[k] = module._parameters[k]
        with torch.no_grad():
            out = module.forward(*args, **kwargs)
    finally:
        module._parameters.update(saved)
        module.__dict__.update(shadows)
    if not isinstance(out, Tensor):
        raise TypeError(f"{type(module).__name__} returned {type(out).__name__}, not a tensor")
    return out


def _cotangent(like: Tensor) -> Tensor:
    """A fixed, sign-changing output gradient for the VJP check (no global RNG is consumed)."""
    n = like.numel()
    v = torch.sin(torch.arange(n, device=like.device, dtype=torch.float64) * 1.7 + 0.3)
    return v.reshape(like.shape).to(like.dtype)


def _close(got: Optional[Tensor], want: Tensor, dtype: torch.dtype) -> bool:
    """Equal up to sqrt(eps) of `dtype` (the call's output dtype: under autocast, bf16 rounding of the
    module's own matmuls is not a different function; a wrong one is off by O(1))."""
    if got is None or got.shape != want.shape:
        return False
    tol = math.sqrt(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0
    diff = float((got.double() - want.double()).norm())
    return math.isfinite(diff) and diff <= tol * max(float(want.double().norm()), 1e-30)


# Each form: (applies?, reference output, expected {name: VJP of <y, v>}) of (x, W, b, module, v, n)
def _linear_fits(x: Tensor, w: Tensor, b: Optional[Tensor]) -> bool:
    return x.is_floating_point() and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1] and (
        b is None or tuple(b.shape) == (w.shape[0],))


def _conv1d_fits(x: Tensor, w: Tensor, b: Optional[Tensor]) -> bool:
    return x.is_floating_point() and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[0] and (
        b is None or tuple(b.shape) == (w.shape[1],))


def _embedding_fits(x: Tensor, w: Tensor, b: Optional[Tensor]) -> bool:
    return not x.is_floating_point() and not x.is_complex() and w.dim() == 2 and b is None


def _affine_fits(x: Tensor, w: Tensor, b: Optional[Tensor]) -> bool:
    return (x.is_floating_point() and 1 <= w.dim() <= x.dim() and tuple(x.shape[x.dim() - w.dim():]) == tuple(w.shape)
            and (b is None or b.shape == w.shape))


def _rows(t: Tensor, tail: int) -> Tensor:
    return t.reshape(-1, t.shape[-1]) if tail == 1 else t.reshape(-1, *t.shape[t.dim() - tail:])


def _expected(kind: str, x: Tensor, w: Tensor, b: Optional[Tensor], v: Tensor, n: Optional[Tensor],
              padding_idx: Optional[int]) -> tuple[Tensor, dict[str, Tensor]]:
    """Reference output and the VJP <v, y> with respect to weight / bias, in the weight's dtype."""
    dt = w.dtype
    if kind == "linear":
        ref = F.linear(x, w, b)
        x2, v2 = _rows(x, 1).to(dt), _rows(v, 1).to(dt)
        return ref, {"weight": v2.t() @ x2, "bias": v2.sum(0)}
    if kind == "conv1d":
        ref = x @ w if b is None else torch.addmm(b, x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], -1)
        x2, v2 = _rows(x, 1).to(dt), _rows(v, 1).to(dt)
        return ref, {"weight": x2.t() @ v2, "bias": v2.sum(0)}
    if kind == "embedding":
        ref = F.embedding(x, w, padding_idx)
        ids, v2 = x.reshape(-1).long(), v.reshape(-1, w.shape[1]).to(dt)
        if padding_idx is not None:
            keep = ids != (padding_idx % w.shape[0])
            ids, v2 = ids[keep], v2[keep]
        return ref, {"weight": torch.zeros_like(w).index_add_(0, ids, v2)}
    assert n is not None, "affine needs the unit-weight output"
    ref = n * w if b is None else n * w + b
    v2, n2 = _rows(v, w.dim()).to(dt), _rows(n, w.dim()).to(dt)
    return ref, {"weight": (v2 * n2).sum(0), "bias": v2.sum(0)}


_FORMS: tuple[tuple[str, Callable[[Tensor, Tensor, Optional[Tensor]], bool]], ...] = (
    ("embedding", _embedding_fits), ("linear", _linear_fits), ("conv1d", _conv1d_fits), ("affine", _affine_fits),
)


def _vjp(module: nn.Module, args: tuple, kwargs: dict, params: dict[str, nn.Parameter], v: Tensor) -> dict:
    """<v, y> differentiated through the module's own forward, for the in-scope parameters."""
    names = [k for k in _PARAM_NAMES if k in params and params[k].requires_grad]
    # what the module computes with: the parameter, or under FSDP the unit's gathered tensor standing in for it
    live = [t for k in names if isinstance(t := module._parameters.get(k), Tensor) and t.requires_grad]
    if len(live) != len(names):
        return {}
    with torch.enable_grad():
        out = module.forward(*_detached(args), **_detached(kwargs))
        if not isinstance(out, Tensor) or out.shape != v.shape or not out.requires_grad:
            return {}
        grads = torch.autograd.grad((out * v).sum(), live, allow_unused=True)
    return {k: g for k, g in zip(names, grads) if g is not None}


def verify_call(
    module: nn.Module, args: tuple, kwargs: dict, output: Any, params: dict[str, nn.Parameter]
) -> tuple[Optional[str], str]:
    """(kind, "") when this call provably computes one supported function of its weight / bias on this
    batch (output and parameter VJP both match), else (None, why). `params`: the in-scope parameters."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    name = type(module).__name__
    if not isinstance(x, Tensor) or not isinstance(output, Tensor):
        return None, f"{name}: non-tensor input or output"
    w, b = module._parameters.get("weight"), module._parameters.get("bias")
    if w is None:
        return None, f"{name}: no weight"
    padding_idx = getattr(module, "padding_idx", None)
    padding_idx = padding_idx if isinstance(padding_idx, int) else None
    v = _cotangent(output)
    tried = []
    for kind, fits in _FORMS:
        if not fits(x, w, b):
            continue
        tried.append(kind)
        try:
            n = unit_output(module, _detached(args), _detached(kwargs)) if kind == "affine" else None
            if n is not None and n.shape != output.shape:
                continue
            with torch.no_grad():
                ref, want = _expected(kind, x.detach(), w.detach(), None if b is None else b.detach(), v, n,
                                      padding_idx)
            if not _close(output.detach(), ref, output.dtype):
                continue
            got = _vjp(module, args, kwargs, params, v)
            low = max(output.dtype, w.dtype, key=lambda d: torch.finfo(d).eps if d.is_floating_point else 0.0)
            if all(_close(got.get(k), want[k], low) for k in params if k in want and params[k].requires_grad):
                return kind, ""
        except Exception:  # a form that cannot even be evaluated is simply not this call's form
            continue
    forms = f"checked: {'/'.join(tried)}" if tried else "no supported form fits its shapes"
    return None, f"forward of {name} does not compute a supported function of its weight/bias ({forms})"
