"""Benchmark: mixture quality of every reweighting method on the bundled multilingual corpus.

The paper's claim to check (wiki40b set-up): GRAPE reaches lower target log-perplexity than uniform and
DoGE on every target, and reaches uniform's final level in at most 0.6x the tokens. Here: the demo set-up
(6 source languages, 7 target languages, the demo-cpu recipe's byte-level decoder) at a fixed, smaller
token budget so that 6 methods x 3 seeds fit in ~40 minutes on 2 CPU cores. Every run is the product
path (recipe -> Composer Trainer with GrapeAlgorithm) through :func:`grape_stream.apps.demo.run_method`, with
the same GRAPE step sizes as the demo.

Numbers: token-level test cross-entropy (nats per byte) on a fixed strided subset of each target's test
split (the same samples for every method and seed, so differences are paired), average and worst over
the 7 targets, mean +- std over seeds; and the training tokens each method needs to reach uniform's final
average (same seed, both read on the curve's subset of 48 samples per target), interpolated linearly between curve
points ("not reached" if it never does).

    .venv/bin/python bench/mixture_quality.py                      # 6 methods x 3 seeds (~40 min, 2 cores)
    .venv/bin/python bench/mixture_quality.py --seeds 0 --methods uniform,grape --steps 40   # smoke run
    .venv/bin/python bench/mixture_quality.py --corpus english     # English sources + QA targets (gpt2 tokens)

``--corpus english`` (bench/mixture_english.py): 7 English source domains, 4 multiple-choice QA targets,
GPT-2 tokenizer; adds CRISP, RegMix and GRAPE started from them, multiple-choice accuracy and cost.

Runs already finished with identical settings are reused (``--fresh`` to redo them), so an interrupted
bench continues where it stopped; bench/results/mixture_quality.json is rewritten after every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from common import REPO, parser, result_path, write_json

RESULTS = result_path("mixture_quality")


def bench_settings(steps: int) -> Any:
    """The demo's settings (same model, lr, GRAPE step sizes) at a smaller budget; eval on a subset."""
    from grape_stream.apps.demo_settings import DEMO

    return DEMO.replace(steps=steps, warmup=max(steps // 10, 1), update_every=max(steps // 5, 1),
                        curve_every=max(steps // 8, 1), curve_samples=48, final_eval=False, final_samples=192)


def tokens_to_reach(curve: Mapping[str, Any], level: float) -> float | None:
    """First training-token count at which the average test loss is <= level (linear interpolation)."""
    xs, ys = curve["tokens"], curve["avg"]
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y <= level:
            if i == 0:
                return float(x)
            x0, y0 = xs[i - 1], ys[i - 1]
            return float(x0 + (x - x0) * (y0 - level) / (y0 - y)) if y0 != y else float(x)
    return None


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return m, s


def _pm(xs: Sequence[float], digits: int = 4) -> str:
    if not xs:
        return "-"
    m, s = _mean_std(xs)
    return f"{m:.{digits}f} +- {s:.{digits}f}"


def aggregate(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, Any]:
    """Per-method statistics over seeds, and the paper's two claims checked against uniform and DoGE."""
    out: dict[str, Any] = {}
    uniform = runs.get("uniform", {})
    for m, by_seed in runs.items():
        seeds = sorted(by_seed)
        avg = [by_seed[s]["final_avg"] for s in seeds]
        worst = [by_seed[s]["final_worst"] for s in seeds]
        targets = list(by_seed[seeds[0]]["targets"])
        per_target = {t: [by_seed[s]["final"][t] for s in seeds] for t in targets}
        reach, ratios = {}, []
        for s in seeds:
            if s not in uniform:
                continue
            u = uniform[s]
            # the curve's own last point: the curve subset, not the larger final subset, is the yardstick
            t = tokens_to_reach(by_seed[s]["curve"], u["curve"]["avg"][-1])
            reach[s] = t
            if t is not None:
                ratios.append(t / u["train_tokens"])
        tv = []
        for s in seeds:
            traj = by_seed[s]["trajectory"]
            if traj:
                a0 = traj[0]["alpha"]
                tv.append(max(0.5 * sum(abs(x - y) for x, y in zip(r["alpha"], a0)) for r in traj))
        out[m] = {
            "seeds": seeds,
            "average": {"values": avg, "mean": _mean_std(avg)[0], "std": _mean_std(avg)[1]},
            "worst": {"values": worst, "mean": _mean_std(worst)[0], "std": _mean_std(worst)[1]},
            "per_target_mean": {t: _mean_std(v)[0] for t, v in per_target.items()},
            "tokens_to_uniform_final_avg": {str(s): reach[s] for s in reach},
            "tokens_ratio_vs_uniform": {"values": ratios, "reached": len(ratios), "of": len(reach),
                                        "mean": _mean_std(ratios)[0] if ratios else None},
            "alpha_moved_tv": tv,
            "final_alpha_seed_mean": _mean_alpha(by_seed),
            "seconds_mean": _mean_std([by_seed[s]["seconds"]["total"] for s in seeds])[0],
        }
        if all("accuracy" in by_seed[s] for s in seeds):  # English corpus: multiple choice and cost
            for key in ("acc", "acc_norm"):
                vals = [by_seed[s]["accuracy"][key] for s in seeds]
                out[m][key] = {"values": vals, "mean": _mean_std(vals)[0], "std": _mean_std(vals)[1]}
            cost = [by_seed[s]["cost_seconds"] / uniform[s]["cost_seconds"] for s in seeds if s in uniform]
            out[m]["cost_vs_uniform"] = {"values": cost, "mean": _mean_std(cost)[0] if cost else None}
    claims: dict[str, Any] = {}
    if "grape" in runs:
        g = runs["grape"]
        for base in ("uniform", "doge"):
            if base not in runs:
                continue
            common = sorted(set(g) & set(runs[base]))
            targets = list(g[common[0]]["targets"]) if common else []
            mean_win = {t: out["grape"]["per_target_mean"][t] < out[base]["per_target_mean"][t] for t in targets}
            seed_wins = {t: sum(g[s]["final"][t] < runs[base][s]["final"][t] for s in common) for t in targets}
            claims[f"grape_beats_{base}_on_every_target"] = {
                "holds_on_seed_mean": all(mean_win.values()) if mean_win else None,
                "targets_won_on_seed_mean": sum(mean_win.values()), "targets": len(targets),
                "seed_wins_per_target": seed_wins, "seeds": len(common),
            }
        r = out["grape"]["tokens_ratio_vs_uniform"]
        claims["grape_needs_at_most_0.6x_uniform_tokens"] = {
            "holds": bool(r["values"]) and r["reached"] == r["of"] and max(r["values"]) <= 0.6,
            "ratios": r["values"], "reached": r["reached"], "of": r["of"],
        }
    return {"methods": out, "claims": claims}


def _mean_alpha(by_seed: Mapping[int, Mapping[str, Any]]) -> dict[str, float] | None:
    finals = [r["trajectory"][-1]["alpha"] for r in by_seed.values() if r.get("trajectory")]
    if not finals:
        return None
    domains = next(iter(by_seed.values()))["domains"]
    return {d: sum(f[k] for f in finals) / len(finals) for k, d in enumerate(domains)}


def format_table(agg: Mapping[str, Any], train_tokens: int) -> str:
    rows = [("method", "runs", "avg log-ppl", "worst log-ppl", "tokens to uniform's final avg", "alpha moved (TV)")]
    for m, st in agg["methods"].items():
        r = st["tokens_ratio_vs_uniform"]
        if not r["of"]:
            reach = "-"
        elif r["reached"] == 0:
            reach = "not reached"
        else:
            m_, s_ = _mean_std(r["values"])
            reach = f"{m_:.2f}x +- {s_:.2f}" + (
                "" if r["reached"] == r["of"] else f" ({r['reached']}/{r['of']} reached)")
        tv = f"{sum(st['alpha_moved_tv']) / len(st['alpha_moved_tv']):.3f}" if st["alpha_moved_tv"] else "-"
        rows.append((m, str(len(st["seeds"])), _pm(st["average"]["values"]), _pm(st["worst"]["values"]), reach, tv))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    targets = list(next(iter(agg["methods"].values()))["per_target_mean"])
    lines.append("")
    lines.append("per-target test log-ppl (mean over seeds; * = best):")
    head = f"{'method':<12}" + "".join(f"{t:>8}" for t in targets)
    lines.append(head)
    best = {t: min(st["per_target_mean"][t] for st in agg["methods"].values()) for t in targets}
    for m, st in agg["methods"].items():
        cells = "".join(f"{st['per_target_mean'][t]:>7.4f}{'*' if st['per_target_mean'][t] == best[t] else ' '}"
                        for t in targets)
        lines.append(f"{m:<12}{cells}")
    lines.append(f"(budget: {train_tokens / 1e6:.2f}M training bytes per run)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from grape_stream.apps.demo import demo_methods
    from grape_stream.apps.demo_corpus import ensure_converted, find_corpus
    from grape_stream.apps.demo_run import recipe_overrides, run_method

    p = parser(__doc__)
    all_methods = demo_methods()  # the reweighting registry's methods that run from a recipe's options
    p.add_argument("--methods", default=",".join(all_methods))
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run (default: 100 = 0.82M bytes)")
    p.add_argument("--out", default=str(REPO / "runs" / "bench_mixture_quality"), help="run directories")
    p.add_argument("--data", default=None, help="the demo corpus (default: data/demo)")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--fresh", action="store_true", help="redo runs that already finished")
    p.add_argument("--plots", default=None, help="also write comparison PNGs (seed of the first seed) here")
    p.add_argument("--extra", action="append", default=[], help="extra recipe override key=value for every run")
    p.add_argument("--corpus", default="demo", choices=("demo", "english"),
                   help="demo: the multilingual corpus (default); english: bench/mixture_english.py")
    p.add_argument("--proxies", type=int, default=10, help="english: RegMix proxy runs")
    p.add_argument("--jobs", type=int, default=1, help="english: RegMix proxies in parallel")
    p.add_argument("--crisp-samples", type=int, default=32, help="english: documents embedded per domain/target")
    p.add_argument("--choice-items", type=int, default=32, help="english: multiple-choice test items per target")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.corpus == "english":
        if "--steps" not in raw:
            args.steps = 30
        if "--methods" not in raw:
            args.methods = ""
        if "--out" not in raw:
            args.out = str(REPO / "runs" / "bench_mixture_english")
        if "--results" not in raw:
            args.results = str(RESULTS.with_name("mixture_quality_english.json"))
        return main_english(args, all_methods)

    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in all_methods]
    if bad:
        p.error(f"unknown methods {bad}; choose from {all_methods}")
    seeds = [int(s) for s in args.seeds.split(",") if s != ""]
    settings = bench_settings(args.steps)
    out = Path(args.out)
    corpus = find_corpus(args.data)
    mds = out / "mds"
    ensure_converted(corpus, mds, progress=False)

    runs: dict[str, dict[int, dict[str, Any]]] = {}
    order = [(s, m) for s in seeds for m in methods]  # seed-major: a partial bench has whole seeds
    t_start = time.perf_counter()
    for i, (seed, m) in enumerate(order, 1):
        run_dir = out / f"{m}-seed{seed}"
        want = recipe_overrides(m, settings, mds=mds, out_dir=run_dir, seed=seed, extra=args.extra)
        res_path = run_dir / "result.json"
        result = None
        if res_path.exists() and not args.fresh:
            prev = json.loads(res_path.read_text())
            if prev.get("overrides") == want:
                result = prev
        tag = f"[{i}/{len(order)}] {m} seed {seed}"
        if result is None:
            t0 = time.perf_counter()
            result = run_method(m, mds=mds, out_dir=run_dir, settings=settings, seed=seed, progress=False,
                                extra_overrides=args.extra)
            print(f"{tag}: avg {result['final_avg']:.4f} worst {result['final_worst']:.4f} "
                  f"({time.perf_counter() - t0:.0f}s, {(time.perf_counter() - t_start) / 60:.1f} min so far)",
                  flush=True)
        else:
            print(f"{tag}: reused {res_path}", flush=True)
        runs.setdefault(m, {})[seed] = result
        _write(args.results, runs, settings, seeds, methods, args, partial=i < len(order))

    agg = aggregate(runs)
    train_tokens = next(iter(next(iter(runs.values())).values()))["train_tokens"]
    print("")
    print(format_table(agg, train_tokens))
    print("")
    for name, c in agg["claims"].items():
        print(f"claim {name}: {json.dumps(c)}")
    if args.plots:
        from grape_stream.apps.demo_plots import plot_test_loss, plot_weights

        s0 = seeds[0]
        sel = {m: runs[m][s0] for m in methods if s0 in runs.get(m, {})}
        print(plot_test_loss(sel, Path(args.plots) / "bench_test_loss.png", dpi=72))
        print(plot_weights(sel, Path(args.plots) / "bench_weights.png", dpi=75))
    print(f"wrote {args.results}")
    return 0


def main_english(args: argparse.Namespace, registry: Sequence[str]) -> int:
    """``--corpus english``: the same loop, plus the baseline weights, accuracy and cost (mixture_english)."""
    sys.path.insert(0, str(REPO / "bench"))
    import mixture_english as en

    from grape_stream.apps.demo_run import recipe_overrides, run_method

    methods = en.methods_list(args.methods, registry)
    seeds = [int(s) for s in args.seeds.split(",") if s != ""]
    settings = en.settings(args.steps)
    out, corpus = Path(args.out), Path(args.data or REPO / "data" / "english")
    mds = out / "mds"
    en.convert(corpus, mds)
    docs = {b: en.baseline(b, corpus, mds, out, steps=args.steps, proxies=args.proxies, jobs=args.jobs,
                           crisp_samples=args.crisp_samples, fresh=args.fresh)
            for b in ("crisp", "regmix") if any(en.DERIVED.get(m, ("", ""))[1] == b for m in methods)}
    args.baseline_docs = docs
    items = en.choice_items(corpus, args.choice_items)
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    order = [(s, m) for s in seeds for m in methods]
    t_start = time.perf_counter()
    for i, (seed, m) in enumerate(order, 1):
        run_dir = out / f"{m}-seed{seed}"
        base, extra = en.method_overrides(m, docs)
        extra = [*en.OVERRIDES, *extra, *args.extra]
        want = recipe_overrides(base, settings, mds=mds, out_dir=run_dir, seed=seed, extra=extra)
        res_path = run_dir / "result.json"
        result = None
        if res_path.exists() and not args.fresh:
            prev = json.loads(res_path.read_text())
            if prev.get("overrides") == want and "accuracy" in prev:
                result = prev
        if result is None:
            cb = en.scorer(items)
            result = run_method(base, mds=mds, out_dir=run_dir, settings=settings, seed=seed, progress=False,
                                extra_overrides=extra, extra_callbacks=[cb])
            result["method"], result["choice"] = m, cb.scores
            result["accuracy"] = en.accuracy_summary(cb.scores)
            result["cost_seconds"] = en.cost_seconds(m, result["seconds"]["total"], docs)
            res_path.write_text(json.dumps(result, indent=1))
            print(f"[{i}/{len(order)}] {m} seed {seed}: avg {result['final_avg']:.4f} "
                  f"worst {result['final_worst']:.4f} "
                  f"acc {result['accuracy']['acc']:.3f} acc_norm {result['accuracy']['acc_norm']:.3f} "
                  f"({result['seconds']['total']:.0f}s, {(time.perf_counter() - t_start) / 60:.1f} min so far)",
                  flush=True)
        runs.setdefault(m, {})[seed] = result
        _write(args.results, runs, settings, seeds, methods, args, partial=i < len(order))
    agg = aggregate(runs)
    train_tokens = next(iter(next(iter(runs.values())).values()))["train_tokens"]
    print("")
    print(format_table_english(agg, train_tokens, docs))
    for name, c in agg["claims"].items():
        print(f"claim {name}: {json.dumps(c)}")
    print(f"wrote {args.results}")
    return 0


def format_table_english(agg: Mapping[str, Any], train_tokens: int, docs: Mapping[str, Any]) -> str:
    rows = [("method", "runs", "avg log-ppl", "worst log-ppl", "acc", "acc_norm", "tokens to uniform's avg", "cost")]
    for m, st in agg["methods"].items():
        r = st["tokens_ratio_vs_uniform"]
        reach = "-" if not r["of"] else "not reached" if r["reached"] == 0 else (
            f"{_mean_std(r['values'])[0]:.2f}x" + ("" if r["reached"] == r["of"] else f" ({r['reached']}/{r['of']})"))
        cost = st.get("cost_vs_uniform", {}).get("mean")
        rows.append((m, str(len(st["seeds"])), _pm(st["average"]["values"]), _pm(st["worst"]["values"]),
                     _pm(st["acc"]["values"], 3) if "acc" in st else "-",
                     _pm(st["acc_norm"]["values"], 3) if "acc_norm" in st else "-", reach,
                     f"{cost:.2f}x" if cost is not None else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    targets = list(next(iter(agg["methods"].values()))["per_target_mean"])
    lines += ["", "per-target test log-ppl (nats per GPT-2 token, mean over seeds; * = best):",
              f"{'method':<13}" + "".join(f"{t:>9}" for t in targets)]
    best = {t: min(st["per_target_mean"][t] for st in agg["methods"].values()) for t in targets}
    for m, st in agg["methods"].items():
        lines.append(f"{m:<13}" + "".join(
            f"{st['per_target_mean'][t]:>8.4f}{'*' if st['per_target_mean'][t] == best[t] else ' '}" for t in targets))
    for name, d in docs.items():
        lines.append(f"{name} alpha: " + " ".join(f"{k} {v:.3f}" for k, v in d["alpha"].items())
                     + f" ({d['seconds']:.0f} s, once)")
    lines.append(f"(budget: {train_tokens / 1e3:.0f}k training GPT-2 tokens per run)")
    return "\n".join(lines)


def _write(path: str, runs: Mapping[str, Mapping[int, Mapping[str, Any]]], settings: Any, seeds: Sequence[int],
           methods: Sequence[str], args: argparse.Namespace, partial: bool) -> None:
    agg = aggregate(runs)
    train_tokens = next(iter(next(iter(runs.values())).values()))["train_tokens"]
    doc = {
        "bench": "mixture_quality",
        "partial": partial,
        "command": "python bench/mixture_quality.py " + " ".join(sys.argv[1:]),
        "settings": dataclasses.asdict(settings),
        "extra_overrides": list(args.extra),
        "seeds_requested": list(seeds),
        "methods_requested": list(methods),
        "train_tokens_per_run": train_tokens,
        "metric": "token-level test cross-entropy (nats/byte), strided subset of each target's test split",
        "table": (format_table(agg, train_tokens) if args.corpus == "demo"
                  else format_table_english(agg, train_tokens, getattr(args, "baseline_docs", {}))),
        **agg,
        "runs": {m: {str(s): {k: r[k] for k in ("final", "final_avg", "final_worst", "curve", "trajectory", "seconds",
                                                 "accuracy", "choice", "cost_seconds") if k in r}
                     for s, r in by_seed.items()} for m, by_seed in runs.items()},
    }
    write_json(path, doc)


if __name__ == "__main__":
    raise SystemExit(main())
