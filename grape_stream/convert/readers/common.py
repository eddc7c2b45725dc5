"""What every reader shares: the record types, bad-input kinds, and fault-tolerant file iteration.

Readers never raise on bad input: they yield a `BadInput` naming the file position and the reason, and
carry on where the format allows it (the next JSON line, the next parquet row group). A fault that
makes the rest of a file unreadable (a corrupt zstd frame, a parquet file without footer) is yielded
once with `fatal=True` and ends that file. The converter counts them per file in report.json, or stops
at the first one under `--strict`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

__all__ = [
    "Record",
    "BadInput",
    "BAD_KINDS",
    "Reader",
    "iter_jsonl",
    "iter_parquet_batches",
    "iter_parquet_rows",
    "get_field",
    "check_domain_name",
    "natural_key",
    "strip_suffixes",
    "SPLIT_WORDS",
    "as_token_array",
    "expand_patterns",
]

# Every kind of bad input the converter reports (report.json keys; docs/converters.md lists them).
BAD_KINDS = (
    "corrupt_zstd",       # zstd frame fails to decode or the file ends inside a frame; rest of file lost
    "corrupt_gzip",       # same for .gz
    "invalid_json",       # a line that is not a JSON object (includes a cut-off last line)
    "non_utf8",           # a line (or parquet string) that is not valid UTF-8
    "missing_field",      # a required field/column is absent or null
    "bad_field",          # a field has the wrong type or an unusable value (e.g. label out of range)
    "bad_tokens",         # pre-tokenized ids outside [0, vocab) or not integers
    "token_count_mismatch",  # token_count disagrees with len(tokens); the document is KEPT (tokens win)
    "empty_document",     # no text / no tokens after cleaning
    "truncated_parquet",  # parquet footer/row group unreadable; the unreadable part is lost
    "unreadable_file",    # the file cannot be opened at all
)

SPLIT_WORDS = ("train", "validation", "valid", "val", "dev", "test", "holdout")

_DOMAIN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,127}$")


@dataclass(slots=True)
class Record:
    """One input document, or one task example.

    index: position in its file (line number for JSON lines, row number for parquet); together with the
    file's relative path it seeds the split assignment, so splits never depend on the worker count.
    Exactly one of text / tokens is set.
    """

    index: int
    unit: str  # "line" or "row": how `index` is counted (for messages)
    domain: str
    text: str | None = None
    tokens: np.ndarray | None = None
    split: str | None = None


@dataclass(slots=True)
class BadInput:
    kind: str
    index: int | None  # line/row where it happened, None for the whole file
    unit: str
    reason: str
    fatal: bool = False  # True: the rest of the file could not be read
    keep: Record | None = field(default=None)  # a warning-only kind still yields its record here

    def where(self) -> str:
        return f"{self.unit} {self.index}" if self.index is not None else "whole file"


class Reader:
    """Base class of the dataset readers. Subclasses are small picklable dataclasses (they travel to
    worker processes).

    pretokenized: records carry `tokens` (GPT-2 ids) instead of `text`.
    per_example: records are task examples (padded one per sample), not documents to pack.
    """

    source: str = ""
    pretokenized: bool = False
    per_example: bool = False
    patterns: tuple[str, ...] = ()

    def path_domain(self, path: str) -> str | None:
        """The domain of every record of `path` when the path alone decides it, else None.

        Lets the converter finalise a domain as soon as its files are done (and skip it on a re-run).
        """
        return None

    def read(self, path: str) -> Iterator[Record | BadInput]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The options that change the output (stored in the plan; a re-run must match them)."""
        return {}


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


def get_field(obj: Any, dotted: str) -> Any:
    """`obj["a"]["b"]` for "a.b"; raises KeyError naming the missing part."""
    cur = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(part)
        cur = cur[part]
    return cur


# ----------------------------------------------------------------------------- compressed streams

_CHUNK = 1 << 16


