"""Alignment noise per unit of extra compute: in-step alignments vs probes (issue #25, part 3).

The setting of bench/overhead.py: K=7 domains (bigram rules), N=6 tasks (each copying one domain's rule),
our GPT (d=64, 2 layers, 4 heads, vocab 512, seq 64), global batch 64, an update every 100 steps, probes
of 8 samples per group, one torch thread. The model is first trained for --warm steps on the uniform
mixture (realistic gradients), then frozen: every estimator below measures the same quantity at the same
parameters, so their spread is noise only.

The quantity is GRAPE's domain score b_k = <g_k, v> with v = sum_n z_n h_n / l_n (z uniform), v taken from
one task probe of 8 samples per task and shared by every estimator (the task side's noise is the same for
both methods). Only its centred part c(b) = b - mean(b) moves alpha, so, as for ``probe_rse``
(docs/reweighting.md):

    noise    sigma^2 = mean_k Var(c(b_k))        signal S^2 = Var_k(c(b_k)) of the pooled mean, noise removed
    RSE      = sigma / S

* ``probe b=8`` (16, 32): R independent probes of b samples per domain, b from the domain gradients of each
  (the in-step engine on the probe batch: exactly <g_k, v>);
* ``steps m``: the training steps of one 100-step interval observed every m-th step (100 / m batches of 64
  drawn from the uniform mixture). Its variance comes from J observed batches by the ratio estimator:
  Var(b_k) = Var_j(M_jk - b_k W_jk) / (n W_k^2) for n batches per interval (checked against direct grouping
  of the same batches for n = 1, 2, 4: the "direct" column).

Extra compute per update (process CPU seconds, medians of interleaved repeats):
* probes: one fused probe (group_gram over K + N groups of 8), the paper's update;
* steps m: the task probe of in-step alignments (one forward and one backward over N x 8 keeping the N task
  gradients, instep_probe; the two-backward variant is timed too) + (100 / m) x (observed step - plain step).

    PYTHONPATH=$PWD python bench/instep.py [--quick]      # prints a table, writes bench/results/instep.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import numpy as np
from common import parser, write_json  # (it puts the repository on sys.path)
from overhead import RULES, _seq  # noqa: E402  (the same data rules as the overhead bench)

K, N = 7, 6


def _domain_batch(rng: np.random.Generator, domains: np.ndarray, args: argparse.Namespace) -> dict:
    import torch

    toks = np.stack([_seq(rng, RULES[int(k)], args.vocab, args.seq_len + 1) for k in domains])
    return {"tokens": torch.as_tensor(toks), "domain": torch.as_tensor(domains, dtype=torch.int64)}


def _task_groups(rng: np.random.Generator, args: argparse.Namespace) -> list[dict]:
    import torch

    groups = []
    for n in range(N):
        toks = np.stack([_seq(rng, RULES[n % K], args.vocab, args.seq_len + 1, noise=0.05)
                         for _ in range(args.probe_batch)])
        mask = torch.zeros(toks.shape, dtype=torch.uint8)
        mask[:, (args.seq_len + 1) // 2:] = 1
        groups.append({"tokens": torch.as_tensor(toks), "loss_mask": mask})
    return groups


def _cpu(fn: Callable[[], Any]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model after --warm plain training steps on the uniform mixture, and its optimizer."""
    import torch

    from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                          d_model=args.d_model, d_ff=4 * args.d_model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(1)
    for _ in range(args.warm):
        b = _domain_batch(rng, rng.integers(0, K, args.batch), args)
        per_sample_lm_loss(model, b).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def target_direction(model: Any, args: argparse.Namespace) -> tuple[dict, np.ndarray]:
    """v = sum_n z_n h_n / l_n (z uniform) from one task probe of 8 per task (instep_probe.task_probe)."""
    from grape_stream.grape.instep_probe import task_probe
    from grape_stream.models import per_sample_lm_loss

    groups = _task_groups(np.random.default_rng(2), args)
    probe = task_probe(model, per_sample_lm_loss, groups, fixed=[],
                       coefficients=lambda losses, r, gram: np.full(N, 1.0 / N) / losses)
    return probe.direction, probe.losses


def probe_scores(model: Any, v: dict, b: int, repeats: int, args: argparse.Namespace) -> np.ndarray:
    """(R, K): b_k = <g_k, v> of R independent probes of b samples per domain."""
    from grape_stream.grape.gram.instep import StepAlignments
    from grape_stream.models import per_sample_lm_loss

    sa = StepAlignments(model, per_sample_lm_loss, K)
    sa.set_directions([v])
    rng = np.random.default_rng(100 + b)
    out = []
    for _ in range(repeats):
        sa.reset()
        batch = _domain_batch(rng, np.repeat(np.arange(K), b), args)
        with sa.observe(batch):
            per_sample_lm_loss(model, batch).mean().backward()
        out.append(sa.alignments()[:, 0].numpy())
    model.zero_grad(set_to_none=True)
    return np.array(out)


