"""What the controller needs of a mixer, and nothing more: its domain names and ``set_weights``.

Any object with ``domain_names`` (or ``domains``), ``probe(k, n, key, ...)`` and ``set_weights(alpha)``
will do; a WeightedStreamingMixer also takes ``consumed=`` (batches the loop has taken), which makes the
batch the new weights apply from deterministic.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

__all__ = ["mixer_domain_names", "push_weights"]


def mixer_domain_names(mixer: Any) -> list[str]:
    names = getattr(mixer, "domain_names", None)
    if names is None:
        domains = getattr(mixer, "domains", None)
        if domains is None:
            raise TypeError(f"{type(mixer).__name__} has neither `domain_names` nor `domains`; "
                            "is it a WeightedStreamingMixer?")
        names = [getattr(d, "name", d) for d in domains]
    names = [str(n) for n in names]
    if not names:
        raise ValueError("the mixer has no domains")
    return names


def _takes_consumed(mixer: Any) -> bool:
    try:
        return "consumed" in inspect.signature(mixer.set_weights).parameters
    except (TypeError, ValueError):
        return False


def push_weights(mixer: Any, alpha: np.ndarray, consumed: int | None) -> int | None:
    """Hand `alpha` to the mixer; the batch index it applies from, when the mixer says.

    "As soon as possible": the mixer applies the weights from the first batch no DataLoader worker can
    have composed yet (batches consumed + the loader's prefetch depth), a deterministic batch when the
    loader is mixer.dataloader() or the caller says how many batches were consumed.
    """
    kwargs: dict[str, Any] = {}
    if consumed is not None and _takes_consumed(mixer):
        kwargs["consumed"] = int(consumed)
    version_at = mixer.set_weights(np.asarray(alpha, dtype=np.float64), **kwargs)
    return int(version_at) if isinstance(version_at, (int, np.integer)) else None
