"""Wall-time overhead of GRAPE in a real Composer run: method=grape vs the same run with method=uniform,
for three model families: our GPT, an HF Llama config and llm-foundry's MPT.

Set-up (the paper's shape, a CPU-sized model): K=7 domains, N=6 target tasks, alpha/z updates every 100
optimizer steps, probes of 8 samples per domain and per task, global batch 64 (the paper's), a small
decoder. Both runs read the same real MDS shards through the WeightedStreamingMixer inside a Composer
Trainer; the timer covers the training loop only (FIT_START to the last BATCH_END: no data writing, no
model build, no evaluation). Runs are interleaved (per repeat and family: uniform, grape) and medians are
compared. Three measures: the process's CPU time (robust when other jobs share the cores; torch runs one
thread by default here), wall time, and the "accounted" overhead (the time GRAPE's updates themselves
took over the rest of the GRAPE run).

Families, all at the same d_model / layers / heads / vocab / seq (so a probe is a comparable fraction of a step):

* ``gpt``: the recipe's ``model.kind: gpt`` (exactly the set-up of the earlier single-family runs);
* ``hf-llama``: the recipe's ``model.kind: hf`` with ``hf_config: llama`` (RMSNorm, rotary, SwiGLU with
  intermediate size d_ff, untied head; built from the config, no download);
* ``mpt``: llm-foundry's ``MPTForCausalLM`` (expansion ratio 4, torch attention) when ``llmfoundry`` is
  importable, else grape_stream.testing.families.MPTStyle (a faithful copy); passed to
  ``build(cfg, model=...)``, the way to train a decoder the recipe cannot name. llm-foundry 0.22 pins an
  older torch: install it beside the venv (see bench/probe_families.py) and put it on PYTHONPATH.

Each family also reports which parameters took the probe's exact (slow) fallback: GramInfo.fallback_params
of a probe of the trained model, and any fallback warning raised during its GRAPE runs (should be none).

    PYTHONPATH=$PWD:$FOUNDRY_PKGS python bench/overhead.py [--family gpt,hf-llama,mpt] \
        [--steps 500] [--repeats 3] [--quick]

Prints a table and writes bench/results/overhead.json (top-level keys: the gpt row, as before; per family
under "families"). Goal (issue #14): overhead <= 3% on each family.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import warnings
from typing import Any

import numpy as np
from common import parser, write_json  # (it puts the repository on sys.path)

K, N = 7, 6
FAMILIES = ("gpt", "hf-llama", "mpt")
FALLBACK_WARNING = "group_gram: exact fallback"
RULES = [(3, 7), (5, 11), (7, 13), (11, 17), (13, 19), (17, 23), (19, 29)]


def _seq(rng: np.random.Generator, rule: tuple[int, int], vocab: int, n: int, noise: float = 0.1) -> np.ndarray:
    a, b = rule
    out = np.empty(n, dtype=np.int64)
    out[0] = rng.integers(1, vocab)
    for i in range(1, n):
        out[i] = rng.integers(1, vocab) if rng.random() < noise else (a * out[i - 1] + b) % (vocab - 1) + 1
    return out


def write_data(root: str, vocab: int, seq_len: int, per_domain: int) -> None:
    """K domains (bigram rules) and N tasks (each copying one domain's rule), as real zstd MDS shards."""
    from streaming import MDSWriter

    for k in range(K):
        rng = np.random.default_rng(k)
        with MDSWriter(out=os.path.join(root, f"d{k}", "train"), columns={"tokens": "ndarray:uint16"},
                       compression="zstd") as w:
            for _ in range(per_domain):
                w.write({"tokens": _seq(rng, RULES[k], vocab, seq_len).astype(np.uint16)})
    for n in range(N):
        rng = np.random.default_rng(100 + n)
        for split, count in (("validation", 256), ("test", 64)):
            with MDSWriter(out=os.path.join(root, "tasks", f"t{n}", split),
                           columns={"tokens": "ndarray:uint16", "loss_mask": "ndarray:uint8"}, compression="zstd") as w:
                for _ in range(count):
                    toks = _seq(rng, RULES[n % K], vocab, seq_len, noise=0.05)
                    mask = np.zeros(seq_len, dtype=np.uint8)
                    mask[seq_len // 2:] = 1
                    w.write({"tokens": toks.astype(np.uint16), "loss_mask": mask})


def model_section(family: str, args: argparse.Namespace) -> dict:
    """The recipe's model section (for mpt only the vocabulary matters: the model is passed prebuilt)."""
    if family == "hf-llama":
        return {"kind": "hf", "vocab_size": args.vocab, "hf_config": "llama",
                "hf_overrides": {"hidden_size": args.d_model, "intermediate_size": 4 * args.d_model,
                                 "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
                                 "num_key_value_heads": args.heads, "tie_word_embeddings": False}}
    return {"vocab_size": args.vocab, "n_layer": args.layers, "n_head": args.heads, "d_model": args.d_model,
            "d_ff": 4 * args.d_model}


def prebuilt_model(family: str, args: argparse.Namespace) -> tuple[Any, str]:
    """(the model to pass to build(), or None for a recipe-named one; where its code comes from)."""
    if family == "gpt":
        return None, "grape_stream.models.GPT (recipe model.kind=gpt)"
    if family == "hf-llama":
        return None, "transformers LlamaForCausalLM (recipe model.kind=hf, hf_config=llama)"
    import torch

    from grape_stream.testing.families import FamilySize, build_family

    size = FamilySize(d_model=args.d_model, n_layer=args.layers, n_head=args.heads, vocab=args.vocab, seq=args.seq_len)
    model, _, source = build_family("mpt", size, dtype=torch.float32, seed=1)
    return model.train(), source


def probe_groups(args: argparse.Namespace) -> list[dict]:
    """K domain + N task probe groups of --probe-batch sequences (the bench's rules; tasks score the second half)."""
    import torch

    groups = []
    for g in range(K + N):
        rng = np.random.default_rng(1000 + g)
        toks = np.stack([_seq(rng, RULES[g % K], args.vocab, args.seq_len) for _ in range(args.probe_batch)])
        mask = torch.ones(toks.shape, dtype=torch.uint8)
        if g >= K:
            mask[:, : args.seq_len // 2] = 0
        groups.append({"tokens": torch.as_tensor(toks), "loss_mask": mask})
    return groups


def gram_info(built: Any, args: argparse.Namespace) -> dict:
    """GramInfo of one probe of the trained model, as GRAPE runs it (same module, same per-sample loss)."""
    from grape_stream.grape.gram.group_gram import group_gram
    from grape_stream.grape.probes import unwrap_for_probe

    model = unwrap_for_probe(built.model)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, info = group_gram(model, built.algorithm.per_sample_loss, probe_groups(args), return_info=True)
    return {"fallback_params": list(info.fallback_params), "fallback_reasons": dict(info.fallback_reasons),
            "fast_path": dict(info.fast_path)}


def run_once(method: str, family: str, root: str, out: str, args: argparse.Namespace,
             algorithm: dict | None = None) -> dict:
    """One timed run; ``algorithm``: more keys of the recipe's algorithm section (bench/instep.py's variants)."""
    from composer.core import Callback

    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    cfg = load_recipe({
        "run_name": f"overhead-{family}-{method}",
        "seed": 1,
        "output_dir": os.path.join(out, "{run_name}"),
        "model": model_section(family, args),
        "data": {"local": root, "split": "train", "seq_len": args.seq_len, "domains": [f"d{k}" for k in range(K)],
                 "tasks": [f"t{n}" for n in range(N)], "task_local": os.path.join(root, "tasks"),
                 "num_workers": 0},
        "algorithm": {"method": method, "alpha_every": args.every, "z_every": args.every,
                      "probe_domain_batch": args.probe_batch, "probe_task_batch": args.probe_batch,
                      "mu_alpha": 1e-3, "mu_z": 2e-4, "trajectory": method != "uniform", "plots": False,
                      "summary": False, **(algorithm or {})},
        "optimizer": {"lr": 1e-3},
        "scheduler": {"name": "cosine", "t_warmup": "20ba"},
        "trainer": {"max_duration": f"{args.steps}ba", "global_train_batch_size": args.batch,
                    "eval_interval": f"{10 * args.steps}ba", "eval_subset_num_batches": 1, "log_to_console": False,
                    "metrics_jsonl": False, "device": "cpu", "precision": "fp32"},
    })
    marks: dict = {}

    cpu_ticks: list[float] = []

    class Timer(Callback):
        def fit_start(self, state, logger):
            marks["start"], marks["cpu_start"] = time.perf_counter(), time.process_time()
            cpu_ticks.append(marks["cpu_start"])

        def batch_end(self, state, logger):  # after GrapeAlgorithm's update (algorithms run before callbacks)
            marks["end"], marks["cpu_end"] = time.perf_counter(), time.process_time()
            cpu_ticks.append(marks["cpu_end"])

    model, source = prebuilt_model(family, args)
    built = build(cfg, extra_callbacks=[Timer()], model=model)
    info: dict = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message=FALLBACK_WARNING)
            built.trainer.fit()
        history = list(built.algorithm.controller.history)
        params = sum(p.numel() for p in built.model.parameters())
        if method == "grape":
            info = gram_info(built, args)
    finally:
        built.close()
    fallback_warnings = sorted({str(w.message) for w in caught if FALLBACK_WARNING in str(w.message)})
    updates = [r for r in history if not r.get("initial")]
    secs = [r["seconds"] for r in updates if "seconds" in r]
    parts = {}
    for key in ("probe_data", "gram", "reweight", "total"):
        vals = [s[key] for s in secs if key in s]
        parts[key] = sum(vals)
    # CPU seconds of the steps without an update (step s ends at tick s): do GRAPE runs' ordinary steps slow down?
    plain = [b - a for s, (a, b) in enumerate(zip(cpu_ticks, cpu_ticks[1:]), 1) if s % args.every]
    return {"method": method, "family": family, "source": source, "params": params,
            "plain_step_cpu_median": statistics.median(plain) if plain else float("nan"),
            "seconds": marks["end"] - marks["start"], "cpu_seconds": marks["cpu_end"] - marks["cpu_start"],
            "updates": len(updates), "update_seconds": parts, "fallback_warnings": fallback_warnings, **info}


def summarise(runs: list[dict], args: argparse.Namespace) -> dict:
    """One family's figures (the keys the single-family JSON had at its top level)."""
    med = {m: statistics.median(r["seconds"] for r in runs if r["method"] == m) for m in ("uniform", "grape")}
    best = {m: min(r["seconds"] for r in runs if r["method"] == m) for m in ("uniform", "grape")}
    # CPU time of this process: unlike wall time, barely affected by other jobs on a shared machine.
    cpu = {m: statistics.median(r["cpu_seconds"] for r in runs if r["method"] == m) for m in ("uniform", "grape")}
    overhead_cpu = cpu["grape"] / cpu["uniform"] - 1.0
    # Robust to a shared machine: the time GRAPE's updates themselves took, over the rest of its own run.
    g = [r for r in runs if r["method"] == "grape"]
    accounted = statistics.median(
        r["update_seconds"]["total"] / max(r["seconds"] - r["update_seconds"]["total"], 1e-9) for r in g)
    upd = statistics.median(r["update_seconds"]["total"] / max(r["updates"], 1) for r in g)
    gram = statistics.median(r["update_seconds"]["gram"] / max(r["updates"], 1) for r in g)
    data = statistics.median(r["update_seconds"]["probe_data"] / max(r["updates"], 1) for r in g)
    step = med["uniform"] / args.steps
    # Paired: each grape run against the uniform run just before it (the same load on a shared machine).
    u = [r for r in runs if r["method"] == "uniform"]
    paired_cpu = statistics.median(b["cpu_seconds"] / a["cpu_seconds"] - 1.0 for a, b in zip(u, g))
    step_slowdown = statistics.median(b["plain_step_cpu_median"] / a["plain_step_cpu_median"] - 1.0
                                      for a, b in zip(u, g))
    # Within each run: CPU time over (steps x the run's median step without an update). Load that drifts
    # between runs cancels; what GRAPE adds at any step (updates, weight switches, trajectory) stays.
    def excess(r: dict) -> float:
        return r["cpu_seconds"] / (args.steps * r["plain_step_cpu_median"])

    within = statistics.median(excess(b) / excess(a) - 1.0 for a, b in zip(u, g))
    fallback = sorted({p for r in g for p in r.get("fallback_params", [])})
    warned = sorted({w for r in g for w in r["fallback_warnings"]})
    return {
        "source": runs[0]["source"],
        "params": runs[0]["params"],
        "median_seconds": med,
        "best_seconds": best,
        "median_cpu_seconds": cpu,
        "overhead_cpu": overhead_cpu,
        "overhead_cpu_paired": paired_cpu,
        "overhead_cpu_within_run": within,
        "plain_step_slowdown_cpu": step_slowdown,
        "overhead": med["grape"] / med["uniform"] - 1.0,
        "overhead_best_of": best["grape"] / best["uniform"] - 1.0,
        "overhead_accounted": accounted,
        "seconds_per_step_uniform": step,
        "seconds_per_update": upd,
        "seconds_per_update_gram": gram,
        "seconds_per_update_probe_data": data,
        "update_cost_in_steps": upd / step,
        "probe_samples_per_update": (K + N) * args.probe_batch,
        "paper_estimate": (N + 1) / args.every + (K + 1) / args.every,
        "fallback_params": fallback,
        "fallback_warnings": warned,
        "fast_path": g[-1].get("fast_path", {}),
        "runs": runs,
        "goal": "overhead <= 3%",
        "goal_met_cpu": overhead_cpu <= 0.03,
        "goal_met_cpu_paired": paired_cpu <= 0.03,
        "goal_met_cpu_within_run": within <= 0.03,
        "goal_met_accounted": accounted <= 0.03,
    }


def goal_met(r: dict) -> bool:
    return r["overhead_accounted"] <= 0.03 and r["overhead_cpu_within_run"] <= 0.03 and not r["fallback_params"]


def print_table(fams: dict[str, dict], args: argparse.Namespace) -> None:
    print()
    print(f"{'family':<10}{'params':>9}{'cpu s/step':>11}{'update s':>9}{'= steps':>8}{'accounted':>10}"
          f"{'cpu within':>11}{'cpu paired':>11}{'cpu medians':>12}{'wall':>8}{'plain steps':>12}  fallback")
    for fam, r in fams.items():
        fb = ", ".join(r["fallback_params"]) or ("WARNED" if r["fallback_warnings"] else "none")
        print(f"{fam:<10}{r['params'] / 1e6:>8.3f}M{r['median_cpu_seconds']['uniform'] / args.steps:>11.4f}"
              f"{r['seconds_per_update']:>9.3f}{r['update_cost_in_steps']:>8.2f}{100 * r['overhead_accounted']:>9.2f}%"
              f"{100 * r['overhead_cpu_within_run']:>+10.2f}%"
              f"{100 * r['overhead_cpu_paired']:>+10.2f}%{100 * r['overhead_cpu']:>+11.2f}%"
              f"{100 * r['overhead']:>+7.1f}%"
              f"{100 * r['plain_step_slowdown_cpu']:>+11.2f}%  {fb}")
    print("accounted: GRAPE update time / rest of the GRAPE run; cpu within: CPU time over steps x the run's median "
          "step without an update, grape vs uniform (paired; cancels load drift between runs); "
          "cpu paired: median over repeats of grape / the "
          "uniform run before it - 1; cpu medians: median grape / median uniform - 1; plain steps: median CPU "
          "time of the steps without an update, grape vs uniform (paired)")
    for fam, r in fams.items():
        print(f"  {fam}: {r['source']}")
    met = all(goal_met(r) for r in fams.values())
    print(f"goal <= 3% (accounted and CPU within runs) with no exact fallback, every family: "
          f"{'met' if met else 'NOT met'}")
    print(f"the paper's separate gradient passes: {100 * ((N + 1) + (K + 1)) / args.every:.0f}% more gradient "
          f"computations; {(K + N) * args.probe_batch} probe samples per update vs {args.batch} per step, every "
          f"{args.every} steps; load average now: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "overhead", quick="a smoke run: 40 steps, updates every 10, one repeat")
    p.add_argument("--family", default=",".join(FAMILIES), help=f"comma-separated subset of {', '.join(FAMILIES)}")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--probe-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared 2-core machine two threads oversubscribe "
                        "and make every op several times slower; both methods use the same setting)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.repeats = 40, 10, 1
    families = [f for f in args.family.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} {unknown}; choose from {list(FAMILIES)}")

    import torch

    torch.set_num_threads(args.threads)
    runs: dict[str, list[dict]] = {f: [] for f in families}
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "data")
        write_data(root, args.vocab, args.seq_len, per_domain=max(2000, args.steps * args.batch // K + 64))
        warm = argparse.Namespace(**{**vars(args), "steps": 10, "every": 5})
        for fam in families:  # warm-up (imports, allocator, first-call costs, the probe's layouts), not timed
            run_once("grape", fam, root, tmp, warm)
        for _ in range(args.repeats):
            for fam in families:
                for method in ("uniform", "grape"):
                    r = run_once(method, fam, root, tmp, args)
                    runs[fam].append(r)
                    print(f"  {fam:<9}{method:<8} {r['seconds']:8.2f} s wall {r['cpu_seconds']:8.2f} s cpu  "
                          f"({r['updates']} updates)", flush=True)
    fams = {f: summarise(runs[f], args) for f in families}
    top = fams.get("gpt") or fams[families[0]]
    result = {
        "config": {**vars(args), "K": K, "N": N, "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "cpu": platform.processor() or platform.machine(), "load_avg": os.getloadavg()},
        # the top-level keys are the gpt row (as in the single-family runs); every family is under "families"
        **{k: v for k, v in top.items() if k not in ("source", "params", "fallback_warnings", "fast_path")},
        "families": fams,
        "goal_met_all_families": all(goal_met(r) for r in fams.values()),
    }
    print_table(fams, args)
    write_json(args.out, result, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
