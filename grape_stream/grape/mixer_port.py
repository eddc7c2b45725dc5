"""The seam between the controller and the mixer: :class:`MixerPort`, what the controller needs of a mixer.

The controller reads the domain names and the current weights, draws probe samples and hands over new
weights; nothing else. :class:`~grape_stream.mixing.mixer.WeightedStreamingMixer` is one (checked by
mypy where the integrations pass it, and at run time by :func:`check_mixer`); a test double or another
data source implements the same five members. ``set_weights(alpha, consumed=n)``: ``consumed`` is how
many batches the loop has taken, when the loop knows (Composer does), which makes the batch the new
weights apply from deterministic; the return value is that batch.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["MixerPort", "check_mixer", "push_weights"]


@runtime_checkable
class MixerPort(Protocol):
    """What a :class:`~grape_stream.grape.controller.GrapeController` needs of the mixer it drives."""

    @property
    def domain_names(self) -> list[str]:
        """The K domains, in the order of the weights."""
        ...

    @property
    def weights(self) -> np.ndarray:
        """The latest weights given (K floats summing to 1)."""
        ...

    def probe(self, domain_index: int, n: int, key: Any, *, rank: int | None = None,
              world_size: int | None = None) -> list[dict[str, Any]]:
        """``n`` samples of domain ``domain_index``, a pure function of the mixer's seed and ``key`` (rank-disjoint
        when ``rank`` and ``world_size`` are given); each a dict with ``tokens``."""
        ...

    def set_weights(self, alpha: Sequence[float] | np.ndarray, at_batch: int | None = None, *,
                    consumed: int | None = None) -> int:
        """Schedule new weights; the index of the first batch they compose."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The mixer's position (saved beside the controller by the trainer integrations)."""
        ...


def check_mixer(mixer: Any) -> list[str]:
    """The mixer's domain names, after checking it has every member of :class:`MixerPort` (else one
    TypeError naming what is missing)."""
    missing = [m for m in ("domain_names", "weights", "probe", "set_weights", "state_dict") if not hasattr(mixer, m)]
    if missing:
        raise TypeError(f"{type(mixer).__name__} is not a mixer the controller can drive: it has no "
                        f"{', '.join(missing)} (see grape_stream.grape.mixer_port.MixerPort; is it a "
                        "WeightedStreamingMixer?)")
    names = [str(n) for n in mixer.domain_names]
    if not names:
        raise ValueError("the mixer has no domains")
    return names


def push_weights(mixer: MixerPort, alpha: np.ndarray, consumed: int | None) -> int:
    """Hand ``alpha`` to the mixer "as soon as possible"; the batch index it applies from.

    The mixer applies the weights from the first batch no DataLoader worker can have composed yet (batches
    consumed + the loader's prefetch depth), a deterministic batch when the loader is ``mixer.dataloader()``
    or the caller says how many batches were consumed.
    """
    alpha = np.asarray(alpha, dtype=np.float64)
    applied = mixer.set_weights(alpha) if consumed is None else mixer.set_weights(alpha, consumed=int(consumed))
    return int(applied)
