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
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from grape_stream.convert.packing import ExamplePadder, SequencePacker

__all__ = ["UnitJob", "ConvertInputError", "run_unit", "assign_split", "atomic_write_json", "STATE_DIR"]

STATE_DIR = ".grape_convert"

# Test hook, documented in docs/converters.md: seconds to sleep after every tokenized batch, so a test
# can kill a conversion in the middle of a unit. Never set it in production.
_DELAY_ENV = "GRAPE_STREAM_CONVERT_TEST_DELAY"

_BATCH_DOCS = 512
_BATCH_BYTES = 4 << 20
_PROGRESS_EVERY_S = 0.5


class ConvertInputError(ValueError):
    """Bad input under --strict: the message names the file, the line/row and what is wrong."""


@dataclass
class UnitJob:
    """Everything a worker process needs to run one unit (picklable)."""

    unit: str
    files: list[tuple[str, str]]  # (absolute path, path relative to the input root)
    reader: Any  # a converters.Reader
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


def atomic_write_json(path: str, obj: Any) -> None:
    """Write JSON so that readers see the old file or the whole new one, never a torn one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def dataset_dir(root: str, domain: str, split: str | None) -> str:
    return os.path.join(root, domain, split) if split else os.path.join(root, domain)


def remote_dir(root: str, domain: str, split: str | None) -> str:
    return "/".join([root.rstrip("/"), domain] + ([split] if split else []))


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
        from streaming import MDSWriter

        job, p = self.job, self.job.plan
        local = self.local_dir()
        if os.path.exists(local):
            shutil.rmtree(local)
        # Written locally, uploaded by `_upload_unit` once the unit is complete: one S3 client per unit
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


def run_unit(job: UnitJob, progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Convert one unit and write its done-marker; returns the marker's content."""
    from grape_stream.convert.readers.common import BadInput
    from grape_stream.convert.tokenization import load_tokenizer

    plan = job.plan
    tok = None if job.reader.pretokenized else load_tokenizer(plan["tokenizer"], plan["eos_id"])
    split_fracs: dict[str, float] | None = plan["split"]
    delay = float(os.environ.get(_DELAY_ENV, "0") or 0)
    _clear_stale_partitions(job.local, job.unit)

    outputs: dict[tuple[str, str | None], _Output] = {}
    reports: dict[str, _FileReport] = {}
    batch: list[tuple[tuple[str, str | None], Any]] = []
    batch_bytes = 0
    pending_progress: dict[str, Any] = {"documents": 0, "tokens": {}}
    last_progress = time.monotonic()

    def flush() -> None:
        nonlocal batch, batch_bytes, last_progress
        if not batch:
            return
        if tok is not None:
            arrays = tok.encode_batch([payload for _, payload in batch])
        else:
            arrays = [payload for _, payload in batch]
        grouped: dict[tuple[str, str | None], list[np.ndarray]] = {}
        for (key, _), arr in zip(batch, arrays):
            grouped.setdefault(key, []).append(arr)
        for key, docs in grouped.items():
            out = outputs.get(key)
            if out is None:
                out = outputs[key] = _Output(job, *key)
            before = out.packer.stats.tokens
            out.write(*_as_pair(out.packer.add(docs)))
            toks = pending_progress["tokens"]
            toks[key[0]] = toks.get(key[0], 0) + out.packer.stats.tokens - before
        pending_progress["documents"] += len(batch)
        batch, batch_bytes = [], 0
        if delay:
            time.sleep(delay)
        now = time.monotonic()
        if progress is not None and now - last_progress >= _PROGRESS_EVERY_S:
            progress(dict(pending_progress, tokens=dict(pending_progress["tokens"])))
            pending_progress["documents"], pending_progress["tokens"] = 0, {}
            last_progress = now

    for path, rel in job.files:
        rep = reports[rel] = _FileReport()
        for item in job.reader.read(path):
            if isinstance(item, BadInput):
                _count_bad(rep, rel, item, job.max_examples)
                if job.strict:
                    raise ConvertInputError(f"{rel}: {item.where()}: {item.kind}: {item.reason}")
                if item.keep is None:
                    continue
                item = item.keep
            if item.text is not None:
                if not item.text.strip():
                    bad = BadInput("empty_document", item.index, item.unit, "empty text")
                    _count_bad(rep, rel, bad, job.max_examples)
                    if job.strict:
                        raise ConvertInputError(f"{rel}: {bad.where()}: empty_document: {bad.reason}")
                    continue
                payload: Any = item.text
                batch_bytes += len(item.text)
            else:
                if item.tokens is None or item.tokens.size == 0:
                    bad = BadInput("empty_document", item.index, item.unit, "no tokens")
                    _count_bad(rep, rel, bad, job.max_examples)
                    if job.strict:
                        raise ConvertInputError(f"{rel}: {bad.where()}: empty_document: {bad.reason}")
                    continue
                payload = item.tokens
                batch_bytes += 4 * item.tokens.size
            split = item.split
            if split is None and split_fracs:
                split = assign_split(split_fracs, plan["split_seed"], rel, item.index)
            batch.append(((item.domain, split), payload))
            rep.documents += 1
            if len(batch) >= _BATCH_DOCS or batch_bytes >= _BATCH_BYTES:
                flush()
        flush()

    ordered = [outputs[k] for k in sorted(outputs, key=lambda k: (k[0], k[1] or ""))]
    results = [o.finish() for o in ordered]
    if job.remote:
        _upload_unit(job, [o.local_dir() for o in ordered if o.writer is not None])
    if progress is not None:
        progress(dict(pending_progress, tokens=dict(pending_progress["tokens"])))
    marker = {
        "unit": job.unit,
        "files": [rel for _, rel in job.files],
        "outputs": results,
        "report": {rel: r.as_dict() for rel, r in reports.items()},
    }
    atomic_write_json(os.path.join(job.local, STATE_DIR, "units", f"{job.unit}.json"), marker)
    return marker


def _as_pair(x: Any) -> tuple[np.ndarray, np.ndarray | None]:
    return x if isinstance(x, tuple) else (x, None)


def _count_bad(rep: _FileReport, rel: str, bad: Any, max_examples: int) -> None:
    rep.bad[bad.kind] = rep.bad.get(bad.kind, 0) + 1
    if sum(1 for e in rep.examples if e["kind"] == bad.kind) < max_examples:
        ex: dict[str, Any] = {"file": rel, "kind": bad.kind, "reason": bad.reason}
        if bad.index is not None:
            ex[bad.unit] = bad.index
        rep.examples.append(ex)


def _upload_unit(job: UnitJob, dirs: list[str]) -> None:
    """Upload a finished unit's partitions (shards first, each partition's index.json last) with
    streaming's uploader; local shards are then deleted unless keep_local, the small index.json files
    stay (finalising merges them without downloading)."""
    from concurrent.futures import ThreadPoolExecutor

    from streaming.base.storage.upload import CloudUploader

    cu = CloudUploader.get((job.local, job.remote), keep_local=True, exist_ok=True)
    shards, indexes = [], []
    for d in dirs:
        for name in sorted(os.listdir(d)):
            rel = os.path.relpath(os.path.join(d, name), job.local).replace(os.sep, "/")
            (indexes if name == "index.json" else shards).append(rel)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(cu.upload_file, shards))
        list(pool.map(cu.upload_file, indexes))
    if not job.keep_local:
        for rel in shards:
            os.remove(os.path.join(job.local, rel))
