"""`grape-stream demo`: uniform vs GRAPE (and any registry method) on real multilingual text, on a laptop CPU.

The default setting is the value benchmark's (:mod:`.demo_pool`, ``bench/value.py``): a pool of 13 languages
(six high-resource ones plus the small training splits of seven low-resource ones) whose mixture is learned,
and the seven low-resource languages as targets whose held-out text we want to model well. Every method
trains the same small GPT (a 4,096-id BPE trained on the pool) from the same initialisation on the same token
budget; only the domain weights differ. At the benchmark's exact settings the demo prints the benchmark's
seed means and its best static mixture's loss beside the run's own table. ``--setting bytes`` is the earlier
demo: six high-resource sources only, a byte-level model (there the methods tie, docs/results.md).

Everything runs on the product path: the bundled corpus (``data/demo``) is converted with
:func:`grape_stream.convert.pipeline.convert` into per-language MDS shards (:mod:`.demo_corpus`), and each
method is the bundled
``demo-cpu`` recipe (:mod:`grape_stream.recipe`, :mod:`grape_stream.integrations.composer.trainer`) built into a
Composer Trainer with ``GrapeAlgorithm``, with a few overrides (:func:`.demo_run.recipe_overrides`). The recipe is
the default GRAPE run itself; the demo prints (and saves in ``summary.json``) the ``grape-stream train`` command of
each run (:func:`.demo_run.reproduce_command`). Two callbacks
(:mod:`.demo_callbacks`) watch the run: a tqdm
progress bar, and a test-loss curve on a fixed strided subset of each target's test split (the
headline numbers come from the recipe's own evaluators, on the whole test split, at the end).

Outputs under ``--out`` (default ``runs/demo``, ``runs/demo_bytes`` for ``--setting bytes``):
``tokenizer.json`` and ``mds/`` (the converted corpus, reused while the corpus, the tokenizer and the settings
are unchanged; the ``demo-cpu`` recipe's ``data.local``), ``<method>/`` (metrics.jsonl, grape_trajectory.jsonl/.png,
result.json), ``summary.json``, ``test_loss.png`` and ``weights.png``.

The same runner (:func:`.demo_run.run_method`) drives ``bench/mixture_quality.py``. The method choices are
the reweighting registry's (:func:`demo_methods`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from grape_stream.apps.demo_callbacks import strided_indices
from grape_stream.apps.demo_corpus import CONVERT_SETTINGS_FILE, ensure_converted, find_corpus
from grape_stream.apps.demo_plots import plot_test_loss, plot_weights
from grape_stream.apps.demo_pool import (
    QUICK_STEPS,
    STEPS,
    pool_settings,
    prepare,
    quick_settings,
    reference_lines,
)
from grape_stream.apps.demo_run import RECIPE, recipe_overrides, run_method, run_methods
from grape_stream.apps.demo_settings import DEMO, QUICK, DemoSettings
from grape_stream.console import add_console_arguments
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


def _unit(setting: str) -> str:
    return "byte" if setting == "bytes" else "token"


def _seq_len(setting: str) -> int:
    return 256 if setting == "bytes" else 128


def _summary(results: Mapping[str, Mapping[str, Any]], settings: DemoSettings, seed: int, corpus: Path,
             mds: Path, setting: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "what": f"test log-perplexity (nats per {_unit(setting)}) per target language after the same token budget",
        "setting": setting,
        "recipe": RECIPE,
        "model_data": list(settings.model_data),
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
            "command": r["command"],
            "overrides": r["overrides"],
            "curve": r["curve"],
            "trajectory": r["trajectory"],
        }
    return out


def _header(corpus_meta: Mapping[str, Any], settings: DemoSettings, methods: Sequence[str], quick: bool,
            setting: str) -> str:
    roles = corpus_meta.get("roles", {})
    seq = _seq_len(setting)
    tokens = settings.steps * settings.global_batch * seq
    targets = roles.get("targets", [])
    if setting == "bytes":
        sources = roles.get("sources", [])
        what = (f"the demo-cpu recipe's byte-level GPT; {settings.steps} steps x {settings.global_batch} x {seq} bytes"
                f" = {tokens / 1e6:.1f}M training bytes per method")
    else:
        sources = [*roles.get("sources", []), *targets]
        what = (f"a 4-layer GPT (d=128) over a 4,096-id BPE trained on the sources; {settings.steps} steps x "
                f"{settings.global_batch} x {seq} tokens = {tokens / 1e6:.2f}M training tokens per method")
    lines = [
        "",
        "grape-stream demo" + (" (quick)" if quick else "") + ": which source languages should a small model read",
        "to be good at seven low-resource languages? Uniform mixing vs adaptive mixing, on real text, on this CPU.",
        "",
        f"  sources (the mixture alpha is learned over): {' '.join(sources)}",
        f"  targets (held-out test text we care about): {' '.join(targets)}",
        f"  model: {what}",
        f"  every {settings.update_every} steps the adaptive methods probe {settings.probe_domain_batch} samples per"
        f" source and {settings.probe_task_batch} per target (probe split) and update alpha",
        "  methods:",
    ]
    if setting != "bytes":
        lines.insert(6, "  (the targets' small training splits are sources too: a little very relevant text in a pool "
                        "of mostly irrelevant text)")
    lines += [f"    {m:<12}{REWEIGHTERS[m].description}" for m in methods]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------
def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str], DemoSettings]:
    choices = demo_methods()
    p = argparse.ArgumentParser(
        prog="grape-stream demo",
        description="Train a small GPT on a pool of 13 languages of the bundled corpus with uniform and GRAPE "
                    "mixtures for the same token budget, and compare the test loss of 7 low-resource languages.",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run ({QUICK_STEPS} steps per method, ~2 minutes) instead of {STEPS} steps")
    p.add_argument("--setting", choices=("pool", "bytes"), default="pool",
                   help="pool: the value benchmark's setting (default); bytes: the earlier byte-level demo "
                        "(6 sources, where the methods tie)")
    p.add_argument("--out", default=None, help="output directory (default: runs/demo, bytes: runs/demo_bytes)")
    p.add_argument("--data", default=None, help="the bundled corpus directory (default: data/demo)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated methods (default: uniform,grape, bytes: uniform,doge,grape; any of "
                        f"{', '.join(choices)})")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of model init, data order and probes (default: 0, the benchmark's first; bytes: 17)")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps per method (default: {STEPS}, "
                                                           f"--quick {QUICK_STEPS})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs trained at the same time, each in its own process with its share of the cores "
                        "(default: one per core, at most one per method)")
    add_console_arguments(p)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    bytes_ = args.setting == "bytes"
    args.methods = args.methods or ("uniform,doge,grape" if bytes_ else "uniform,grape")
    args.seed = args.seed if args.seed is not None else (17 if bytes_ else 0)
    args.out = args.out or ("runs/demo_bytes" if bytes_ else "runs/demo")

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in choices]
    if bad or not methods:
        p.error(f"unknown method(s) {bad}; choose from {', '.join(choices)}")
    if len(set(methods)) != len(methods):
        p.error(f"--methods repeats a method: {args.methods}")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.jobs is not None and args.jobs < 1:
        p.error("--jobs must be >= 1")
    if not bytes_:
        steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
        return args, methods, quick_settings(steps) if args.quick else pool_settings(steps)
    settings = QUICK if args.quick else DEMO
    if args.steps is not None:
        settings = settings.replace(steps=args.steps, warmup=min(settings.warmup, max(args.steps // 5, 1)),
                                    update_every=min(settings.update_every, max(args.steps // 4, 1)),
                                    curve_every=min(settings.curve_every, max(args.steps // 3, 1)))
    return args, methods, settings


def _print_results(results: Mapping[str, Mapping[str, Any]], settings: DemoSettings, out: Path,
                   pngs: Sequence[str], setting: str, seed: int) -> None:
    unit = _unit(setting)
    budget = settings.steps * settings.global_batch * _seq_len(setting)
    print("")
    print(f"Test log-perplexity per target language (nats per {unit}, lower is better; * = best),")
    where = ("the whole test split of each target" if settings.final_eval
             else f"a strided subset of {settings.final_samples} test sequences per target")
    print(f"after {budget / 1e6:.2f}M training {unit}s each, on {where}:")
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
    if setting == "pool" and settings == pool_settings(STEPS):
        ref = reference_lines(list(results), seed)
        if ref:
            print("")
            print("\n".join(ref))
    print("")
    print(f"Plots:   {pngs[0]}  (test loss of every target during training)")
    print(f"         {pngs[1]}  (source weights alpha and target weights z over training)")
    for m in results:
        traj_png = out / m / "grape_trajectory.png"
        if traj_png.exists() and m != "uniform":
            print(f"         {traj_png}  ({m}: alpha, z, alignments, probe losses)")
    print(f"Summary: {out / 'summary.json'}")


def _convert(setting: str, corpus: Path, out: Path) -> tuple[Path, str]:
    """The converted corpus for ``setting`` (BPE training first for the pool) and what was done."""
    if setting == "bytes":
        mds = out / "mds"
        _, converted = ensure_converted(corpus, mds, progress=False)
        return mds, "converted" if converted else "already converted (same corpus and settings): reused"
    mds, did = prepare(out, corpus)
    return mds, ("BPE trained and corpus converted" if did
                 else "already converted (same corpus, tokenizer and settings): reused")


def main(argv: Sequence[str] | None = None) -> int:
    args, methods, settings = _parse(argv)
    corpus = find_corpus(args.data)  # CorpusNotFoundError: one line under grape-stream (errors.run_cli)
    corpus_meta = json.loads((corpus / "corpus.json").read_text())
    out = Path(args.out)
    progress = not args.no_progress
    print(_header(corpus_meta, settings, methods, args.quick, args.setting), flush=True)
    print("", flush=True)

    n_steps = len(methods) + 1
    t0 = time.perf_counter()
    what = "corpus" if args.setting == "bytes" else "BPE on the sources' training text, corpus"
    print(f"[1/{n_steps}] {what} {corpus} -> MDS shards under {out}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    mds, done = _convert(args.setting, corpus, out)
    print(f"      {done} ({time.perf_counter() - t0:.0f}s)", flush=True)

    jobs = min(len(methods), args.jobs or os.cpu_count() or 1)
    labels = [f"[{i}/{n_steps}]" for i in range(2, n_steps + 1)]
    if not progress:
        print(f"{labels[0]}-{labels[-1]} training {', '.join(methods)}"
              + (f", {jobs} at a time in their own processes" if jobs > 1 else "") + " ...", flush=True)
    results = run_methods(methods, jobs=jobs, out=out, labels=labels, mds=mds, settings=settings, seed=args.seed,
                          progress=progress)
    summary = _summary(results, settings, args.seed, corpus, mds, args.setting)
    with open(out / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    unit = _unit(args.setting)
    pngs = [plot_test_loss(results, out / "test_loss.png", unit=unit), plot_weights(results, out / "weights.png")]
    _print_results(results, settings, out, pngs, args.setting, args.seed)
    print(f"Done in {(time.perf_counter() - t0) / 60:.1f} min. The same runs with `grape-stream train` (the {RECIPE} "
          "recipe; add --print-config to see all of it):")
    for r in results.values():
        print(f"  {r['command']}")
    return 0


if __name__ == "__main__":
    from grape_stream.errors import run_cli

    raise SystemExit(run_cli("grape-stream demo", main, sys.argv[1:]))
