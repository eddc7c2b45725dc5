"""A progress line for each GRAPE update, with no trainer imported (global rank 0 only).

Why: an update probes K domains + N tasks in one fused forward/backward; on a real model it takes seconds
to minutes during which the training loop prints nothing. The probe has no per-group steps (all groups
share one pass), so progress counts the probe samples the per-sample loss has processed: on a terminal a
tqdm bar ``GRAPE update 3 (step 40): probing 13 groups  96/208 samples``; elsewhere (a log file, a
cluster's captured stdout, where carriage-return bars turn into noise) one start line and one end line.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Optional, TextIO

from grape_stream.world import process_world

__all__ = ["UpdateProgress"]


class UpdateProgress:
    """Reports each GRAPE update: ``with progress.update(...)`` around the controller's update, with the
    per-sample loss wrapped by :meth:`wrap_loss` so the forward passes tick the bar.

    ``enabled=False`` silences it; ``bar`` forces (True) or forbids (False) the tqdm bar (default: a bar
    when ``stream`` is a terminal). Non-leader ranks print nothing.
    """

    def __init__(self, enabled: bool = True, stream: Optional[TextIO] = None, bar: Optional[bool] = None) -> None:
        self.enabled = enabled
        self._stream = stream
        self._bar_mode = bar
        self._bar: Any = None
        self._done = 0
        self._total = 0
        self._active = False
        self.lines: list[str] = []  # what was printed (start/end lines), for tests and callers

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def _print(self, line: str) -> None:
        self.lines.append(line)
        print(line, file=self.stream, flush=True)

    def wrap_loss(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(model, batch) -> Tensor[B]`` that also ticks the bar by B while an update runs."""
        def per_sample_loss(model: Any, batch: Any) -> Any:
            out = fn(model, batch)
            if self._active:
                self._tick(int(out.shape[0]) if getattr(out, "ndim", 0) else 0)
            return out
        per_sample_loss.__wrapped__ = fn  # type: ignore[attr-defined]
        return per_sample_loss

    def _tick(self, n: int) -> None:
        step = max(0, min(n, self._total - self._done))  # layout probes re-run a few samples: cap at the total
        self._done += step
        if self._bar is not None and step:
            self._bar.update(step)

    @contextlib.contextmanager
    def update(self, index: int, step: int, domains: int, tasks: int, samples: int) -> Iterator[None]:
        """Around one update: index (1-based), the optimizer step, the group counts and the probe samples."""
        leader = self.enabled and process_world().is_leader
        groups = domains + tasks
        desc = f"GRAPE update {index} (step {step}): probing {groups} groups ({domains} domains + {tasks} tasks)"
        self._done, self._total, self._active = 0, samples, leader
        use_bar = self._bar_mode if self._bar_mode is not None else bool(getattr(self.stream, "isatty", bool)())
        t0 = time.perf_counter()
        if leader and use_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=samples, desc=desc, unit="sample", file=self.stream, leave=False)
        elif leader:
            self._print(f"{desc}, {samples} samples ...")
        try:
            yield
        finally:
            self._active = False
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            self._elapsed = time.perf_counter() - t0

    def finished(self, index: int, step: int, record: Mapping[str, Any] | None) -> None:
        """The end line of an update: its time and, from the update record, where the time went."""
        if not (self.enabled and process_world().is_leader):
            return
        seconds = dict((record or {}).get("seconds") or {})
        total = float(seconds.pop("total", getattr(self, "_elapsed", 0.0)))
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.2f}s" for k, v in seconds.items())
        skipped = (record or {}).get("skipped")
        extra = f"; skipped: {skipped}" if skipped else ""
        self._print(f"GRAPE update {index} (step {step}) done in {total:.2f}s"
                    f"{' (' + parts + ')' if parts else ''}{extra}")
