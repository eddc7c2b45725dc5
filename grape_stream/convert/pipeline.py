"""Convert a corpus into per-domain MDS datasets, locally or straight to object storage.

    result = convert("jsonl", ["data/*.jsonl.zst"], "out/", tokenizer="bytes", seq_len=256,
                     domain_field="lang", split_field="split", workers=2)

Pipeline: a reader (grape_stream.convert.readers) turns files into records -> tokenize in batches -> pack
into seq_len rows (or pad per example for tasks) -> one MDSWriter per (work unit, domain, split) ->
streaming's `merge_index` joins a domain's unit partitions once all of them are written.

Why work units: the input files are cut into units (`files_per_unit` files each, in sorted order). A
unit is converted by one process start to finish and leaves a done-marker; a re-run after a kill skips
marked units and redoes the rest from scratch, so it ends byte-identical to an uninterrupted run, and
the output is the same for any `workers`. Packing restarts per unit: the last partial sequence of each
(unit, domain, split) is dropped (or padded with `remainder="pad"`) -- less than seq_len tokens per
unit and domain. A domain is finalised (its index.json merged) as soon as every unit that can hold it
is done; `manifest.json` is written last, atomically, and lists only finalised domains.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import sys
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from grape_stream.convert.unit import (
    STATE_DIR,
    ConvertInputError,
    UnitJob,
    atomic_write_json,
    dataset_dir,
    remote_dir,
    run_unit,
)
from grape_stream.convert.packing import EOS_MODES, REMAINDER_MODES, PackStats

__all__ = ["convert", "ConvertResult", "ConvertInputError", "ConvertStateError", "CONVERTER_VERSION", "parse_split", "format_table"]

CONVERTER_VERSION = 1
log = logging.getLogger(__name__)


class ConvertStateError(RuntimeError):
    """OUT holds something this run must not overwrite (another conversion, or foreign files)."""


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


def parse_split(spec: str | dict[str, float] | None, holdout: float | None = None) -> dict[str, float] | None:
    """`"train=0.8,probe=0.1,test=0.1"` -> ordered fractions summing to 1; `holdout=f` -> train/val."""
    if holdout is not None:
        if spec is not None:
            raise ValueError("--holdout and --split are exclusive (--holdout F is --split train=1-F,val=F)")
        if not 0.0 < holdout < 1.0:
            raise ValueError(f"--holdout must be a fraction in (0, 1), got {holdout}")
        return {"train": 1.0 - holdout, "val": holdout}
    if spec is None:
        return None
    if isinstance(spec, str):
        out: dict[str, float] = {}
        for part in spec.split(","):
            name, eq, frac = part.partition("=")
            name = name.strip()
            if not eq or not name:
                raise ValueError(f"--split expects name=fraction[,name=fraction...], got {spec!r}")
            try:
                out[name] = float(frac)
            except ValueError:
                raise ValueError(f"--split: {frac!r} is not a number (in {spec!r})") from None
    else:
        out = {str(k): float(v) for k, v in spec.items()}
    from grape_stream.convert.readers.common import check_domain_name

    for name, frac in out.items():
        why = check_domain_name(name)
        if why:
            raise ValueError(f"--split name: {why.replace('domain', 'split')}")
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"--split fraction for {name!r} must be in (0, 1], got {frac}")
    if abs(sum(out.values()) - 1.0) > 1e-6:
        raise ValueError(f"--split fractions must sum to 1, got {sum(out.values())} in {out}")
    return out


def _size_bytes(size: int | str) -> int:
    from streaming.base.util import bytes_to_int

    return int(bytes_to_int(size))


def _is_remote(out: str) -> bool:
    return urllib.parse.urlparse(out).scheme not in ("", "file") and "://" in out


def _default_local(remote: str) -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha1(remote.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(cache, "grape_stream", "convert", digest)


@contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """streaming's merge_index logs a WARNING on the root logger per call ("A temporary folder ...")."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        root.setLevel(level)


# ----------------------------------------------------------------------------------------------- API

