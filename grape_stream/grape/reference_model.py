"""DoReMi's reference model: the training model's architecture with a reference run's weights, and its
per-token losses on a training (micro-)batch.

The reference is a deep copy of the module being trained (built once, at the first observed batch: the
same architecture, wrappers and device) with the weights of ``reference`` loaded (a sharded training model,
FSDP1 or FSDP2: the reference's weights sharded the same way and swapped into it for its forward,
grape.sharded_reference): a Composer checkpoint
(``state["model"]``), a ``{"model": state_dict}`` file or a plain ``state_dict``. Key prefixes that differ
only by a wrapper (``model.`` of ComposerGPT, ``module.`` of DDP) are matched; anything else is one error
that says how many keys are missing / unexpected. It runs in eval mode with no gradient, and its per-token
losses are read from the same loss function the controller probes with (``per_sample_loss``), through the
per-token losses that function shows to :func:`~grape_stream.models.loss_watch.watch_losses`.

A checkpoint is code: full pickle runs whatever the file names. So the file is read with
``torch.load(weights_only=True)``, allowing only the few plain types a Composer 0.32 checkpoint holds beside
its tensors (its RNG state's numpy arrays, a TorchVersion, a timedelta; a Lightning ``.ckpt`` and an HF
``pytorch_model.bin`` need none; ``tests/test_reference_trust.py`` makes real ones). Anything else is one
error naming ``reference_trusted``: set it (the user's explicit choice for a file they trust) to load with
full pickle.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib
import logging
import os
import pickle
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
from torch import nn

from grape_stream.errors import ConfigError
from grape_stream.grape.probes import sharded_parameter, unwrap_for_probe
from grape_stream.grape.sharded_reference import ShardedReference
from grape_stream.models.loss_watch import watching_losses

__all__ = ["ReferenceModel", "reference_state_dict"]

log = logging.getLogger(__name__)

_PREFIXES = ("model.", "module.", "_orig_mod.")


def checkpoint_safe_globals() -> list[Any]:
    """The types beside tensors that a Composer 0.32 checkpoint holds (``state["rng"]``'s numpy arrays and
    dtypes, ``metadata``'s TorchVersion, a timedelta): plain data, no constructor that runs code."""
    import numpy as np
    from torch.torch_version import TorchVersion

    multiarray = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")
    dtypes = {type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDG"}
    return [TorchVersion, multiarray._reconstruct, np.ndarray, np.dtype, datetime.timedelta, *dtypes]


def _load_file(path: str, trusted: bool = False) -> Any:
    if os.path.isdir(path):  # a Hugging Face checkpoint folder
        for name in ("model.safetensors", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(path, name)):
                return _load_file(os.path.join(path, name), trusted)
        raise ConfigError(f"algorithm.options.reference: {path} is a folder without model.safetensors")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    if trusted:
        log.info("loading the reference checkpoint %s with full pickle (reference_trusted: true)", path)
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(checkpoint_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _first_line_naming_the_type(str(exc))
        raise ConfigError(f"algorithm.options.reference: {path} holds more than weights ({found}); a checkpoint is "
                          "code (full pickle runs what it names): set algorithm.options.reference_trusted: true "
                          "only if you trust who wrote it") from None


def _first_line_naming_the_type(message: str) -> str:
    for line in message.splitlines():
        if "GLOBAL" in line or "got <" in line or "Unsupported" in line:
            return line.strip().rstrip(".")[:200]
    return "objects torch's weights_only loader refuses"


def reference_state_dict(path: str, want: Mapping[str, torch.Tensor], *,
                         trusted: bool = False) -> dict[str, torch.Tensor]:
    """The reference weights in ``path``, keyed as ``want`` (the copy's own state_dict) is; a pickle is loaded
    with ``weights_only=True`` unless ``trusted``."""
    if not os.path.exists(path):
        raise ConfigError(f"algorithm.options.reference: no reference model file at {path!r}")
    obj = _load_file(path, trusted)
    if isinstance(obj, Mapping) and isinstance(obj.get("state"), Mapping) and "model" in obj["state"]:
        obj = obj["state"]["model"]  # a Composer checkpoint
    elif isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
        obj = obj["model"]
    elif isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]  # a Lightning checkpoint
    if not isinstance(obj, Mapping):
        raise ConfigError(f"algorithm.options.reference: {path} holds no state_dict (got {type(obj).__name__})")
    sd = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    keys = set(want)
    for cand in _candidates(sd):
        if set(cand) == keys:
            return cand
    missing, unexpected = keys - set(sd), set(sd) - keys
    raise ConfigError(f"algorithm.options.reference: {path} does not fit the training model ({len(missing)} "
                      f"weights missing, e.g. {sorted(missing)[:2]}, {len(unexpected)} unexpected, e.g. "
                      f"{sorted(unexpected)[:2]}): it must be a checkpoint of the same architecture")


def _candidates(sd: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``sd`` itself, with one wrapper prefix removed, with one added."""
    out = [sd]
    for p in _PREFIXES:
        if sd and all(k.startswith(p) for k in sd):
            out.append({k[len(p):]: v for k, v in sd.items()})
        out.append({p + k: v for k, v in sd.items()})
    return out


class _TokenCapture:
    """A loss watcher that keeps the per-token losses of the first loss computed under it."""

    def __init__(self) -> None:
        self.tokens: Optional[torch.Tensor] = None

    def watch_tokens(self, token_losses: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        if self.tokens is None:
            self.tokens = token_losses.detach()

    def watch(self, losses: torch.Tensor) -> None:
        pass


class ReferenceModel:
    """The frozen reference: built from the training model on first use, then its per-token losses."""

    def __init__(self, path: str, per_sample_loss: Callable[[nn.Module, Any], torch.Tensor], *,
                 trusted: bool = False) -> None:
        self.path = path
        self.trusted = trusted
        self.per_sample_loss = per_sample_loss
        self.model: Optional[nn.Module] = None
        self.sharded: Optional[ShardedReference] = None

    def _build(self, model: nn.Module) -> nn.Module:
        inner = unwrap_for_probe(model)
        ref = copy.deepcopy(inner)
        for p in ref.parameters():
            p.requires_grad_(False)
            p.grad = None
        ref.load_state_dict(reference_state_dict(self.path, ref.state_dict(), trusted=self.trusted))
        return ref.eval()

    def token_losses(self, model: nn.Module, batch: Any,
                     autocast: Optional[Callable[[], ContextManager[Any]]] = None) -> torch.Tensor:
        """The reference's per-token losses (B, T) on ``batch`` (no gradient, eval mode, training precision)."""
        if self.model is None and self.sharded is None:
            if sharded_parameter(model) is None:
                self.model = self._build(model)
            else:  # FSDP: the reference sharded as the training model is, swapped into it (grape.sharded_reference)
                self.sharded = ShardedReference(model, lambda want: reference_state_dict(self.path, want))
        capture = _TokenCapture()
        with contextlib.ExitStack() as stack:
            reference = self.model if self.sharded is None else stack.enter_context(self.sharded.swapped())
            assert reference is not None, "built above"
            stack.enter_context(torch.no_grad())
            stack.enter_context(watching_losses(capture))
            if autocast is not None:
                stack.enter_context(autocast())
            try:
                self.per_sample_loss(reference, batch)
            except (TypeError, AttributeError, KeyError) as exc:
                raise ConfigError(f"DoReMi could not score the reference model ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}): its forward must take the "
                                  "tokens and return logits (or an output with .logits)") from exc
        if capture.tokens is None:
            raise ConfigError("DoReMi needs per-token losses: the reference's loss did not go through "
                              "grape_stream.models.per_sample_lm_loss_from_logits (pass a per_sample_loss that does)")
        return capture.tokens
