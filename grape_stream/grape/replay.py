"""Method "schedule": replay a recorded trajectory instead of computing alignments.

Weights found by a small proxy run can steer a large run at no probe cost: the replayed weights
switch at the recorded steps (times ``stretch``: a 10k-step proxy trajectory drives a 50k-step run with
stretch 5).
"""

from __future__ import annotations

import bisect
import os
from typing import Any, Sequence

import numpy as np

from grape_stream.grape.trajectory import floats, load_trajectory

__all__ = ["REPLAY_METHOD", "ScheduleReplay"]

#: The controller method that replays a trajectory; every other method name is a reweighter's.
REPLAY_METHOD = "schedule"


class ScheduleReplay:
    """A trajectory's alpha (and z) by step, and which record is in force."""

    def __init__(self, path: str | os.PathLike[str], domain_names: Sequence[str], stretch: float = 1.0) -> None:
        if stretch <= 0:
            raise ValueError(f"schedule_stretch must be > 0, got {stretch}")
        meta, records = load_trajectory(path)
        if meta.get("domains") and list(meta["domains"]) != list(domain_names):
            raise ValueError(
                f"schedule {path} was recorded for domains {meta['domains']}, but the mixer has {list(domain_names)}"
            )
        for rec in records:
            if len(rec["alpha"]) != len(domain_names):
                raise ValueError(
                    f"schedule {path}: step {rec['step']} has {len(rec['alpha'])} weights, expected {len(domain_names)}"
                )
        self.path = os.fspath(path)
        self.records = records
        self.steps = [float(r["step"]) * stretch for r in records]
        #: index of the record in force (-1: none yet, the mixer's own weights apply)
        self.index = -1

    def current(self) -> dict[str, Any]:
        """The record in force (the first one before any is reached)."""
        return self.records[max(self.index, 0)]

    @property
    def starts_at_zero(self) -> bool:
        return self.steps[0] <= 0

    def advance(self, step: int) -> dict[str, Any] | None:
        """The record that comes into force at `step`, or None if the one in force stays."""
        idx = bisect.bisect_right(self.steps, float(step)) - 1
        if idx < 0 or idx == self.index:
            return None
        self.index = idx
        return self.records[idx]

    @staticmethod
    def update_record(step: int, src: dict[str, Any]) -> dict[str, Any]:
        """The controller's history record for a replayed switch."""
        return {"type": "update", "step": int(step), "method": REPLAY_METHOD, "source_step": src["step"],
                "alpha": floats(np.asarray(src["alpha"], dtype=np.float64)), "z": src.get("z"),
                "seconds": {"total": 0.0}}
