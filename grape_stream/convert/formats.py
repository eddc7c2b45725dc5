"""Fault-tolerant iteration over the file formats corpora ship in: JSON lines (plain, .zst, .gz) and parquet.

Every reader needs the same two things from a file: the records that decode, and a `BadInput` for each
part that does not (with its line or row), so one bad line or row group never costs the whole corpus.
pyarrow is imported on first use: `grape-stream convert --help` and the JSON-lines path never pay for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import zlib
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator, Sequence

import zstandard

from grape_stream.convert.records import BadInput

__all__ = ["DEFAULT_MAX_RECORD_BYTES", "LineTooLong", "iter_jsonl", "iter_parquet_batches", "iter_parquet_rows",
           "raw_lines", "record_limit"]

_CHUNK = 1 << 16
#: The largest record (a JSON line, a text) converted by default: larger ones are skipped and counted.
DEFAULT_MAX_RECORD_BYTES = 64 << 20
_MAX_RECORD: contextvars.ContextVar[int] = contextvars.ContextVar("max_record_bytes", default=DEFAULT_MAX_RECORD_BYTES)


@contextlib.contextmanager
def record_limit(max_bytes: int) -> Iterator[None]:
    """Records over ``max_bytes`` read inside the block are skipped (``record_too_large``): set by the unit
    that converts (from the plan), read by every reader's file iterator without passing it through each."""
    token = _MAX_RECORD.set(int(max_bytes))
    try:
        yield
    finally:
        _MAX_RECORD.reset(token)


def max_record_bytes() -> int:
    return _MAX_RECORD.get()


# ----------------------------------------------------------------------------- compressed streams
#: Compressed bytes handed to one zstd decompress() call: zstd expands at most ~32768x (an RLE block), so
#: one call yields at most ~16 MiB, whatever the file (an 8 KB frame can hold 256 MiB of one byte).
_ZSTD_SLICE = 512
#: The most bytes one gzip decompress() call may return (zlib stops there and keeps the rest of its input).
_GZIP_OUT = 1 << 20


def _frame_chunks(
    f: IO[bytes], new_decoder: Callable[[], Any], errors: tuple[type[BaseException], ...], what: str,
    step: Callable[[Any, memoryview], tuple[bytes, int, bool]],
) -> Iterator[bytes]:
    """Decompressed bytes of a multi-frame (zstd) or multi-member (gzip) stream, each decode call bounded
    (``step`` decodes a bounded part: its output, the input bytes it consumed, whether it holds more output
    for the same input): yields what decodes in pieces of about 64 KiB, then raises ValueError on a corrupt
    or truncated frame (zstandard's stream reader, for one, silently returns a truncated file's prefix)."""
    obj = new_decoder()
    fed = False
    out: list[bytes] = []
    held = 0
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        view, pos, more = memoryview(chunk), 0, False
        while pos < len(view) or more:
            try:
                piece, used, more = step(obj, view[pos:])
            except errors as e:
                raise ValueError(f"{what} does not decode: {e}") from e
            pos += used
            fed = True
            if piece:
                out.append(piece)
                held += len(piece)
                if held >= _CHUNK:
                    yield b"".join(out)
                    out, held = [], 0
            if obj.eof:
                obj, fed, more = new_decoder(), False, False
    if out:
        yield b"".join(out)
    if fed:
        raise ValueError(f"file ends inside a {what} (truncated download?)")


def _zstd_step(obj: Any, data: memoryview) -> tuple[bytes, int, bool]:
    part = data[:_ZSTD_SLICE]
    out = obj.decompress(part)
    return out, len(part) - len(obj.unused_data) if obj.eof else len(part), False


def _gzip_step(obj: Any, data: memoryview) -> tuple[bytes, int, bool]:
    out = obj.decompress(data, _GZIP_OUT)
    if obj.eof:
        return out, len(data) - len(obj.unused_data), False
    return out, len(data) - len(obj.unconsumed_tail), len(out) == _GZIP_OUT


def _zstd_chunks(f: IO[bytes]) -> Iterator[bytes]:
    dctx = zstandard.ZstdDecompressor()
    return _frame_chunks(f, dctx.decompressobj, (zstandard.ZstdError,), "zstd frame", _zstd_step)


def _gzip_chunks(f: IO[bytes]) -> Iterator[bytes]:
    return _frame_chunks(f, lambda: zlib.decompressobj(wbits=31), (zlib.error,), "gzip member", _gzip_step)


def _plain_chunks(f: IO[bytes]) -> Iterator[bytes]:
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            return
        yield chunk


@dataclass(frozen=True, slots=True)
class LineTooLong:
    """A line over the record size limit, skipped without being held in memory (its length in bytes)."""

    nbytes: int


def raw_lines(path: str, max_bytes: int | None = None) -> Iterator[bytes | LineTooLong]:
    """Lines (without the newline) of a .jsonl / .jsonl.zst / .jsonl.gz file; ValueError mid-way on a
    corrupt compressed stream. A line longer than ``max_bytes`` comes as a :class:`LineTooLong`: its bytes
    are dropped as they arrive, so memory stays bounded by the limit. Linear in the file's size: a long
    line is kept as the list of its pieces until its newline arrives (joined once)."""
    with open(path, "rb") as f:
        if path.endswith(".zst"):
            chunks = _zstd_chunks(f)
        elif path.endswith(".gz"):
            chunks = _gzip_chunks(f)
        else:
            chunks = _plain_chunks(f)
        limit = max_bytes if max_bytes is not None else float("inf")
        pending: list[bytes] = []
        size = 0  # bytes of the line so far (dropped ones too, once over the limit)
        for chunk in chunks:
            lines = chunk.split(b"\n")
            last = lines.pop()
            if lines:
                first = lines[0]
                size += len(first)
                if size > limit:
                    yield LineTooLong(size)
                else:
                    yield b"".join((*pending, first)) if pending else first
                if len(chunk) > limit:
                    yield from (LineTooLong(len(x)) if len(x) > limit else x for x in lines[1:])
                else:
                    yield from lines[1:]
                pending, size = [], 0
            size += len(last)
            if size > limit:
                pending = []
            elif last:
                pending.append(last)
        if size > limit:
            yield LineTooLong(size)
        elif pending:
            yield b"".join(pending)


def _decode_line(raw: bytes, lineno: int) -> dict | BadInput:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadInput("non_utf8", lineno, "line",
                        f"not valid UTF-8 at byte {e.start}: {raw[max(0, e.start - 8):e.start + 8]!r}")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return BadInput("invalid_json", lineno, "line", f"not JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return BadInput("invalid_json", lineno, "line", f"a JSON {type(obj).__name__}, not an object")
    return obj


def iter_jsonl(path: str) -> Iterator[tuple[int, dict] | BadInput]:
    """(line number, object) for each JSON-object line, or a BadInput for each line that is not one.

    Blank lines are skipped (they hold no record). Line numbers are 1-based, as editors show them.
    """
    kind = "corrupt_zstd" if path.endswith(".zst") else "corrupt_gzip" if path.endswith(".gz") else "unreadable_file"
    lineno = 0
    limit = _MAX_RECORD.get()
    try:
        for raw in raw_lines(path, limit):
            lineno += 1
            if isinstance(raw, LineTooLong):
                yield BadInput("record_too_large", lineno, "line", f"{raw.nbytes} bytes, over the record size limit "
                               f"of {limit} bytes (--max-record-size): skipped")
                continue
            if not raw.strip():
                continue
            obj = _decode_line(raw, lineno)
            yield obj if isinstance(obj, BadInput) else (lineno, obj)
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
