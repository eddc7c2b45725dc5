"""Progress bars of a conversion: one bar of units, one bar of packed tokens per domain."""

from __future__ import annotations

from typing import Any, Iterable

from tqdm.auto import tqdm

__all__ = ["Progress"]


class Progress:
    """One tqdm bar of units, plus one bar of packed tokens per domain (created as domains appear).

    Created after the worker pool is started, so no bar thread exists when workers are forked.
    """

    def __init__(self, *, enabled: bool, total_units: int, done_units: int,
                 done_markers: Iterable[dict[str, Any]]) -> None:
        self.enabled = enabled
        self.bars: dict[str, Any] = {}
        self.units: Any = None
        if not enabled:
            return
        self.units = tqdm(total=total_units, initial=done_units, desc="units", unit="unit", position=0,
                          dynamic_ncols=True)
        for m in done_markers:
            for o in m["outputs"]:
                self._bar(o["domain"]).update(o["tokens"])

    def _bar(self, domain: str) -> Any:
        bar = self.bars.get(domain)
        if bar is None:
            bar = self.bars[domain] = tqdm(
                desc=domain, unit="tok", unit_scale=True, position=len(self.bars) + 1, dynamic_ncols=True
            )
        return bar

    def update(self, p: dict[str, Any]) -> None:
        """A worker's progress message: tokens packed per domain since its last message."""
        if not self.enabled:
            return
        for dom, n in p.get("tokens", {}).items():
            self._bar(dom).update(n)

    def unit_done(self, marker: dict[str, Any]) -> None:
        if self.units is not None:
            self.units.update(1)

    def close(self) -> None:
        for b in [self.units, *self.bars.values()]:
            if b is not None:
                b.close()
