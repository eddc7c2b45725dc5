"""DoReMi (Xie et al. 2023, "DoReMi: Optimizing Data Mixtures Speeds Up Language Model Pretraining",
Algorithm 1): domain weights from the proxy model's excess loss over a reference model, online.

At each update, with lambda_k the per-token excess loss max(l_proxy - l_ref, 0) averaged over the tokens of
domain k's samples in the training steps since the last update (grape.loss_mode computes it on the batches
the model trains on),

    alpha'  = softmax(log alpha_prev + eta * lambda)
    alpha   = (1 - c) * alpha' + c / K

(eta: ``eta``, paper 1.0; c: ``smoothing``, paper 1e-3). A domain with no token in the interval keeps its last
lambda (0 before its first), as the authors' code does: sampling from alpha, a small domain often has no
sample in an interval, and "no evidence" must not read as "no excess loss".
The paper's output, the domain weights of the final run, is the average of alpha over the updates: kept in
the method's state and written into every update record as ``average_alpha``
(:func:`average_alpha_from_trajectory` reads the last one; docs/reweighting.md, "DoReMi", says how to train
the final static run from it).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.from_losses import DomainLosses
from grape_stream.grape.reweighting.options import ReweighterOptions, real
from grape_stream.grape.reweighting.registry import register

__all__ = ["DoremiOptions", "DoremiReweighter", "average_alpha_from_trajectory", "doremi_step"]


@dataclass
class DoremiOptions(ReweighterOptions):
    reference: Optional[str] = None  # the reference model's weights: a Composer checkpoint .pt or a state_dict file
    eta: float = 1.0  # the step size of the multiplicative update (paper: 1.0)
    smoothing: float = 1e-3  # c: alpha = (1 - c) * softmax(...) + c * uniform (paper: 1e-3)
    reference_trusted: bool = False  # load `reference` with full pickle (it runs code): only for a file you trust

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        out = super().resolve(num_domains, num_tasks)
        ref = self.reference
        if ref is not None and (not isinstance(ref, (str, os.PathLike)) or not str(ref)):
            raise ConfigError(f"reference must be the path of the reference model's weights, got {self.reference!r}")
        eta, c = real(self.eta, "eta"), real(self.smoothing, "smoothing")
        if not (math.isfinite(eta) and eta > 0):
            raise ConfigError(f"eta must be a positive number (paper: 1.0), got {self.eta!r}")
        if not (0.0 <= c <= 1.0):
            raise ConfigError(f"smoothing must lie in [0, 1] (paper: 1e-3), got {self.smoothing!r}")
        if not isinstance(self.reference_trusted, bool):
            raise ConfigError(f"reference_trusted must be true or false, got {self.reference_trusted!r}")
        out.update(reference=None if self.reference is None else os.fspath(self.reference), eta=eta, smoothing=c,
                   reference_trusted=self.reference_trusted)
        return out


def doremi_step(alpha_prev: np.ndarray, excess: np.ndarray, eta: float, smoothing: float) -> np.ndarray:
    """Algorithm 1's weight update: the new alpha from the previous one and the per-domain excess losses
    ``excess`` (lambda, finite: the caller fills a domain without tokens)."""
    lam = np.asarray(excess, dtype=np.float64)
    with np.errstate(divide="ignore"):
        logits = np.log(np.asarray(alpha_prev, dtype=np.float64)) + eta * lam
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return (1.0 - smoothing) * p + smoothing / len(p)


@register
class DoremiReweighter(Reweighter):
    method = "doremi"
    description = "DoReMi (Xie et al. 2023): alpha from the excess training loss over a reference model (reference=...)"
    Options = DoremiOptions
    signal = Signal.training_losses
    needs_reference = True
    moves_alpha = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._alpha_sum = np.zeros(self.num_domains)
        self._alpha_count = 0
        self._last_excess = np.zeros(self.num_domains)

    def _loss_step(self, losses: DomainLosses, lr: float | None,
                   index: int) -> tuple[np.ndarray, np.ndarray | None, float]:
        assert losses.excess is not None, "update_from_losses checks it"
        o = self._options
        excess = np.asarray(losses.excess, dtype=np.float64)
        lam = np.where(np.isfinite(excess), excess, self._last_excess)
        alpha = doremi_step(self._alpha, lam, o["eta"], o["smoothing"])
        self._last_excess = lam
        self._alpha_sum = self._alpha_sum + alpha
        self._alpha_count += 1
        return np.log(alpha), lam, float(o["eta"])

    @property
    def average_alpha(self) -> np.ndarray:
        """The mean of alpha over the updates so far (the paper's output; the initial weights before any)."""
        return self._alpha_sum / self._alpha_count if self._alpha_count else self.alpha

    def _record_extra(self) -> dict[str, Any]:
        return {"average_alpha": self.average_alpha.tolist()}

    def _method_state(self) -> Optional[dict[str, Any]]:
        return {"alpha_sum": self._alpha_sum.tolist(), "alpha_count": self._alpha_count,
                "last_excess": self._last_excess.tolist()}

    def _load_method_state(self, state: Optional[Mapping[str, Any]]) -> None:
        zeros = np.zeros(self.num_domains)
        self._alpha_sum = zeros if state is None else np.asarray(state["alpha_sum"], np.float64)
        self._alpha_count = 0 if state is None else int(state["alpha_count"])
        self._last_excess = zeros.copy() if state is None else np.asarray(state["last_excess"], np.float64)


def average_alpha_from_trajectory(path: str | os.PathLike[str]) -> list[float]:
    """The ``average_alpha`` of the last DoReMi update in a trajectory JSONL: the weights of the final run
    (``algorithm.method=static algorithm.options.weights=[...]``)."""
    found: Optional[list[float]] = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "update" and rec.get("average_alpha") is not None:
                found = [float(v) for v in rec["average_alpha"]]
    if found is None:
        raise ConfigError(f"{path} holds no DoReMi update (no 'average_alpha' in its records)")
    return found
