"""The layout probe: which leading dimension of each hooked module call is the batch, found by running the
loss on one and on two samples with the engine recording (``FusedGramEngine`` owns the recording state;
this module only asks it to record, then classifies with gram/layouts.py's rules).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from grape_stream.grape.gram.batches import map_tensors
from grape_stream.grape.gram.capabilities import AUTO
from grape_stream.grape.gram.hooks import FusedGramEngine
from grape_stream.grape.gram.layouts import CallKey, Layouts, classify_layout

__all__ = ["probe_layouts"]

PerSampleLoss = Callable[[nn.Module, Any], Tensor]


def probe_layouts(
    engine: FusedGramEngine, model: nn.Module, per_sample_loss: PerSampleLoss, batch: Any, total: int
) -> tuple[Layouts, dict[CallKey, Optional[str]]]:
    """Which leading dimension of each hooked module call is the batch (see `classify_layout`), and the
    verified kind of each call of an ``AUTO`` module (None: no supported function; the module is demoted).

    Runs the loss under no_grad on the first sample (where ``AUTO`` calls are verified) and on the first
    two samples and compares each call's leading shape; a call computed once for the whole batch
    (positional embeddings of arange(T)) is then re-run expanded per sample and kept on the fast path
    only if the losses are unchanged. Cached per model and batch signature: a few no-grad forwards of
    <= 2 samples, once.
    """
    needs_kinds = any(kind == AUTO for _, _, kind, _ in engine.modules)
    if total < 2 and not needs_kinds:
        return {}, {}
    one = map_tensors(batch, lambda t: t[:1])
    two = map_tensors(batch, lambda t: t[:2])
    rng = torch.get_rng_state()
    cuda_dev = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    cuda_rng = torch.cuda.get_rng_state(cuda_dev) if cuda_dev is not None else None

    def reset_rng() -> None:
        torch.set_rng_state(rng)
        if cuda_rng is not None and cuda_dev is not None:
            torch.cuda.set_rng_state(cuda_rng, cuda_dev)

    with engine.layout_probing(), torch.no_grad():
        rec1, _ = engine.record_leads(lambda: per_sample_loss(model, one), verify=True)  # AUTO calls checked here
        kinds = engine.verified_kinds()
        if total < 2:
            return {k: ("unsupported", v) for k, v in rec1.items()}, kinds
        reset_rng()
        rec2, ref = engine.record_leads(lambda: per_sample_loss(model, two))
        layouts = {k: (classify_layout(rec1.get(k), rec2.get(k)), rec1.get(k)) for k in set(rec1) | set(rec2)}
        _verify_shared(engine, model, per_sample_loss, two, ref.detach(), layouts, reset_rng)
    return layouts, kinds


def _verify_shared(engine: FusedGramEngine, model: nn.Module, per_sample_loss: PerSampleLoss, two: Any,
                   ref: Tensor, layouts: Layouts, reset_rng: Callable[[], None]) -> None:
    """Keep a broadcast ("shared") call on the fast path only if expanding it per sample leaves the
    two-sample losses unchanged."""
    tol = math.sqrt(torch.finfo(ref.dtype).eps) if ref.is_floating_point() else 0.0
    for key, (layout, lead1) in sorted(layouts.items()):
        if layout not in ("shared", "shared1"):
            continue
        reset_rng()
        try:
            out = engine.forward_expanded(lambda: per_sample_loss(model, two), key, layout, 2)
            same = isinstance(out, Tensor) and out.shape == ref.shape and bool(
                torch.allclose(out.detach(), ref, rtol=tol, atol=tol, equal_nan=True)
            )
        except Exception:
            same = False
        if not same:
            layouts[key] = ("unsupported", lead1)
