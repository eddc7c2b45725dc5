"""Resident memory per method of the value benchmark, each method in its own process (issue 32 part 6).

The value benchmark (``bench/value.py``) records each run's peak RSS only (its ``peak_rss_mb``, once per run, from
the run's own process). Here every method trains ``--steps`` steps of the value
benchmark's setting (``grape_stream/apps/demo_pool.py``: model, batch, sequence length, the update every 25
steps as at its 400-step budget; the method's overrides are ``bench/value.py``'s ``METHODS``) in a fresh
process of its own, twice: once as it runs, once with ``gc.collect()`` before every reading. After every
batch the process records its RSS (``/proc/self/statm``) and the number of objects the cycle collector
tracks; every 10 steps, the live tensors Python can see (count and bytes); at the end, ``ru_maxrss`` (the
peak). Memory that rises with the steps and stays in the gc variant is held by something live (a leak);
memory that rises only without gc is held by reference cycles, freed at the collector's rare full passes.

    .venv/bin/python bench/memory.py                     # 100 steps, every method, both variants (~30 min)
    .venv/bin/python bench/memory.py --quick             # 24 steps, uniform / grape / grape_steps (a few minutes)
    .venv/bin/python bench/memory.py --methods grape_steps --steps 200 --no-gc-variant
    .venv/bin/python bench/memory.py --jobs 2 --gc-methods uniform,grape,grape_steps   # what results/memory.json ran

``crisp`` is a static mixture at CRISP's weights as ``bench/results/value.json``'s search found them;
``doremi`` reads a ``uniform_reference`` checkpoint, which this script trains (and measures) first.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from common import HERE, REPO, parser, peak_rss_mb, write_json

_PAGE = os.sysconf("SC_PAGE_SIZE")
METHODS = ["uniform", "crisp", "grape", "grape_steps", "doge", "rnb", "odm", "ado", "uniform_reference", "doremi"]
QUICK_METHODS = ["uniform", "grape", "grape_steps"]
CENSUS_EVERY = 10  # steps between two counts of the live tensors (a pass over every object: ~0.1 s)


def rss_mb() -> float:
    """The process's resident set now (MB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def tensor_census() -> dict[str, float]:
    """The torch tensors the collector can reach: how many, and the bytes of their distinct storages (MB)."""
    import torch

    n, storages = 0, {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor):
                n += 1
                s = o.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        except Exception:  # noqa: BLE001 - a half-built or meta tensor: not counted
            continue
    return {"tensors": n, "tensor_mb": sum(storages.values()) / 2**20}


def slope_per_100(points: Sequence[tuple[int, float]]) -> float | None:
    """Least-squares slope of RSS against the step, times 100 (MB per 100 steps); None under 3 points."""
    if len(points) < 3 or len({x for x, _ in points}) < 2:
        return None
    x, y = np.asarray(points, dtype=np.float64).T
    return 100 * float(np.polyfit(x, y, 1)[0])


# ----------------------------------------------------------------------------- one method, in its own process

def child(method: str, steps: int, collect: bool, work: Path, mds: Path, out: Path, quick: bool) -> None:
    """Train ``method`` for ``steps`` steps here, recording memory after every batch; write the record to ``out``."""
    import torch
    import value
    from composer.core import Callback

    from grape_stream.apps.demo_pool import DATA, LR, MODEL, STEPS, pool_settings, update_interval
    from grape_stream.apps.demo_run import run_method

    torch.set_num_threads(1)
    every = update_interval(STEPS)  # the value benchmark's update interval (25 steps), whatever --steps is
    value._RUN.update(steps=steps, out=work)  # uniform_reference saves, doremi reads, at this budget
    docs = json.loads((REPO / "bench" / "results" / "value.json").read_text()).get("search") or {}
    base, make = value.METHODS[method]
    over = [*MODEL, *DATA, *make(LR, docs, 0, {})]
    if method == "grape_steps":  # every step of the value benchmark's interval observed (its lambda scales it)
        over.append(f"algorithm.alignment_steps={every}")
    settings = pool_settings(steps).replace(update_every=every, curve_every=every)
    if quick:
        settings = settings.replace(curve_samples=16, final_samples=32)
    rows: list[dict[str, Any]] = []

    class Memory(Callback):  # type: ignore[misc]
        def batch_end(self, state: Any, logger: Any) -> None:
            step = int(state.timestamp.batch)
            if collect:
                gc.collect()
            row: dict[str, Any] = {"step": step, "rss_mb": round(rss_mb(), 1), "gc_objects": len(gc.get_objects())}
            if step % CENSUS_EVERY == 0 or step == steps:
                row.update(tensor_census())
            rows.append(row)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # uniform_reference keeps its run: doremi reads its checkpoint
        run_dir = work / f"{method}-seed0" if method == "uniform_reference" else Path(tmp) / method
        run_method(base, mds=mds, out_dir=run_dir, settings=settings, seed=0, progress=False, extra_overrides=over,
                   extra_callbacks=[Memory()])
    out.write_text(json.dumps({"per_step": rows, "peak_rss_mb": peak_rss_mb(), "end_rss_mb": rss_mb(),
                               "seconds": time.perf_counter() - t0, "update_every": every, "overrides": over}))


