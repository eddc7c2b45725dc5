"""Subprocess entry for tests/test_hf_trainer.py: a tiny HF Llama trained by GrapeTrainer on the mixer.

    python tests/_hf_run.py DATA OUT [--steps 24] [--save-every 6] [--accumulate 1] [--kill-at STEP] [--resume]

Every batch the model trains on is appended to ``OUT/samples.jsonl`` (mixer batch index, sample ids,
domains), flushed line by line so a SIGKILL keeps what was written. ``--kill-at`` SIGKILLs the process at
the end of that optimizer step (after GRAPE's update): nothing is flushed or closed, as in an OOM kill or a
preempted node. ``--resume`` resumes from the newest ``checkpoint-N`` in OUT. Each rank writes its
controller's (step, alpha) history to ``OUT/alphas-rank<r>.json`` at the end. Under ``torchrun
--nproc_per_node 2`` it trains with DDP on CPU (gloo); rank r > 0 records its batches in
``samples-rank<r>.jsonl``. ``--method`` other than grape: uniform, rnb or a loss-driven method updating every 4
steps (``--reference``: DoReMi's reference weights); the update records go to ``OUT/history-rank<r>.json``.
``--alignments steps``: GRAPE's domain side from the training steps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DOMAINS = ["d0", "d1", "d2"]
TASKS = ["t0", "t1"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--method", default="grape")
    p.add_argument("--reference", default=None)
    p.add_argument("--alignments", default="probe")
    a = p.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from _grape_data import SEQ, SHORT_RUN, VOCAB
    from grape_stream import DomainStream, TaskStream, WeightedStreamingMixer
    from grape_stream.integrations.hf import GrapeTrainer, GrapeTrainerCallback, causal_lm_inputs

    os.makedirs(a.out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    record = open(os.path.join(a.out, "samples.jsonl" if rank == 0 else f"samples-rank{rank}.jsonl"), "a",
                  encoding="utf-8")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one process group, before streaming makes its own
        torch.distributed.init_process_group("gloo")

    def recording_inputs(batch):
        record.write(json.dumps({"batch": int(batch["batch_index"][0]), "ids": batch["sample_index"].tolist(),
                                 "domains": batch["domain"].tolist()}) + "\n")
        record.flush()
        return causal_lm_inputs(batch)

    class KillAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    mixer = WeightedStreamingMixer([DomainStream(d, local=f"{a.data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=8, seed=0,
                                   global_batch_size=8 * int(os.environ.get("WORLD_SIZE", "1")) * a.accumulate)
    tasks = [TaskStream(t, local=f"{a.data}/tasks/{t}") for t in TASKS]
    torch.set_num_threads(1)  # two cores shared by the suite: no oversubscription
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ))
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8, learning_rate=3e-3,
                             gradient_accumulation_steps=a.accumulate, lr_scheduler_type="cosine", logging_steps=1,
                             save_steps=a.save_every, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    if a.method != "grape":  # uniform or a loss-driven method (--reference: DoReMi's)
        short = SHORT_RUN.get(a.method, {})
        grape = GrapeTrainerCallback(method=a.method, alpha_every=short.get("alpha_every", 4), plots=False,
                                     options={**short.get("options", {}),
                                              **({"reference": a.reference} if a.reference else {})})
    else:
        grape = GrapeTrainerCallback(method="grape", tasks=tasks, alpha_every=4, z_every=4, probe_domain_batch=4,
                                     probe_task_batch=4, mu_alpha=3e-3, mu_z=3e-4, plots=False,
                                     alignments=a.alignments)
    trainer = GrapeTrainer(model=model, args=args, mixer=mixer, batch_transform=recording_inputs,
                           callbacks=[grape, KillAt()])
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    with open(os.path.join(a.out, f"alphas-rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump([[r["step"], r["alpha"]] for r in grape.controller.history], f)
    with open(os.path.join(a.out, f"history-rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(grape.controller.history, f)
    mixer.close()


if __name__ == "__main__":
    main()