def _frame_chunks(f, new_decoder: Callable[[], Any], errors: tuple[type[BaseException], ...], what: str) -> Iterator[bytes]:
    """Decompressed bytes of a multi-frame (zstd) or multi-member (gzip) stream: yields what decodes, then
    raises ValueError on a corrupt or truncated frame (zstandard's stream reader, for one, silently returns
    a truncated file's prefix)."""
    obj = new_decoder()
    fed = False
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        while chunk:
            try:
                out = obj.decompress(chunk)
            except errors as e:
                raise ValueError(f"{what} does not decode: {e}") from e
            fed = True
            if out:
                yield out
            if obj.eof:
                chunk = obj.unused_data
                obj = new_decoder()
                fed = False
            else:
                chunk = b""
    if fed:
        raise ValueError(f"file ends inside a {what} (truncated download?)")


def _zstd_chunks(f) -> Iterator[bytes]:
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    return _frame_chunks(f, dctx.decompressobj, (zstandard.ZstdError,), "zstd frame")


def _gzip_chunks(f) -> Iterator[bytes]:
    import zlib

    return _frame_chunks(f, lambda: zlib.decompressobj(wbits=31), (zlib.error,), "gzip member")


def _plain_chunks(f) -> Iterator[bytes]:
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            return
        yield chunk


def _raw_lines(path: str) -> Iterator[bytes]:
    """Lines (without the newline) of a .jsonl / .jsonl.zst / .jsonl.gz file; ValueError mid-way on a
    corrupt compressed stream."""
    with open(path, "rb") as f:
        if path.endswith(".zst"):
            chunks = _zstd_chunks(f)
        elif path.endswith(".gz"):
            chunks = _gzip_chunks(f)
        else:
            chunks = _plain_chunks(f)
        pending = b""
        for chunk in chunks:
            buf = pending + chunk if pending else chunk
            lines = buf.split(b"\n")
            pending = lines.pop()
            yield from lines
        if pending:
            yield pending


