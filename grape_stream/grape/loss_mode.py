"""The training-loss mode: what the loss-driven methods (DoReMi, ODM, ADO) read instead of a probe.

The signal source ``Signal.training_losses`` (grape.signal), built by the controller for a method whose class says
so. On every training step the trainer wraps
each (micro-)batch's forward + backward in :meth:`LossMode.begin` / :meth:`LossMode.end` (or
:meth:`LossMode.observe`); meanwhile the per-sample loss vector the training loss is made of passes through
:func:`~grape_stream.models.loss_watch.watch_losses` and is summed per domain (``batch["domain"]``), detached,
on its own device: loss sum and sample count, and for a method with ``needs_reference`` (DoReMi) the
per-token excess loss max(l_proxy - l_ref, 0) summed over counted tokens and the token count, the reference's
per-token losses from a no-grad forward of the reference model on the same micro-batch
(grape.reference_model). :meth:`LossMode.after_step` folds the step's sums into the interval's (one
all-reduce under torch.distributed: every rank then holds identical numbers); at a due step
:meth:`LossMode.update` hands the interval's per-domain means to ``reweighter.update_from_losses``.

Cost: a few index_adds per micro-batch on K-long vectors and no host sync until an update or a checkpoint
reads the totals (plus, for DoReMi, the reference forward the method itself needs). The interval's sums are
in the controller's state_dict, so a killed run resumes onto the same trajectory.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Mapping, Optional

import numpy as np
import torch
from torch import nn

from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.reference_model import ReferenceModel
from grape_stream.grape.reweighting import DomainLosses
from grape_stream.grape.signal import SignalParts, UpdateCall
from grape_stream.models.loss_watch import watching_losses
from grape_stream.world import dist_active

__all__ = ["LossMode"]

#: rows of the sums: loss sum, samples, excess-loss sum (over tokens), tokens
_ROWS = 4
_WHERE = "docs/reweighting.md, 'Loss-driven methods'"


class _Window:
    """The loss watcher of one (micro-)batch: adds its per-domain sums into the step's."""

    def __init__(self, mode: "LossMode", domains: torch.Tensor, reference: Optional[torch.Tensor]) -> None:
        self.mode, self.domains, self.reference = mode, domains, reference
        self.seen = False
        self._excess: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def watch_tokens(self, token_losses: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        if self.seen or self.reference is None:
            return
        ce = token_losses.detach().double()
        ref = self.reference.to(ce.device).double()
        if ref.shape != ce.shape:
            raise ConfigError(f"DoReMi: the reference's per-token losses have shape {tuple(ref.shape)} but the "
                              f"training loss's have {tuple(ce.shape)}: the two models must score the same tokens")
        m = torch.ones_like(ce) if mask is None else mask.detach().to(ce.device).double()
        self._excess = (((ce - ref).clamp_min(0.0) * m).sum(dim=1), m.sum(dim=1))

    def watch(self, losses: torch.Tensor) -> None:
        if self.seen:  # a second loss vector in the same forward (an auxiliary loss) is not the training loss
            return
        if losses.dim() != 1 or losses.shape[0] != self.domains.shape[0]:
            raise ConfigError(f"the training loss's per-sample vector has shape {tuple(losses.shape)} but the batch "
                              f"has {self.domains.shape[0]} samples: a loss-driven method needs one loss per sample")
        self.seen = True
        sums = self.mode._step_sums_on(losses.device)
        d = self.domains.to(losses.device, torch.long)
        sums[0].index_add_(0, d, losses.detach().double())
        sums[1].index_add_(0, d, torch.ones_like(d, dtype=torch.float64))
        if self.reference is not None:
            if self._excess is None:
                raise ConfigError("DoReMi needs per-token losses: the training loss did not go through "
                                  "grape_stream.models.per_sample_lm_loss_from_logits")
            sums[2].index_add_(0, d, self._excess[0])
            sums[3].index_add_(0, d, self._excess[1])


class LossMode:
    """The per-domain training-loss sums of a loss-driven method (``Signal.training_losses``)."""

    kind: ClassVar[Signal] = Signal.training_losses
    #: the controller's state_dict entry (the name it has always had: older checkpoints load)
    state_key: ClassVar[Optional[str]] = "training_losses"

    def __init__(self, parts: SignalParts) -> None:
        reweighter = parts.reweighter
        if parts.config.alignments == "steps":
            raise ConfigError(f"alignments: steps does not apply to method {reweighter.method!r}: it reads the "
                              f"training losses, not alignments; leave alignments at 'probe' ({_WHERE})")
        self.reweighter = reweighter
        self.num_domains = len(parts.domain_names)
        self.reference: Optional[ReferenceModel] = None
        if reweighter.needs_reference:
            path = reweighter.options.get("reference")
            if not path:
                raise ConfigError(f"method {reweighter.method!r} needs algorithm.options.reference: the reference "
                                  "model's weights (a Composer checkpoint or a state_dict file)")
            if not os.path.exists(str(path)):
                raise ConfigError(f"algorithm.options.reference: no reference model file at {path!r}")
            self.reference = ReferenceModel(str(path), parts.per_sample_loss,
                                            trusted=bool(reweighter.options.get("reference_trusted")))
        #: the interval's sums (rows: loss, samples, excess, tokens), summed over ranks
        self.totals = torch.zeros(_ROWS, self.num_domains, dtype=torch.float64)
        #: optimizer steps folded into ``totals``
        self.steps = 0
        self._step_sums: Optional[torch.Tensor] = None
        self._stack: Optional[contextlib.ExitStack] = None
        self._window: Optional[_Window] = None

    def _step_sums_on(self, device: torch.device) -> torch.Tensor:
        if self._step_sums is None:
            self._step_sums = torch.zeros(_ROWS, self.num_domains, dtype=torch.float64, device=device)
        elif self._step_sums.device != device:
            self._step_sums = self._step_sums.to(device)
        return self._step_sums

    # ------------------------------------------------------------------------------------------ steps
    def observed(self, step: int) -> bool:
        """Every optimizer step is watched (1-based)."""
        return step > 0

    def begin(self, model: nn.Module, step: int, batch: Any, domains: Optional[torch.Tensor] = None, *,
              optimizer: Any = None, autocast: Optional[Callable[[], ContextManager[Any]]] = None) -> None:
        """Watch the training loss of one (micro-)batch of step ``step`` (every step is watched)."""
        if domains is None:
            if not isinstance(batch, Mapping) or "domain" not in batch:
                raise ConfigError(f"method {self.reweighter.method!r} reads each domain's training loss: the "
                                  "training batch must carry the mixer's 'domain' column (or pass domains=)")
            domains = batch["domain"]
        domains = torch.as_tensor(domains)
        self.end(check=False)  # a micro-batch whose end was never signalled (an exception in the trainer) is dropped
        reference = None if self.reference is None else self.reference.token_losses(model, batch, autocast)
        self._window = _Window(self, domains, reference)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(watching_losses(self._window))

    def end(self, check: bool = True) -> None:
        """The forward (+ backward) of the micro-batch begun last has run (``check=False``: it was cut short by
        an exception, which is the error to report, not that no loss was seen)."""
        stack, window = self._stack, self._window
        self._stack = self._window = None
        if stack is not None:
            stack.close()
        if check and window is not None and not window.seen:
            raise ConfigError(f"method {self.reweighter.method!r} saw no per-sample training loss: compute the "
                              "training loss with grape_stream.models.per_sample_lm_loss (or pass per-sample losses "
                              f"through grape_stream.models.loss_watch.watch_losses) inside observe() ({_WHERE})")

    @contextlib.contextmanager
    def observe(self, model: nn.Module, step: int, batch: Any, domains: Optional[torch.Tensor] = None, *,
                optimizer: Any = None, autocast: Optional[Callable[[], ContextManager[Any]]] = None) -> Iterator[None]:
        self.begin(model, step, batch, domains, optimizer=optimizer, autocast=autocast)
        try:
            yield
        except BaseException:
            self.end(check=False)
            raise
        self.end()

    @property
    def pending(self) -> bool:
        """Whether a step's sums wait for :meth:`after_step`."""
        return self._step_sums is not None

    def after_step(self) -> None:
        """After an optimizer step (every rank): fold the step's sums into the interval's, summed over ranks."""
        s, self._step_sums = self._step_sums, None
        if s is None:
            return
        if dist_active():
            torch.distributed.all_reduce(s)
        self.totals = self.totals.to(s.device) + s
        self.steps += 1

    # ------------------------------------------------------------------------------------------ the update
    def domain_losses(self) -> DomainLosses:
        """The interval's per-domain means (a host sync: the totals come to the CPU here)."""
        t = self.totals.cpu().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            loss = np.where(t[1] > 0, t[0] / t[1], np.nan)
            excess = np.where(t[3] > 0, t[2] / t[3], np.nan) if self.reference is not None else None
        return DomainLosses(loss=loss, samples=t[1].copy(), steps=max(self.steps, 1), excess=excess)

    def meta(self) -> dict[str, Any]:
        return {}

    def update(self, call: UpdateCall, rec: dict[str, Any], seconds: dict[str, float]) -> None:
        """The reweighter's update from the interval's losses; fills the update record ``rec``."""
        step, lr = call.step, call.lr
        t0 = time.perf_counter()
        if self.steps == 0 or float(self.totals[1].sum()) == 0.0:
            raise ConfigError(f"method {self.reweighter.method!r} saw no training losses before the update at step "
                              f"{step}: wrap each (micro-)batch's forward + backward in controller.observe(model, "
                              f"step, batch) (the integrations do) ({_WHERE})")
        losses = self.domain_losses()
        rw = self.reweighter
        rw.update_from_losses(losses, lr, step=step)
        last = rw.history[-1] if rw.history else {}
        rec.update(domain_loss=_json(losses.loss), domain_samples=[int(v) for v in losses.samples],
                   loss_steps=int(losses.steps))
        if losses.excess is not None:
            rec["domain_excess"] = _json(losses.excess)
        for key, value in last.items():
            if key not in _BASE_RECORD and key not in rec:
                rec[key] = value  # a method's own entries (DoReMi's average_alpha)
        if last.get("skipped"):
            rec["skipped"] = last["skipped"]
        self.totals = torch.zeros(_ROWS, self.num_domains, dtype=torch.float64)
        self.steps = 0
        seconds["reweight"] = time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"totals": self.totals.cpu().clone(), "steps": int(self.steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        totals = torch.as_tensor(state["totals"], dtype=torch.float64).cpu().clone()
        if tuple(totals.shape) != (_ROWS, self.num_domains):
            raise ValueError(f"the checkpoint's training-loss sums have shape {tuple(totals.shape)}, expected "
                             f"({_ROWS}, {self.num_domains})")
        self.totals, self.steps = totals, int(state["steps"])


#: the reweighter record's own keys (the controller's record has its own alpha, z, step, ...)
_BASE_RECORD = frozenset({"update", "step", "lr", "alpha", "z", "task_losses", "a", "b", "eta_alpha", "eta_z",
                          "skipped"})


def _json(v: np.ndarray) -> list[Optional[float]]:
    return [float(x) if np.isfinite(x) else None for x in np.asarray(v, dtype=np.float64)]