def step_sums(model: Any, v: dict, batches: int, args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """(J, K) per-batch sums M_j and weights W_j of J observed training batches (uniform mixture)."""
    from grape_stream.grape.gram.instep import StepAlignments
    from grape_stream.models import per_sample_lm_loss

    sa = StepAlignments(model, per_sample_lm_loss, K)
    sa.set_directions([v])
    rng = np.random.default_rng(7)
    sums, weights = [], []
    for _ in range(batches):
        sa.reset()
        batch = _domain_batch(rng, rng.integers(0, K, args.batch), args)
        with sa.observe(batch):
            per_sample_lm_loss(model, batch).mean().backward()
        sums.append(sa.sums[:, 0].cpu().numpy().copy())  # copies: reset() zeroes the tensors in place
        weights.append(sa.weights.cpu().numpy().copy())
    model.zero_grad(set_to_none=True)
    return np.array(sums), np.array(weights)


def noise_of(scores: np.ndarray) -> float:
    """mean_k Var_r(c(b_k)) over repeats r."""
    c = scores - scores.mean(axis=1, keepdims=True)
    return float(c.var(axis=0, ddof=1).mean())


def ratio_noise(sums: np.ndarray, weights: np.ndarray, n: int) -> float:
    """Noise of c(b) for intervals of n observed batches, from per-batch sums by the ratio estimator."""
    b = sums.sum(0) / weights.sum(0)
    resid = sums - b[None, :] * weights  # (J, K)
    cov = np.cov(resid.T, ddof=1) / (n * weights.mean(0)[:, None] * weights.mean(0)[None, :])  # Cov(b_k, b_j)
    centre = np.eye(K) - np.full((K, K), 1.0 / K)
    return float(np.trace(centre @ cov @ centre.T) / K)


def direct_noise(sums: np.ndarray, weights: np.ndarray, n: int) -> float:
    groups = len(sums) // n
    s = sums[: groups * n].reshape(groups, n, K).sum(1)
    w = weights[: groups * n].reshape(groups, n, K).sum(1)
    return noise_of(s / w)


def costs(model: Any, opt: Any, v: dict, args: argparse.Namespace) -> dict[str, float]:
    """Median process CPU seconds: plain step, observed step (mixer order / sorted by domain), the fused probe,
    the task probe of in-step alignments."""
    import torch

    from grape_stream.grape.gram.group_gram import group_gram
    from grape_stream.grape.gram.instep import StepAlignments
    from grape_stream.grape.instep_probe import task_probe
    from grape_stream.models import per_sample_lm_loss

    sa = StepAlignments(model, per_sample_lm_loss, K)
    sa.set_directions([v])
    rng = np.random.default_rng(11)
    task_groups = _task_groups(rng, args)
    probe_groups = [{"tokens": _domain_batch(rng, np.full(args.probe_batch, k), args)["tokens"],
                     "loss_mask": torch.ones(args.probe_batch, args.seq_len + 1, dtype=torch.uint8)}
                    for k in range(K)] + task_groups
    params = {p: p.detach().clone() for p in model.parameters()}

    def train(observe: str) -> None:
        doms = rng.integers(0, K, args.batch)
        batch = _domain_batch(rng, np.sort(doms) if observe == "sorted" else doms, args)
        if observe:
            with sa.observe(batch):
                per_sample_lm_loss(model, batch).mean().backward()
        else:
            per_sample_lm_loss(model, batch).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    uniform = np.full(N, 1.0 / N)
    jobs: dict[str, Callable[[], Any]] = {
        "plain_step": lambda: train(""),
        "observed_step": lambda: train("mixer"),
        "observed_step_sorted": lambda: train("sorted"),
        "fused_probe": lambda: group_gram(model, per_sample_lm_loss, probe_groups),
        "task_probe_steps": lambda: task_probe(model, per_sample_lm_loss, task_groups, fixed=[v],
                                               coefficients=lambda losses, r, gram: uniform / losses),
        "task_probe_steps_two_backwards": lambda: task_probe(
            model, per_sample_lm_loss, task_groups, fixed=[v], coefficients=lambda losses, r, gram: uniform / losses,
            keep_gradients=False),
    }
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for rep in range(args.cost_repeats + 2):
        for name, job in jobs.items():
            t = _cpu(job)
            if rep >= 2:  # warm-up: first calls, layout probes, allocator
                times[name].append(t)
    with torch.no_grad():
        for p, saved in params.items():
            p.copy_(saved)  # the timed steps moved the model: put it back
    return {k: statistics.median(v) for k, v in times.items()}


def overhead_runs(args: argparse.Namespace) -> dict[str, Any]:
    """Full Composer runs (bench/overhead.py's set-up, our GPT): uniform, GRAPE with probes, GRAPE with in-step
    alignments at each --overhead-steps, interleaved --overhead-repeats times. Per variant: the update time over
    the rest of the run ("accounted"; it misses what observed steps add) and the run's CPU over (steps x its
    median step without an update), against the uniform run before it ("within": everything GRAPE adds)."""
    import tempfile

    import overhead

    o = argparse.Namespace(**vars(args))  # the same names as bench/overhead.py's options
    o.steps, o.every, o.threads = args.overhead_run_steps, args.every, 1
    variants: dict[str, tuple[str, dict]] = {"uniform": ("uniform", {}), "probe": ("grape", {})}
    for n in args.overhead_steps:
        variants[f"steps {n}"] = ("grape", {"alignments": "steps", "alignment_steps": n})
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "data")
        overhead.write_data(root, o.vocab, o.seq_len, per_domain=max(2000, o.steps * o.batch // K + 64))
        warm = argparse.Namespace(**{**vars(o), "steps": 10, "every": 5})
        for method, extra in variants.values():
            if method != "uniform":
                overhead.run_once(method, "gpt", root, tmp, warm, extra)
        for _ in range(args.overhead_repeats):
            for name, (method, extra) in variants.items():
                r = overhead.run_once(method, "gpt", root, tmp, o, extra)
                runs[name].append(r)
                print(f"  {name:<10} {r['seconds']:8.2f} s wall {r['cpu_seconds']:8.2f} s cpu ({r['updates']} updates)",
                      flush=True)

    def excess(r: dict) -> float:
        return r["cpu_seconds"] / (o.steps * r["plain_step_cpu_median"])

    out = {}
    for name, rs in runs.items():
        paired = [excess(b) / excess(a) - 1.0 for a, b in zip(runs["uniform"], rs)]
        acc = [r["update_seconds"]["total"] / max(r["seconds"] - r["update_seconds"]["total"], 1e-9) for r in rs]
        out[name] = {"within_cpu": statistics.median(paired), "within_cpu_all": paired,
                     "accounted": statistics.median(acc), "cpu_seconds": [r["cpu_seconds"] for r in rs],
                     "updates": rs[0]["updates"]}
    return {"steps": o.steps, "every": o.every, "variants": out}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "instep", quick="")
    p.add_argument("--warm", type=int, default=150)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--probe-batch", type=int, default=8)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=40, help="independent probes per probe size")
    p.add_argument("--batches", type=int, default=200, help="observed training batches for the in-step noise")
    p.add_argument("--cost-repeats", type=int, default=15)
    p.add_argument("--overhead", action="store_true", help="also time full Composer runs (bench/overhead.py's set-up)")
    p.add_argument("--overhead-steps", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 10],
                   help="alignment_steps values of the in-step runs")
    p.add_argument("--overhead-repeats", type=int, default=3)
    p.add_argument("--overhead-run-steps", type=int, default=500)
    p.add_argument("--skip-noise", action="store_true", help="only the full runs (keeps the noise rows of --out)")
    args = p.parse_args(argv)
    if args.quick:
        args.warm, args.repeats, args.batches, args.cost_repeats = 20, 8, 24, 3

    import torch

    torch.set_num_threads(1)
    if args.skip_noise:
        with open(args.out, encoding="utf-8") as f:
            result = json.load(f)
        result["overhead"] = overhead_runs(args)
        print_overhead(result["overhead"])
        write_json(args.out, result, indent=2)
        return 0
    model, opt = build(args)
    v, task_losses = target_direction(model, args)
    probes = {b: probe_scores(model, v, b, args.repeats, args) for b in (8, 16, 32)}
    sums, weights = step_sums(model, v, args.batches, args)
    cost = costs(model, opt, v, args)

    pooled = np.concatenate([s for s in probes.values()] + [sums / weights])
    cmean = pooled.mean(0) - pooled.mean()
    rows = []
    step = cost["plain_step"]
    for b, scores in probes.items():
        extra = cost["fused_probe"] * (b / 8)  # the fused probe's work is linear in its size
        rows.append({"estimator": f"probe b={b}", "samples_per_domain": b, "noise": noise_of(scores),
                     "direct": None, "extra_cpu_s": extra, "measured": b == 8})
    per_obs = {"mixer order": cost["observed_step"] - step, "sorted": cost["observed_step_sorted"] - step}
    for m in (100, 50, 20, 10, 5, 2, 1):
        n = args.every // m
        for order, d in per_obs.items():
            rows.append({"estimator": f"steps every {m} ({order})", "samples_per_domain": n * args.batch / K,
                         "noise": ratio_noise(sums, weights, n),
                         "direct": direct_noise(sums, weights, n) if n <= 4 and order == "sorted" else None,
                         "extra_cpu_s": cost["task_probe_steps"] + n * max(d, 0.0), "measured": True})
    signal = max(float(np.var(cmean, ddof=0)) - min(r["noise"] for r in rows), 1e-300)
    ref = next(r for r in rows if r["estimator"] == "probe b=8")
    for r in rows:
        r["rse"] = float(np.sqrt(r["noise"] / signal))
        r["extra_steps"] = r["extra_cpu_s"] / step
        r["overhead_pct"] = 100 * r["extra_cpu_s"] / (args.every * step)
        r["noise_x_cost_vs_probe8"] = (r["noise"] * r["extra_cpu_s"]) / (ref["noise"] * ref["extra_cpu_s"])
    print_table(rows, cost, args)
    result = {"config": {**vars(args), "K": K, "N": N, "torch": torch.__version__,
                         "cpu": platform.processor() or platform.machine(), "load_avg": os.getloadavg()},
              "costs_cpu_s": cost, "signal_var": signal, "task_losses": task_losses.tolist(),
              "b_pooled_centred": cmean.tolist(), "rows": rows}
    if args.overhead:
        result["overhead"] = overhead_runs(args)
        print_overhead(result["overhead"])
    write_json(args.out, result, indent=2)
    print(f"wrote {args.out}")
    return 0


