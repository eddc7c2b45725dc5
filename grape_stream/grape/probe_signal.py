"""The signal sources that watch no training step: the probe (the paper's path) and none.

:class:`ProbeSignal` (``Signal.probe``): at a due step the probe stage (grape.probe_stage: K domain + N task
probe batches, one fused backward, the (K+N) x (K+N) Gram averaged over the ranks, so every rank feeds identical
numbers to the deterministic reweighter), then ``reweighter.update``. :class:`QuietSignal`: a method whose weights
never move (``Signal.none``: uniform, static) and a replayed trajectory (``Signal.replay``, which the controller
runs itself: grape.signal says why) read nothing. Both implement :class:`~grape_stream.grape.signal.SignalSource`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, ClassVar, ContextManager, Mapping, Optional

import torch
from torch import nn

from grape_stream.config.choices import Signal
from grape_stream.grape.signal import Autocast, SignalParts, UpdateCall
from grape_stream.world import collective_rank_size

__all__ = ["ProbeSignal", "QuietSignal"]

log = logging.getLogger(__name__)


class _NoSteps:
    """The watching half of a source that watches no training step: every call a no-op."""

    state_key: ClassVar[Optional[str]] = None
    pending: ClassVar[bool] = False

    def observed(self, step: int) -> bool:
        return False

    def begin(self, model: nn.Module, step: int, batch: Any, domains: Optional[torch.Tensor] = None, *,
              optimizer: Any = None, autocast: Optional[Autocast] = None) -> None:
        return None

    def end(self) -> None:
        return None

    def observe(self, model: nn.Module, step: int, batch: Any, domains: Optional[torch.Tensor] = None, *,
                optimizer: Any = None, autocast: Optional[Autocast] = None) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def after_step(self) -> None:
        return None

    def meta(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> Optional[dict[str, Any]]:
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


class QuietSignal(_NoSteps):
    """Nothing to read: the weights never move (``Signal.none``) or a replay sets them (``Signal.replay``)."""

    def __init__(self, kind: Signal) -> None:
        self.kind = kind

    def update(self, call: UpdateCall, rec: dict[str, Any], seconds: dict[str, float]) -> None:
        return None


class ProbeSignal(_NoSteps):
    """The probe stage, then the reweighter (``Signal.probe``)."""

    kind: ClassVar[Signal] = Signal.probe

    def __init__(self, parts: SignalParts) -> None:
        self.parts = parts

    def update(self, call: UpdateCall, rec: dict[str, Any], seconds: dict[str, float]) -> None:
        """Probe -> Gram -> reweighter; fill ``rec`` with what each did."""
        rw, step = self.parts.reweighter, call.step
        rank, world = collective_rank_size()
        # Sharded: every rank probed different samples; the Gram and losses are averaged over the ranks
        # (one all-reduce), so every rank feeds identical numbers to the reweighter.
        gram, losses = self.parts.probe.run(call.model, step, rank=rank, world=world, reweighter=rw,
                                            autocast=call.autocast, optimizer=call.optimizer, rec=rec,
                                            seconds=seconds)
        t = time.perf_counter()
        k = len(self.parts.domain_names)
        rw.update(gram, losses[k:], float(call.lr), step=step, update_alpha=call.update_alpha,
                  update_z=call.update_z)
        seconds["reweight"] = time.perf_counter() - t
        last = rw.history[-1] if rw.history else {}
        if last.get("b") is not None:
            rec["domain_alignment"] = last["b"]
        if last.get("a") is not None:
            rec["task_alignment"] = last["a"]
        if last.get("skipped"):
            rec["skipped"] = last["skipped"]
            log.warning("GRAPE update at step %d skipped: %s", step, last["skipped"])
