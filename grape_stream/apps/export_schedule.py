"""``grape-stream export-schedule``: a run's alpha(t) trajectory as a schedule other training code reads, so a mixture
found with grape_stream can be reused where grape_stream is not installed (docs/export.md).

Formats (``--format``):

* ``json``: the whole schedule, ``{"format": "grape_stream.schedule/1", "domains": [...], "schedule": [{"from_batch":
  B, "weights": {domain: w}}, ...], "until": E, "mean": {...}, "final": {...}}``: piecewise constant, each entry in
  force from its batch until the next one (an entry from batch E or later never trained: the run ended at E).
* ``megatron``: the value of Megatron-LM's ``--data-path`` (or the content of a ``--data-args-path`` file): a blend
  ``w1 prefix1 w2 prefix2 ...`` of one static mixture, each prefix a dataset that Megatron's
  ``tools/preprocess_data.py`` wrote (``<prefix>.bin`` + ``<prefix>.idx``): Megatron reads those, not MDS.

Megatron takes one static mixture, so it gets the weights ``--at``: ``mean`` (default: the mixture the run actually
drew, the schedule averaged over the batches it trained) or ``final`` (the last weights the method chose). Each
domain needs its dataset prefix: ``--path DOMAIN=PREFIX`` (repeatable) or ``--root DIR`` (``DIR/<domain>``).

torchtitan and Megatron-Energon were formats here once and are not any more: torchtitan's mainline has no
multi-source weighted dataset option to parse a mixture string, and an Energon metadataset blends datasets
prepared by ``energon prepare`` (WebDataset tar shards), which grape_stream neither writes nor reads; a file either
would accept only after the user rewrites the data is better given as the JSON above.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping, Sequence

from grape_stream.console import add_console_arguments
from grape_stream.errors import ConfigError, DataError
from grape_stream.grape.trajectory import load_trajectory

__all__ = ["export", "main", "schedule_of"]

FORMATS = ("json", "megatron")


def schedule_of(meta: Mapping[str, Any], records: Sequence[Mapping[str, Any]],
                until: int | None = None) -> dict[str, Any]:
    """The piecewise-constant schedule of a trajectory, with its batch-weighted mean and its final weights.

    ``until``: the batch the run ended at (default: the step of the last update, the last batch the trajectory
    shows the run trained). The mean counts each entry for the batches it was in force before ``until``; an
    entry that starts at ``until`` or later (the update at a run's last step) never trained and counts zero."""
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
    last_step = max(int(rec.get("step", 0) or 0) for rec in records)
    end = until if until is not None else max(last_step, steps[0][0] + 1)
    if end <= steps[0][0]:
        raise ConfigError(f"--until {end} must be after the first weights' batch ({steps[0][0]})")
    total = [0.0] * len(domains)
    for (start, w), (nxt, _) in zip(steps, [*steps[1:], (end, [])]):
        span = max(0, min(nxt, end) - start)
        for k, v in enumerate(w):
            total[k] += v * span
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
    assert paths is not None, "megatron needs a dataset prefix per domain"
    spaced = [paths[d] for d in weights if not paths[d] or any(c.isspace() for c in paths[d])]
    if spaced:  # Megatron splits --data-path (and a --data-args-path file) on whitespace
        raise ConfigError(f"Megatron dataset prefixes cannot be empty or hold whitespace: {spaced}")
    return " ".join(f"{w:.6g} {paths[d]}" for d, w in weights.items()) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="grape-stream export-schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("trajectory", help="a run's grape_trajectory.jsonl")
    p.add_argument("--format", "-f", choices=FORMATS, default="json",
                   help="json: the whole schedule, its mean and final weights (default); megatron: Megatron-LM's "
                        "--data-path blend 'w1 prefix1 w2 prefix2 ...' of one static mixture (--at)")
    p.add_argument("--at", choices=("mean", "final"), default="mean",
                   help="megatron: the mean mixture over the run (default) or the final weights")
    p.add_argument("--path", action="append", default=[], metavar="DOMAIN=PREFIX",
                   help="megatron: a domain's dataset prefix (<prefix>.bin/.idx); repeatable")
    p.add_argument("--root", default=None, help="megatron: dataset prefixes as ROOT/<domain> (--path overrides one)")
    p.add_argument("--until", type=int, default=None,
                   help="the batch the run ended at, for the mean (default: the last update's step)")
    p.add_argument("--out", "-o", default=None, help="write here instead of stdout")
    add_console_arguments(p)
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
