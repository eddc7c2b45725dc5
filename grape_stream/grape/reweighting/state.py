"""JSON forms of the reweighter's numbers, exact both ways.

Python's float repr round-trips exactly through JSON, so plain lists of floats suffice; the only
values JSON cannot hold are non-finite ones, which get an explicit encoding here.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["STATE_FORMAT", "json_floats", "log_weights_from_json", "log_weights_to_json"]

STATE_FORMAT = "grape_stream.reweighter/1"


def json_floats(values: np.ndarray | None) -> list[float | None] | None:
    """A JSON-safe list: floats round-trip exactly through json (repr is shortest-exact); NaN/inf -> None."""
    if values is None:
        return None
    return [float(v) if math.isfinite(v) else None for v in np.asarray(values, dtype=np.float64).tolist()]


def log_weights_to_json(log_w: np.ndarray) -> list[float | None]:
    # -inf (an exact zero weight) is the only non-finite value a log-weight may hold; JSON has no -inf.
    return [None if v == -math.inf else float(v) for v in log_w.tolist()]


def log_weights_from_json(values: Sequence[float | None], size: int, name: str) -> np.ndarray:
    if not isinstance(values, (list, tuple)) or len(values) != size:
        raise ValueError(f"state_dict[{name!r}] must be a list of {size} numbers")
    out = np.array([-math.inf if v is None else float(v) for v in values], dtype=np.float64)
    if np.any(np.isnan(out)) or np.any(out == math.inf):
        raise ValueError(f"state_dict[{name!r}] holds NaN or +inf")
    return out

