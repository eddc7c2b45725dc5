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

This module is the sequence (check, plan, run, finish); each step lives in its own module: plan.py,
runner.py + unit.py, finalise.py, remote.py, progress.py.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from grape_stream.atomic import atomic_write_json
from grape_stream.convert.errors import ConvertInputError, ConvertStateError
from grape_stream.convert.finalise import Finaliser, build_manifest, build_report
from grape_stream.convert.inputs import expand_patterns
from grape_stream.convert.layout import CONVERTER_VERSION, STATE_DIR
from grape_stream.convert.plan import (
    Units,
    build_plan,
    check_run_options,
    check_shard_options,
    load_markers,
    parse_split,
    prepare_out,
    split_units,
    tokenizer_facts,
)
from grape_stream.convert.progress import Progress
from grape_stream.convert.readers import Reader, build_reader
from grape_stream.convert.remote import check_remote, default_local, is_remote, upload
from grape_stream.convert.result import ConvertResult, format_table
from grape_stream.convert.runner import Runner
from grape_stream.convert.text_policy import TEXT_POLICIES
from grape_stream.convert.unit import UnitJob

__all__ = [
    "convert", "ConvertResult", "ConvertInputError", "ConvertStateError", "CONVERTER_VERSION", "parse_split",
    "format_table",
]


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
    text_policy: str = "repair",
    overwrite: bool = False,
    max_examples: int = 5,
    progress: bool = True,
    **reader_options: Any,
) -> ConvertResult:
    """Convert `inputs` (paths, globs or directories) of one `source` layout into MDS under `out`.

    source: one of grape_stream.convert.readers.SOURCES (slimpajama | climblab | climbmix | wiki40b |
        jsonl | parquet | task).
    out: a local directory, or a remote URL (s3://bucket/prefix; endpoint from S3_ENDPOINT_URL) with
        `local` as the staging directory (default: ~/.cache/grape_stream/convert/<hash of out>), which
        also holds the resume state.
    reader_options: options of readers added later than the named ones (see readers/base.py).
    Re-running with the same arguments resumes (or returns at once if complete); different arguments on
    the same `out` raise ConvertStateError unless `overwrite`. See docs/converters.md for every option.
    Long because the signature and this docstring name every option; the body is one call per step.
    """
    check_run_options(workers=workers, files_per_unit=files_per_unit, eos=eos, remainder=remainder,
                      seq_len=seq_len, domain=domain)
    reader = build_reader(
        source, split_from_path=split_from_path, domain=domain, domain_field=domain_field,
        split_field=split_field, text_field=text_field, markers=markers, layout=layout, **reader_options,
    )
    check_shard_options(compression, hashes)
    split_fracs = parse_split(split, holdout)
    if split_fracs and (split_field or split_from_path):
        raise ValueError("--split/--holdout assign splits by hash; --split-field/--split-from-path read them from the "
                         "data: pick one")
    if per_example is None:
        per_example = reader.per_example
    if per_example and remainder != "drop":
        raise ValueError("remainder applies to packed sequences; per-example samples are always padded")
    tok = tokenizer_facts(reader, source, tokenizer, eos_id)

    files, root = expand_patterns([inputs] if isinstance(inputs, str) else list(inputs), reader.patterns)
    rels = [os.path.relpath(f, root) for f in files]
    remote = out.rstrip("/") if is_remote(out) else None
    local_root = os.path.abspath(os.path.expanduser(local or (default_local(out) if remote else out)))
    if remote:
        check_remote(remote)

    plan = build_plan(
        source=source, reader=reader, tok=tok, seq_len=seq_len, eos=eos, remainder=remainder,
        per_example=per_example, split_fracs=split_fracs, split_seed=split_seed,
        split_by="hash" if split_fracs else "field" if split_field else "path" if split_from_path else None,
        compression=compression, shard_size=shard_size, hashes=hashes, files_per_unit=files_per_unit,
        root=root, files=files, rels=rels, remote=remote,
    )
    if text_policy not in TEXT_POLICIES:
        raise ValueError(f"text_policy must be one of {TEXT_POLICIES}, got {text_policy!r}")
    if text_policy != "repair":  # part of the plan (a resume must not mix policies); absent = the default,
        plan["text_policy"] = text_policy  # so conversions started before the option existed still resume
    state = os.path.join(local_root, STATE_DIR)
    prepare_out(local_root, state, plan, overwrite)
    units = split_units(files, rels, files_per_unit)
    if os.path.exists(os.path.join(local_root, "manifest.json")):
        return _already_complete(local_root, remote, len(units))
    jobs_kw = dict(reader=reader, plan=plan, local=local_root, remote=remote, keep_local=keep_local,
                   strict=strict, max_examples=max_examples)
    return _run(plan, reader, units, state, local_root, remote, workers, progress, jobs_kw)


def _already_complete(local_root: str, remote: str | None, n_units: int) -> ConvertResult:
    with open(os.path.join(local_root, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(local_root, "report.json")) as f:
        report = json.load(f)
    if remote:
        upload(local_root, remote, ["report.json", "manifest.json"])
    return ConvertResult(out=remote or local_root, local=local_root, manifest=manifest, report=report,
                         units_skipped=n_units)


def _run(plan: dict[str, Any], reader: Reader, units: Units, state: str, local_root: str, remote: str | None,
         workers: int, progress: bool, jobs_kw: dict[str, Any]) -> ConvertResult:
    """Run the units not done yet, finalising domains as they complete; then report.json, manifest.json."""
    done = load_markers(state, [u for u, _ in units])
    jobs = [UnitJob(unit=u, files=fs, **jobs_kw) for u, fs in units if u not in done]

    # Which units may write a domain: known up front when the path decides the domain.
    unit_domains: dict[str, set[str] | None] = {}
    for u, fs in units:
        ds = {reader.path_domain(p) for p, _ in fs}
        unit_domains[u] = None if None in ds else ds  # type: ignore[assignment]
    finaliser = Finaliser(local_root, remote, state, units, unit_domains, done)

    # The pool is started (workers forked) before any progress-bar thread exists in this process.
    with Runner(jobs, workers) as runner:
        bars = Progress(enabled=progress, total_units=len(units), done_units=len(done), done_markers=done.values())
        try:
            finaliser.finalise_ready()
            for marker in runner.results(bars.update):
                done[marker["unit"]] = marker
                bars.unit_done(marker)
                finaliser.unit_done(marker)
            finaliser.finalise_ready(final=True)
        finally:
            bars.close()

    report = build_report(plan, units, done)
    manifest = build_manifest(plan, finaliser.domain_stats, report)
    atomic_write_json(os.path.join(local_root, "report.json"), report)
    atomic_write_json(os.path.join(local_root, "manifest.json"), manifest)  # last: its presence means "complete"
    if remote:
        upload(local_root, remote, ["report.json", "manifest.json"])
    return ConvertResult(
        out=remote or local_root, local=local_root, manifest=manifest, report=report,
        units_run=len(jobs), units_skipped=len(units) - len(jobs),
    )
