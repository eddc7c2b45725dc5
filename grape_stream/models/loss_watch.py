"""Who reads the per-sample loss vector of a training forward: the in-step alignments' hook point.

In-step alignments (``grape/gram/instep.py``) need each sample's weight in the objective a training step
backpropagates (a mean, Composer's micro-batch fraction, a gradient scaler's factor ...). That weight is
exactly the gradient the per-sample loss vector receives, so the per-sample losses grape_stream computes
(``models.per_sample_lm_loss_from_logits``, used by ComposerGPT's training loss and the plain loop) pass
through :func:`watch_losses`, which hands them to the watcher installed with :func:`watching_losses` (if
any). Outside an observed step it returns the tensor untouched. The loss-driven methods' training-loss mode
(``grape/loss_mode.py``) watches the same vectors, and DoReMi's excess loss also needs the per-token losses
behind them: a watcher with a ``watch_tokens(token_losses, mask)`` method receives those first. Level 0:
imports nothing from grape_stream.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional, Protocol

from torch import Tensor

__all__ = ["LossWatcher", "watch_losses", "watching_losses"]


class LossWatcher(Protocol):
    def watch(self, losses: Tensor) -> None:
        """Called with every per-sample loss vector (B,) computed while the watcher is installed."""
        ...


_WATCHER: contextvars.ContextVar[Optional[LossWatcher]] = contextvars.ContextVar("grape_stream_loss_watcher",
                                                                                 default=None)


@contextlib.contextmanager
def watching_losses(watcher: LossWatcher) -> Iterator[None]:
    token = _WATCHER.set(watcher)
    try:
        yield
    finally:
        _WATCHER.reset(token)


def watch_losses(losses: Tensor, token_losses: Optional[Tensor] = None, token_mask: Optional[Tensor] = None) -> Tensor:
    """Show a per-sample loss vector to the installed watcher (if any); returns it unchanged.

    ``token_losses`` (B, T) / ``token_mask`` (B, T or None: every token counts) are the per-token losses the
    vector averages; a watcher that has ``watch_tokens`` sees them before the vector."""
    watcher = _WATCHER.get()
    if watcher is not None:
        watch_tokens = getattr(watcher, "watch_tokens", None)
        if watch_tokens is not None and token_losses is not None:
            watch_tokens(token_losses, token_mask)
        watcher.watch(losses)
    return losses
