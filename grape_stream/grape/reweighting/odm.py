"""ODM (Albalak, Pan, Raffel, Wang 2023, "Efficient Online Data Mixing For Language Model Pre-Training").

An EXP3 multi-armed bandit over the K domains whose reward is each domain's training loss: a domain the
model still finds hard is sampled more. No probe: each update reads the per-domain mean training loss of
the batches trained on since the last one (grape.reweighting.from_losses). With ``alpha_every=1`` an update
is one step of the paper's Algorithm 1; docs/reweighting.md ("ODM") has the equations as implemented and
where a choice had to be made. :func:`odm_step` is the update as a pure function; :class:`OdmReweighter`
holds the bandit's state (the reward estimates and the step count) and calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.reweighting.base import Reweighter
from grape_stream.grape.reweighting.from_losses import DomainLosses
from grape_stream.grape.reweighting.options import ReweighterOptions, real
from grape_stream.grape.reweighting.registry import register

__all__ = ["OdmOptions", "OdmReweighter", "OdmStep", "odm_epsilon", "odm_policy", "odm_step"]


def odm_epsilon(t: int, num_domains: int) -> float:
    """The exploration rate eps_t = min(1/K, sqrt(ln K / (K t))) (eps_0 = 1/K); also EXP3's learning rate."""
    k = int(num_domains)
    if t <= 0 or k == 1:
        return 1.0 / k
    return min(1.0 / k, math.sqrt(math.log(k) / (k * t)))


def odm_policy(rewards: np.ndarray, eps_prev: float, eps: float) -> np.ndarray:
    """pi_i = (1 - K eps) exp(eps_prev R_i) / sum_j exp(eps_prev R_j) + eps (the softmax mixed with uniform)."""
    r = np.asarray(rewards, dtype=np.float64)
    k = r.shape[0]
    e = np.exp(eps_prev * r - np.max(eps_prev * r))  # shifted: the same softmax, no overflow
    return (1.0 - k * eps) * (e / e.sum()) + eps


@dataclass(frozen=True)
class OdmStep:
    """One ODM update: the new policy, the reward estimates after it, the steps seen and eps_{t-1} used."""

    policy: np.ndarray
    rewards: np.ndarray
    steps_seen: int
    learning_rate: float


def odm_step(rewards: np.ndarray, steps_seen: int, policy: np.ndarray, losses: DomainLosses,
             smoothing: float) -> OdmStep:
    """One ODM update, a pure function.

    ``rewards``: the estimates R_hat before it; ``steps_seen``: the optimizer steps before the interval;
    ``policy``: the sampling distribution the interval's batches were drawn from (the current alpha).
    A domain seen in the interval gets R_i <- smoothing * R_i + (1 - smoothing) * L_i / pi_i (its mean
    training loss, importance-weighted by the probability it was drawn with); the others keep theirs
    (EXP3 updates only the arms played). The step count moves by ``losses.steps`` to t, and the policy for
    step t+1 is (1 - K eps_{t+1}) softmax(eps_t R) + eps_{t+1} (:func:`odm_policy`): with one step per
    update this is the paper's Algorithm 1 step for step.
    """
    r = np.array(rewards, dtype=np.float64)
    seen = losses.seen
    pi = np.asarray(policy, dtype=np.float64)
    loss = np.asarray(losses.loss, dtype=np.float64)
    r[seen] = smoothing * r[seen] + (1.0 - smoothing) * loss[seen] / pi[seen]
    t = int(steps_seen) + int(losses.steps)
    k = r.shape[0]
    eps_prev, eps_next = odm_epsilon(t, k), odm_epsilon(t + 1, k)
    return OdmStep(odm_policy(r, eps_prev, eps_next), r, t, eps_prev)


@dataclass
class OdmOptions(ReweighterOptions):
    """ODM's one option: the smoothing of its reward estimates (the paper's moving average)."""

    smoothing: float = 0.9  # R_i <- smoothing * R_i + (1 - smoothing) * L_i / pi_i (0: the newest reward only)

    def resolve(self, num_domains: int, num_tasks: int) -> dict[str, Any]:
        value = real(self.smoothing, "smoothing")
        if not (math.isfinite(value) and 0.0 <= value < 1.0):
            raise ConfigError(f"smoothing must lie in [0, 1) (the weight of the old reward estimate), got {value!r}")
        out = super().resolve(num_domains, num_tasks)
        out["smoothing"] = value
        return out


@register
class OdmReweighter(Reweighter):
    method = "odm"
    description = "ODM (Albalak et al. 2023): EXP3 bandit over domains, reward = training loss (no probe)"
    Options = OdmOptions
    moves_alpha = True
    signal = Signal.training_losses
    _rewards: np.ndarray
    _steps_seen: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load_method_state(None)

    def _loss_step(self, losses: DomainLosses, lr: float | None,
                   index: int) -> tuple[np.ndarray, np.ndarray | None, float]:
        out = odm_step(self._rewards, self._steps_seen, self._alpha, losses, self._options["smoothing"])
        self._rewards, self._steps_seen = out.rewards, out.steps_seen
        return np.log(out.policy), out.rewards.copy(), out.learning_rate

    def _method_state(self) -> Optional[dict[str, Any]]:
        return {"rewards": self._rewards.tolist(), "steps_seen": self._steps_seen}

    def _load_method_state(self, state: Optional[Mapping[str, Any]]) -> None:
        if state is None:
            self._rewards = np.zeros(self.num_domains, dtype=np.float64)
            self._steps_seen = 0
            return
        rewards = np.array(state["rewards"], dtype=np.float64)
        if rewards.shape != (self.num_domains,) or not np.all(np.isfinite(rewards)):
            raise ValueError(f"state_dict['method_state']['rewards'] must hold {self.num_domains} finite numbers")
        self._rewards, self._steps_seen = rewards, int(state["steps_seen"])
