"""The controller's probe options beyond the paper: the optimizer's geometry and the probe size rule.

Kept apart from the controller so that its default path (the paper: SGD inner products, fixed probe
size) stays exactly as it was; :class:`ProbeOptions` does nothing unless an option is set. The
reweighter-side options (cosine alignments, Gram / alpha EMA) live in grape.reweighting.noise.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from grape_stream.grape.alignment import probe_gram
from grape_stream.grape.geometry import GEOMETRIES, adam_preconditioner
from grape_stream.grape.probe_size import (
    DEFAULT_PROBE_BOUNDS,
    ProbeSizer,
    combine_halves,
    relative_standard_error,
    split_halves,
)

__all__ = ["ProbeOptions"]

log = logging.getLogger(__name__)


class ProbeOptions:
    """``geometry`` ("sgd" | "adam") and ``probe_rse`` (None | target relative standard error) of a controller.

    ``probe_batch_bounds``: the smallest and largest per-group probe batch the size rule may choose.
    """

    def __init__(self, geometry: str, probe_rse: float | None, probe_batch_bounds: Sequence[int] | None,
                 domain_batch: int, task_batch: int) -> None:
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry must be 'sgd' (paper) or 'adam' (AdamW's preconditioner), got {geometry!r}")
        self.geometry = geometry
        bounds = tuple(probe_batch_bounds) if probe_batch_bounds is not None else DEFAULT_PROBE_BOUNDS
        self.sizer = None if probe_rse is None else ProbeSizer(probe_rse, domain_batch, task_batch, bounds)
        self._said: str | None = None

    def meta(self) -> dict[str, Any]:
        """What a trajectory's meta line records (only the non-default options)."""
        out: dict[str, Any] = {}
        if self.geometry != "sgd":
            out["geometry"] = self.geometry
        if self.sizer is not None:
            out.update(probe_rse=self.sizer.target, probe_batch_bounds=list(self.sizer.bounds))
        return out

    def sizes(self, domain_batch: int, task_batch: int) -> tuple[int, int]:
        """The per-group probe batch sizes of the next probe."""
        if self.sizer is None:
            return domain_batch, task_batch
        return self.sizer.domain_batch, self.sizer.task_batch

    def gram(self, model: nn.Module, per_sample_loss: Callable[[nn.Module, Any], torch.Tensor],
             groups: list[dict[str, torch.Tensor]], *, optimizer: Any, reweighter: Any, num_domains: int,
             rec: dict[str, Any], **probe_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
        """probe_gram with the options applied; what they did goes into the update record `rec`."""
        pre = None
        if self.geometry == "adam":
            pre, used = adam_preconditioner(optimizer, model)
            rec["geometry"] = used
            if used != self._said:
                self._said = used
                log.info("GRAPE alignment geometry: %s", used)
        if self.sizer is None:
            return probe_gram(model, per_sample_loss, groups, precondition=pre, **probe_kwargs)
        half_gram, half_losses = probe_gram(model, per_sample_loss, split_halves(groups), precondition=pre,
                                            **probe_kwargs)
        gram, losses = combine_halves(half_gram, half_losses)
        k = num_domains
        _, b = reweighter.preview(gram, losses[k:])
        _, b1 = reweighter.preview(half_gram[0::2, 0::2], half_losses[0::2][k:])
        _, b2 = reweighter.preview(half_gram[1::2, 1::2], half_losses[1::2][k:])
        rse, noise, signal = relative_standard_error(np.asarray(b), np.asarray(b1), np.asarray(b2))
        rec["probe_batch"] = [self.sizer.domain_batch, self.sizer.task_batch]
        rec["probe_rse"] = rse if np.isfinite(rse) else None  # None: no signal above the noise
        rec["probe_noise_var"], rec["probe_signal_var"] = noise, signal
        rec["next_probe_batch"] = list(self.sizer.next_sizes(rse))
        return gram, losses

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.sizer is None else self.sizer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if self.sizer is not None and state is not None:
            self.sizer.load_state_dict(state)

