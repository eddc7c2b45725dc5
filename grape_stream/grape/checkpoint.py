"""The controller's checkpoint form: plain types and tensors only, a format string, a bounded history.

Checkpoints must load with ``torch.load(weights_only=True)``, so numpy arrays become tagged tensors.
The checkpoint keeps only the newest ``CHECKPOINT_HISTORY`` update records: the full run is on disk in
the trajectory JSONL (grape.trajectory), and the reweighter inside keeps just its last record, so
neither grows with the length of the run.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

__all__ = [
    "CHECKPOINT_HISTORY",
    "LEGACY_STATE_FORMATS",
    "STATE_FORMAT",
    "check_state_format",
    "from_plain",
    "history_tail",
    "to_plain",
]

#: Version of the controller's state_dict layout (bumped on incompatible change).
STATE_FORMAT = "grape_stream.controller/2"
#: Older layouts still read: int 1 kept the full history (and the reweighter's full history) in it.
LEGACY_STATE_FORMATS = (1,)
#: Update records kept in a checkpoint (1,000 updates = 100k steps at the paper's period of 100).
CHECKPOINT_HISTORY = 1000


def check_state_format(state: Mapping[str, Any], **same: Any) -> None:
    """A readable controller state, written by a run with the same ``same`` values (method, domains, tasks)."""
    fmt = state.get("format")
    if fmt != STATE_FORMAT and (isinstance(fmt, bool) or fmt not in LEGACY_STATE_FORMATS):
        raise ValueError(
            f"controller state format {fmt!r} is not supported (expected {STATE_FORMAT!r} or one of "
            f"{list(LEGACY_STATE_FORMATS)})"
        )
    for key, mine in same.items():
        if state.get(key) != mine:
            raise ValueError(f"checkpoint was written with {key}={state.get(key)!r} but this run has {key}={mine!r}; "
                             "resume with the same recipe")


def history_tail(history: list[dict[str, Any]], dropped: int, limit: int | None = None
                 ) -> tuple[list[dict[str, Any]], int]:
    """(the newest `limit` records (default CHECKPOINT_HISTORY), how many older ones are then missing in all)."""
    limit = CHECKPOINT_HISTORY if limit is None else limit
    keep = history[-limit:] if limit > 0 else []
    return keep, dropped + len(history) - len(keep)


def to_plain(obj: Any) -> Any:
    """numpy arrays -> tagged tensors, numpy scalars -> Python numbers, recursively."""
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.array(obj, copy=True))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(to_plain(v) for v in obj)
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    return obj


def from_plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        if set(obj.keys()) == {"__ndarray__"}:
            return obj["__ndarray__"].cpu().numpy().copy()
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(from_plain(v) for v in obj)
    if isinstance(obj, list):
        return [from_plain(v) for v in obj]
    return obj
