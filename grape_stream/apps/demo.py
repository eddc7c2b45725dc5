"""`grape-stream demo`: uniform vs DoGE vs GRAPE on real multilingual text, on a laptop CPU.

The paper's wiki40b experiment in miniature: six source languages (en fr de es ru it) are the domains
whose mixture is learned, seven low-resource languages (tr da ca pl nl uk pt) are the targets whose
held-out text we want to model well. Every method trains the same byte-level decoder from the same
initialisation on the same token budget; only the domain weights differ.

Everything runs on the product path: the bundled corpus (``data/demo``) is converted with
:func:`grape_stream.convert.pipeline.convert` into per-language MDS shards (:mod:`.demo_corpus`), and each
method is the bundled
``demo-cpu`` recipe (:mod:`grape_stream.recipe`, :mod:`grape_stream.integrations.composer.trainer`) built into a
Composer Trainer with ``GrapeAlgorithm``, with a few overrides (:func:`.demo_run.recipe_overrides`). Two callbacks
(:mod:`.demo_callbacks`) watch the run: a tqdm
progress bar, and a test-loss curve on a fixed strided subset of each target's test split (the
headline numbers come from the recipe's own evaluators, on the whole test split, at the end).

Outputs under ``--out`` (default ``runs/demo``): ``mds/`` (the converted corpus, reused while the
corpus and settings are unchanged), ``<method>/`` (metrics.jsonl, grape_trajectory.jsonl/.png,
result.json), ``summary.json``, ``test_loss.png`` and ``weights.png``.

The same runner (:func:`.demo_run.run_method`) drives ``bench/mixture_quality.py``. The method choices are
the reweighting registry's (:func:`demo_methods`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from grape_stream.apps.demo_callbacks import strided_indices
from grape_stream.apps.demo_corpus import CONVERT_SETTINGS_FILE, ensure_converted, find_corpus
from grape_stream.apps.demo_plots import plot_test_loss, plot_weights
from grape_stream.apps.demo_run import RECIPE, recipe_overrides, run_method
from grape_stream.apps.demo_settings import DEMO, QUICK, DemoSettings
from grape_stream.grape.reweighting import REWEIGHTERS, available_methods, build_reweighter

__all__ = [
    "CONVERT_SETTINGS_FILE",
    "DEMO",
    "QUICK",
    "DemoSettings",
    "alpha_movement",
    "demo_methods",
    "ensure_converted",
    "find_corpus",
    "format_table",
    "main",
    "recipe_overrides",
    "run_method",
]

_strided_indices = strided_indices  # the name it had when it lived here


def demo_methods() -> list[str]:
    """The registry's methods that run from the recipe's options alone (``static`` needs ``weights=[...]``,
    which the demo has no way to give; ``doremi`` needs a reference model's weights): the demo's ``--methods``
    choices."""
    out = []
    for m in available_methods():
        if REWEIGHTERS[m].needs_reference:
            continue
        try:
            build_reweighter(m, num_domains=2, num_tasks=2)
        except (TypeError, ValueError):
            continue
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------
def alpha_movement(result: Mapping[str, Any]) -> float:
    """Largest total-variation distance of alpha from its initial value over the run (0 = never moved)."""
    traj = result.get("trajectory") or []
    if not traj:
        return 0.0
    a0 = traj[0]["alpha"]
    return max(0.5 * sum(abs(x - y) for x, y in zip(r["alpha"], a0)) for r in traj)


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Per-target test log-perplexity, average and worst; the best method of each row is starred."""
    methods = list(results)
    targets = list(next(iter(results.values()))["targets"])
    w = max(9, *(len(m) + 2 for m in methods))
    lines = [f"{'target':<8}" + "".join(f"{m:>{w}}" for m in methods)]
    lines.append("-" * len(lines[0]))

    def row(label: str, values: list[float]) -> str:
        best = min(values)
        cells = "".join(f"{v:>{w - 1}.4f}{'*' if v == best and len(values) > 1 else ' '}" for v in values)
        return f"{label:<8}{cells}"

    for t in targets:
        lines.append(row(t, [results[m]["final"][t] for m in methods]))
    lines.append("-" * len(lines[0]))
    lines.append(row("average", [results[m]["final_avg"] for m in methods]))
    lines.append(row("worst", [results[m]["final_worst"] for m in methods]))
    return "\n".join(lines)


def _summary(results: Mapping[str, Mapping[str, Any]], settings: DemoSettings, seed: int, corpus: Path,
             mds: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "what": "test log-perplexity (nats per byte) per target language after the same token budget",
        "recipe": RECIPE,
        "settings": dataclasses.asdict(settings),
        "seed": seed,
        "corpus": str(corpus),
        "mds": str(mds),
        "methods": {},
    }
    for m, r in results.items():
        out["methods"][m] = {
            "final": r["final"], "average": r["final_avg"], "worst": r["final_worst"],
            "final_source": r["final_source"], "train_tokens": r["train_tokens"],
            "alpha_final": dict(zip(r["domains"], r["trajectory"][-1]["alpha"])) if r["trajectory"] else None,
            "z_final": (dict(zip(r["targets"], r["trajectory"][-1]["z"]))
                        if r["trajectory"] and r["trajectory"][-1].get("z") is not None and m != "uniform" else None),
            "alpha_moved_tv": alpha_movement(r),
            "seconds": r["seconds"],
            "curve": r["curve"],
            "trajectory": r["trajectory"],
        }
    return out


def _header(corpus_meta: Mapping[str, Any], settings: DemoSettings, methods: Sequence[str], quick: bool) -> str:
    roles = corpus_meta.get("roles", {})
    tokens = settings.steps * settings.global_batch * 256
    lines = [
        "",
        "grape-stream demo" + (" (quick)" if quick else "") + ": which source languages should a small model read",
        "to be good at seven other languages? Uniform mixing vs DoGE vs GRAPE, on real text, on this CPU.",
        "",
        f"  sources (the mixture alpha is learned over): {' '.join(roles.get('sources', []))}",
        f"  targets (held-out text we care about):       {' '.join(roles.get('targets', []))}",
        f"  model: the demo-cpu recipe's byte-level GPT; {settings.steps} steps x {settings.global_batch} x 256 bytes"
        f" = {tokens / 1e6:.1f}M training bytes per method",
        f"  every {settings.update_every} steps DoGE/GRAPE probe {settings.probe_domain_batch} samples per source and"
        f" {settings.probe_task_batch} per target (probe split) and update alpha",
        "  methods:",
    ]
    lines += [f"    {m:<12}{REWEIGHTERS[m].description}" for m in methods]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------
def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str], DemoSettings]:
    choices = demo_methods()
    p = argparse.ArgumentParser(
        prog="grape-stream demo",
        description="Train a small byte-level decoder on the bundled multilingual corpus with uniform, DoGE and "
                    "GRAPE mixtures for the same token budget, and compare target-language test log-perplexity.",
    )
    p.add_argument("--quick", action="store_true",
                   help="a ~1.3 minute run (48 steps per method) instead of ~7 minutes (400 steps), on 2 idle cores")
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument("--data", default=None, help="the bundled corpus directory (default: data/demo)")
    p.add_argument("--methods", default="uniform,doge,grape",
                   help=f"comma-separated methods (default: uniform,doge,grape; any of {', '.join(choices)})")
    p.add_argument("--seed", type=int, default=17, help="seed of model init, data order and probes (default: 17)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per method (default: 400, --quick 48)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in choices]
    if bad or not methods:
        p.error(f"unknown method(s) {bad}; choose from {', '.join(choices)}")
    if len(set(methods)) != len(methods):
        p.error(f"--methods repeats a method: {args.methods}")
    settings = QUICK if args.quick else DEMO
    if args.steps is not None:
        if args.steps < 1:
            p.error("--steps must be >= 1")
        settings = settings.replace(steps=args.steps, warmup=min(settings.warmup, max(args.steps // 5, 1)),
                                    update_every=min(settings.update_every, max(args.steps // 4, 1)),
                                    curve_every=min(settings.curve_every, max(args.steps // 3, 1)))
    return args, methods, settings


def _print_results(results: Mapping[str, Mapping[str, Any]], settings: DemoSettings, out: Path,
                   pngs: Sequence[str]) -> None:
    budget = settings.steps * settings.global_batch * 256
    print("")
    print("Test log-perplexity per target language (nats per byte, lower is better; * = best),")
    where = ("the whole test split of each target" if settings.final_eval
             else f"a strided subset of {settings.final_samples} test samples per target")
    print(f"after {budget / 1e6:.2f}M training bytes each, on {where}:")
    print("")
    print(format_table(results))
    print("")
    for m, r in results.items():
        if r["trajectory"] and m != "uniform":
            final = r["trajectory"][-1]["alpha"]
            top = sorted(zip(r["domains"], final), key=lambda kv: -kv[1])
            print(f"  {m:<12} final alpha: " + " ".join(f"{d} {a:.2f}" for d, a in top)
                  + f"   (moved {alpha_movement(r):.2f} in total variation from uniform)")
    if "uniform" in results and len(results) > 1:
        u = results["uniform"]["final_avg"]
        for m, r in results.items():
            if m != "uniform":
                print(f"  {m:<12} average {r['final_avg'] - u:+.4f} vs uniform, worst "
                      f"{r['final_worst'] - results['uniform']['final_worst']:+.4f}")
    print("")
    print(f"Plots:   {pngs[0]}  (test loss of every target during training)")
    print(f"         {pngs[1]}  (source weights alpha and target weights z over training)")
    for m in results:
        traj_png = out / m / "grape_trajectory.png"
        if traj_png.exists() and m != "uniform":
            print(f"         {traj_png}  ({m}: alpha, z, alignments, probe losses)")
    print(f"Summary: {out / 'summary.json'}")


def main(argv: Sequence[str] | None = None) -> int:
    args, methods, settings = _parse(argv)
    corpus = find_corpus(args.data)  # CorpusNotFoundError: one line under grape-stream (errors.run_cli)
    corpus_meta = json.loads((corpus / "corpus.json").read_text())
    out = Path(args.out)
    mds = out / "mds"
    progress = not args.no_progress
    print(_header(corpus_meta, settings, methods, args.quick), flush=True)
    print("", flush=True)

    n_steps = len(methods) + 1
    t0 = time.perf_counter()
    print(f"[1/{n_steps}] corpus {corpus} -> MDS shards in {mds}", flush=True)
    _, converted = ensure_converted(corpus, mds, progress=False)
    print(f"      {'converted' if converted else 'already converted (same corpus and settings): reused'}"
          f" ({time.perf_counter() - t0:.0f}s)", flush=True)

    results: dict[str, dict[str, Any]] = {}
    for i, m in enumerate(methods, start=2):
        if not progress:
            print(f"[{i}/{n_steps}] training {m} ...", flush=True)
        results[m] = run_method(m, mds=mds, out_dir=out / m, settings=settings, seed=args.seed, progress=progress,
                                position=f"[{i}/{n_steps}]")
    summary = _summary(results, settings, args.seed, corpus, mds)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    pngs = [plot_test_loss(results, out / "test_loss.png"), plot_weights(results, out / "weights.png")]
    _print_results(results, settings, out, pngs)
    print(f"Done in {(time.perf_counter() - t0) / 60:.1f} min. Try `grape-stream train {RECIPE} --print-config` to see "
          f"the recipe each run used.")
    return 0


if __name__ == "__main__":
    from grape_stream.errors import run_cli

    raise SystemExit(run_cli("grape-stream demo", main, sys.argv[1:]))
