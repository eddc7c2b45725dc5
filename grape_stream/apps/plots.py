"""``grape-stream plot TRAJ.jsonl [-o OUT.png]``: render GRAPE trajectories to PNG.

The figure itself is :func:`grape_stream.integrations.trajectory_plot.plot_trajectory` (the trainers'
trajectory callbacks draw the same one at fit end).
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from grape_stream.console import add_console_arguments
from grape_stream.errors import DataError
from grape_stream.integrations.trajectory_plot import plot_trajectory

__all__ = ["plot_trajectory", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grape-stream plot", description="Plot GRAPE trajectories (JSONL) to PNG.")
    parser.add_argument("trajectories", nargs="+", help="trajectory JSONL file(s) written by a GRAPE run")
    parser.add_argument("-o", "--out", help="output PNG (only with one trajectory; default: beside the JSONL)")
    add_console_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.out and len(args.trajectories) > 1:
        parser.error("--out takes one trajectory; omit it to write each PNG beside its JSONL")
    for path in args.trajectories:
        if not os.path.exists(path):
            raise DataError(f"no such file: {path}")
        print(plot_trajectory(path, args.out))  # a bad trajectory is a DataError: one line under grape-stream
    return 0
