"""The trajectory JSONL: one meta line, then one record per weight update (the full run, on disk).

It is what the plots, ``grape-stream inspect`` and the ``schedule`` replay read. A checkpoint holds
only the newest records (grape.checkpoint); a resumed controller therefore rewrites the file keeping
the older records already on disk, so the file stays complete across any number of resumes.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from grape_stream.atomic import atomic_open
from grape_stream.errors import DataError

#: The trajectory's file name in a run's folder (every integration writes it there by default).
TRAJECTORY_FILE = "grape_trajectory.jsonl"

__all__ = ["TRAJECTORY_FILE", "floats", "jsonable", "load_trajectory", "read_records", "write_trajectory"]


def floats(x: Iterable[Any]) -> list[float]:
    return [float(v) for v in np.asarray(x, dtype=np.float64).ravel()]


def jsonable(v: Any) -> Any:
    """`v` if json can write it, else a list (arrays, tuples) or its repr (anything else)."""
    try:
        json.dumps(v)
        return v
    except TypeError:
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, (list, tuple)):
            return [jsonable(x) for x in v]
        return repr(v)


def read_records(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(meta, update records in file order); errors name the line. An empty file gives no records."""
    meta: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            kind = rec.get("type", "update")
            if kind == "meta":
                meta = rec
            elif kind == "update":
                if "step" not in rec or "alpha" not in rec:
                    raise DataError(f"{path}:{lineno}: an update record needs 'step' and 'alpha'")
                records.append(rec)
    return meta, records


def load_trajectory(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read a trajectory JSONL: (meta, update records sorted by step). Errors name the line."""
    meta, records = read_records(path)
    if not records:
        raise DataError(f"{path}: no update records (is it a GRAPE trajectory JSONL?)")
    records.sort(key=lambda r: r["step"])
    return meta, records


def _earlier_on_disk(path: str, before_step: float) -> list[dict[str, Any]]:
    """Records of an existing trajectory file older than `before_step` (none if the file is absent)."""
    if not os.path.exists(path):
        return []
    try:
        _, records = read_records(path)
    except (OSError, ValueError):
        return []
    return [r for r in records if r["step"] < before_step]


def write_trajectory(
    path: str | os.PathLike[str],
    meta: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    *,
    keep_earlier: bool = False,
) -> str:
    """Write meta + records as JSONL, atomically (a reader never sees half a file).

    ``keep_earlier``: `records` is only the newest part of the run (a resumed controller's memory), so
    the records of the existing file that precede it are kept in front of them.
    """
    path = os.fspath(path)
    earlier = _earlier_on_disk(path, records[0]["step"]) if keep_earlier and records else []
    with atomic_open(path, fsync=False) as f:
        f.write(json.dumps(dict(meta)) + "\n")
        for rec in [*earlier, *records]:
            f.write(json.dumps(rec) + "\n")
    return path