def print_overhead(res: dict) -> None:
    print(f"\nfull Composer runs ({res['steps']} steps, an update every {res['every']}): overhead against uniform")
    print(f"{'variant':<12}{'CPU within runs':>16}{'accounted':>11}   per repeat")
    for name, r in res["variants"].items():
        each = " ".join(f"{100 * x:+.2f}%" for x in r["within_cpu_all"])
        print(f"{name:<12}{100 * r['within_cpu']:>+15.2f}%{100 * r['accounted']:>10.2f}%   {each}")
    print("CPU within runs: a run's CPU over (steps x its median step without an update), over the same for the "
          "uniform run before it; accounted: update time over the rest of the run (it misses the observed steps)")


def print_table(rows: list[dict], cost: dict, args: argparse.Namespace) -> None:
    step = cost["plain_step"]
    print()
    print(f"CPU s (medians): plain step {step:.4f}, observed step {cost['observed_step']:.4f} (+"
          f"{100 * (cost['observed_step'] / step - 1):.1f}%), sorted by domain {cost['observed_step_sorted']:.4f} (+"
          f"{100 * (cost['observed_step_sorted'] / step - 1):.1f}%), fused probe {cost['fused_probe']:.4f} "
          f"({cost['fused_probe'] / step:.2f} steps), in-step task probe {cost['task_probe_steps']:.4f} "
          f"({cost['task_probe_steps'] / step:.2f} steps; with two backwards instead of N gradient copies "
          f"{cost['task_probe_steps_two_backwards'] / step:.2f})")
    print(f"{'estimator':<30}{'per domain':>11}{'extra/upd':>11}{'overhead':>10}{'RSE':>8}{'direct':>9}"
          f"{'noise x cost':>14}")
    for r in rows:
        direct = "" if r["direct"] is None else f"{np.sqrt(r['direct'] / r['noise']):.2f}x"
        print(f"{r['estimator']:<30}{r['samples_per_domain']:>11.1f}{r['extra_steps']:>8.2f} st"
              f"{r['overhead_pct']:>9.2f}%{r['rse']:>8.3f}{direct:>9}{r['noise_x_cost_vs_probe8']:>14.3f}")
    print(f"extra/upd: CPU per update in plain-step units; overhead: over {args.every} steps; RSE: noise sd / "
          "signal sd of the centred domain score; direct: sd from direct grouping / ratio-estimator sd; noise x cost: "
          "variance x extra CPU, relative to the paper's probe (lower is better). probe b=16/32: cost scaled from b=8")


if __name__ == "__main__":
    raise SystemExit(main())
