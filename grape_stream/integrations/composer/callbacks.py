"""Composer callbacks and a logger for GRAPE runs: the trajectory JSONL (+ PNG, the console summary and
the tracker artifacts at fit end), the task evaluation summary (the paper's average and worst
log-perplexity), and every metric as JSON lines.

Only global rank 0 writes files (:func:`grape_stream.world.process_world`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional, Sequence

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger, LoggerDestination

from grape_stream.atomic import atomic_write_text
from grape_stream.grape.trajectory import TRAJECTORY_FILE
from grape_stream.integrations.composer.algorithm import GrapeAlgorithm
from grape_stream.integrations.composer.artifacts import log_trajectory_artifacts
from grape_stream.integrations.run_end import write_run_end
from grape_stream.world import process_world

__all__ = ["GrapeTrajectoryCallback", "JSONLMetricsLogger", "TaskEvalSummary", "final_eval_pending",
           "grape_algorithm_of"]

log = logging.getLogger(__name__)


def grape_algorithm_of(state: State) -> GrapeAlgorithm | None:
    """The trainer's GrapeAlgorithm, if it has one."""
    for algo in state.algorithms:
        if isinstance(algo, GrapeAlgorithm):
            return algo
    return None


class GrapeTrajectoryCallback(Callback):
    """Writes the GRAPE trajectory as JSONL after every update (atomic rewrite: survives a kill); at fit end
    the PNG plots (stacked areas of alpha and z, the domain-task alignment heatmap, per-task losses), the
    run summary (printed, and written as ``grape_summary.txt``: per-target log-ppl, avg, worst, final
    alpha, where the files are) and the files as tracker artifacts (see
    :mod:`grape_stream.integrations.composer.artifacts`).

    ``folder`` may contain ``{run_name}``. Only global rank 0 writes and prints.
    """

    def __init__(self, folder: str = "{run_name}", filename: str = TRAJECTORY_FILE,
                 plots: bool = True, summary: bool = True, artifacts: bool = True) -> None:
        self.folder = folder
        self.filename = filename
        self.plots = plots
        self.summary = summary
        self.artifacts = artifacts
        self.summary_text: str | None = None
        self._pending = False  # fit ended, the final evaluation has not run yet
        self._written_updates = -1
        self.path: str | None = None

    def _path(self, state: State) -> str:
        return os.path.join(self.folder.format(run_name=state.run_name), self.filename)

    def _write(self, state: State) -> str | None:
        algo = grape_algorithm_of(state)
        if algo is None or algo.controller is None:
            return None
        self.path = self._path(state)
        if process_world().is_leader:
            algo.controller.write_trajectory(self.path)
        self._written_updates = algo.controller.num_updates
        return self.path

    def fit_start(self, state: State, logger: Logger) -> None:
        if grape_algorithm_of(state) is None:
            log.warning("GrapeTrajectoryCallback: no GrapeAlgorithm in this trainer; nothing will be written")

    def batch_end(self, state: State, logger: Logger) -> None:
        algo = grape_algorithm_of(state)
        if algo is not None and algo.controller is not None and algo.controller.num_updates != self._written_updates:
            self._write(state)

    def fit_end(self, state: State, logger: Logger) -> None:
        # Composer 0.32.1 runs its final evaluation *after* FIT_END (Trainer._train_loop: FIT_END, then
        # _run_evaluators(FIT_END)) whenever max_duration is not a multiple of eval_interval; the summary waits
        # for it (EVAL_AFTER_ALL), else it would show the previous round's figures. CLOSE is the safety net.
        self._pending = final_eval_pending(state)
        if self._pending:
            self._write(state)
        else:
            self._finish(state, logger)

    def eval_after_all(self, state: State, logger: Logger) -> None:
        if self._pending:
            self._pending = False
            self._finish(state, logger, evals=_task_evals(state, fresh=True))

    def close(self, state: State, logger: Logger) -> None:
        if self._pending:
            self._pending = False
            self._finish(state, logger)

    def _finish(self, state: State, logger: Logger, evals: dict[str, float] | None = None) -> None:
        """Plots, the summary and the tracker artifacts: once, after the run's last evaluation."""
        path = self._write(state)
        if path is None or not process_world().is_leader:
            return
        algo = grape_algorithm_of(state)
        assert algo is not None and algo.controller is not None
        end = write_run_end(algo.controller, path, plots=self.plots, summary=self.summary,
                            evals=(_task_evals(state) if evals is None else evals) if self.summary else None)
        self.summary_text = end.summary_text
        if self.artifacts:
            log_trajectory_artifacts(logger, end.files, end.plot, int(state.timestamp.batch))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class TaskEvalSummary(Callback):
    """After each evaluation round, log the average and the worst log-perplexity over the target tasks
    (``metrics/grape/avg_log_ppl``, ``metrics/grape/worst_log_ppl``) — the paper's two headline numbers."""

    def __init__(self, labels: Sequence[str], metric: str = "LanguageCrossEntropy") -> None:
        self.labels = list(labels)
        self.metric = metric
        self.last: dict[str, float] = {}

    def values(self, state: State) -> dict[str, float]:
        """Per-target value of ``metric`` from the evaluation that just ran (call at EVAL_AFTER_ALL)."""
        values = {}
        for label in self.labels:
            metric = state.eval_metrics.get(label, {}).get(self.metric)
            if metric is not None:
                values[label] = float(metric.compute())
        return values

    def eval_after_all(self, state: State, logger: Logger) -> None:
        values = self.values(state)
        if not values:
            return
        self.last = values
        logger.log_metrics({
            "metrics/grape/avg_log_ppl": sum(values.values()) / len(values),
            "metrics/grape/worst_log_ppl": max(values.values()),
        })

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def final_eval_pending(state: State) -> bool:
    """At FIT_END: will Composer evaluate once more after it? Composer's own interval schedulers answer
    FIT_END without changing their state (``create_interval_scheduler``'s ``final_events``)."""
    return any(ev.eval_interval is not None and ev.eval_interval(state, Event.FIT_END) for ev in state.evaluators)


