"""The contract between readers and the converter: a `Record` to convert or a `BadInput` to count.

It lives in the core (not in readers/) because the core's own file-format iterators
(`grape_stream.convert.formats`) report bad lines with it, and the unit runner consumes both types;
readers re-export them from `grape_stream.convert.readers.base`.

Readers never raise on bad input: they yield a `BadInput` naming the file position and the reason, and
carry on where the format allows it (the next JSON line, the next parquet row group). A fault that
makes the rest of a file unreadable (a corrupt zstd frame, a parquet file without footer) is yielded
once with `fatal=True` and ends that file. The converter counts them per file in report.json, or stops
at the first one under `--strict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Record", "BadInput", "BAD_KINDS"]

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
    "repaired_text",      # lone surrogates / control characters fixed (text policy "repair"); the document is KEPT
    "unencodable_text",   # the same, dropped (text policy "skip")
    "record_too_large",   # a JSON line / text over --max-record-size: skipped without being held in memory
    "truncated_parquet",  # parquet footer/row group unreadable; the unreadable part is lost
    "unreadable_file",    # the file cannot be opened at all
)


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
    """One unusable record (or the unreadable rest of a file): counted in report.json, fatal under --strict."""

    kind: str
    index: int | None  # line/row where it happened, None for the whole file
    unit: str
    reason: str
    fatal: bool = False  # True: the rest of the file could not be read
    keep: Record | None = field(default=None)  # a warning-only kind still yields its record here

    def where(self) -> str:
        return f"{self.unit} {self.index}" if self.index is not None else "whole file"
