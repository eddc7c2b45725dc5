"""GRAPE's probe on an FSDP-sharded model: per-rank extra peak memory and wall overhead against uniform.

Set-up: 4 gloo processes on CPU (glibc told to return freed memory at once, so resident memory follows the live
tensors), our GPT sharded with FSDP2 (``fully_shard`` per block, then the root), AdamW,
float32. Each configuration (K domains, N targets: 20/6, the paper's ClimbLab setting, and 7/6) measures on
every rank:

* a uniform training step (forward + backward + AdamW on a per-rank micro-batch): median wall time, and the
  process's peak resident memory during the step (parameters, gradients, optimizer state, activations,
  gathered units);
* GRAPE's probe, ``group_gram`` on the sharded model (one FSDP unit gathered at a time, grape/gram/sharding.py),
  with ``b`` samples per group per rank, run where Composer runs it (after the optimizer step, gradients
  still held): median wall time and peak resident memory;
* the removed replica path for comparison (every rank gathers the full weights into an unsharded copy, then
  probes it): the same two numbers;
* exactness: the same weights in float64, sharded probe vs the unsharded single-process computation (each
  rank's probe on the whole model, averaged), max relative error over the Gram and the losses;
* the micro-batched probe (``micro_batch_size``: per-group gradients summed over the ranks and kept sharded,
  G x P / W per rank, grape/gram/shard_sums.py) against the one-pass probe on the same, larger probe (K=20, N=6,
  ``--micro-probe-batch`` samples per group per rank, more than a training micro-batch): wall time and peak of
  each, and its float64 error against one unsharded process probing every rank's samples together.

Wall overhead at an update every 100 steps = probe time / (100 x step time); extra peak memory, per rank (the
largest over ranks is reported) = (probe peak - step peak)+ / (step peak - the bare process's resident memory
before the model was built), i.e. relative to what training itself holds; extra gradient computations per
training step (the paper's unit) = probe samples / (100 x training samples), the probe being one fused
forward/backward (the paper's separate passes: (K+1 + N+1) / 100). Peaks are the kernel's resident-set
high-water mark, reset before each measured call (/proc/self/clear_refs; Linux).

    PYTHONPATH=$PWD .venv/bin/python bench/fsdp.py [--quick] [--out bench/results/fsdp.json]

Prints a table and writes the JSON with a ``claims`` object: {"k20_n6": {"wall_overhead", "extra_peak_memory",
"max_rel_error_vs_unsharded"}, "k7_n6": {...}, "k20_n6_micro": {the same for the micro-batched probe, and
"one_pass_wall_overhead", "one_pass_extra_peak_memory" for the one-pass probe of the same samples}} (fractions).
Goal (issue 31): at K=20, N=6 <= 5% wall and <= 10% extra peak memory per rank.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import parser, write_json  # (it puts the repository on sys.path)

from grape_stream.grape.gram.group_gram import group_gram  # noqa: E402
from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss  # noqa: E402

EVERY = 100  # optimizer steps per GRAPE update
WORLD = 4


def _model(args: argparse.Namespace, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=4, d_model=args.d_model,
                    d_ff=4 * args.d_model)
    return GPT(cfg).to(dtype)


def _shard(model: GPT) -> GPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(n: int, args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab, (n, args.seq), generator=gen)
    return {"tokens": tokens, "loss_mask": torch.ones_like(tokens, dtype=torch.uint8)}


def _groups(g: int, args: argparse.Namespace, rank: int, size: int | None = None) -> list[dict[str, torch.Tensor]]:
    return [_batch(size or args.probe_batch, args, seed=1000 * rank + i) for i in range(g)]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _peak(fn: Callable[[], Any]) -> tuple[float, int]:
    """(wall seconds, the process's peak resident memory during the call, bytes): the kernel's high-water mark,
    reset before the call (/proc/self/clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return dt, _status("VmHWM")


def _micro_measure(model: GPT, step: Callable[[int], None], args: argparse.Namespace, rank: int,
                   i: int) -> dict[str, Any]:
    """The larger probe of the micro-batched line, one pass and micro-batched, each after a training step."""
    k, n = args.micro
    groups = _groups(k + n, args, rank, args.micro_probe_batch)
    one = lambda: group_gram(model, per_sample_lm_loss, groups)  # noqa: E731
    micro = lambda: group_gram(model, per_sample_lm_loss, groups, micro_batch_size=args.micro_batch_size)  # noqa: E731
    one()  # warm-up: the layout probe is cached per batch shape (the same for both)
    times: dict[str, list[float]] = {"one": [], "micro": []}
    peaks: dict[str, list[int]] = {"one": [], "micro": []}
    for r in range(args.repeats):
        for name, fn in (("one", one), ("micro", micro)):
            dist.barrier()
            _peak(lambda j=i + 2 * r: step(j % 4))  # the same heap state as the main lines' probes
            dist.barrier()
            dt, peak = _peak(fn)
            times[name].append(dt)
            peaks[name].append(peak)
    return {f"{name}_{what}": (statistics.median(times[name]) if what == "s" else max(peaks[name]))
            for name in ("one", "micro") for what in ("s", "peak")}


def _replica_probe(sharded: GPT, args: argparse.Namespace, groups: list) -> None:
    """The removed path: gather the full weights on every rank, load them into an unsharded copy, probe it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    replica = _model(args, torch.float32)
    replica.load_state_dict(full)
    group_gram(replica, per_sample_lm_loss, groups)


def _worker(rank: int, args: argparse.Namespace, tmp: str) -> None:
    """Long because one process runs every configuration in turn (CPU time is the budget)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD)
    out: dict[str, Any] = {}
    try:
        baseline = _status("VmRSS")  # the process before the model: interpreter, torch, gloo
        model = _shard(_model(args, torch.float32))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step_batches = [_batch(args.train_batch, args, seed=rank * 7919 + s) for s in range(4)]

        def step(i: int) -> None:
            opt.zero_grad(set_to_none=True)
            per_sample_lm_loss(model, step_batches[i]).mean().backward()
            opt.step()

        for i in range(2):  # warm-up: lazy init, optimizer state allocated
            step(i)
        step_times, step_peaks = [], []
        i = 2
        for k, n in args.configs:
            groups = _groups(k + n, args, rank)
            probe_times, probe_peaks, replica_times, replica_peaks = [], [], [], []
            group_gram(model, per_sample_lm_loss, groups)  # warm-up: the layout probe is cached per batch shape
            for _ in range(args.repeats):
                dist.barrier()  # a training step, then the probe after it (interleaved: the same heap state)
                dt, peak = _peak(lambda i=i: step(i % len(step_batches)))
                step_times.append(dt)
                step_peaks.append(peak)
                i += 1
                dist.barrier()
                dt, peak = _peak(lambda groups=groups: group_gram(model, per_sample_lm_loss, groups))
                probe_times.append(dt)
                probe_peaks.append(peak)
                if not args.no_replica:
                    dist.barrier()
                    dt, peak = _peak(lambda groups=groups: _replica_probe(model, args, groups))
                    replica_times.append(dt)
                    replica_peaks.append(peak)
            out[f"k{k}_n{n}"] = {"probe_s": statistics.median(probe_times), "probe_peak": max(probe_peaks),
                                 "replica_s": statistics.median(replica_times) if replica_times else None,
                                 "replica_peak": max(replica_peaks) if replica_peaks else None,
                                 "probe_samples": (k + n) * args.probe_batch}
        out["micro"] = _micro_measure(model, step, args, rank, i)
        out["step_s"] = statistics.median(step_times)
        out["step_peak"] = max(step_peaks)
        out["baseline"] = baseline
        # exactness in float64: the same weights sharded vs the unsharded computation (done on every rank)
        exact = _shard(_model(args, torch.float64))
        for k, n in args.configs:
            groups = _groups(k + n, args, rank)
            gram, losses = group_gram(exact, per_sample_lm_loss, groups)
            out[f"k{k}_n{n}"]["gram64"] = (gram, losses)
        k, n = args.micro
        micro_groups = _groups(k + n, args, rank, args.micro_probe_batch)
        out["micro"]["gram64"] = group_gram(exact, per_sample_lm_loss, micro_groups,
                                            micro_batch_size=args.micro_batch_size)
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference(args: argparse.Namespace, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    grams, losses = [], []
    model = _model(args, torch.float64)
    for rank in range(WORLD):
        g, l_ = group_gram(copy.deepcopy(model), per_sample_lm_loss, _groups(k + n, args, rank), reduce=None)
        grams.append(g)
        losses.append(l_)
    return torch.stack(grams).mean(0), torch.stack(losses).mean(0)


def _micro_reference(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """One unsharded process probing every rank's samples of each group together (the micro-batched convention)."""
    k, n = args.micro
    per_rank = [_groups(k + n, args, rank, args.micro_probe_batch) for rank in range(WORLD)]
    groups = [{key: torch.cat([g[i][key] for g in per_rank]) for key in per_rank[0][i]} for i in range(k + n)]
    return group_gram(_model(args, torch.float64), per_sample_lm_loss, groups, micro_batch_size=args.micro_batch_size)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _micro_claims(args: argparse.Namespace, ranks: list[dict], step_s: float,
                  extra: Callable[[dict, int], float]) -> tuple[str, dict[str, Any]]:
    """The micro-batched line's claims and configuration from every rank's measurements."""
    k, n = args.micro
    per = [r["micro"] for r in ranks]
    want_gram, want_losses = _micro_reference(args)
    err = max(max(_rel(x["gram64"][0], want_gram), _rel(x["gram64"][1], want_losses)) for x in per)
    micro_s = statistics.median(x["micro_s"] for x in per)
    one_s = statistics.median(x["one_s"] for x in per)
    params = sum(q.numel() for q in _model(args, torch.float32).parameters())
    claims = {"wall_overhead": micro_s / (EVERY * step_s),
              "extra_peak_memory": max(extra(r, r["micro"]["micro_peak"]) for r in ranks),
              "max_rel_error_vs_unsharded": err,
              "one_pass_wall_overhead": one_s / (EVERY * step_s),
              "one_pass_extra_peak_memory": max(extra(r, r["micro"]["one_peak"]) for r in ranks)}
    config = {"K": k, "N": n, "probe_batch_per_group_per_rank": args.micro_probe_batch,
              "probe_samples_per_rank": (k + n) * args.micro_probe_batch, "micro_batch_size": args.micro_batch_size,
              "probe_s": micro_s, "probe_peak_bytes": max(x["micro_peak"] for x in per),
              "one_pass_probe_s": one_s, "one_pass_peak_bytes": max(x["one_peak"] for x in per),
              "shard_bytes_per_rank": (k + n) * -(-params // WORLD) * 4,
              "convention": "the Gram of the rank-mean group gradients (one process probing every rank's samples)"}
    return f"k{k}_n{n}_micro", {"claims": claims, "config": config}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "fsdp", quick="a smoke run: K=7, N=6 and the K=20, N=6 micro-batched line, a smaller model")
    p.add_argument("--no-replica", action="store_true", help="skip the removed replica path's comparison")
    p.add_argument("--micro-probe-batch", type=int, default=4,
                   help="samples per group per rank of the micro-batched line's probe (default 4)")
    p.add_argument("--micro-batch-size", type=int, default=16, help="its micro_batch_size (default 16)")
    args = p.parse_args(argv)
    args.configs = [(20, 6), (7, 6)]
    args.vocab, args.seq, args.d_model, args.layers = 4096, 64, 128, 4
    args.train_batch, args.probe_batch, args.repeats = 32, 1, 2
    args.micro = (20, 6)
    if args.quick:
        args.configs = [(7, 6)]
        args.vocab, args.seq, args.d_model, args.layers = 512, 32, 64, 2
        args.train_batch, args.repeats = 16, 1
    # glibc returns freed memory to the kernel at once (large blocks mmap'd, the heap trimmed), so the resident
    # set follows the live tensors instead of what the allocator kept from earlier calls
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, tmp), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    step_s = statistics.median(r["step_s"] for r in ranks)
    step_peak = max(r["step_peak"] for r in ranks)

    def extra(r: dict, peak: int) -> float:  # this rank's probe peak above its step's, over what training holds
        return max(0.0, peak - r["step_peak"]) / (r["step_peak"] - r["baseline"])

    rows, claims, configs = [], {}, {}
    for k, n in args.configs:
        key = f"k{k}_n{n}"
        per = [r[key] for r in ranks]
        probe_s = statistics.median(x["probe_s"] for x in per)
        probe_peak = max(x["probe_peak"] for x in per)
        want_gram, want_losses = _reference(args, k, n)
        err = max(max(_rel(x["gram64"][0], want_gram), _rel(x["gram64"][1], want_losses)) for x in per)
        wall = probe_s / (EVERY * step_s)
        extra_mem = max(extra(r, r[key]["probe_peak"]) for r in ranks)
        samples = per[0]["probe_samples"]
        grads = samples / (EVERY * args.train_batch)
        paper = (k + 1 + n + 1) / EVERY
        rep_s = statistics.median(x["replica_s"] for x in per) if per[0]["replica_s"] is not None else None
        rep_peak = max(x["replica_peak"] for x in per) if per[0]["replica_peak"] is not None else None
        claims[key] = {"wall_overhead": wall, "extra_peak_memory": extra_mem, "max_rel_error_vs_unsharded": err}
        configs[key] = {
            "K": k, "N": n, "probe_s": probe_s, "probe_peak_bytes": probe_peak, "probe_samples_per_rank": samples,
            "extra_gradient_computations_per_step": grads, "paper_separate_passes_per_step": paper,
            "replica_probe_s": rep_s, "replica_peak_bytes": rep_peak,
            "replica_wall_overhead": None if rep_s is None else rep_s / (EVERY * step_s),
            "replica_extra_peak_memory": None if rep_peak is None else max(extra(r, r[key]["replica_peak"])
                                                                            for r in ranks),
        }
        rows.append((key, probe_s, wall, probe_peak, extra_mem, grads, paper, err, rep_s, rep_peak))
    micro_key, micro_row = _micro_claims(args, ranks, step_s, extra)
    claims[micro_key] = micro_row["claims"]
    configs[micro_key] = micro_row["config"]
    mib = 1 / 2 ** 20
    params = sum(q.numel() for q in _model(args, torch.float32).parameters())
    print(f"4 gloo ranks (CPU), GPT {params / 1e6:.2f}M parameters (d={args.d_model}, {args.layers} layers, vocab "
          f"{args.vocab}, seq {args.seq}), FSDP2; per rank: training micro-batch {args.train_batch}, probe "
          f"{args.probe_batch} sample(s) per group; uniform step {step_s:.3f} s, peak {step_peak * mib:.1f} MiB; "
          f"update every {EVERY} steps")
    print("| K,N | probe s | wall overhead | probe peak MiB | extra peak | extra grads/step (paper) | max rel err |"
          " replica s | replica peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, ps, wall, pk, em, grads, paper, err, rs, rp in rows:
        print(f"| {key} | {ps:.3f} | {wall:.2%} | {pk * mib:.1f} | {em:.1%} | {grads:.2%} ({paper:.0%}) | {err:.1e} |"
              f" {'-' if rs is None else f'{rs:.3f}'} | {'-' if rp is None else f'{rp * mib:.1f}'} |")
    m = micro_row["config"]
    print(f"\nmicro-batched probe (K={m['K']}, N={m['N']}, {m['probe_batch_per_group_per_rank']} samples per group per "
          f"rank = {m['probe_samples_per_rank']} per rank, micro_batch_size {m['micro_batch_size']}; per-group "
          f"gradient shards {m['shard_bytes_per_rank'] * mib:.1f} MiB per rank):")
    print("| probe | probe s | wall overhead | probe peak MiB | extra peak | max rel err |")
    print("|---|---|---|---|---|---|")
    c = claims[micro_key]
    print(f"| one pass | {m['one_pass_probe_s']:.3f} | {c['one_pass_wall_overhead']:.2%} | "
          f"{m['one_pass_peak_bytes'] * mib:.1f} | {c['one_pass_extra_peak_memory']:.1%} | - |")
    print(f"| micro_batch_size {m['micro_batch_size']} | {m['probe_s']:.3f} | {c['wall_overhead']:.2%} | "
          f"{m['probe_peak_bytes'] * mib:.1f} | {c['extra_peak_memory']:.1%} | {c['max_rel_error_vs_unsharded']:.1e} |")
    result = {
        "claims": claims, "configs": configs, "step_s": step_s, "step_peak_bytes": step_peak,
        "setup": {"world": WORLD, "fsdp": "fsdp2", "params": params, "d_model": args.d_model, "layers": args.layers,
                  "vocab": args.vocab, "seq": args.seq, "train_batch_per_rank": args.train_batch,
                  "probe_batch_per_group_per_rank": args.probe_batch, "every": EVERY, "quick": args.quick,
                  "micro_probe_batch_per_group_per_rank": args.micro_probe_batch,
                  "micro_batch_size": args.micro_batch_size},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
