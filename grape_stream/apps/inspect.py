"""``grape-stream inspect PATH``: what is in a converted MDS output, one MDS dataset, or a GRAPE trajectory.

- a directory with ``manifest.json`` (a ``grape-stream convert`` output): tokenizer, seq_len, vocab and a
  table of domains / splits with their sample counts, plus what ``report.json`` says was skipped;
- a directory with ``index.json`` (one MDS dataset, or a split of one): shards, samples, columns, bytes;
- a ``.jsonl`` trajectory: method, domains, tasks, number of updates, first and last weights, time per update.

``--json`` prints the summary as JSON instead of a table.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Sequence

import numpy as np

from grape_stream.console import add_console_arguments
from grape_stream.errors import DataError

__all__ = ["summarize", "main"]


def _mds_index_summary(index_path: str) -> dict[str, Any]:
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    shards = index.get("shards", [])
    samples = sum(int(s.get("samples", 0)) for s in shards)
    raw = sum(int((s.get("raw_data") or {}).get("bytes", 0)) for s in shards)
    zipped = sum(int((s.get("zip_data") or {}).get("bytes", 0)) for s in shards if s.get("zip_data"))
    columns: dict[str, str] = {}
    if shards:
        names = shards[0].get("column_names", [])
        encs = shards[0].get("column_encodings", [])
        columns = dict(zip(names, encs))
    return {
        "kind": "mds",
        "path": os.path.dirname(index_path),
        "version": index.get("version"),
        "shards": len(shards),
        "samples": samples,
        "columns": columns,
        "compression": shards[0].get("compression") if shards else None,
        "raw_bytes": raw,
        "compressed_bytes": zipped or None,
    }


def _find_indexes(root: str) -> list[str]:
    """One index per dataset: below a directory with an index.json (a merged dataset) the per-worker
    ``part-*`` indexes describe the same samples again, so they are not listed (nor counted twice)."""
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        if "index.json" in files:
            found.append(os.path.join(dirpath, "index.json"))
            dirs[:] = []
    return sorted(found)


def _manifest_summary(root: str) -> dict[str, Any]:
    with open(os.path.join(root, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    datasets = []
    for idx in _find_indexes(root):
        s = _mds_index_summary(idx)
        s["name"] = os.path.relpath(os.path.dirname(idx), root)
        datasets.append(s)
    report = None
    rp = os.path.join(root, "report.json")
    if os.path.exists(rp):
        with open(rp, encoding="utf-8") as f:
            report = json.load(f)
    return {"kind": "manifest", "path": root, "manifest": manifest, "datasets": datasets, "report": report}


def _trajectory_summary(path: str) -> dict[str, Any]:
    from grape_stream.grape.controller import load_trajectory

    meta, records = load_trajectory(path)
    updates = [r for r in records if not r.get("initial")]
    secs = [r["seconds"]["total"] for r in updates if r.get("seconds", {}).get("total") is not None]
    first, last = records[0], records[-1]
    return {
        "kind": "trajectory",
        "path": path,
        "method": meta.get("method", last.get("method")),
        "domains": meta.get("domains"),
        "tasks": meta.get("tasks"),
        "updates": len(updates),
        "steps": [records[0]["step"], last["step"]],
        "alpha_first": first["alpha"],
        "alpha_last": last["alpha"],
        "z_first": first.get("z"),
        "z_last": last.get("z"),
        "task_loss_last": next((r["task_loss"] for r in reversed(records) if r.get("task_loss")), None),
        "seconds_per_update": float(np.mean(secs)) if secs else None,
        "skipped": sum(1 for r in updates if r.get("skipped")),
    }


def summarize(path: str) -> dict[str, Any]:
    """A summary of ``path`` (manifest dir, MDS dir or trajectory JSONL); DataError (a ValueError) if it is none."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "manifest.json")):
            return _manifest_summary(path)
        if os.path.exists(os.path.join(path, "index.json")):
            return _mds_index_summary(os.path.join(path, "index.json"))
        idx = _find_indexes(path)
        if idx:
            return {"kind": "mds_tree", "path": path,
                    "datasets": [dict(_mds_index_summary(i), name=os.path.relpath(os.path.dirname(i), path))
                                 for i in idx]}
        raise DataError(f"{path}: no manifest.json and no index.json below it (is it a `grape-stream convert` output?)")
    if os.path.isfile(path):
        if path.endswith((".jsonl", ".json")):
            return _trajectory_summary(path)
        raise DataError(f"{path}: not a directory and not a .jsonl trajectory")
    raise DataError(f"{path}: no such file or directory")


