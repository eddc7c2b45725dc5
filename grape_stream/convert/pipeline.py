"""Convert a corpus into per-domain MDS datasets, locally or straight to object storage.

    result = convert("jsonl", ["data/*.jsonl.zst"], "out/", tokenizer="bytes", seq_len=256,
                     domain_field="lang", split_field="split", workers=2)
    result = convert(ConvertConfig(source="jsonl", inputs=["data/*.jsonl.zst"], out="out/", seq_len=256,
                                   reader={"domain_field": "lang"}))

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
runner.py + unit.py, finalise.py, remote.py, progress.py. The settings are one ConvertConfig
(grape_stream.config), built by the command line or by ``convert``'s arguments, read by each step.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from grape_stream.atomic import atomic_write_json
from grape_stream.config import ConvertConfig
from grape_stream.convert.errors import ConvertInputError, ConvertStateError
from grape_stream.convert.finalise import Finaliser, build_manifest, build_report
from grape_stream.convert.formats import DEFAULT_MAX_RECORD_BYTES
from grape_stream.convert.inputs import expand_patterns
from grape_stream.convert.layout import CONVERTER_VERSION, STATE_DIR
from grape_stream.convert.plan import (
    Units,
    build_plan,
    check_run_options,
    check_shard_options,
    convert_config,
    load_markers,
    parse_split,
    prepare_out,
    size_bytes,
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


def convert(source: str | ConvertConfig, inputs: str | Sequence[str] | None = None, out: str | None = None,
            **options: Any) -> ConvertResult:
    """Convert a corpus into MDS under ``out``: ``convert(config)`` with a
    :class:`~grape_stream.config.ConvertConfig`, or its fields as arguments (``convert("jsonl", ["c/*.jsonl"],
    "out/", seq_len=256, domain_field="lang")``: reader options such as ``domain_field`` join
    ``config.reader``); keyword arguments also override a given config's fields.

    source: one of grape_stream.convert.readers.SOURCES (slimpajama | climblab | climbmix | wiki40b |
        jsonl | parquet | task). inputs: paths, globs or directories of that layout.
    out: a local directory, or a remote URL (s3://bucket/prefix; endpoint from S3_ENDPOINT_URL) with
        ``local`` as the staging directory (default: ~/.cache/grape_stream/convert/<hash of out>), which
        also holds the resume state.
    Re-running with the same settings resumes (or returns at once if complete); different settings on
    the same ``out`` raise ConvertStateError unless ``overwrite``. docs/converters.md documents every option.
    """
    config = convert_config(source, inputs, out, options)
    check_run_options(config)
    reader = build_reader(config.source, **config.reader)
    check_shard_options(config.compression, config.hashes)
    split_fracs = parse_split(config.split, config.holdout)
    split_field, split_from_path = config.reader.get("split_field"), config.reader.get("split_from_path")
    if split_fracs and (split_field or split_from_path):
        raise ValueError("--split/--holdout assign splits by hash; --split-field/--split-from-path read them from the "
                         "data: pick one")
    per_example = reader.per_example if config.per_example is None else config.per_example
    if per_example and config.remainder != "drop":
        raise ValueError("remainder applies to packed sequences; per-example samples are always padded")
    tok = tokenizer_facts(reader, config.source, config.tokenizer, config.eos_id)

    files, root = expand_patterns(list(config.inputs), reader.patterns)
    rels = [os.path.relpath(f, root) for f in files]
    remote = config.out.rstrip("/") if is_remote(config.out) else None
    local_root = os.path.abspath(os.path.expanduser(config.local or (default_local(config.out) if remote
                                                                     else config.out)))
    if remote:
        check_remote(remote)

    plan = build_plan(
        config, reader=reader, tok=tok, per_example=per_example, split_fracs=split_fracs,
        split_by="hash" if split_fracs else "field" if split_field else "path" if split_from_path else None,
        root=root, files=files, rels=rels, remote=remote,
    )
    if config.text_policy not in TEXT_POLICIES:
        raise ValueError(f"text_policy must be one of {TEXT_POLICIES}, got {config.text_policy!r}")
    if config.text_policy != "repair":  # part of the plan (a resume must not mix policies); absent = the default,
        plan["text_policy"] = config.text_policy  # so conversions started before the option existed still resume
    max_record = size_bytes(config.max_record_size)
    if max_record < 1:
        raise ValueError(f"max_record_size must be positive, got {config.max_record_size!r}")
    if max_record != DEFAULT_MAX_RECORD_BYTES:  # the same rule as text_policy
        plan["max_record_bytes"] = max_record
    state = os.path.join(local_root, STATE_DIR)
    prepare_out(local_root, state, plan, config.overwrite)
    units = split_units(files, rels, config.files_per_unit)
    if os.path.exists(os.path.join(local_root, "manifest.json")):
        return _already_complete(local_root, remote, len(units))
    jobs_kw = dict(reader=reader, plan=plan, local=local_root, remote=remote, keep_local=config.keep_local,
                   strict=config.strict, max_examples=config.max_examples)
    return _run(plan, reader, units, state, local_root, remote, config.workers, config.progress, jobs_kw)


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
