"""Which modules have a fast path, and how each module call's rows map to samples.

The fused Gram attributes every row of a hooked module's input to one sample. That is only known for
some functions of a module's weight / bias (``fast_kind``: known forwards, or any module whose calls are
verified to compute one of them, see ``capabilities``) and some layouts of the call's leading
dimensions, found once per model and batch signature by running the loss on one and on two samples
(gram/layout_probe.py). Anything else goes to the exact fallback rather than being guessed.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from torch import Tensor, nn

from grape_stream.grape.gram.capabilities import AUTO, demoted_reason, is_candidate

__all__ = [
    "FAST_PARAM_NAMES",
    "classify_layout",
    "fallback_reason",
    "expand_shared",
    "fast_kind",
    "is_sample_major_view",
    "lead_shape",
]

PerSampleLoss = Callable[[nn.Module, Any], Tensor]


def _hf_conv1d_forward() -> Optional[Callable]:
    """HF Conv1D.forward (GPT-2 style models: a transposed Linear), if transformers is loaded at all: a
    model holding a Conv1D has imported it, and nobody else should pay for importing transformers."""
    mod = sys.modules.get("transformers.pytorch_utils")
    conv = getattr(mod, "Conv1D", None) if mod is not None else None
    return getattr(conv, "forward", None)


_RMSNORM_FORWARD = getattr(getattr(nn, "RMSNorm", None), "forward", None)


def fast_kind(module: nn.Module) -> Optional[str]:
    """The fast path that handles this module's direct parameters exactly, ``AUTO``, or None.

    A known *forward function* is trusted (not the class: a subclass that overrides forward computes
    something else). Any other module whose direct parameters are a weight and an optional bias is
    ``AUTO``: each of its calls is verified on the probe batch (``capabilities.verify_call``) and the
    module is demoted to the exact fallback if one call matches no supported function.
    """
    if "forward" in vars(module):  # forward patched on the instance (e.g. by an accelerator hook)
        return AUTO if is_candidate(module) else None
    fwd = type(module).forward
    if fwd is nn.Linear.forward:
        return "linear"
    if fwd is nn.Embedding.forward:
        return "embedding"
    if fwd is nn.LayerNorm.forward:
        return "layernorm"
    if _RMSNORM_FORWARD is not None and fwd is _RMSNORM_FORWARD:
        return "rmsnorm"
    conv = _hf_conv1d_forward()
    if conv is not None and fwd is conv:
        return "conv1d"
    return AUTO if is_candidate(module) else None


def fallback_reason(module: nn.Module) -> str:
    """Why `module`'s parameters take the exact fallback (for GramInfo.fallback_reasons and the warning)."""
    why = demoted_reason(module)
    if why is not None:
        return why
    names = sorted(k for k, p in module._parameters.items() if p is not None)
    return f"no fast path for {type(module).__name__} (parameters {names}; a fast path needs weight[, bias])"


FAST_PARAM_NAMES = {
    "linear": ("weight", "bias"),
    "conv1d": ("weight", "bias"),
    "embedding": ("weight",),
    "layernorm": ("weight", "bias"),
    "rmsnorm": ("weight",),
    AUTO: ("weight", "bias"),  # per call one of linear / conv1d / embedding / affine (capabilities.py)
}


def lead_shape(kind: str, module: nn.Module, inp: Tensor) -> tuple[int, ...]:
    """The leading (per-token) dimensions of a module input: everything but the feature dims."""
    if kind == "embedding":
        return tuple(inp.shape)
    if kind in ("layernorm", "rmsnorm"):
        norm: Any = module  # nn.LayerNorm or RMSNorm (matched on forward by fast_kind)
        return tuple(inp.shape[: inp.dim() - len(norm.normalized_shape)])
    if kind == "affine":  # verified: the weight's shape is the trailing shape of input and output
        return tuple(inp.shape[: inp.dim() - module._parameters["weight"].dim()])  # type: ignore[union-attr]
    return tuple(inp.shape[:-1])


def classify_layout(lead1: Optional[tuple[int, ...]], lead2: Optional[tuple[int, ...]]) -> str:
    """How a module call's rows map to samples, from its leading shape with 1 and with 2 samples.

    "batch": (B, ...) batch-first; "flat": (B*r, ...) flattened rows (attributed only when the input is
    provably a contiguous view of a batch-first tensor); "shared1": (1, ...) broadcast over the batch;
    "shared": no batch dimension at all (e.g. positional embeddings of arange(T)), broadcast over the
    batch; "unsupported": anything else (e.g. sequence-first layouts) -> exact fallback.
    """
    if lead1 is None or lead2 is None or len(lead1) != len(lead2):
        return "unsupported"
    if lead1 == lead2:
        return "shared1" if lead1 and lead1[0] == 1 else "shared"
    if lead1 and lead2[0] == 2 * lead1[0] and lead2[1:] == lead1[1:]:
        return "batch" if lead1[0] == 1 else "flat"
    return "unsupported"


def is_sample_major_view(inp: Tensor, batch: int) -> bool:
    """True when `inp` (B*r, ...) is a contiguous reshape of a contiguous batch-first (B, ...) tensor."""
    base = inp._base
    return (
        base is not None
        and base.dim() >= 1
        and base.shape[0] == batch
        and base.is_contiguous()
        and inp.is_contiguous()
        and inp.data_ptr() == base.data_ptr()
        and inp.numel() == base.numel()
    )


def expand_shared(t: Tensor, layout: str, batch: int) -> Tensor:
    """A per-sample view (B, ...) of a tensor that the module computed once for the whole batch."""
    if layout == "shared1":
        return t.expand(batch, *t.shape[1:])
    return t.unsqueeze(0).expand(batch, *t.shape)


CallKey = tuple[int, int]  # (id(module), call ordinal within one forward)
Lead = Optional[tuple[int, ...]]  # a call's leading (per-token) dimensions
Layouts = dict[CallKey, tuple[str, Lead]]
