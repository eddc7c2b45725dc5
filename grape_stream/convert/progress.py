"""Progress of a conversion: on a terminal, one bar of units and one bar of packed tokens per domain; in a
log (stderr is not a terminal: a file, a pipe, a cluster's captured output), one plain line every
``interval`` seconds and one at the end.

Why two forms: tqdm redraws its bars with carriage returns and cursor moves, which a log keeps as control
codes (a 16 s conversion wrote 4.4 KB of them); a line every few seconds says the same and stays readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Optional, TextIO

__all__ = ["Progress"]


def _tokens(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


class Progress:
    """Units done and tokens packed per domain, as tqdm bars (terminal) or plain lines (anything else).

    ``bars``: force (True) or forbid (False) the bars; default: bars when ``stream`` (stderr) is a terminal.
    Created after the worker pool is started, so no bar thread exists when workers are forked.
    """

    def __init__(self, *, enabled: bool, total_units: int, done_units: int,
                 done_markers: Iterable[dict[str, Any]], stream: Optional[TextIO] = None,
                 bars: Optional[bool] = None, interval: float = 5.0) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.use_bars = bars if bars is not None else bool(getattr(self.stream, "isatty", bool)())
        self.interval = interval
        self.bars: dict[str, Any] = {}
        self.units: Any = None
        self.total_units, self.done_units = total_units, done_units
        self.tokens: dict[str, int] = {}
        self._t0 = self._last = time.monotonic()
        if not enabled:
            return
        if self.use_bars:
            from tqdm.auto import tqdm

            self.units = tqdm(total=total_units, initial=done_units, desc="units", unit="unit", position=0,
                              dynamic_ncols=True, file=self.stream)
        for m in done_markers:
            for o in m["outputs"]:
                self._add(o["domain"], o["tokens"])

    def _add(self, domain: str, n: int) -> None:
        self.tokens[domain] = self.tokens.get(domain, 0) + n
        if not self.use_bars:
            return
        bar = self.bars.get(domain)
        if bar is None:
            from tqdm.auto import tqdm

            bar = self.bars[domain] = tqdm(desc=domain, unit="tok", unit_scale=True, position=len(self.bars) + 1,
                                           dynamic_ncols=True, file=self.stream)
        bar.update(n)

    def line(self) -> str:
        """``convert: 3/8 units, 1.2M tokens (en 0.8M, fr 0.4M), 12s``"""
        total = sum(self.tokens.values())
        per = ", ".join(f"{d} {_tokens(n)}" for d, n in self.tokens.items())
        return (f"convert: {self.done_units}/{self.total_units} units, {_tokens(total)} tokens"
                f"{f' ({per})' if per else ''}, {time.monotonic() - self._t0:.0f}s")

    def _maybe_print(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.enabled and not self.use_bars and (force or now - self._last >= self.interval):
            self._last = now
            print(self.line(), file=self.stream, flush=True)

    def update(self, p: dict[str, Any]) -> None:
        """A worker's progress message: tokens packed per domain since its last message."""
        if not self.enabled:
            return
        for dom, n in p.get("tokens", {}).items():
            self._add(dom, n)
        self._maybe_print()

    def unit_done(self, marker: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.done_units += 1
        if self.units is not None:
            self.units.update(1)
        self._maybe_print()

    def close(self) -> None:
        for b in [self.units, *self.bars.values()]:
            if b is not None:
                b.close()
        self.units, self.bars = None, {}
        self._maybe_print(force=True)
