"""Input files and the names derived from them: globs and directories, natural sort, safe domain names.

Shared by the pipeline (which files, which root), the Spark path (domain names from columns) and the
readers (domains and splits from paths), so it sits in the core rather than in the readers folder.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any, Iterable, Sequence

__all__ = [
    "SPLIT_WORDS",
    "natural_key",
    "strip_suffixes",
    "check_domain_name",
    "split_from_path",
    "expand_patterns",
]

SPLIT_WORDS = ("train", "validation", "valid", "val", "dev", "test", "holdout")

_DOMAIN_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._=+-]{0,127}\Z")  # \Z: "$" accepts a trailing newline


def natural_key(s: str) -> list[Any]:
    """Sort key so that cluster_2 < cluster_10 and part_9 < part_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def strip_suffixes(name: str) -> str:
    """`validation-00000-of-00001.parquet` -> `validation-00000-of-00001`; `en.jsonl.zst` -> `en`."""
    base = os.path.basename(name)
    for suf in (".zst", ".gz", ".jsonl", ".json", ".parquet", ".tokenized"):
        if base.endswith(suf):
            base = base[: -len(suf)]
    for suf in (".jsonl", ".json", ".tokenized"):
        if base.endswith(suf):
            base = base[: -len(suf)]
    return base


def check_domain_name(name: Any) -> str | None:
    """The reason a domain name is unusable as a directory name, or None when it is fine."""
    if not isinstance(name, str):
        return f"domain must be a string, got {type(name).__name__} {name!r}"
    if not _DOMAIN_RE.match(name) or name in (".", ".."):
        return f"domain {name!r} is not a safe directory name (letters, digits, . _ = + -)"
    if name in ("manifest.json", "report.json") or name.startswith("part-"):
        return f"domain {name!r} is reserved (an output file or partition name)"
    return None


def split_from_path(path: str) -> str | None:
    """`.../validation/chunk1/x.jsonl.zst` -> "validation"; wiki40b's `validation-0000.parquet` too."""
    parts = os.path.normpath(path).split(os.sep)
    for part in reversed(parts[:-1]):
        if part in SPLIT_WORDS:
            return part
    stem = os.path.basename(path).split("-")[0].split(".")[0].split("_")[0]
    return stem if stem in SPLIT_WORDS else None


def _has_glob(p: str) -> bool:
    return any(ch in p for ch in "*?[")


def _base_of(p: str) -> str:
    """Where an input's relative paths start: a directory itself, a glob's directory part, a file's directory."""
    if os.path.isdir(p):
        return p
    if _has_glob(p):
        head = p.split("*")[0].split("?")[0].split("[")[0]
        return head if head.endswith(os.sep) else os.path.dirname(head)
    return os.path.dirname(p)


def _files_of(p: str, suffixes: Sequence[str]) -> list[str]:
    if os.path.isdir(p):
        hits = []
        for root, dirs, files in os.walk(p):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            hits += [os.path.join(root, f) for f in files if f.endswith(tuple(suffixes)) and not f.startswith(".")]
        if not hits:
            raise FileNotFoundError(f"input directory {p!r} holds no {'/'.join(suffixes)} files")
        return hits
    if _has_glob(p):
        hits = [m for m in glob.glob(p, recursive=True) if os.path.isfile(m)]
        if not hits:
            raise FileNotFoundError(f"input glob {p!r} matches no file")
        return hits
    if os.path.isfile(p):
        return [p]
    raise FileNotFoundError(f"input {p!r} is not a file, directory or glob")


def expand_patterns(patterns: Iterable[str], suffixes: Sequence[str]) -> tuple[list[str], str]:
    """Files named by paths, globs or directories (recursively, keeping files with one of `suffixes`),
    and the input root their relative paths (in report.json, manifest.json, the split hash) start from:
    a directory input itself, a glob's directory part, a file's directory; the common root of them all.
    """
    found: list[str] = []
    bases: list[str] = []
    for p in patterns:
        p = os.path.expanduser(p)
        bases.append(_base_of(p))
        found += _files_of(p, suffixes)
    uniq = sorted({os.path.abspath(f) for f in found}, key=natural_key)
    root = os.path.commonpath([os.path.abspath(b or ".") for b in bases])
    return uniq, root
