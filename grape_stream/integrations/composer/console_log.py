"""What a ``grape-stream train`` run prints: Composer's console log, cut to what a person reads.

Why: at Composer 0.32.1's defaults a 6-batch run of the demo recipe printed 328 lines: every console block
held the whole K x N alignment matrix (91 lines for 13 domains x 7 targets) and the per-group probe details,
five ``time/*`` counters, the run's hyperparameters, ten progress lines per target per evaluation, and a
"Cannot split tensor" warning (with the virtualenv's path) at each target's last, smaller evaluation batch.
:class:`GrapeConsoleLogger` keeps the loss, the mixture (``grape/alpha/*``, ``grape/z/*``) and the evaluation
results; everything else still reaches ``metrics.jsonl`` and the trackers, which log every metric.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional

from composer.core import State
from composer.loggers import ConsoleLogger, Logger
from composer.loggers.logger import format_log_data_value

__all__ = ["CONSOLE_HIDDEN", "GrapeConsoleLogger", "composer_warnings_filtered", "shown_on_console"]

#: Per-name metrics printed as one line per family (``grape/alpha: en 0.0892 fr 0.0786 ...``).
CONSOLE_ONE_LINE = ("grape/alpha/", "grape/z/")
#: Metric name prefixes left off the console (kept in metrics.jsonl and the trackers).
CONSOLE_HIDDEN = (
    "grape/alignment/", "grape/domain_alignment/", "grape/task_alignment/", "grape/domain_loss/",
    "grape/domain_excess/", "grape/task_loss/", "grape/seconds/", "time/", "trainer/",
)


def shown_on_console(name: str) -> bool:
    """Whether a metric is printed in the console blocks."""
    return not name.startswith(CONSOLE_HIDDEN)


class GrapeConsoleLogger(ConsoleLogger):
    """Composer's console logger without the matrix, the counters, the hyperparameter dump and the evaluation
    progress lines; the mixture on one line per family, each target's evaluation on one line."""

    def log_to_console(self, data: dict[str, Any], state: State, prefix: str = "", is_train: bool = True) -> None:
        if not is_train:  # one line per evaluated target: its metrics side by side
            cells = ", ".join(f"{name.rpartition('/')[2]} {format_log_data_value(v)}" for name, v in data.items())
            self._log_to_console(f"{self._get_eval_progress_string(state)}" + (f": {cells}" if cells else ""))
            return
        lines = [self._get_progress_string(state) + (":" if data else "")]
        families: dict[str, list[str]] = {}
        for name, value in data.items():
            if name.startswith(CONSOLE_ONE_LINE):
                family, _, leaf = name.rpartition("/")
                families.setdefault(family, []).append(f"{leaf} {float(value):.4f}")
            else:
                lines.append(f"\t {prefix}{name}: {format_log_data_value(value)}")
        lines += [f"\t {prefix}{family}: {' '.join(cells)}" for family, cells in families.items()]
        self._log_to_console("\n".join(lines))

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        super().log_metrics({k: v for k, v in metrics.items() if shown_on_console(k)}, step)

    def _log_hparams_to_console(self) -> None:
        return None  # the run's description is printed before it starts; the trackers get every hyperparameter

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        return None


@contextlib.contextmanager
def composer_warnings_filtered() -> Iterator[None]:
    """Composer 0.32.1 warnings a GRAPE run causes on purpose, off from Trainer construction on.

    Our console logger passed in ``loggers`` (Composer advises ``log_to_console``, whose logger this one replaces):
    off while the Trainer is built. "Cannot split tensor of length n into batches of size b" at a target's last
    evaluation batch, smaller than the evaluation batch size (the whole test split is evaluated; not a fault):
    off for the process, for that message of ``composer.core.data_spec`` only (it is raised during ``fit``)."""
    warnings.filterwarnings("ignore", message=r"Cannot split (tensor|list) of length", module=r"composer\.core")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Specifying the ConsoleLogger via `loggers`")
        yield
