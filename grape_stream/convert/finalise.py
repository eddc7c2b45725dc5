"""Finishing a conversion: merge each domain's unit partitions into one index, then report and manifest.

A domain is finalised (its index.json merged with streaming's `merge_index`) as soon as every unit that
may hold it is done, so a long conversion exposes finished domains early and a re-run skips them.
`report.json` (bad input per file) and `manifest.json` (domains, sizes, settings) are built from the
units' done-markers and the finalised domains; the pipeline writes the manifest last.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

from grape_stream.atomic import atomic_write_json
from grape_stream.convert.inputs import natural_key
from grape_stream.convert.layout import CONVERTER_VERSION, MANIFEST_FORMAT, dataset_dir
from grape_stream.convert.packing import PackStats
from grape_stream.convert.plan import Units
from grape_stream.convert.remote import upload
from grape_stream.version import __version__

__all__ = ["Finaliser", "build_report", "build_manifest"]


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


class Finaliser:
    """Merges a domain's partitions into its index.json once every unit that may hold it is done.

    unit_domains: per unit, the domains its paths decide, or None when only its records tell (then no
    domain is final until that unit is done). done: the markers of finished units, shared with the caller.
    """

    def __init__(self, local: str, remote: str | None, state: str, units: Units,
                 unit_domains: dict[str, set[str] | None], done: dict[str, dict[str, Any]]) -> None:
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
            doms = unit_domains[u]
            if u not in done and doms is not None:
                for d in doms:
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
        doms = self.unit_domains[u]
        if doms is None:
            self.unknown_pending -= 1
        else:
            for d in doms:
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
        per_split: dict[str | None, list[dict[str, Any]]] = {}
        for _, o in sorted(self.outputs[dom], key=lambda t: t[0]):  # unit order, whatever order they finished in
            per_split.setdefault(o["split"], []).append(o)
        splits: list[dict[str, Any]] = []
        for sp in sorted(per_split, key=lambda s: s or ""):
            outs = per_split[sp]
            stats = PackStats()
            for o in outs:
                stats.add(PackStats.from_dict(o))
            ddir = dataset_dir(self.local, dom, sp)
            parts = [o["partition"] for o in outs if o["partition"]]
            os.makedirs(ddir, exist_ok=True)
            self._merge(ddir, dom, sp, parts)
            rel = os.path.relpath(ddir, self.local)
            splits.append({"split": sp, "path": rel.replace(os.sep, "/"), "partitions": len(parts), **stats.as_dict()})
        atomic_write_json(os.path.join(self.state, "domains", f"{dom}.json"), {"domain": dom, "splits": splits})
        self.domain_stats[dom] = {s["split"]: s for s in splits}

    def _merge(self, ddir: str, dom: str, sp: str | None, parts: list[str]) -> None:
        """One (domain, split)'s index.json from its partitions' (kept locally, also for a remote OUT: only
        their shards are deleted once uploaded), merged here and then uploaded under the retry policy."""
        from streaming.base.util import merge_index  # imports torch

        if not parts:
            # Documents but no full sequence: an empty (valid) MDS index, flagged in the manifest.
            atomic_write_json(os.path.join(ddir, "index.json"), {"version": 2, "shards": []})
        else:
            with _quiet_root_logger():
                merge_index([os.path.join(ddir, p, "index.json") for p in parts], ddir, keep_local=True)
        if self.remote:
            rel = os.path.relpath(os.path.join(ddir, "index.json"), self.local).replace(os.sep, "/")
            upload(self.local, self.remote, [rel])


def build_report(plan: dict[str, Any], units: Units, done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """report.json: every input file's documents and bad input, in unit order, with totals."""
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


_PLAN_KEYS = ("source", "reader", "seq_len", "dtype", "columns", "eos", "remainder", "per_example", "split",
              "split_seed", "split_by", "compression", "shard_size", "hashes", "files_per_unit")
# (not "input_root": the converting machine's absolute path is no business of the readers; "sources" are relative)


def _domain_entry(dom: str, splits: dict[str | None, dict[str, Any]], agg: PackStats) -> dict[str, Any]:
    entry: dict[str, Any] = {"path": dom, **agg.as_dict()}
    if None not in splits:
        entry["splits"] = {
            sp: {k: v for k, v in s.items() if k != "split"}
            for sp, s in sorted(splits.items(), key=lambda kv: natural_key(kv[0] or ""))
        }
    else:
        entry["partitions"] = splits[None]["partitions"]
    return entry


def build_manifest(plan: dict[str, Any], domain_stats: dict[str, dict[str | None, dict[str, Any]]],
                   report: dict[str, Any]) -> dict[str, Any]:
    """manifest.json: the settings a reader of OUT needs, and documents/tokens/samples per domain and split."""
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
        domains[dom] = _domain_entry(dom, splits, agg)
    return {
        "format": MANIFEST_FORMAT,
        "converter_version": CONVERTER_VERSION,
        "grape_stream_version": __version__,
        "kind": "task" if plan["per_example"] else "domain",
        "tokenizer": {"name": plan["tokenizer"], "vocab_size": plan["vocab_size"], "eos_id": plan["eos_id"]},
        **{k: plan[k] for k in _PLAN_KEYS},
        "sources": [rel for rel, _ in plan["inputs"]],
        "domains": domains,
        "totals": {**totals.as_dict(), "domains": len(domains)},
        "bad_input": report["totals"]["bad"],
        "warnings": warnings,
    }
