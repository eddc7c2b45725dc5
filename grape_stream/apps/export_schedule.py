"""``grape-stream export-schedule``: a run's alpha(t) trajectory as a schedule other loaders read, so a mixture found
with grape_stream can be reused where grape_stream is not installed.

Formats (``--format``):

* ``json``: the whole schedule, ``{"format": "grape_stream.schedule/1", "domains": [...], "schedule": [{"from_batch":
  B, "weights": {domain: w}}, ...], "mean": {...}, "final": {...}}``: piecewise constant, each entry in force from
  its batch until the next one.
* ``torchtitan``: the value of torchtitan's multi-source ``--training.dataset`` (``path:weight,path:weight``).
* ``energon``: a Megatron-Energon metadataset YAML (``MetadatasetV2``, ``splits.train.blend: [{weight, path}]``).

torchtitan and Energon take one static mixture, so those two formats hold the weights ``--at``: ``mean`` (default:
the mixture the run actually drew, the schedule averaged over batches) or ``final`` (the last weights). Each domain
needs a path in the other loader's terms: ``--path DOMAIN=PATH`` (repeatable) or ``--root DIR`` (``DIR/<domain>``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping, Sequence

import yaml

from grape_stream.errors import ConfigError, DataError
from grape_stream.grape.trajectory import load_trajectory

__all__ = ["export", "main", "schedule_of"]

FORMATS = ("json", "torchtitan", "energon")


def schedule_of(meta: Mapping[str, Any], records: Sequence[Mapping[str, Any]],
                until: int | None = None) -> dict[str, Any]:
    """The piecewise-constant schedule of a trajectory, with its batch-weighted mean and its final weights.

    ``until``: the batch the run ended at (default: the last change plus one update interval, ``alpha_every``),
    so the last weights count in the mean for as long as the others did."""
    domains = list(meta.get("domains") or [])
    steps: list[tuple[int, list[float]]] = []
    for rec in records:
        if rec.get("alpha") is None:
            continue
        start = int(rec.get("from_batch", rec.get("step", 0)) or 0)
        if steps and steps[-1][0] == start:
            steps.pop()  # the later record for the same batch wins
        steps.append((start, [float(a) for a in rec["alpha"]]))
    if not domains or not steps:
        raise DataError("the trajectory has no domains or no weights: is it a grape_stream trajectory JSONL?")
    end = until if until is not None else steps[-1][0] + int(meta.get("alpha_every") or 1)
    if end <= steps[-1][0]:
        raise ConfigError(f"--until {end} must be after the last weight change (batch {steps[-1][0]})")
    total = [0.0] * len(domains)
    for (start, w), (nxt, _) in zip(steps, [*steps[1:], (end, [])]):
        for k, v in enumerate(w):
            total[k] += v * (nxt - start)
    span = end - steps[0][0]
    named = lambda w: {d: round(v, 8) for d, v in zip(domains, w)}  # noqa: E731
    return {"format": "grape_stream.schedule/1", "method": meta.get("method"), "domains": domains, "unit": "batch",
            "until": end, "schedule": [{"from_batch": s, "weights": named(w)} for s, w in steps],
            "mean": named([t / span for t in total]), "final": named(steps[-1][1])}


def _paths(domains: Sequence[str], pairs: Sequence[str], root: str | None) -> dict[str, str]:
    out = {d: os.path.join(root, d) for d in domains} if root else {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or name not in domains:
            raise ConfigError(f"--path {pair!r}: expected DOMAIN=PATH with DOMAIN one of {', '.join(domains)}")
        out[name] = path
    missing = [d for d in domains if d not in out]
    if missing:
        raise ConfigError(f"no path for domain(s) {', '.join(missing)}: give --root DIR or --path DOMAIN=PATH")
    return out


def export(schedule: Mapping[str, Any], fmt: str, at: str = "mean", paths: Mapping[str, str] | None = None) -> str:
    """The schedule as text in ``fmt`` (see the module docstring)."""
    if fmt == "json":
        return json.dumps(schedule, indent=2) + "\n"
    weights: Mapping[str, float] = schedule[at]
    assert paths is not None, "torchtitan and energon need a path per domain"
    if fmt == "torchtitan":
        return ",".join(f"{paths[d]}:{w:.6g}" for d, w in weights.items()) + "\n"
    blend = [{"weight": float(f"{w:.6g}"), "path": paths[d]} for d, w in weights.items()]
    doc = {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {"train": {"blend": blend}}}
    header = f"# grape_stream {schedule.get('method')} mixture ({at} over batches 0-{schedule['until']}), exported\n"
    return header + yaml.safe_dump(doc, sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="grape-stream export-schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("trajectory", help="a run's grape_trajectory.jsonl")
    p.add_argument("--format", "-f", choices=FORMATS, default="json")
    p.add_argument("--at", choices=("mean", "final"), default="mean",
                   help="torchtitan / energon: the mean mixture over the run (default) or the final weights")
    p.add_argument("--path", action="append", default=[], metavar="DOMAIN=PATH", help="a domain's data path")
    p.add_argument("--root", default=None, help="domain paths as ROOT/<domain> (--path overrides one)")
    p.add_argument("--until", type=int, default=None, help="the batch the run ended at (for the mean)")
    p.add_argument("--out", "-o", default=None, help="write here instead of stdout")
    args = p.parse_args(list(argv) if argv is not None else None)
    if not os.path.isfile(args.trajectory):
        raise DataError(f"no trajectory file {args.trajectory}")
    meta, records = load_trajectory(args.trajectory)
    schedule = schedule_of(meta, records, args.until)
    paths = None if args.format == "json" else _paths(schedule["domains"], args.path, args.root)
    text = export(schedule, args.format, args.at, paths)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