def convert(
    source: str,
    inputs: str | Sequence[str],
    out: str,
    *,
    tokenizer: str = "gpt2",
    eos_id: int | None = None,
    seq_len: int = 1024,
    eos: str = "auto",
    remainder: str = "drop",
    per_example: bool | None = None,
    holdout: float | None = None,
    split: str | dict[str, float] | None = None,
    split_seed: int = 0,
    split_field: str | None = None,
    split_from_path: bool = False,
    domain: str | None = None,
    domain_field: str | None = None,
    text_field: str | None = None,
    markers: str | None = None,
    layout: str | None = None,
    workers: int = 1,
    files_per_unit: int = 1,
    compression: str | None = "zstd",
    shard_size: int | str = "64mb",
    hashes: Sequence[str] = (),
    local: str | None = None,
    keep_local: bool = False,
    strict: bool = False,
    overwrite: bool = False,
    max_examples: int = 5,
    progress: bool = True,
) -> ConvertResult:
    """Convert `inputs` (paths, globs or directories) of one `source` layout into MDS under `out`.

    source: slimpajama | climblab | climbmix | wiki40b | jsonl | parquet | task.
    out: a local directory, or a remote URL (s3://bucket/prefix; endpoint from S3_ENDPOINT_URL) with
        `local` as the staging directory (default: ~/.cache/grape_stream/convert/<hash of out>), which
        also holds the resume state.
    Re-running with the same arguments resumes (or returns at once if complete); different arguments on
    the same `out` raise ConvertStateError unless `overwrite`. See docs/converters.md for every option.
    """
    from grape_stream.convert.readers import build_reader
    from grape_stream.convert.readers.common import check_domain_name, expand_patterns
    from grape_stream.convert.tokenization import GPT2_EOS_ID, load_tokenizer, token_dtype

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if files_per_unit < 1:
        raise ValueError(f"files_per_unit must be >= 1, got {files_per_unit}")
    if eos not in EOS_MODES:
        raise ValueError(f"eos must be one of {EOS_MODES}, got {eos!r}")
    if remainder not in REMAINDER_MODES:
        raise ValueError(f"remainder must be one of {REMAINDER_MODES}, got {remainder!r}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if domain is not None and check_domain_name(domain):
        raise ValueError(f"--domain: {check_domain_name(domain)}")
    reader = build_reader(
        source, split_from_path=split_from_path, domain=domain, domain_field=domain_field,
        split_field=split_field, text_field=text_field, markers=markers, layout=layout,
    )
    from streaming.base.compression import is_compression
    from streaming.base.hashing import is_hash

    if compression and not is_compression(compression):
        raise ValueError(f"unknown compression {compression!r} (e.g. zstd, zstd:7, gz, br, snappy, or none)")
    for h in hashes:
        if not is_hash(h):
            raise ValueError(f"unknown hash {h!r} (e.g. sha1, md5, xxh64)")
    split_fracs = parse_split(split, holdout)
    if split_fracs and (split_field or split_from_path):
        raise ValueError("--split/--holdout assign splits by hash; --split-field/--split-from-path read them from the data: pick one")
    if per_example is None:
        per_example = reader.per_example
    if per_example and remainder != "drop":
        raise ValueError("remainder applies to packed sequences; per-example samples are always padded")

    if reader.pretokenized:
        if tokenizer != "gpt2":
            raise ValueError(f"{source} is already tokenized with GPT-2; --tokenizer must be gpt2, got {tokenizer!r}")
        tok_name, vocab_size, eos_final = "gpt2", 50257, GPT2_EOS_ID if eos_id is None else int(eos_id)
        if eos_final != GPT2_EOS_ID:
            raise ValueError(f"{source} uses GPT-2 ids; its EOS id is {GPT2_EOS_ID}")
    else:
        tok = load_tokenizer(tokenizer, eos_id)
        tok_name, vocab_size, eos_final = tok.name, tok.vocab_size, tok.eos_id
    dtype = token_dtype(vocab_size)
    columns = {"tokens": f"ndarray:{dtype.name}"}
    if per_example or remainder == "pad":
        columns["loss_mask"] = "ndarray:uint8"

    files, root = expand_patterns([inputs] if isinstance(inputs, str) else list(inputs), reader.patterns)
    rels = [os.path.relpath(f, root) for f in files]

    remote = out.rstrip("/") if _is_remote(out) else None
    local_root = os.path.abspath(os.path.expanduser(local or (_default_local(out) if remote else out)))
    if remote:
        _check_remote(remote)

    plan: dict[str, Any] = {
        "converter_version": CONVERTER_VERSION,
        "source": source,
        "reader": reader.describe(),
        "tokenizer": tok_name,
        "vocab_size": int(vocab_size),
        "eos_id": int(eos_final),
        "dtype": dtype.name,
        "columns": columns,
        "seq_len": int(seq_len),
        "eos": eos,
        "remainder": remainder,
        "per_example": bool(per_example),
        "split": split_fracs,
        "split_seed": int(split_seed),
        "split_by": "hash" if split_fracs else "field" if split_field else "path" if split_from_path else None,
        "compression": compression or None,
        "shard_size": _size_bytes(shard_size),
        "hashes": sorted(hashes),
        "files_per_unit": int(files_per_unit),
        "input_root": root,
        "inputs": [[rel, os.path.getsize(f)] for f, rel in zip(files, rels)],
        "remote": remote,
    }
    state = os.path.join(local_root, STATE_DIR)
    _prepare_out(local_root, state, plan, overwrite)

    manifest_path = os.path.join(local_root, "manifest.json")
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        with open(os.path.join(local_root, "report.json")) as f:
            report = json.load(f)
        if remote:
            _upload(local_root, remote, ["report.json", "manifest.json"])
        n = len(_units(files, rels, files_per_unit))
        return ConvertResult(out=remote or local_root, local=local_root, manifest=manifest, report=report, units_skipped=n)

    units = _units(files, rels, files_per_unit)
    done = _load_markers(state, [u for u, _ in units])
    jobs = [
        UnitJob(unit=u, files=fs, reader=reader, plan=plan, local=local_root, remote=remote,
                keep_local=keep_local, strict=strict, max_examples=max_examples)
        for u, fs in units if u not in done
    ]

    # Which units may write a domain: known up front when the path decides the domain.
    unit_domains: dict[str, set[str] | None] = {}
    for u, fs in units:
        ds = {reader.path_domain(p) for p, _ in fs}
        unit_domains[u] = None if None in ds else ds  # type: ignore[assignment]
    finaliser = _Finaliser(local_root, remote, state, units, unit_domains, done)

    # The pool is started (workers forked) before any progress-bar thread exists in this process.
    with _Runner(jobs, workers) as runner:
        bars = _Progress(enabled=progress, total_units=len(units), done_units=len(done), done_markers=done.values())
        try:
            finaliser.finalise_ready()
            for marker in runner.results(bars.update):
                done[marker["unit"]] = marker
                bars.unit_done(marker)
                finaliser.unit_done(marker)
            finaliser.finalise_ready(final=True)
        finally:
            bars.close()

    report = _build_report(plan, units, done)
    manifest = _build_manifest(plan, finaliser.domain_stats, report)
    atomic_write_json(os.path.join(local_root, "report.json"), report)
    atomic_write_json(manifest_path, manifest)  # last: its presence means "complete"
    if remote:
        _upload(local_root, remote, ["report.json", "manifest.json"])
    return ConvertResult(
        out=remote or local_root, local=local_root, manifest=manifest, report=report,
        units_run=len(jobs), units_skipped=len(units) - len(jobs),
    )


# ------------------------------------------------------------------------------------- state, units

def _prepare_out(local_root: str, state: str, plan: dict[str, Any], overwrite: bool) -> None:
    plan_path = os.path.join(state, "plan.json")
    if os.path.isdir(local_root) and os.listdir(local_root):
        if not os.path.exists(plan_path):
            raise ConvertStateError(
                f"{local_root} is not empty and holds no grape-stream conversion ({STATE_DIR}/plan.json); "
                "choose an empty or new directory"
            )
        with open(plan_path) as f:
            old = json.load(f)
        new = json.loads(json.dumps(plan))
        if old != new and not overwrite:
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise ConvertStateError(
                f"{local_root} holds a conversion with different settings ({', '.join(diff)}); "
                "pass overwrite=True / --overwrite to start over, or choose another output"
            )
        if overwrite:
            for name in os.listdir(local_root):
                p = os.path.join(local_root, name)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    os.makedirs(os.path.join(state, "units"), exist_ok=True)
    if not os.path.exists(plan_path):
        atomic_write_json(plan_path, plan)


def _units(files: list[str], rels: list[str], per_unit: int) -> list[tuple[str, list[tuple[str, str]]]]:
    pairs = list(zip(files, rels))
    return [(f"part-{i // per_unit:05d}", pairs[i:i + per_unit]) for i in range(0, len(pairs), per_unit)]


def _load_markers(state: str, unit_ids: list[str]) -> dict[str, dict[str, Any]]:
    done = {}
    for u in unit_ids:
        p = os.path.join(state, "units", f"{u}.json")
        if os.path.exists(p):
            with open(p) as f:
                done[u] = json.load(f)
    return done


def _check_remote(remote: str) -> None:
    """Fail before any work when the bucket is unreachable (wrong endpoint, missing bucket, no creds)."""
    from streaming.base.storage.upload import CloudUploader

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            CloudUploader.get((tmp, remote), exist_ok=True)
        except Exception as e:
            endpoint = os.environ.get("S3_ENDPOINT_URL", "(default AWS)")
            raise ConnectionError(f"cannot write to {remote} (S3_ENDPOINT_URL={endpoint}): {e}") from e


def _upload(local_root: str, remote: str, names: list[str]) -> None:
    from streaming.base.storage.upload import CloudUploader

    cu = CloudUploader.get((local_root, remote), keep_local=True, exist_ok=True)
    for name in names:  # in order: the manifest last
        cu.upload_file(name)


# ------------------------------------------------------------------------------------------ running

def _worker_init(q: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates the pool
    # One core per worker: parallelism comes from --workers, not from tokenizers' own thread pool.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    global _QUEUE
    _QUEUE = q


_QUEUE: Any = None


def _worker_run(job: UnitJob) -> dict[str, Any]:
    def report(p: dict[str, Any]) -> None:
        _QUEUE.put(p)

    return run_unit(job, report)


def _start_method() -> str:
    """fork where available: workers start in milliseconds instead of re-importing torch (via
    streaming) for seconds each. GRAPE_STREAM_CONVERT_START_METHOD=spawn|forkserver overrides it."""
    env = os.environ.get("GRAPE_STREAM_CONVERT_START_METHOD")
    if env:
        return env
    return "fork" if "fork" in mp.get_all_start_methods() and sys.platform != "darwin" else "spawn"


@contextmanager
def _no_tokenizer_threads_in_children() -> Iterator[None]:
    """Workers are forked while this is set, so each tokenizes on one thread (parallelism comes from
    --workers) and tokenizers does not warn about forking after its thread pool was used."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


class _Runner:
    """Runs units and yields their markers as they complete: in this process for one worker (or one
    unit), else in a process pool whose workers each run whole units."""

    def __init__(self, jobs: list[UnitJob], workers: int) -> None:
        self.jobs = jobs
        self.workers = min(workers, len(jobs))
        self.pool: Any = None
        self.queue: Any = None

    def __enter__(self) -> "_Runner":
        if self.workers > 1:
            ctx = mp.get_context(_start_method())
            self.queue = ctx.Queue()
            with _no_tokenizer_threads_in_children():
                self.pool = ctx.Pool(self.workers, initializer=_worker_init, initargs=(self.queue,))
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.pool is not None:
            if exc_type is None:
                self.pool.close()
            else:
                self.pool.terminate()  # an error (or Ctrl-C): stop the other units now; they are redone on resume
            self.pool.join()

    def _drain(self, on_progress: Callable[[dict[str, Any]], None], timeout: float) -> None:
        try:
            while True:
                on_progress(self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait())
        except queue_mod.Empty:
            pass

    def results(self, on_progress: Callable[[dict[str, Any]], None]) -> Iterator[dict[str, Any]]:
        if self.pool is None:
            for job in self.jobs:
                yield run_unit(job, on_progress)
            return
        pending = [self.pool.apply_async(_worker_run, (job,)) for job in self.jobs]
        while pending:
            self._drain(on_progress, 0.1)
            still = []
            for res in pending:
                if res.ready():
                    yield res.get()  # re-raises a worker's exception (e.g. --strict) here
                else:
                    still.append(res)
            pending = still
        self._drain(on_progress, 0.0)


# ------------------------------------------------------------------------------------- finalising

class _Finaliser:
    """Merges a domain's partitions into its index.json once every unit that may hold it is done."""

    def __init__(self, local: str, remote: str | None, state: str, units: list, unit_domains: dict, done: dict) -> None:
        self.local = local
        self.remote = remote
        self.state = state
        self.position = {u: i for i, (u, _) in enumerate(units)}
        self.done = done
        # Incremental bookkeeping, so each finished unit costs O(its outputs), not O(all units).
        self.unknown_pending = sum(1 for u, _ in units if unit_domains[u] is None and u not in done)
        self.waiting: dict[str, int] = {}  # domain -> units not done that may hold it (path-decided)
        self.unit_domains = unit_domains
        for u, _ in units:
            if u not in done and unit_domains[u] is not None:
                for d in unit_domains[u]:
                    self.waiting[d] = self.waiting.get(d, 0) + 1
        self.outputs: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for u, marker in done.items():
            self._index(u, marker)
        self.domain_stats: dict[str, dict[str | None, dict[str, Any]]] = {}
        ddir = os.path.join(state, "domains")
        for name in sorted(os.listdir(ddir)) if os.path.isdir(ddir) else []:
            if name.endswith(".json"):
                with open(os.path.join(ddir, name)) as f:
                    d = json.load(f)
                self.domain_stats[d["domain"]] = {s["split"]: s for s in d["splits"]}

    def _index(self, unit: str, marker: dict[str, Any]) -> None:
        for o in marker["outputs"]:
            self.outputs.setdefault(o["domain"], []).append((self.position[unit], o))

    def unit_done(self, marker: dict[str, Any]) -> None:
        u = marker["unit"]
        self._index(u, marker)
        if self.unit_domains[u] is None:
            self.unknown_pending -= 1
        else:
            for d in self.unit_domains[u]:
                self.waiting[d] -= 1
        self.finalise_ready()

    def finalise_ready(self, final: bool = False) -> None:
        if final and (len(self.done) != len(self.position) or self.unknown_pending or any(self.waiting.values())):
            raise RuntimeError("internal error: finalising before every unit is done")
        if self.unknown_pending:
            return  # a unit whose domains only its records tell is still running: any domain may grow
        for dom in sorted(self.outputs):
            if dom not in self.domain_stats and not self.waiting.get(dom, 0):
                self._finalise(dom)

    def _finalise(self, dom: str) -> None:
        from streaming.base.util import merge_index

        per_split: dict[str | None, list[dict[str, Any]]] = {}
        for _, o in sorted(self.outputs[dom], key=lambda t: t[0]):  # unit order, whatever order they finished in
            per_split.setdefault(o["split"], []).append(o)
        splits = []
        for sp in sorted(per_split, key=lambda s: s or ""):
            outs = per_split[sp]
            stats = PackStats()
            for o in outs:
                stats.add(PackStats.from_dict(o))
            ddir = dataset_dir(self.local, dom, sp)
            parts = [o["partition"] for o in outs if o["partition"]]
            os.makedirs(ddir, exist_ok=True)
            if parts:
                if self.remote:
                    rdir = remote_dir(self.remote, dom, sp)
                    urls: list[Any] = [(os.path.join(ddir, p, "index.json"), f"{rdir}/{p}/index.json") for p in parts]
                    target: Any = (ddir, rdir)
                else:
                    urls = [os.path.join(ddir, p, "index.json") for p in parts]
                    target = ddir
                with _quiet_root_logger():
                    merge_index(urls, target, keep_local=True)
            else:
                # Documents but no full sequence: an empty (valid) MDS index, flagged in the manifest.
                atomic_write_json(os.path.join(ddir, "index.json"), {"version": 2, "shards": []})
                if self.remote:
                    _upload(ddir, remote_dir(self.remote, dom, sp), ["index.json"])
            rel = os.path.relpath(ddir, self.local)
            splits.append({"split": sp, "path": rel.replace(os.sep, "/"), "partitions": len(parts), **stats.as_dict()})
        atomic_write_json(os.path.join(self.state, "domains", f"{dom}.json"), {"domain": dom, "splits": splits})
        self.domain_stats[dom] = {s["split"]: s for s in splits}


# ----------------------------------------------------------------------------------- report/manifest

def _build_report(plan: dict[str, Any], units: list, done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    files: dict[str, Any] = {}
    totals: dict[str, int] = {}
    docs = 0
    for u, _ in units:
        for rel, r in done[u]["report"].items():
            files[rel] = r
            docs += r["documents"]
            for k, n in r["bad"].items():
                totals[k] = totals.get(k, 0) + n
    return {
        "source": plan["source"],
        "files": files,
        "totals": {"files": len(files), "documents": docs, "bad": dict(sorted(totals.items()))},
    }


def _build_manifest(plan: dict[str, Any], domain_stats: dict, report: dict[str, Any]) -> dict[str, Any]:
    from grape_stream import __version__
    from grape_stream.convert.readers.common import natural_key

    domains: dict[str, Any] = {}
    warnings: list[str] = []
    totals = PackStats()
    for dom in sorted(domain_stats, key=natural_key):
        splits = domain_stats[dom]
        agg = PackStats()
        for s in splits.values():
            agg.add(PackStats.from_dict(s))
            if s["samples"] == 0:
                warnings.append(f"{s['path']}: {s['documents']} documents but no complete sample (seq_len too long?)")
        totals.add(agg)
        entry: dict[str, Any] = {"path": dom, **agg.as_dict()}
        if None not in splits:
            entry["splits"] = {
                sp: {k: v for k, v in s.items() if k != "split"} for sp, s in sorted(splits.items(), key=lambda kv: natural_key(kv[0]))
            }
        else:
            entry["partitions"] = splits[None]["partitions"]
        domains[dom] = entry
    keys = ("source", "reader", "seq_len", "dtype", "columns", "eos", "remainder", "per_example", "split",
            "split_seed", "split_by", "compression", "shard_size", "hashes", "files_per_unit", "input_root")
    return {
        "format": "grape_stream.convert.pipeline",
        "converter_version": CONVERTER_VERSION,
        "grape_stream_version": __version__,
        "kind": "task" if plan["per_example"] else "domain",
        "tokenizer": {"name": plan["tokenizer"], "vocab_size": plan["vocab_size"], "eos_id": plan["eos_id"]},
        **{k: plan[k] for k in keys},
        "sources": [rel for rel, _ in plan["inputs"]],
        "domains": domains,
        "totals": {**totals.as_dict(), "domains": len(domains)},
        "bad_input": report["totals"]["bad"],
        "warnings": warnings,
    }


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


# ------------------------------------------------------------------------------------------ progress

class _Progress:
    """One tqdm bar of units, plus one bar of packed tokens per domain (created as domains appear)."""

    def __init__(self, *, enabled: bool, total_units: int, done_units: int, done_markers: Any) -> None:
        self.enabled = enabled
        self.bars: dict[str, Any] = {}
        self.units = None
        if not enabled:
            return
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self.units = tqdm(total=total_units, initial=done_units, desc="units", unit="unit", position=0, dynamic_ncols=True)
        for m in done_markers:
            for o in m["outputs"]:
                self._bar(o["domain"]).update(o["tokens"])

    def _bar(self, domain: str) -> Any:
        bar = self.bars.get(domain)
        if bar is None:
            bar = self.bars[domain] = self._tqdm(
                desc=domain, unit="tok", unit_scale=True, position=len(self.bars) + 1, dynamic_ncols=True
            )
        return bar

    def update(self, p: dict[str, Any]) -> None:
        if not self.enabled:
            return
        for dom, n in p.get("tokens", {}).items():
            self._bar(dom).update(n)

    def unit_done(self, marker: dict[str, Any]) -> None:
        if self.units is not None:
            self.units.update(1)

    def close(self) -> None:
        for b in [self.units, *self.bars.values()]:
            if b is not None:
                b.close()