def _task_evals(state: State, fresh: bool = False) -> dict[str, float]:
    """The target tasks' log-perplexity for the summary: the round that just ran (``fresh``, at EVAL_AFTER_ALL,
    before TaskEvalSummary may have seen it: callback order) or TaskEvalSummary's last round."""
    for cb in state.callbacks:
        if isinstance(cb, TaskEvalSummary):
            values = cb.values(state) if fresh else {}
            if values or cb.last:
                return values or dict(cb.last)
    return {}


class JSONLMetricsLogger(LoggerDestination):
    """Every logged metric as one JSON line ``{"step": batch, name: value, ...}`` (global rank 0 only).

    Lines are flushed as they are written, so a run killed mid-way keeps what it logged. The number of
    lines is part of the checkpoint (this logger's state), so a run resumed from a checkpoint first cuts
    the file back to the lines written when that checkpoint was saved: the steps between the checkpoint
    and the kill, which the resumed run trains (and logs) again, appear once, as in a run never killed.
    A run that starts from scratch (no checkpoint loaded) starts the file from scratch too: a run killed before
    its first checkpoint and started again with the same command logs its first steps once, not twice.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._file: Any = None
        self._rows = 0  # lines in the file, once opened
        self._keep: int | None = None  # lines to keep when the file is opened (set by a resume)
        self._resumed = False  # a checkpoint's state was loaded: keep (the first _keep) lines of the file

    def _open(self) -> Any:
        if not process_world().is_leader:
            return None
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            on_disk = _read_lines(self.path) if self._resumed else []
            # a resume keeps the rows its checkpoint counted (the rows it replays are logged again by this run)
            lines = on_disk[: self._keep] if self._keep is not None else on_disk
            if not self._resumed or len(lines) < len(on_disk):
                atomic_write_text(self.path, "".join(lines))
            self._rows = len(lines)
            self._file = open(self.path, "a", encoding="utf-8")
        return self._file

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        f = self._open()
        if f is None:
            return
        row: dict[str, Any] = {"step": step}
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:
                    continue
                v = v.item()
            if isinstance(v, (int, float)):
                row[k] = float(v)
        f.write(json.dumps(row) + "\n")
        f.flush()
        self._rows += 1

    def state_dict(self) -> dict[str, Any]:
        if self._file is None and process_world().is_leader:  # nothing logged yet by this run
            if not self._resumed:
                return {"rows": 0}
            return {"rows": self._keep if self._keep is not None else len(_read_lines(self.path))}
        return {"rows": self._rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = True
        if "rows" in state:  # absent in checkpoints of earlier versions: the file is appended to, as then
            self._keep = int(state["rows"])

    def close(self, state: State, logger: Logger) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _read_lines(path: str) -> list[str]:
    """The complete lines of a metrics file (a last line cut off by a kill is dropped); [] if absent."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []
