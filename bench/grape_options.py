"""Benchmark: GRAPE's options beyond the paper on benchmark 1 (the bundled multilingual demo corpus).

Same set-up as ``bench/mixture_quality.py`` (its settings, its runner, its statistics): 100 steps of the
demo-cpu recipe per run, alpha/z updated every 20 steps, test log-ppl on a fixed strided subset of each
target's test split. Each *variant* is a reweighting method plus recipe overrides; ``grape`` is the
paper's GRAPE at the bench's step sizes (clip_norm 1, as in mixture_quality), every other ``grape*``
variant changes one option (docs/reweighting.md, "Beyond the paper"):

    cosine          alignment=cosine (unit-length probe gradients) instead of clip_norm
    gram_ema        gram_ema=0.5 (EMA of the Gram across updates)
    alpha_ema       alpha_ema=0.5 (Dynamic Gradient Alignment's damping of alpha)
    adam            geometry=adam (inner products preconditioned by AdamW's 1/(sqrt(v_hat)+eps))
    probe_rse       probe size from the measured probe variance (target relative standard error 0.2, 4..32)
    ...and the combinations listed in VARIANTS.

    .venv/bin/python bench/grape_options.py                                  # the default variants x 3 seeds
    .venv/bin/python bench/grape_options.py --variants uniform,grape,cosine --seeds 0   # a 1-seed screen
    .venv/bin/python bench/grape_options.py --quick                          # smoke run (20 steps, 1 seed)

Prints a table (mean +- std of the average and worst target log-ppl, tokens to uniform's final average,
and the paired per-seed difference to uniform and to grape) and writes bench/results/grape_options.json.
Finished runs with identical overrides are reused (``--fresh`` redoes them); ``--baselines-from`` takes
uniform / grape runs from a mixture_quality JSON with identical settings instead of rerunning them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from common import REPO, parser, result_path, write_json

RESULTS = result_path("grape_options")

#: variant -> (reweighting method, recipe overrides on top of the mixture_quality bench settings)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "uniform": ("uniform", ()),
    "grape": ("grape", ()),
    "cosine": ("grape", ("algorithm.options.alignment=cosine", "algorithm.options.clip_norm=null")),
    "gram_ema": ("grape", ("algorithm.options.gram_ema=0.5",)),
    "alpha_ema": ("grape", ("algorithm.options.alpha_ema=0.5",)),
    "adam": ("grape", ("algorithm.geometry=adam",)),
    "adam_cosine": ("grape", ("algorithm.geometry=adam", "algorithm.options.alignment=cosine",
                              "algorithm.options.clip_norm=null")),
    "probe_rse": ("grape", ("algorithm.probe_rse=0.2", "algorithm.probe_batch_bounds=[4,32]")),
    "cosine_gram_ema": ("grape", ("algorithm.options.alignment=cosine", "algorithm.options.clip_norm=null",
                                  "algorithm.options.gram_ema=0.5")),
    "adam_gram_ema": ("grape", ("algorithm.geometry=adam", "algorithm.options.gram_ema=0.5")),
}
DEFAULT_VARIANTS = "uniform,grape,cosine,gram_ema,alpha_ema,adam,probe_rse"


def _mq() -> Any:
    """bench/mixture_quality.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("mixture_quality", REPO / "bench" / "mixture_quality.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def paired(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], ref: str, key: str) -> dict[str, dict[str, Any]]:
    """Per variant: the per-seed differences (variant - ref) of `key`, on the seeds both have."""
    mq = _mq()
    out: dict[str, dict[str, Any]] = {}
    for v, by_seed in runs.items():
        common = sorted(set(by_seed) & set(runs.get(ref, {})))
        d = [by_seed[s][key] - runs[ref][s][key] for s in common]
        if d:
            m, sd = mq._mean_std(d)
            out[v] = {"seeds": common, "diffs": d, "mean": m, "std": sd, "wins": sum(x < 0 for x in d)}
    return out


def format_paired(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> str:
    lines = ["paired per-seed difference (variant - reference; negative = better; wins = seeds better):",
             f"{'variant':<16}{'avg - uniform':>24}{'worst - uniform':>24}{'avg - grape':>24}{'worst - grape':>24}"]
    cols = [paired(runs, ref, key) for ref in ("uniform", "grape") for key in ("final_avg", "final_worst")]
    for v in runs:
        cells = []
        for c in cols:
            e = c.get(v)
            cells.append("-" if e is None else f"{e['mean']:+.4f} +- {e['std']:.4f} ({e['wins']}/{len(e['diffs'])})")
        lines.append(f"{v:<16}" + "".join(f"{x:>24}" for x in cells))
    return "\n".join(lines)


def _baseline_from(doc: Mapping[str, Any], method: str, seed: int, settings: Any) -> dict[str, Any] | None:
    """A uniform / grape run of a mixture_quality JSON, in run_method's result shape (same settings only)."""
    import dataclasses

    want = json.loads(json.dumps(dataclasses.asdict(settings)))  # as the JSON holds it (tuples are lists)
    if doc.get("settings") != want or doc.get("extra_overrides"):
        return None
    r = (doc.get("runs") or {}).get(method, {}).get(str(seed))
    if r is None:
        return None
    domains = [d for d in (doc["methods"][method].get("final_alpha_seed_mean") or {})] or None
    return {**r, "method": method, "seed": seed, "targets": list(r["final"]), "domains": domains,
            "train_tokens": doc["train_tokens_per_run"], "reused_from": "mixture_quality.json"}


def main(argv: Sequence[str] | None = None) -> int:
    from grape_stream.apps.demo_corpus import ensure_converted, find_corpus
    from grape_stream.apps.demo_run import recipe_overrides, run_method

    mq = _mq()
    p = parser(__doc__)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="smoke run: 20 steps, seed 0, uniform,grape,cosine")
    p.add_argument("--out", default=str(REPO / "runs" / "bench_grape_options"))
    p.add_argument("--data", default=None, help="the demo corpus (default: data/demo)")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--reuse-only", action="store_true",
                   help="run nothing: tabulate the finished runs (a variant screened on fewer seeds shows fewer runs)")
    p.add_argument("--baselines-from", default=None, help="a mixture_quality JSON to take uniform/grape runs from")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.quick:
        args.steps, args.seeds = 20, "0"
        if args.variants == DEFAULT_VARIANTS:
            args.variants = "uniform,grape,cosine"
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s != ""]
    settings = mq.bench_settings(args.steps)
    out = Path(args.out)
    mds = out / "mds"
    ensure_converted(find_corpus(args.data), mds, progress=False)
    base_doc = json.loads(Path(args.baselines_from).read_text()) if args.baselines_from else None

    runs: dict[str, dict[int, dict[str, Any]]] = {}
    order = [(s, v) for s in seeds for v in variants]
    t_start = time.perf_counter()
    for i, (seed, v) in enumerate(order, 1):
        method, extra = VARIANTS[v]
        run_dir = out / f"{v}-seed{seed}"
        want = recipe_overrides(method, settings, mds=mds, out_dir=run_dir, seed=seed, extra=extra)
        res_path = run_dir / "result.json"
        result = None
        if base_doc is not None and v in ("uniform", "grape"):
            result = _baseline_from(base_doc, method, seed, settings)
        if result is None and res_path.exists() and not args.fresh:
            prev = json.loads(res_path.read_text())
            result = prev if prev.get("overrides") == want else None
        tag = f"[{i}/{len(order)}] {v} seed {seed}"
        if result is None and args.reuse_only:
            print(f"{tag}: not run (--reuse-only)", flush=True)
            continue
        if result is None:
            t0 = time.perf_counter()
            result = run_method(method, mds=mds, out_dir=run_dir, settings=settings, seed=seed, progress=False,
                                extra_overrides=extra)
            print(f"{tag}: avg {result['final_avg']:.4f} worst {result['final_worst']:.4f} "
                  f"({time.perf_counter() - t0:.0f}s, {(time.perf_counter() - t_start) / 60:.1f} min so far)",
                  flush=True)
        else:
            print(f"{tag}: reused ({result.get('reused_from', res_path)})", flush=True)
        runs.setdefault(v, {})[seed] = result
        _write(args, runs, settings, seeds, variants, partial=i < len(order))

    _write(args, runs, settings, seeds, variants, partial=False)  # complete as far as runs exist
    agg = mq.aggregate(runs)
    train_tokens = next(iter(next(iter(runs.values())).values()))["train_tokens"]
    print("")
    print(mq.format_table(agg, train_tokens))
    print("")
    print(format_paired(runs))
    print(f"wrote {args.results}")
    return 0


def _write(args: argparse.Namespace, runs: Mapping[str, Mapping[int, Mapping[str, Any]]], settings: Any,
           seeds: Sequence[int], variants: Sequence[str], partial: bool) -> None:
    import dataclasses

    mq = _mq()
    agg = mq.aggregate(runs)
    train_tokens = next(iter(next(iter(runs.values())).values()))["train_tokens"]
    doc = {
        "bench": "grape_options",
        "partial": partial,
        "command": "python bench/grape_options.py " + " ".join(sys.argv[1:]),
        "settings": dataclasses.asdict(settings),
        "variants": {v: {"method": VARIANTS[v][0], "overrides": list(VARIANTS[v][1])} for v in variants},
        "seeds_requested": list(seeds),
        "train_tokens_per_run": train_tokens,
        "metric": "token-level test cross-entropy (nats/byte), strided subset of each target's test split",
        "table": mq.format_table(agg, train_tokens),
        "paired_table": format_paired(runs),
        "paired": {f"{key}_vs_{ref}": paired(runs, ref, key) for ref in ("uniform", "grape")
                   for key in ("final_avg", "final_worst")},
        **agg,
        "runs": {v: {str(s): {k: r.get(k) for k in ("final", "final_avg", "final_worst", "curve", "trajectory",
                                                    "seconds", "reused_from")}
                     for s, r in by_seed.items()} for v, by_seed in runs.items()},
    }
    write_json(args.results, doc)


if __name__ == "__main__":
    raise SystemExit(main())
