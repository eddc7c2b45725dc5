"""The per-group gradient contribution of one module call, by the kind of the module's function.

Inside the fused backward, each hooked call of a fast-path module (a :class:`Use`: its input, and the
gradient of its output arriving in the tensor hook) yields, per parameter, the G per-group gradient
contributions of the micro-batch's groups, in the form cheapest for the kind: a matmul pair (Linear / HF
Conv1D: ``MatmulContribution``, ghost or dense), sparse rows (Embedding), or a dense per-group tensor (the
affine parameters of LayerNorm, RMSNorm and verified ``affine`` calls). The formulas are the chain rule for
each function; ``hooks.FusedGramEngine`` feeds the results to the parameters' accumulators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grape_stream.grape.gram.accumulators import MatmulContribution, SparseRowContribution, TensorContribution
from grape_stream.grape.gram.batches import MicroBatch

__all__ = ["Use", "contributions"]


@dataclass(eq=False)
class Use:
    """One call of a fast-path module in the current forward."""

    name: str
    kind: str
    module: nn.Module
    params: dict[str, nn.Parameter]
    inp: Optional[Tensor]
    rows_per_sample: int
    node: Any = None  # grad_fn of the output (or the output itself when it is a leaf)
    fired: bool = False
    keep_ids: Optional[Tensor] = None  # embedding: rows it touches (for the tied-weight projection)
    shapes: dict[str, torch.Size] = field(default_factory=dict)  # full parameter shapes (FSDP: not the shard's)


def _shape(use: Use, pname: str) -> torch.Size:
    """The parameter's full shape: as its module saw it in the forward (under FSDP1 the parameter object itself
    holds a flat shard outside its unit's forward)."""
    shape = use.shapes.get(pname)
    return shape if shape is not None else use.params[pname].shape


def _segments(mb: MicroBatch, rows: int) -> list[tuple[int, int]]:
    return [(a * rows, b * rows) for a, b in mb.sample_segments]


def _token_local(mb: MicroBatch, rows: int) -> Tensor:
    return mb.local.repeat_interleave(rows) if rows > 1 else mb.local


def _segsum(mb: MicroBatch, x: Tensor, rows: int) -> Tensor:
    """(n, ...) token rows -> (G_m, ...) per-group sums (rows of a group are contiguous)."""
    per_sample = x.reshape(mb.batch_size, rows, -1).sum(1)  # (B, f)
    out = mb.onehot(per_sample.dtype) @ per_sample  # (G_m, B) @ (B, f)
    return out.reshape(-1, *x.shape[1:])


def contributions(use: Use, grad: Tensor, mb: MicroBatch, *, compute_dtype: Callable[[torch.dtype], torch.dtype],
                  allow_ghost: bool, scales: dict[int, Tensor]) -> dict[str, Any]:
    """{parameter name: its per-group contribution} of one module call, from its input and output gradient.

    ``scales``: id(parameter) -> sqrt of its preconditioner weight (matmul and embedding forms apply it here;
    the caller scales the dense per-group tensors).
    """
    def scale(pname: str) -> Optional[Tensor]:
        return scales.get(id(use.params[pname])) if pname in use.params else None

    mod: Any = use.module  # duck-typed by use.kind: Linear, HF Conv1D, Embedding, LayerNorm or RMSNorm
    rows, inp = use.rows_per_sample, use.inp
    assert inp is not None, "the input is dropped only after the use's contributions are formed"
    groups = mb.groups
    out: dict[str, Any] = {}
    if use.kind in ("linear", "conv1d"):
        dtype = compute_dtype(grad.dtype)
        x = inp.reshape(-1, inp.shape[-1]).to(dtype)
        dy = grad.reshape(-1, grad.shape[-1]).to(dtype)
        segs = _segments(mb, rows)
        if "weight" in use.params:
            left, right = (dy, x) if use.kind == "linear" else (x, dy)
            out["weight"] = MatmulContribution(left, right, segs, groups, allow_ghost,
                                               scale("weight"))
        if "bias" in use.params:
            out["bias"] = TensorContribution(_segsum(mb, dy, rows), groups)
    elif use.kind == "embedding":
        dtype = compute_dtype(grad.dtype)
        ids = inp.reshape(-1)
        vecs = grad.reshape(ids.numel(), -1).to(dtype)
        tok_groups = groups[_token_local(mb, rows)]
        pad = getattr(mod, "padding_idx", None)
        if pad is not None:  # the padding row never receives gradient
            keep = ids != pad
            ids, vecs, tok_groups = ids[keep], vecs[keep], tok_groups[keep]
        s = scale("weight")
        if s is not None:
            vecs = vecs * s[ids.long()].reshape(vecs.shape)
        out["weight"] = SparseRowContribution(tok_groups, ids.long(), vecs, _shape(use, "weight")[0])
    elif use.kind in ("layernorm", "rmsnorm", "affine"):
        dtype = compute_dtype(grad.dtype)
        x = inp.to(dtype)
        if use.kind == "affine":  # inp is already the module's own n(x) (capabilities.unit_output)
            ns = tuple(_shape(use, "weight"))
            xhat = x
        elif use.kind == "layernorm":
            ns = tuple(mod.normalized_shape)
            xhat = F.layer_norm(x, ns, None, None, mod.eps)
        else:
            ns = tuple(mod.normalized_shape)
            eps = mod.eps if mod.eps is not None else torch.finfo(x.dtype).eps
            xhat = F.rms_norm(x, ns, None, eps)
        feat = math.prod(ns)
        dy = grad.to(dtype).reshape(-1, feat)
        if "weight" in use.params:
            w = _segsum(mb, dy * xhat.reshape(-1, feat), rows)
            out["weight"] = TensorContribution(w.reshape(-1, *ns), groups)
        if "bias" in use.params:
            out["bias"] = TensorContribution(_segsum(mb, dy, rows).reshape(-1, *ns), groups)
    else:  # pragma: no cover - guarded by fast_kind
        raise AssertionError(use.kind)
    return out
