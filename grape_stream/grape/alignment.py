"""The probe's Gram: one fused forward/backward over the probe groups, with the model left as found.

Separate from grape.probes (which group_gram itself imports for the unwrap) so that no import cycle is
needed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping

import numpy as np
import torch
from torch import nn

from grape_stream.grape.gram.group_gram import group_gram
from grape_stream.grape.probes import module_device

__all__ = ["probe_gram"]


def probe_gram(
    model: nn.Module,
    per_sample_loss: Callable[[nn.Module, Any], torch.Tensor],
    groups: list[dict[str, torch.Tensor]],
    *,
    train_mode: bool,
    autocast: Callable[[], ContextManager[Any]] | None,
    reduce: str | None,
    gram_options: Mapping[str, Any],
    precondition: Mapping[Any, torch.Tensor] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(Gram, losses) of the probe groups as float64 numpy, leaving the model's mode and the RNG as found.

    The probe must not advance the training RNG (dropout masks, etc.): a run with GRAPE and one resumed
    from a checkpoint must see the same random numbers as their uninterrupted twins. A non-finite result
    is an error: updating the mixture from a diverged model would hide the divergence. ``precondition``
    (parameter -> elementwise weight, grape.geometry) is passed to the fused Gram only when given.
    """
    extra = {} if precondition is None else {"precondition": precondition}
    was_training = model.training
    model.train(train_mode)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and module_device(model).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), (autocast() if autocast is not None else contextlib.nullcontext()):
            gram, losses = group_gram(model, per_sample_loss, groups, **{"reduce": reduce, **gram_options, **extra})
    finally:
        model.train(was_training)
    gram = np.asarray(torch.as_tensor(gram).detach().double().cpu().numpy(), dtype=np.float64)
    losses = np.asarray(torch.as_tensor(losses).detach().double().cpu().numpy(), dtype=np.float64).ravel()
    G = len(groups)
    if gram.shape != (G, G) or losses.shape != (G,):
        raise RuntimeError(f"group_gram returned shapes {gram.shape} and {losses.shape}, expected {(G, G)} and {(G,)}")
    if not (np.all(np.isfinite(gram)) and np.all(np.isfinite(losses))):
        raise FloatingPointError(
            "the probe's Gram matrix or losses are not finite (the model diverged, or the probe data holds "
            "token ids outside the vocabulary); refusing to update the mixture"
        )
    return gram, losses
