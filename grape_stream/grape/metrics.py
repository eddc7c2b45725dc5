"""One update record -> the flat ``{"grape/...": float}`` dict any logger takes.

Every trainer integration logs the same names, so dashboards of a Composer run and a plain loop match.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

__all__ = ["update_metrics"]


def update_metrics(
    rec: Mapping[str, Any], domain_names: Sequence[str], task_names: Sequence[str], *, alignment: bool = True
) -> dict[str, float]:
    """``grape/alpha/<domain>``, ``grape/z/<task>``, the probe losses and alignments, the timings and lr.

    ``alignment=False`` leaves out the K x N ``grape/alignment/<domain>/<task>`` entries. Missing or
    non-finite values are left out (a logger would choke on NaN).
    """
    m: dict[str, Any] = {}
    per_name = (
        ("alpha", domain_names, rec.get("alpha")),
        ("z", task_names, rec.get("z")),
        ("task_loss", task_names, rec.get("task_loss")),
        ("domain_loss", domain_names, rec.get("domain_loss")),
        ("domain_excess", domain_names, rec.get("domain_excess")),
        ("domain_alignment", domain_names, rec.get("domain_alignment")),
        ("task_alignment", task_names, rec.get("task_alignment")),
    )
    for key, names, values in per_name:
        for name, v in zip(names, values or []):
            m[f"grape/{key}/{name}"] = v
    if alignment and rec.get("alignment"):
        for dname, row in zip(domain_names, rec["alignment"]):
            for tname, v in zip(task_names, row):
                m[f"grape/alignment/{dname}/{tname}"] = v
    for k, v in (rec.get("seconds") or {}).items():
        m[f"grape/seconds/{k}"] = v
    if "lr" in rec:
        m["grape/lr"] = rec["lr"]
    return {k: float(v) for k, v in m.items() if v is not None and math.isfinite(float(v))}
