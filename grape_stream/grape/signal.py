"""Where a reweighting update's numbers come from: the one protocol a GrapeController drives.

A run's updates read one of a few signals (:class:`~grape_stream.config.choices.Signal`, resolved from a config by
:func:`~grape_stream.grape.algorithm_config.signal_source`): the probe Gram (grape.probe_signal), the training
steps' in-step alignments (grape.instep_mode), R&B's per-domain Gram of the training steps (grape.instep_gram),
each domain's training losses (grape.loss_mode), or nothing (a method whose weights never move). Each is one
:class:`SignalSource`: it may watch the training steps (``observe`` / ``begin`` ... ``end`` around each
(micro-)batch's forward + backward, ``after_step`` after each optimizer step), it produces an update
(``update``: the reweighter moved, the record filled), and it carries its own checkpoint state. The controller
holds one and calls it without asking which it is; the trainer integrations read ``kind`` and ``observed(step)``.

A source is built from :class:`SignalParts` -- the explicit things it reads (the config, the reweighter, the
per-sample loss, the names, the probe stage) -- never from the controller itself. Replaying a recorded
trajectory (``method: schedule``) is not a source: it has no reweighter and sets the weights at every step the
trajectory has (grape.replay); the controller runs it beside a source that watches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn

from grape_stream.config import AlgorithmConfig
from grape_stream.config.choices import Signal
from grape_stream.grape.probe_stage import PerSampleLoss, ProbeStage
from grape_stream.grape.reweighting import Reweighter

__all__ = ["Autocast", "SignalParts", "SignalSource", "UpdateCall"]

#: the training precision context a probe's forward runs under (None: none)
Autocast = Callable[[], ContextManager[Any]]


@dataclass(frozen=True)
class SignalParts:
    """What a signal source is built from: the controller builds this once and keeps no back-reference in it."""

    config: AlgorithmConfig
    #: the method's reweighter (every source but replay has one)
    reweighter: Reweighter
    #: the options the reweighter was built with (the in-step mode refuses some)
    reweighter_options: Mapping[str, Any]
    domain_names: Sequence[str]
    task_names: Sequence[str]
    #: ``f(model, batch) -> Tensor[B]``: what the probes and the in-step engine differentiate
    per_sample_loss: PerSampleLoss
    #: draws the probe batches (domains and tasks) and runs the fused probe (grape.probe_stage)
    probe: ProbeStage


@dataclass(frozen=True)
class UpdateCall:
    """One due update as the controller hands it to its source."""

    model: nn.Module
    #: the optimizer step just taken (1-based)
    step: int
    #: the learning rate the next step uses
    lr: float
    update_alpha: bool
    update_z: bool
    #: the training optimizer (read, never changed: Adam geometry, the in-step task side's first moment)
    optimizer: Any = None
    autocast: Optional[Autocast] = None


class SignalSource(Protocol):
    """What the controller needs from where an update's numbers come from."""

    @property
    def kind(self) -> Signal:
        """Which signal this is (a class attribute of each implementation)."""
        ...

    @property
    def state_key(self) -> Optional[str]:
        """The controller's state_dict entry for this source's state (None: it keeps none)."""
        ...

    @property
    def pending(self) -> bool:
        """Whether a watched step's sums wait for :meth:`after_step`."""
        ...

    def observed(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based: the step being trained) is watched."""
        ...

    def begin(self, model: nn.Module, step: int, batch: Any, domains: Optional[torch.Tensor] = None, *,
              optimizer: Any = None, autocast: Optional[Autocast] = None) -> None:
        """Before the forward of one (micro-)batch of step ``step`` (a no-op on steps not watched)."""
        ...

    def end(self) -> None:
        """After the backward of the (micro-)batch :meth:`begin` began."""
        ...

    def observe(self, model: nn.Module, step: int, batch: Any, domains: Optional[torch.Tensor] = None, *,
                optimizer: Any = None, autocast: Optional[Autocast] = None) -> ContextManager[Any]:
        """:meth:`begin` ... :meth:`end` around one (micro-)batch's forward + backward."""
        ...

    def after_step(self) -> None:
        """After every optimizer step (every rank): fold a watched step's sums in."""
        ...

    def update(self, call: UpdateCall, rec: dict[str, Any], seconds: dict[str, float]) -> None:
        """Move the reweighter from this source's numbers; fill the update record ``rec`` and the timings."""
        ...

    def meta(self) -> dict[str, Any]:
        """Entries of the trajectory's meta line this source adds."""
        ...

    def state_dict(self) -> Optional[dict[str, Any]]:
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ...
