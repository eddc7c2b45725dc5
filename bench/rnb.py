"""What R&B (method rnb) costs per update, beside GRAPE's probe and GRAPE's in-step alignments (issue 24).

bench/instep.py's setting: K=7 domains (bigram rules), N=6 tasks, our GPT (d=64, 2 layers, 4 heads, vocab 512,
seq 64), global batch 64, an update every 100 steps, probes of 8 per group, one torch thread, the model warmed
for --warm steps. Process CPU seconds, medians of interleaved repeats:

* ``plain_step``: forward + backward + AdamW step of a batch of 64 (the mixer's order);
* ``rnb_observed_step``: the same step observed by R&B's engine (no direction; each domain's gradient part kept
  and summed into the round's K gradient copies, grape.instep_gram);
* ``rnb_update``: the round's K x K Gram of the sums (gram_of_sums) + the softmax update;
* ``grape_observed_step``: the step observed by GRAPE's in-step alignments (one direction);
* ``fused_probe``: GRAPE's paper update (one fused probe of K + N groups of 8);
* ``task_probe_steps``: the task probe of GRAPE's in-step alignments.

Per update (one interval of --every steps, m of them observed): rnb m x (observed - plain) + rnb_update;
GRAPE probe: fused_probe; GRAPE steps m: task_probe + m x (grape_observed - plain). Also the memory R&B keeps:
K gradient copies.

    PYTHONPATH=$PWD python bench/rnb.py [--quick]      # prints a table, writes bench/results/rnb.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
from typing import Any, Callable

import numpy as np
from common import parser, write_json  # (it puts the repository on sys.path)
from instep import K, N, _cpu, _domain_batch, _task_groups, build, target_direction  # noqa: E402


def costs(model: Any, opt: Any, v: dict, args: argparse.Namespace) -> tuple[dict[str, float], int]:
    import torch

    from grape_stream.grape.gram.group_gram import group_gram
    from grape_stream.grape.gram.instep import StepAlignments
    from grape_stream.grape.gram.instep_grads import PartStore
    from grape_stream.grape.instep_gram import gram_of_sums
    from grape_stream.grape.instep_probe import task_probe
    from grape_stream.grape.reweighting import build_reweighter
    from grape_stream.models import per_sample_lm_loss

    rnb = StepAlignments(model, per_sample_lm_loss, K)
    rnb.set_directions([])
    store = PartStore(K)
    grape = StepAlignments(model, per_sample_lm_loss, K)
    grape.set_directions([v])
    rw = build_reweighter("rnb", K, 1)
    rng = np.random.default_rng(11)
    task_groups = _task_groups(rng, args)
    probe_groups = [{"tokens": _domain_batch(rng, np.full(args.probe_batch, k), args)["tokens"],
                     "loss_mask": torch.ones(args.probe_batch, args.seq_len + 1, dtype=torch.uint8)}
                    for k in range(K)] + task_groups
    params = {p: p.detach().clone() for p in model.parameters()}
    weights = torch.zeros(K, dtype=torch.float64)

    def train(sa: Any) -> None:
        nonlocal weights
        batch = _domain_batch(rng, rng.integers(0, K, args.batch), args)
        if sa is None:
            per_sample_lm_loss(model, batch).mean().backward()
        else:
            with sa.observe(batch, store=store if sa is rnb else None):
                per_sample_lm_loss(model, batch).mean().backward()
            if sa is rnb:
                weights += sa.weights.cpu()
            sa.reset()
        opt.step()
        opt.zero_grad(set_to_none=True)

    uniform = np.full(N, 1.0 / N)
    jobs: dict[str, Callable[[], Any]] = {
        "plain_step": lambda: train(None),
        "rnb_observed_step": lambda: train(rnb),
        "rnb_update": lambda: rw.update_from_step_gram(gram_of_sums(store.grads, weights), np.ones(K)),
        "grape_observed_step": lambda: train(grape),
        "fused_probe": lambda: group_gram(model, per_sample_lm_loss, probe_groups),
        "task_probe_steps": lambda: task_probe(model, per_sample_lm_loss, task_groups, fixed=[v],
                                               coefficients=lambda losses, r, gram: uniform / losses),
    }
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for rep in range(args.cost_repeats + 2):
        for name, job in jobs.items():
            t = _cpu(job)
            if rep >= 2:  # warm-up: first calls, layout probes, allocator
                times[name].append(t)
    kept = sum(t.numel() for t in store.grads.values())
    with torch.no_grad():
        for p, saved in params.items():
            p.copy_(saved)
    return {k: statistics.median(x) for k, x in times.items()}, kept


def main(argv: list[str] | None = None) -> int:
    p = parser(None, "rnb", quick="")
    p.add_argument("--warm", type=int, default=150)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--probe-batch", type=int, default=8)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--cost-repeats", type=int, default=15)
    p.add_argument("--observed", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 10, 100],
                   help="observed steps per interval to report")
    args = p.parse_args(argv)
    if args.quick:
        args.warm, args.cost_repeats = 20, 5
    import torch

    torch.set_num_threads(1)
    model, opt = build(args)
    v, _ = target_direction(model, args)
    cost, kept = costs(model, opt, v, args)
    n_params = sum(q.numel() for q in model.parameters())
    per_update: dict[str, float] = {"grape probe": cost["fused_probe"]}
    for m in args.observed:
        per_update[f"rnb steps {m}"] = m * (cost["rnb_observed_step"] - cost["plain_step"]) + cost["rnb_update"]
        per_update[f"grape steps {m}"] = (cost["task_probe_steps"]
                                          + m * (cost["grape_observed_step"] - cost["plain_step"]))
    interval = args.every * cost["plain_step"]
    result = {"args": vars(args), "platform": platform.platform(), "torch": torch.__version__,
              "cpu_seconds": cost, "params": n_params, "rnb_kept_elements": kept,
              "per_update_cpu_seconds": per_update,
              "per_update_fraction_of_interval": {k: x / interval for k, x in per_update.items()}}
    print(f"model: {n_params} parameters; R&B keeps {kept} elements (K x params = {K * n_params})")
    for k, x in cost.items():
        print(f"  {k:<22} {x * 1e3:9.2f} ms cpu")
    print(f"per update (an interval of {args.every} plain steps = {interval:.2f} s cpu):")
    for k, x in per_update.items():
        print(f"  {k:<16} {x * 1e3:9.1f} ms  {100 * x / interval:6.2f} % of the interval")
    if not args.quick:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
