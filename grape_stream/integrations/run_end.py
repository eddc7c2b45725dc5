"""The end of a GRAPE run, written in one place for every trainer: the trajectory's plot and the summary table.

Why one place: the Composer callback and :class:`~grape_stream.integrations.grape_loop.GrapeLoop` (HF Trainer,
Lightning, plain loops) each wrote the end of a run with their own copy of the same steps, and had drifted (only
Composer runs left ``grape_summary.txt``). Both now call :func:`write_run_end` after their trajectory is written;
what differs is only where the target evaluations come from (Composer's final evaluation round, or none).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from grape_stream.atomic import atomic_write_text
from grape_stream.integrations.summary import format_summary, summarize_controller
from grape_stream.integrations.trajectory_plot import plot_trajectory

__all__ = ["SUMMARY_FILE", "RunEnd", "write_run_end"]

log = logging.getLogger(__name__)

SUMMARY_FILE = "grape_summary.txt"


@dataclass
class RunEnd:
    """What the end of a run wrote: the files (the trajectory first) a tracker may log as artifacts."""

    trajectory: Optional[str]
    plot: Optional[str] = None
    summary: Optional[str] = None  # the summary file's path
    summary_text: Optional[str] = None
    files: list[str] = field(default_factory=list)


def write_run_end(controller: Any, trajectory: Optional[str], *, plots: bool, summary: bool,
                  evals: Optional[Mapping[str, float]] = None) -> RunEnd:
    """The plot of ``trajectory`` (a plotting problem is a warning: it must not fail a finished training run)
    and, with ``summary``, the end-of-run table printed and written next to the trajectory (without a
    trajectory: printed only). Call on one rank."""
    end = RunEnd(trajectory=trajectory)
    if trajectory is None:
        if summary:
            end.summary_text = format_summary(summarize_controller(controller, dict(evals or {})))
            print(end.summary_text, flush=True)
        return end
    if plots:
        try:
            end.plot = plot_trajectory(trajectory, os.path.splitext(trajectory)[0] + ".png")
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("could not plot the GRAPE trajectory %s: %s", trajectory, exc)
    if summary:
        end.summary_text = format_summary(summarize_controller(controller, dict(evals or {}), trajectory=trajectory,
                                                               plot=end.plot))
        print(end.summary_text, flush=True)
        end.summary = os.path.join(os.path.dirname(trajectory), SUMMARY_FILE)
        atomic_write_text(end.summary, end.summary_text + "\n")
    end.files = [p for p in (trajectory, end.plot, end.summary) if p]
    return end
