"""What `convert` returns, and the per-domain table the CLI prints from a manifest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ConvertResult", "format_table"]


@dataclass
class ConvertResult:
    """What a conversion produced. `manifest` and `report` are the contents of the two JSON files."""

    out: str
    local: str
    manifest: dict[str, Any]
    report: dict[str, Any]
    units_run: int = 0
    units_skipped: int = 0

    @property
    def domains(self) -> list[str]:
        return list(self.manifest["domains"])

    def path(self, domain: str, split: str | None = None) -> str:
        """Local or remote directory of one domain (and split): what StreamingDataset takes."""
        root = self.out.rstrip("/")
        entry = self.manifest["domains"][domain]
        rel = entry["splits"][split]["path"] if split else entry["path"]
        if "://" in root:
            return f"{root}/{rel}"
        return os.path.join(root, rel)

    @property
    def bad_inputs(self) -> int:
        return int(sum(self.report["totals"]["bad"].values()))

    def table(self) -> str:
        return format_table(self.manifest)


def format_table(manifest: dict[str, Any]) -> str:
    """The per-domain documents / tokens / samples table printed at the end of a conversion."""
    rows = [("domain", "split", "documents", "tokens", "samples")]
    for dom, e in manifest["domains"].items():
        for sp, s in (e.get("splits") or {None: e}).items():
            rows.append((dom, sp or "-", f"{s['documents']:,}", f"{s['tokens']:,}", f"{s['samples']:,}"))
    t = manifest["totals"]
    rows.append(("total", "", f"{t['documents']:,}", f"{t['tokens']:,}", f"{t['samples']:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0 or j == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
