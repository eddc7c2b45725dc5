"""Seconds per GRAPE update on real model families: fused Gram vs the exact fallback vs a training step.

For our GPT, HF GPT-2, HF Llama, a torchtitan-style Llama and llm-foundry's MPT at one common size
(default d=256, 4 layers, vocab 8192, seq 128; K=7 domain + N=6 task probe groups of 4 samples), times:

* fused:   ``group_gram`` as it is now (fast paths matched by capability; median of --repeats calls after
           one warm-up call, which also runs the one-off layout / capability probe, timed separately);
* before:  ``group_gram`` with every module that only the capability check admits (LPLayerNorm,
           SharedEmbedding, LlamaRMSNorm, ...) sent to the exact fallback, as the exact-class matching did;
* exact:   every parameter on the exact path (one forward, then one backward per group, G gradient copies);
* step:    one training step (forward + backward + AdamW) on --train-batch sequences.

On CPU the seconds are the process's CPU time with one torch thread (other jobs on a shared machine
barely move it; wall times are in the JSON too); on CUDA, wall time.

The overhead ratio is update seconds / step seconds (the update's cost in training steps; at one update
every 100 steps, ratio / 100 is the fractional overhead). MPT is llm-foundry's MPTForCausalLM when
``llmfoundry`` is importable, else the faithful copy in grape_stream.testing.families (the table says
which). llm-foundry 0.22 pins torch 2.7, so for the real class install it beside the venv (``FOUNDRY_PKGS``: a
folder of your choice), e.g.:

    pip install --no-deps --target $FOUNDRY_PKGS llm-foundry==0.22.0 omegaconf==2.3.0 \\
        antlr4-python3-runtime==4.9.3 einops==0.8.1 catalogue==2.0.10 GitPython==3.1.44 gitdb==4.0.12 \\
        smmap==5.0.2 setuptools==80.9.0 mlflow==2.22.1 mlflow-skinny==2.22.1 opentelemetry-api==1.33.1 \\
        opentelemetry-sdk==1.33.1 opentelemetry-semantic-conventions==0.54b1 deprecated==1.2.18 wrapt==1.17.2 \\
        databricks-sdk==0.55.0 sqlparse==0.5.3 cachetools==5.5.2 datasets==3.6.0 dill==0.3.8 \\
        multiprocess==0.70.16 xxhash==3.5.0 tenacity==9.2.1 beautifulsoup4==4.13.4 soupsieve==2.7
    PYTHONPATH=$PWD:$FOUNDRY_PKGS python bench/probe_families.py [--quick]

Prints a table and writes bench/results/probe_families.json (--quick: tiny sizes, results left alone).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings
from typing import Any, Callable

import torch  # noqa: E402
from common import parser, write_json  # (it puts the repository on sys.path)
from torch import nn  # noqa: E402

from grape_stream.grape.gram.capabilities import AUTO, demote  # noqa: E402
from grape_stream.grape.gram.group_gram import group_gram  # noqa: E402
from grape_stream.grape.gram.layouts import fast_kind  # noqa: E402
from grape_stream.models import no_inplace_loss_grad  # noqa: E402
from grape_stream.testing.families import FAMILIES, FamilySize, build_family  # noqa: E402

K, N = 7, 6


def probe_groups(size: FamilySize, per_group: int, device: torch.device, seed: int = 0) -> list[dict]:
    """K + N groups of `per_group` sequences; task groups score only the second half (a loss_mask)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(K + N):
        tokens = torch.randint(0, size.vocab, (per_group, size.seq), generator=gen)
        mask = torch.ones_like(tokens, dtype=torch.uint8)
        if g >= K:
            mask[:, : size.seq // 2] = 0
        groups.append({"tokens": tokens.to(device), "loss_mask": mask.to(device)})
    return groups


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


WALL: dict[str, list[float]] = {}  # label -> wall seconds, kept beside the CPU seconds in the JSON


def timed(fn: Callable[[], Any], repeats: int, device: torch.device, label: str = "") -> list[float]:
    """Seconds per call: the process's CPU time on CPU (robust when other jobs share the cores; one
    torch thread), wall time on CUDA. Wall seconds go to WALL[label]."""
    out, wall = [], []
    for _ in range(repeats):
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        _sync(device)
        wall.append(time.perf_counter() - t0)
        out.append(wall[-1] if device.type == "cuda" else time.process_time() - c0)
    WALL[label] = wall
    return out


def exact_gram(model: nn.Module, loss_fn: Callable, groups: list[dict]) -> torch.Tensor:
    """Every parameter on the exact path: one fused forward, one backward per group, G gradient copies."""
    params = [p for p in model.parameters() if p.requires_grad]
    batch = {k: torch.cat([g[k] for g in groups]) for k in groups[0]}
    with no_inplace_loss_grad():  # one backward per group over the same graph
        losses = loss_fn(model, batch)
    rows, start = [], 0
    for g in groups:
        n = g["tokens"].shape[0]
        grads = torch.autograd.grad(losses[start:start + n].mean(), params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(gr if gr is not None else torch.zeros_like(p)).reshape(-1)
                               for gr, p in zip(grads, params)]))
        start += n
    flat = torch.stack(rows)
    return (flat @ flat.t()).double().cpu()


