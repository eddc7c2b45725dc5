"""What the training-step methods cost in the Hugging Face Trainer (GrapeTrainer), beside bench/loss_overhead.py's
plain loop: there an HF model computes its own loss, so a loss-driven method (ODM, ADO) has each sample's loss
recomputed from the logits (no gradient), and R&B / ``alignments: steps`` have the observed steps' loss built from
each sample's loss.

A tiny Llama at the value benchmark's shape (4 layers, hidden 128, vocab 4096, seq 128, batch 32), AdamW, a real
mixer over K=7 domains of MDS shards (bench/loss_overhead.py's), one torch thread. Per method, the median over
interleaved repeats of ``Trainer.train`` for ``--steps`` steps, divided by the steps (set-up included, the same
for every method):

* ``step_ms``: one step;
* ``extra_pct``: the method's step over uniform's (uniform runs the same callback with nothing to observe).

ODM and ADO update every step (the papers' setting); ``odm_every20`` reads the same per-sample losses but updates
once in 20 steps (what the per-step update and its logged metrics cost is the difference); R&B observes 4 of every
20 steps and updates every 20.

    PYTHONPATH=$PWD python bench/hf_loss_overhead.py [--quick]   # table + bench/results/hf_loss_overhead.json
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from common import parser  # (it puts the repository on sys.path)
from loss_overhead import _mixer, _write_domains, write_results  # noqa: E402 (bench/ is not a package)

METHODS: dict[str, dict[str, Any]] = {
    "uniform": {"method": "uniform", "alpha_every": 1},
    "odm": {"method": "odm", "alpha_every": 1},
    "ado": {"method": "ado", "alpha_every": 1, "options": {"warmup_steps": 5, "fit_every": 10, "ignore_steps": 2}},
    "rnb": {"method": "rnb", "alpha_every": 20, "alignment_steps": 4},
    "odm_every20": {"method": "odm", "alpha_every": 20},  # the same losses read, one update: what is per-update
}
SHAPE = {"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128}
BATCH = 32


def run(method: str, root: str, steps: int, out: str) -> float:
    """Seconds of ``Trainer.train`` for ``steps`` steps of ``method``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainer, GrapeTrainerCallback

    mixer = _mixer(root, BATCH)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    args = TrainingArguments(output_dir=out, max_steps=steps, learning_rate=1e-3, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True, logging_steps=10 ** 6, seed=0)
    grape = GrapeTrainerCallback(**METHODS[method], trajectory=False, plots=False, summary=False)
    trainer = GrapeTrainer(model=model, args=args, mixer=mixer, callbacks=[grape])
    try:
        t0 = time.perf_counter()
        trainer.train()
        return time.perf_counter() - t0
    finally:
        mixer.close()


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.split("\n")[0], "hf_loss_overhead",
               quick="4 steps, 1 repeat (a smoke run; results not written)")
    p.add_argument("--steps", type=int, default=20, help="training steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per method (median)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 4, 1
        METHODS["rnb"].update(alpha_every=4, alignment_steps=2)
        METHODS["odm_every20"].update(alpha_every=4)
    import torch

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        _write_domains(tmp, SHAPE["max_position_embeddings"], SHAPE["vocab_size"])
        run("uniform", tmp, 2, os.path.join(tmp, "warm"))  # warm-up: allocator, imports, first calls
        for _ in range(args.repeats):
            for m in METHODS:
                times[m].append(run(m, tmp, args.steps, os.path.join(tmp, m)) / args.steps)
    base = statistics.median(times["uniform"])
    table = {m: {"step_ms": 1e3 * statistics.median(t), "extra_pct": 100 * (statistics.median(t) - base) / base,
                 "repeats_ms": [round(1e3 * x, 1) for x in t]} for m, t in times.items()}
    print(f"{'method':<8} {'step ms':>9} {'extra %':>9}   repeats (ms)")
    for m, r in table.items():
        print(f"{m:<8} {r['step_ms']:>9.1f} {r['extra_pct']:>9.2f}   {r['repeats_ms']}")
    if not args.quick:
        write_results(args.out, "hf_loss_overhead", model=SHAPE, batch=BATCH, steps=args.steps, repeats=args.repeats,
                      methods=table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