def _report_line(report: dict[str, Any]) -> str:
    """report.json in one readable line: files, documents, bad input by kind (file:line examples stay there)."""
    totals = report.get("totals") or {}
    bad = totals.get("bad") or {}
    line = f"{totals.get('files', len(report.get('files', {})))} files, {totals.get('documents', '?')} documents"
    if not bad:
        return line + ", no bad input"
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1]))
    return f"{line}; bad input: {kinds} (examples with file and line in report.json)"


def _fmt_w(w: Sequence[float] | None, names: Sequence[str] | None) -> str:
    if w is None:
        return "-"
    names = names or [str(i) for i in range(len(w))]
    return "  ".join(f"{n}={v:.3f}" for n, v in zip(names, w))


def _print(summary: dict[str, Any]) -> None:
    kind = summary["kind"]
    if kind == "trajectory":
        s = summary
        print(f"trajectory {s['path']}")
        print(f"  method   {s['method']}    updates {s['updates']}  (steps {s['steps'][0]}..{s['steps'][1]})"
              f"    skipped {s['skipped']}")
        if s["seconds_per_update"] is not None:
            print(f"  seconds per update  {s['seconds_per_update']:.3f}")
        print(f"  alpha first  {_fmt_w(s['alpha_first'], s['domains'])}")
        print(f"  alpha last   {_fmt_w(s['alpha_last'], s['domains'])}")
        print(f"  z first      {_fmt_w(s['z_first'], s['tasks'])}")
        print(f"  z last       {_fmt_w(s['z_last'], s['tasks'])}")
        if s["task_loss_last"]:
            print(f"  task loss    {_fmt_w(s['task_loss_last'], s['tasks'])}")
        return
    if kind == "manifest":
        m = summary["manifest"]
        print(f"converted output {summary['path']}")
        for key in ("tokenizer", "seq_len", "vocab_size", "eos_id", "dtype", "converter_version", "format"):
            if key in m:
                print(f"  {key:<18} {m[key]}")
    elif kind == "mds":
        summary = {"datasets": [dict(summary, name=".")], "path": summary["path"]}
        print(f"MDS dataset {summary['path']}")
    else:
        print(f"MDS datasets under {summary['path']}")
    rows = summary.get("datasets") or []
    if rows:
        width = max(len(r["name"]) for r in rows)
        print(f"  {'dataset':<{width}}  {'samples':>10}  {'shards':>6}  {'MB':>9}  columns")
        for r in rows:
            mb = (r["compressed_bytes"] or r["raw_bytes"]) / 1e6
            cols = ", ".join(f"{k}:{v}" for k, v in r["columns"].items())
            print(f"  {r['name']:<{width}}  {r['samples']:>10}  {r['shards']:>6}  {mb:>9.2f}  {cols}")
        print(f"  {'total':<{width}}  {sum(r['samples'] for r in rows):>10}")
    report = summary.get("report")
    if report:
        print(f"  report.json        {_report_line(report)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grape-stream inspect",
        description="Summarise a converted MDS output directory, one MDS dataset, or a GRAPE trajectory JSONL.",
    )
    parser.add_argument("path",
                        help="an output directory of grape-stream convert, one MDS dataset, or a trajectory JSONL")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_console_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    summary = summarize(args.path)  # a DataError is one line under grape-stream (errors.run_cli)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print(summary)
    return 0