def run_child(method: str, steps: int, collect: bool, work: Path, mds: Path, quick: bool) -> dict[str, Any]:
    """One fresh process for ``method``; its record, with growth per 100 steps after the first interval."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmd = [sys.executable, str(HERE / "memory.py"), "--child", method, "--steps", str(steps),
               "--work", str(work), "--mds", str(mds), "--record", str(out)]
        cmd += ["--gc"] if collect else []
        cmd += ["--quick"] if quick else []
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{method} (gc={collect}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return summarise(json.loads(out.read_text()), steps)


def summarise(rec: dict[str, Any], steps: int) -> dict[str, Any]:
    """A child's record with its growth per 100 steps (fitted after the first update), the collector's objects
    per step and the live tensors at the first and last census."""
    rows, every = rec["per_step"], rec["update_every"]
    start = every if steps >= 3 * every else min(10, steps // 2)  # after the first update's allocations
    rec["rss_growth_mb_per_100_steps"] = slope_per_100([(r["step"], r["rss_mb"]) for r in rows if r["step"] >= start])
    rec["gc_objects_per_step"] = (slope_per_100([(r["step"], r["gc_objects"]) for r in rows if r["step"] >= start])
                                  or 0.0) / 100
    rec["fit_from_step"] = start
    census = [r for r in rows if "tensors" in r]
    rec["tensors_first_last"] = [census[0]["tensors"], census[-1]["tensors"]] if census else None
    rec["tensor_mb_first_last"] = [census[0]["tensor_mb"], census[-1]["tensor_mb"]] if census else None
    return rec


def _variant(collect: bool) -> str:
    return "gc.collect() each step" if collect else "as run"


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [("method", "variant", "peak RSS MB", "RSS at first fit step", "RSS at end", "MB / 100 steps",
             "gc objects / step", "live tensors first->last", "tensor MB first->last", "s")]
    for m, by in results.items():
        for variant, r in by.items():
            first = next(x for x in r["per_step"] if x["step"] >= r["fit_from_step"])
            g = r["rss_growth_mb_per_100_steps"]
            tl, tm = r["tensors_first_last"], r["tensor_mb_first_last"]
            rows.append((m, variant, f"{r['peak_rss_mb']:.0f}", f"{first['rss_mb']:.0f} (step {first['step']})",
                         f"{r['per_step'][-1]['rss_mb']:.0f}", "-" if g is None else f"{g:+.1f}",
                         f"{r['gc_objects_per_step']:+.1f}", "-" if tl is None else f"{tl[0]} -> {tl[1]}",
                         "-" if tm is None else f"{tm[0]:.0f} -> {tm[1]:.0f}", f"{r['seconds']:.0f}"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in rows]
    lines.insert(1, "-" * max(len(x) for x in lines))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "memory", quick=f"{QUICK_METHODS} at 24 steps, a small test subset (a few minutes)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"of bench/value.py's METHODS (default {METHODS})")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--no-gc-variant", action="store_true", help="skip the runs with gc.collect() before each reading")
    p.add_argument("--gc-methods", default=None, help="the methods that also run the gc variant (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each its own process; RSS is per process)")
    p.add_argument("--work", default=str(REPO / "runs" / "bench_memory"), help="DoReMi's reference run goes here")
    p.add_argument("--data-out", default=str(REPO / "runs" / "bench_value"),
                   help="where the value benchmark's tokenizer and MDS shards are (made here if absent)")
    p.add_argument("--data", default=str(REPO / "data" / "demo"))
    # the child process's arguments
    p.add_argument("--child", default="", help="(internal) train this method here")
    p.add_argument("--gc", action="store_true", help="(internal) gc.collect() before each reading")
    p.add_argument("--mds", default="", help="(internal)")
    p.add_argument("--record", default="", help="(internal)")
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.steps, args.gc, Path(args.work), Path(args.mds), Path(args.record), args.quick)
        return 0
    if args.quick:
        args.steps = 24
        if args.methods == ",".join(METHODS):
            args.methods = ",".join(QUICK_METHODS)
    from grape_stream.apps.demo_pool import prepare

    methods = [m for m in args.methods.split(",") if m]
    if "doremi" in methods and "uniform_reference" not in methods:
        methods.insert(methods.index("doremi"), "uniform_reference")  # its reference model
    mds, _ = prepare(Path(args.data_out), Path(args.data))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    variants = [False] if args.no_gc_variant else [False, True]
    gc_methods = set(methods) if args.gc_methods is None else set(args.gc_methods.split(","))
    todo = [(m, c) for m in methods for c in variants if not c or m in gc_methods]
    done: dict[tuple[str, bool], dict[str, Any]] = {}

    def one(m: str, collect: bool) -> None:
        r = done[m, collect] = run_child(m, args.steps, collect, work, mds, args.quick)
        print(f"{m:<18} {_variant(collect):<22} peak {r['peak_rss_mb']:.0f} MB, "
              f"{r['rss_growth_mb_per_100_steps'] or 0:+.1f} MB / 100 steps ({r['seconds']:.0f} s)", flush=True)

    first = [t for t in todo if t[0] == "uniform_reference"]  # doremi reads its checkpoint: it runs first
    for t in first:
        one(*t)
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:  # each run is a process of its own
        list(pool.map(lambda t: one(*t), [t for t in todo if t not in first]))
    results: dict[str, dict[str, Any]] = {}
    for m, c in todo:
        results.setdefault(m, {})[_variant(c)] = done[m, c]
    text = table(results)
    print("\n" + text)
    doc = {"bench": "memory", "command": "python bench/memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "setting": {"steps": args.steps, "quick": args.quick, "torch_threads": 1, "jobs": args.jobs,
                       "what": "the value benchmark's model, batch, sequence length and update interval (25 steps); "
                               "each method and variant in a fresh process; RSS from /proc/self/statm after every "
                               "batch; peak = ru_maxrss of that process (the final evaluation included)",
                       "growth": "least-squares slope of RSS over the steps from fit_from_step, x 100"},
           "table": text,
           "methods": results}
    write_json(args.out, doc, say=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
