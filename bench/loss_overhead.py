"""What the loss-driven online methods (ODM, ADO, DoReMi) cost a training run (issue 24: <= 0.5% of a uniform
run's wall time for the loss-only methods, DoReMi's reference forward aside).

The product path of a plain loop: a real mixer over real MDS shards (K domains), our GPT at the value
benchmark's shape (4 layers, d=128, vocab 4096, seq 128, batch 32; ``--small`` for the unit tests' size), AdamW,
``GrapeController`` with each method: ``controller.observe`` around the forward + backward (the per-sample
losses summed per domain), ``maybe_update`` after the step (the fold over ranks, the update, the mixer's new
weights). The same batches for every method; one torch thread. Per method, the median of interleaved
repeats of ``--steps`` steps:

* ``step_ms``: one training step, everything included;
* ``controller_ms``: the part of it spent in ``observe`` / ``maybe_update`` (per step, updates amortised);
* ``overhead_pct``: ``controller_ms`` over uniform's ``step_ms``;
* ``extra_pct``: what the method adds to uniform's own controller time (its start and per-step calls), over
  uniform's ``step_ms``: the issue's figure.

DoReMi's row includes its reference model's no-grad forward on every micro-batch (the method's own cost, which
the issue sets aside). ``alpha_every=1`` for all (the papers' per-step updates); ADO refits every 10 steps.

    PYTHONPATH=$PWD python bench/loss_overhead.py [--small] [--quick]   # table + bench/results/loss_overhead.json
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

from common import parser, write_json  # (it puts the repository on sys.path)

K = 7
OPTIONS: dict[str, dict[str, Any]] = {
    "uniform": {},
    "odm": {},
    "ado": {"warmup_steps": 5, "fit_every": 10, "ignore_steps": 2},
    "doremi": {},  # + reference (written below)
}


def run(method: str, root: str, reference: str, model_cfg: Any, batches: list[Any], batch_size: int,
        lr: float = 1e-3) -> tuple[float, float]:
    """(seconds of the whole loop, seconds inside the controller) over ``batches``."""
    import torch

    from grape_stream import GrapeController
    from grape_stream.models import GPT, per_sample_lm_loss

    mixer = _mixer(root, batch_size)
    torch.manual_seed(0)
    model = GPT(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    options = dict(OPTIONS[method], **({"reference": reference} if method == "doremi" else {}))
    ctl = GrapeController(mixer, [], method=method, alpha_every=1, **options)
    ctl.start()
    inside = 0.0
    t0 = time.perf_counter()
    for step, batch in enumerate(batches, 1):
        a = time.perf_counter()
        cm = ctl.observe(model, step, batch)
        cm.__enter__()
        inside += time.perf_counter() - a
        per_sample_lm_loss(model, batch).mean().backward()
        a = time.perf_counter()
        cm.__exit__(None, None, None)
        inside += time.perf_counter() - a
        opt.step()
        opt.zero_grad(set_to_none=True)
        a = time.perf_counter()
        ctl.maybe_update(model, step, lr)
        inside += time.perf_counter() - a
    total = time.perf_counter() - t0
    mixer.close()
    return total, inside


def _mixer(root: str, batch_size: int) -> Any:
    from grape_stream import DomainStream, WeightedStreamingMixer

    return WeightedStreamingMixer([DomainStream(f"d{k}", local=os.path.join(root, f"d{k}")) for k in range(K)],
                                  batch_size=batch_size, seed=0)


def _write_domains(root: str, tokens: int, vocab: int, samples: int = 2000) -> None:
    """K domains of random token sequences (the converter's ``tokens`` column), each with its own token range."""
    import numpy as np
    from streaming import MDSWriter

    for k in range(K):
        rng = np.random.default_rng(k)
        with MDSWriter(out=os.path.join(root, f"d{k}"), columns={"tokens": "ndarray:uint16"},
                       size_limit=1 << 22) as w:
            for _ in range(samples):
                w.write({"tokens": rng.integers(k * vocab // (2 * K), vocab, size=tokens, dtype=np.uint16)})


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.split("\n")[0], "loss_overhead", quick="5 steps, 1 repeat (a smoke run; results not written)")
    p.add_argument("--steps", type=int, default=20, help="training steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per method (median)")
    p.add_argument("--small", action="store_true",
                   help="the unit tests' GPT (2 layers, d=64, vocab 512, seq 64, batch 8)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 5, 1
    import torch

    from grape_stream.models import GPT, GPTConfig

    torch.set_num_threads(1)
    shape = (dict(vocab_size=512, seq_len=64, n_layer=2, n_head=2, d_model=64, d_ff=128), 8) if args.small else \
        (dict(vocab_size=4096, seq_len=128, n_layer=4, n_head=4, d_model=128, d_ff=512), 32)
    cfg, batch_size = GPTConfig(**shape[0]), shape[1]
    rows: dict[str, dict[str, list[float]]] = {m: {"step": [], "inside": []} for m in OPTIONS}
    with tempfile.TemporaryDirectory() as tmp:
        _write_domains(tmp, cfg.seq_len + 1, cfg.vocab_size)
        reference = os.path.join(tmp, "reference.pt")
        torch.manual_seed(1)
        torch.save(GPT(cfg).state_dict(), reference)
        mixer = _mixer(tmp, batch_size)
        it = iter(mixer.dataloader(num_workers=0))
        batches = [next(it) for _ in range(args.steps)]
        mixer.close()
        run("uniform", tmp, reference, cfg, batches[:2], batch_size)  # warm-up: allocator, first calls
        for _ in range(args.repeats):
            for m in OPTIONS:
                total, inside = run(m, tmp, reference, cfg, batches, batch_size)
                rows[m]["step"].append(total / args.steps)
                rows[m]["inside"].append(inside / args.steps)
    base = statistics.median(rows["uniform"]["step"])
    own = statistics.median(rows["uniform"]["inside"])
    table = {m: {"step_ms": 1e3 * statistics.median(r["step"]), "controller_ms": 1e3 * statistics.median(r["inside"]),
                 "overhead_pct": 100 * statistics.median(r["inside"]) / base,
                 "extra_pct": 100 * (statistics.median(r["inside"]) - own) / base} for m, r in rows.items()}
    print(f"{'method':<8} {'step ms':>9} {'controller ms':>14} {'overhead %':>11} {'extra %':>9}")
    for m, r in table.items():
        print(f"{m:<8} {r['step_ms']:>9.1f} {r['controller_ms']:>14.3f} {r['overhead_pct']:>11.3f} "
              f"{r['extra_pct']:>9.3f}")
    if not args.quick:
        write_results(args.out, "loss_overhead", model=shape[0], batch=shape[1], steps=args.steps,
                      repeats=args.repeats, methods=table)
    return 0


def write_results(path: str, bench: str, **fields: Any) -> None:
    """The bench's JSON (its command line, K, the machine, one thread) with ``fields``; shared with
    bench/hf_loss_overhead.py."""
    doc = {"bench": bench, "command": f"python bench/{bench}.py " + " ".join(sys.argv[1:]), "K": K, **fields,
           "machine": platform.processor() or platform.machine(), "threads": 1}
    write_json(path, doc, say=True)


if __name__ == "__main__":
    raise SystemExit(main())
