"""Elementwise preconditioner of the Gram: G[a, b] = sum_p <g_a,p, w_p * g_b,p>.

With w_p = 1 / (sqrt(v_p) + eps) (AdamW's second moment) the Gram measures alignment in the direction
Adam actually moves, not the raw gradient's. Because w_p >= 0 is elementwise, sqrt(w_p) can be folded
into each per-group gradient contribution before any inner product: <sqrt(w) g_a, sqrt(w) g_b> is the
weighted inner product, and every contribution path (dense row blocks, embedding rows, small tensors,
the exact fallback) scales what it already forms, so no extra gradient copy is made. The token-pair
("ghost") form cannot carry an elementwise weight (it never forms the weight gradient), so a
preconditioned matmul layer always uses the per-group weight-gradient form.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import torch
from torch import Tensor, nn

__all__ = ["Precondition", "resolve_precondition"]

#: parameter (object or its name in `model.named_parameters()`) -> elementwise weight w_p, same shape
Precondition = Mapping[Union[nn.Parameter, str], Tensor]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for pre in _WRAPPER_PREFIXES:
            if name.startswith(pre):
                name, changed = name[len(pre):], True
    return name


def resolve_precondition(
    model: nn.Module,
    precondition: Optional[Precondition],
    compute_dtype: Callable[[torch.dtype], torch.dtype],
) -> dict[int, Tensor]:
    """id(parameter) -> sqrt(w_p) (the parameter's shape, compute dtype, its device).

    Names are those of `model.named_parameters()`; wrapper prefixes ("module.", "_orig_mod.") are ignored
    so that names taken from a DDP / compiled model (or its optimizer state) still match. Weights must be
    finite and >= 0 (an inner product needs a nonnegative weight); parameters without an entry use w = 1.
    """
    if not precondition:
        return {}
    by_name: dict[str, nn.Parameter] = {}
    by_id: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_name.setdefault(_strip(name), p)
        by_id[id(p)] = p
    out: dict[int, Tensor] = {}
    for key, weight in precondition.items():
        if isinstance(key, str):
            if _strip(key) not in by_name:
                raise ValueError(f"precondition names {key!r}, which is not a parameter of the model")
            p, label = by_name[_strip(key)], key
        elif isinstance(key, Tensor) and id(key) in by_id:
            p, label = by_id[id(key)], f"parameter of shape {tuple(key.shape)}"
        else:
            raise ValueError("precondition keys must be parameters of the model or their names")
        if not isinstance(weight, Tensor) or tuple(weight.shape) != tuple(p.shape):
            got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
            raise ValueError(f"precondition weight for {label} has shape {got}, expected {tuple(p.shape)}")
        w = weight.detach().to(device=p.device, dtype=compute_dtype(p.dtype))
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
            raise ValueError(f"precondition weight for {label} must be finite and >= 0")
        out[id(p)] = w.sqrt()
    return out