def train_step_fn(model: nn.Module, loss_fn: Callable, batch: dict) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).mean().backward()
        opt.step()

    return step


def bench_family(name: str, size: FamilySize, args: argparse.Namespace, device: torch.device) -> dict:
    WALL.clear()
    model, loss_fn, source = build_family(name, size, torch.float32, seed=0)
    model.to(device)
    groups = probe_groups(size, args.per_group, device)
    capability_modules = [n for n, m in model.named_modules() if fast_kind(m) == AUTO]
    t0 = time.perf_counter()
    gram, _, info = group_gram(model, loss_fn, groups, return_info=True)  # warm-up + layout/capability probe
    first = time.perf_counter() - t0
    fused = timed(lambda: group_gram(model, loss_fn, groups), args.repeats, device, "fused")
    exact = timed(lambda: exact_gram(model, loss_fn, groups), max(1, args.repeats - 1), device, "exact")
    err = float((exact_gram(model, loss_fn, groups) - gram).abs().max() / gram.abs().max())
    before: list[float] = []
    if capability_modules:  # the exact-class matching of the previous release, reproduced by demotion
        for n, m in model.named_modules():
            if n in capability_modules:
                demote(m, "bench: exact-class matching (before)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            group_gram(model, loss_fn, groups)
            before = timed(lambda: group_gram(model, loss_fn, groups), max(1, args.repeats - 1), device, "before")
    model.train()
    gen = torch.Generator().manual_seed(1)
    train_batch = {"tokens": torch.randint(0, size.vocab, (args.train_batch, size.seq), generator=gen).to(device)}
    step = train_step_fn(model, loss_fn, train_batch)
    step()  # warm-up (optimizer state)
    steps = timed(step, args.repeats, device, "step")
    med = {k: statistics.median(v) if v else None
           for k, v in (("fused", fused), ("before", before), ("exact", exact), ("step", steps))}
    clock = "wall" if device.type == "cuda" else "process CPU"
    runs = {"fused": fused, "before": before, "exact": exact, "step": steps}
    return {
        "family": name, "source": source, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "seconds": med, "clock": clock, "first_call_seconds": first, "runs": runs, "wall_runs": dict(WALL),
        "ratio_fused": med["fused"] / med["step"], "ratio_exact": med["exact"] / med["step"],
        "ratio_before": None if med["before"] is None else med["before"] / med["step"],
        "fused_vs_exact_max_rel_diff_fp32": err, "fallback_params": info.fallback_params,
        "capability_modules": len(capability_modules), "fast_path_timings": info.timings,
    }


def print_table(rows: list[dict]) -> None:
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    print(f"{'family':<12}{'params M':>9}{'fused s':>9}{'before s':>10}{'exact s':>9}{'step s':>8}"
          f"{'fused/step':>11}{'before/step':>12}{'exact/step':>11}{'fallback':>9}  source")
    for r in rows:
        s = r["seconds"]
        print(f"{r['family']:<12}{r['params_m']:>9.2f}{s['fused']:>9.3f}{f(s['before'], '.3f'):>10}{s['exact']:>9.3f}"
              f"{s['step']:>8.3f}{r['ratio_fused']:>11.2f}{f(r['ratio_before'], '.2f'):>12}{r['ratio_exact']:>11.2f}"
              f"{len(r['fallback_params']):>9}  {r['source']}")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "probe_families", quick="tiny sizes, 2 repeats; bench/results is left alone")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--per-group", type=int, default=4, help="probe samples per group (K=7 + N=6 groups)")
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared machine)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.vocab, args.seq, args.train_batch, args.repeats = 64, 2, 1024, 32, 8, 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    size = FamilySize(d_model=args.d_model, n_layer=args.layers, n_head=args.heads, vocab=args.vocab, seq=args.seq)
    config = {**vars(args), "K": K, "N": N, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "load_avg": os.getloadavg(),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    rows = []
    for name in args.families.split(","):
        rows.append(bench_family(name, size, args, device))
        print_table(rows[-1:])
        if not args.quick:  # written after every family: a long run interrupted keeps what it measured
            write_json(args.out, {"config": config, "families": rows}, indent=2)
    print()
    print_table(rows)
    if not args.quick:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
