"""What the bench scripts share: where they live, their two common options and how a result file is written.

Every script prints a table and writes one JSON result, by default ``bench/results/<measure>.json`` (docs/results.md
says which file holds which measure); ``--out`` puts it elsewhere, and ``--quick`` is a smoke run at tiny sizes
(``make bench ARGS=--quick`` passes an ``--out`` under ``runs/bench-quick/``, so the committed results stay).
bench/ is not a package: a script run as ``python bench/x.py`` has bench/ on ``sys.path`` and imports this module
as ``common``; importing it puts the repository first on ``sys.path`` too, so a script runs this checkout's
grape_stream without an editable install.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

__all__ = ["HERE", "REPO", "RESULTS", "parser", "peak_rss_mb", "result_path", "write_json"]


def result_path(name: str) -> Path:
    """The committed result file of the measure ``name`` (``bench/results/<name>.json``)."""
    return RESULTS / f"{name}.json"


def parser(doc: str | None, result: str | None = None, *, quick: str | None = None,
           out_help: str | None = None) -> argparse.ArgumentParser:
    """A script's argument parser with its description (``doc`` as written: its usage lines stay readable) and,
    when given, ``--out`` defaulting to ``result_path(result)`` and ``--quick`` with the help text ``quick``.

    Pass ``result=None`` for a script whose ``--out`` means something else (a run directory) or has no default."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    if result is not None:
        p.add_argument("--out", default=str(result_path(result)), help=out_help)
    return p


def peak_rss_mb() -> float:
    """This process's resident high-water mark in MB (Linux reports ``ru_maxrss`` in kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_json(path: str | os.PathLike[str], doc: Any, *, indent: int = 1, newline: bool = False,
               default: Callable[[Any], Any] | None = None, say: bool = False) -> Path:
    """Write ``doc`` to ``path`` whole or not at all (a temporary file beside it, then a rename): a benchmark
    stopped mid-write leaves the previous result, never half a file. Creates the folder; ``newline`` ends the
    file with one; ``say`` prints "wrote PATH"."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=indent, default=default) + ("\n" if newline else ""))
    os.replace(tmp, out)
    if say:
        print(f"wrote {out}")
    return out
