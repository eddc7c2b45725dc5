"""One work unit of a conversion: read a few input files, tokenize, pack, write MDS partitions.

A unit is the grain of parallelism and of resumption. It writes one MDS partition per (domain, split)
it meets, named after itself (`OUT/<domain>[/<split>]/<unit>/shard.*.mds.zstd`), and when everything
is written (and uploaded) it writes its done-marker `OUT/.grape_convert/units/<unit>.json` atomically.
A unit without a marker is redone from scratch, so its output never depends on where a previous run
was killed. Nothing here depends on the number of workers: packing restarts in every unit and the
split of a record is a hash of (seed, file, record index).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from grape_stream.atomic import atomic_write_json
from grape_stream.convert.errors import ConvertInputError
from grape_stream.convert.formats import DEFAULT_MAX_RECORD_BYTES, record_limit
from grape_stream.convert.layout import STATE_DIR, dataset_dir, remote_dir
from grape_stream.convert.packing import ExamplePadder, SequencePacker
from grape_stream.convert.records import BadInput, Record
from grape_stream.convert.remote import upload_partitions
from grape_stream.convert.text_policy import clean_text
from grape_stream.convert.tokenization import Tokenizer, load_tokenizer

__all__ = ["UnitJob", "ConvertInputError", "run_unit", "assign_split", "STATE_DIR", "dataset_dir", "remote_dir"]

# Test hook, documented in docs/converters.md: seconds to sleep after every tokenized batch, so a test
# can kill a conversion in the middle of a unit. Never set it in production.
_DELAY_ENV = "GRAPE_STREAM_CONVERT_TEST_DELAY"

_BATCH_DOCS = 512
_BATCH_BYTES = 4 << 20
_PROGRESS_EVERY_S = 0.5

Progress = Callable[[dict[str, Any]], None]
_Key = tuple[str, str | None]  # (domain, split)


@dataclass
class UnitJob:
    """Everything a worker process needs to run one unit (picklable)."""

    unit: str
    files: list[tuple[str, str]]  # (absolute path, path relative to the input root)
    reader: Any  # a grape_stream.convert.readers.Reader
    plan: dict[str, Any]
    local: str
    remote: str | None
    keep_local: bool
    strict: bool
    max_examples: int = 5


@dataclass
class _FileReport:
    documents: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"documents": self.documents, "bad": dict(sorted(self.bad.items())), "examples": self.examples}


def assign_split(split: dict[str, float], seed: int, relpath: str, index: int) -> str:
    """The split of one record: a uniform draw from hash(seed, file, index) against cumulative fractions.

    Depends only on the record's identity, so it is the same for any worker count and after a resume.
    """
    h = hashlib.blake2b(f"{seed}\x00{relpath}\x00{index}".encode(), digest_size=8).digest()
    u = int.from_bytes(h, "little") / 2.0**64
    acc = 0.0
    name = ""
    for name, frac in split.items():
        acc += frac
        if u < acc:
            return name
    return name  # rounding: fractions sum to 1 within 1e-9


def _clear_stale_partitions(local: str, unit: str) -> None:
    for pattern in (os.path.join(local, "*", unit), os.path.join(local, "*", "*", unit)):
        for d in glob.glob(pattern):
            if os.path.isdir(d) and not os.path.basename(os.path.dirname(d)).startswith("."):
                shutil.rmtree(d)


class _Output:
    """Packer + lazily opened MDSWriter for one (domain, split) of one unit."""

    def __init__(self, job: UnitJob, domain: str, split: str | None) -> None:
        p = job.plan
        dtype = np.dtype(p["dtype"])
        if p["per_example"]:
            self.packer: Any = ExamplePadder(p["seq_len"], p["eos_id"], dtype, eos=p["eos"])
        else:
            self.packer = SequencePacker(p["seq_len"], p["eos_id"], dtype, eos=p["eos"], remainder=p["remainder"])
        self.job = job
        self.domain = domain
        self.split = split
        self.writer: Any = None

    def _open(self) -> Any:
        from streaming import MDSWriter  # imports torch: only in the process that writes

        p = self.job.plan
        local = self.local_dir()
        if os.path.exists(local):
            shutil.rmtree(local)
        # Written locally, uploaded by `upload_partitions` once the unit is complete: one S3 client per unit
        # instead of one per partition, and no upload can land for a unit that was later killed.
        return MDSWriter(
            columns=dict(p["columns"]),
            out=local,
            compression=p["compression"],
            hashes=list(p["hashes"]) or None,
            size_limit=p["shard_size"],
        )

    def local_dir(self) -> str:
        return os.path.join(dataset_dir(self.job.local, self.domain, self.split), self.job.unit)

    def write(self, rows: np.ndarray, mask: np.ndarray | None) -> None:
        if rows.shape[0] == 0:
            return
        if self.writer is None:
            self.writer = self._open()
        if mask is None:
            for r in rows:
                self.writer.write({"tokens": r})
        else:
            for r, m in zip(rows, mask):
                self.writer.write({"tokens": r, "loss_mask": m})

    def finish(self) -> dict[str, Any]:
        if isinstance(self.packer, SequencePacker):
            self.write(*self.packer.finish())
        if self.writer is not None:
            self.writer.finish()
        return {
            "domain": self.domain,
            "split": self.split,
            "partition": self.job.unit if self.writer is not None else None,
            **self.packer.stats.as_dict(),
        }


class _Batcher:
    """Tokenizes a unit's documents in batches and feeds each (domain, split)'s packer and writer;
    reports progress (documents, tokens per domain) at most every _PROGRESS_EVERY_S seconds."""

    def __init__(self, job: UnitJob, tok: Tokenizer | None, progress: Progress | None) -> None:
        self.job = job
        self.tok = tok
        self.progress = progress
        self.delay = float(os.environ.get(_DELAY_ENV, "0") or 0)
        self.outputs: dict[_Key, _Output] = {}
        self.batch: list[tuple[_Key, Any]] = []
        self.batch_bytes = 0
        self.pending: dict[str, Any] = {"documents": 0, "tokens": {}}
        self.last_progress = time.monotonic()

    def add(self, key: _Key, payload: Any, nbytes: int) -> None:
        self.batch.append((key, payload))
        self.batch_bytes += nbytes
        if len(self.batch) >= _BATCH_DOCS or self.batch_bytes >= _BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.batch:
            return
        if self.tok is not None:
            arrays = self.tok.encode_batch([payload for _, payload in self.batch])
        else:
            arrays = [payload for _, payload in self.batch]
        grouped: dict[_Key, list[np.ndarray]] = {}
        for (key, _), arr in zip(self.batch, arrays):
            grouped.setdefault(key, []).append(arr)
        tokens = self.pending["tokens"]
        for key, docs in grouped.items():
            out = self.outputs.get(key)
            if out is None:
                out = self.outputs[key] = _Output(self.job, *key)
            before = out.packer.stats.tokens
            out.write(*_as_pair(out.packer.add(docs)))
            tokens[key[0]] = tokens.get(key[0], 0) + out.packer.stats.tokens - before
        self.pending["documents"] += len(self.batch)
        self.batch, self.batch_bytes = [], 0
        if self.delay:
            time.sleep(self.delay)
        now = time.monotonic()
        if self.progress is not None and now - self.last_progress >= _PROGRESS_EVERY_S:
            self._report()
            self.last_progress = now

    def _report(self) -> None:
        assert self.progress is not None
        self.progress(dict(self.pending, tokens=dict(self.pending["tokens"])))
        self.pending["documents"], self.pending["tokens"] = 0, {}

    def finish(self) -> list[dict[str, Any]]:
        """Close every output (in domain, split order), upload them when remote; their marker entries."""
        ordered = [self.outputs[k] for k in sorted(self.outputs, key=lambda k: (k[0], k[1] or ""))]
        results = [o.finish() for o in ordered]
        if self.job.remote:
            dirs = [o.local_dir() for o in ordered if o.writer is not None]
            upload_partitions(self.job.local, self.job.remote, dirs, keep_local=self.job.keep_local)
        if self.progress is not None:
            self._report()
        return results


def run_unit(job: UnitJob, progress: Progress | None = None) -> dict[str, Any]:
    """Convert one unit and write its done-marker; returns the marker's content."""
    plan = job.plan
    tok = None if job.reader.pretokenized else load_tokenizer(plan["tokenizer"], plan["eos_id"])
    split_fracs: dict[str, float] | None = plan["split"]
    _clear_stale_partitions(job.local, job.unit)

    batcher = _Batcher(job, tok, progress)
    reports: dict[str, _FileReport] = {}
    with record_limit(plan.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES)):  # read by the file iterators
        for path, rel in job.files:
            rep = reports[rel] = _FileReport()
            for item in job.reader.read(path):
                rec = _usable(item, rep, rel, job)
                if rec is None:
                    continue
                payload: Any
                if rec.text is not None:
                    payload, nbytes = rec.text, len(rec.text)
                else:
                    assert rec.tokens is not None  # _usable dropped records with neither
                    payload, nbytes = rec.tokens, 4 * rec.tokens.size
                split = rec.split
                if split is None and split_fracs:
                    split = assign_split(split_fracs, plan["split_seed"], rel, rec.index)
                rep.documents += 1
                batcher.add((rec.domain, split), payload, nbytes)
            batcher.flush()

    marker = {
        "unit": job.unit,
        "files": [rel for _, rel in job.files],
        "outputs": batcher.finish(),
        "report": {rel: r.as_dict() for rel, r in reports.items()},
    }
    atomic_write_json(os.path.join(job.local, STATE_DIR, "units", f"{job.unit}.json"), marker)
    return marker