def iter_jsonl(path: str) -> Iterator[tuple[int, dict] | BadInput]:
    """(line number, object) for each JSON-object line, or a BadInput for each line that is not one.

    Blank lines are skipped (they hold no record). Line numbers are 1-based, as editors show them.
    """
    kind = "corrupt_zstd" if path.endswith(".zst") else "corrupt_gzip" if path.endswith(".gz") else "unreadable_file"
    lineno = 0
    try:
        for raw in _raw_lines(path):
            lineno += 1
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield BadInput("non_utf8", lineno, "line", f"not valid UTF-8 at byte {e.start}: {raw[max(0, e.start - 8):e.start + 8]!r}")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield BadInput("invalid_json", lineno, "line", f"not JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                yield BadInput("invalid_json", lineno, "line", f"a JSON {type(obj).__name__}, not an object")
                continue
            yield lineno, obj
    except ValueError as e:
        yield BadInput(kind, lineno + 1, "line", f"{e}; the rest of the file is unreadable", fatal=True)
    except OSError as e:
        yield BadInput("unreadable_file", None, "line", f"cannot read: {e}", fatal=True)


# ----------------------------------------------------------------------------- parquet

def iter_parquet_batches(
    path: str, columns: Sequence[str], *, optional: Sequence[str] = (), batch_size: int = 1024
) -> Iterator[tuple[int, Any] | BadInput]:
    """(first row number, pyarrow RecordBatch) over the file's row groups, reading only `columns`
    (+ those of `optional` that exist).

    A missing required column, an unreadable footer or an unreadable row group is yielded as a BadInput;
    after a bad row group the next one is tried, so one damaged group does not cost the whole file.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        yield BadInput("truncated_parquet", None, "row", f"parquet footer unreadable ({e}); no rows read", fatal=True)
        return
    names = set(pf.schema_arrow.names)
    missing = [c for c in columns if c not in names]
    if missing:
        yield BadInput(
            "missing_field", None, "row",
            f"column(s) {missing} not in the file (has {sorted(names)}); no rows read", fatal=True,
        )
        return
    cols: list[str] | None = list(columns) + [c for c in optional if c in names and c not in columns]
    if not columns and not optional:
        cols = None  # every column (task layouts are detected from whatever the file has)
    row = 0
    md = pf.metadata
    for rg in range(md.num_row_groups):
        n = md.row_group(rg).num_rows
        done = 0
        try:
            for batch in pf.iter_batches(batch_size=batch_size, row_groups=[rg], columns=cols, use_threads=False):
                yield row + done, batch
                done += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            yield BadInput(
                "truncated_parquet", row + done, "row",
                f"row group {rg} unreadable after {done} of its {n} rows ({e}); {n - done} rows lost",
            )
        row += n


def iter_parquet_rows(
    path: str, columns: Sequence[str], *, optional: Sequence[str] = ()
) -> Iterator[tuple[int, dict] | BadInput]:
    """(row number, dict) for each row, with strings that are not valid UTF-8 reported, not crashed on."""
    for item in iter_parquet_batches(path, columns, optional=optional):
        if isinstance(item, BadInput):
            yield item
            continue
        start, batch = item
        try:
            rows = batch.to_pylist()
        except (UnicodeDecodeError, Exception) as e:  # pyarrow raises on invalid UTF-8 in string columns
            yield from _rows_one_by_one(start, batch, e)
            continue
        for i, r in enumerate(rows):
            yield start + i, r


def _rows_one_by_one(start: int, batch: Any, first_error: Exception) -> Iterator[tuple[int, dict] | BadInput]:
    for i in range(batch.num_rows):
        try:
            yield start + i, batch.slice(i, 1).to_pylist()[0]
        except Exception as e:
            kind = "non_utf8" if isinstance(e, UnicodeDecodeError) or "utf" in str(e).lower() else "bad_field"
            yield BadInput(kind, start + i, "row", f"row does not decode: {e}")


def as_token_array(value: Any, vocab_size: int) -> tuple[np.ndarray | None, str | None]:
    """Validate pre-tokenized ids; (array, None) or (None, reason)."""
    if value is None:
        return None, "tokens is null"
    try:
        arr = np.asarray(value)
    except Exception as e:  # ragged / non-numeric
        return None, f"tokens is not a list of integers ({e})"
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        return None, f"tokens is not a flat list of integers (dtype {arr.dtype}, shape {arr.shape})"
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        return None, f"token ids outside [0, {vocab_size}): min {int(arr.min())}, max {int(arr.max())}"
    return arr.astype(np.uint32, copy=False), None


def expand_patterns(patterns: Iterable[str], suffixes: Sequence[str]) -> tuple[list[str], str]:
    """Files named by paths, globs or directories (recursively, keeping files with one of `suffixes`),
    and the input root their relative paths (in report.json, manifest.json, the split hash) start from:
    a directory input itself, a glob's directory part, a file's directory; the common root of them all.
    """
    import glob

    found: list[str] = []
    bases: list[str] = []
    for p in patterns:
        p = os.path.expanduser(p)
        if os.path.isdir(p):
            bases.append(p)
        elif any(ch in p for ch in "*?["):
            head = p.split("*")[0].split("?")[0].split("[")[0]
            bases.append(head if head.endswith(os.sep) else os.path.dirname(head))
        else:
            bases.append(os.path.dirname(p))
        if os.path.isdir(p):
            hits = []
            for root, dirs, files in os.walk(p):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                hits += [os.path.join(root, f) for f in files if f.endswith(tuple(suffixes)) and not f.startswith(".")]
            if not hits:
                raise FileNotFoundError(f"input directory {p!r} holds no {'/'.join(suffixes)} files")
        elif any(ch in p for ch in "*?["):
            hits = [m for m in glob.glob(p, recursive=True) if os.path.isfile(m)]
            if not hits:
                raise FileNotFoundError(f"input glob {p!r} matches no file")
        elif os.path.isfile(p):
            hits = [p]
        else:
            raise FileNotFoundError(f"input {p!r} is not a file, directory or glob")
        found += hits
    uniq = sorted({os.path.abspath(f) for f in found}, key=natural_key)
    root = os.path.commonpath([os.path.abspath(b or ".") for b in bases])
    return uniq, root