def _usable(item: Record | BadInput, rep: _FileReport, rel: str, job: UnitJob) -> Record | None:
    """The record to convert, or None after counting why not (raising under --strict)."""
    if isinstance(item, BadInput):
        _report_bad(rep, rel, item, job)
        if item.keep is None:
            return None
        item = item.keep
    limit = job.plan.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES)
    if item.text is not None and len(item.text) > limit:  # a parquet cell, a field of a record (chars <= bytes)
        _report_bad(rep, rel, BadInput("record_too_large", item.index, item.unit, f"a text of {len(item.text)} "
                                       f"characters, over the record size limit of {limit} bytes: skipped"), job)
        return None
    if item.text is not None:
        cleaned = clean_text(item.text, job.plan.get("text_policy", "repair"))
        if cleaned.kind is not None:
            _report_bad(rep, rel, BadInput(cleaned.kind, item.index, item.unit, cleaned.reason), job)
            if cleaned.text is None:
                return None
            item.text = cleaned.text
        empty, why = not item.text.strip(), "empty text"
    else:
        empty, why = item.tokens is None or item.tokens.size == 0, "no tokens"
    if empty:
        _report_bad(rep, rel, BadInput("empty_document", item.index, item.unit, why), job)
        return None
    return item


def _report_bad(rep: _FileReport, rel: str, bad: BadInput, job: UnitJob) -> None:
    _count_bad(rep, rel, bad, job.max_examples)
    if job.strict:
        raise ConvertInputError(f"{rel}: {bad.where()}: {bad.kind}: {bad.reason}")


def _as_pair(x: Any) -> tuple[np.ndarray, np.ndarray | None]:
    return x if isinstance(x, tuple) else (x, None)


def _count_bad(rep: _FileReport, rel: str, bad: BadInput, max_examples: int) -> None:
    rep.bad[bad.kind] = rep.bad.get(bad.kind, 0) + 1
    if sum(1 for e in rep.examples if e["kind"] == bad.kind) < max_examples:
        ex: dict[str, Any] = {"file": rel, "kind": bad.kind, "reason": bad.reason}
        if bad.index is not None:
            ex[bad.unit] = bad.index
        rep.examples.append(ex)
