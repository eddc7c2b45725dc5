"""Subprocess entry for tests/test_lightning.py: grape_stream's tiny GPT trained by a Lightning Trainer on the mixer.

    python tests/_lightning_run.py DATA OUT [--steps 24] [--save-every 6] [--accumulate 1] [--kill-at STEP]
                                   [--resume] [--devices N] [--method M [--reference PATH]]

Every batch trained on is appended to ``OUT/samples.jsonl`` (mixer batch index, sample ids, domains and the
exact loss), flushed line by line so a SIGKILL keeps what was written. ``--kill-at`` SIGKILLs the process at
the end of that optimizer step (after GRAPE's update). ``--resume`` resumes from the newest checkpoint in
``OUT/ckpt``. Checkpoints are ``OUT/ckpt/step=N.ckpt``; metrics go to ``OUT/csv/version_0/metrics.csv``; each
rank writes its controller's (step, alpha) history to ``OUT/alphas-rank<r>.json`` and its update records to
``OUT/history-rank<r>.json`` at the end. ``--method`` other than grape: a loss-driven method (``--reference``: the
reference weights DoReMi reads), updating every 4 steps.
``--devices 2`` under ``torchrun --nproc_per_node 2``: DDP on CPU (gloo); rank r > 0 records its batches
in ``samples-rank<r>.jsonl``. ``--strategy model_parallel``: Lightning's ModelParallelStrategy, the GPT's blocks and
root sharded with FSDP2 in ``configure_model`` (Lightning's FSDPStrategy refuses ``accelerator="cpu"``).
``--global-batch G``: per-rank batch G / devices (the same stream on every world size); ``--double``: a float64
model; ``--probe-mode``: GRAPE's ``probe_mode``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    p.add_argument("--devices", type=int, default=1, help="> 1: DDP on CPU (gloo); launch with torchrun")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--alignments", default="probe",
                   help="steps: in-step alignments, 2 observed steps per update; rnb: method rnb on them")
    p.add_argument("--method", default="grape")
    p.add_argument("--reference", default=None)
    p.add_argument("--strategy", default=None, help="fsdp (FSDPStrategy) or model_parallel (fully_shard)")
    p.add_argument("--global-batch", type=int, default=None, help="the same on every --devices (default 8 a rank)")
    p.add_argument("--double", action="store_true", help="a float64 model")
    p.add_argument("--probe-mode", default="sharded")
    a = p.parse_args(argv)

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from _grape_data import SEQ, SHORT_RUN, VOCAB
    from grape_stream import DomainStream, TaskStream, WeightedStreamingMixer
    from grape_stream.integrations.lightning import GrapeLightningCallback, MixerDataModule
    from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss

    torch.set_num_threads(1)  # two cores shared by the suite: no oversubscription
    os.makedirs(a.out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    record = open(os.path.join(a.out, "samples.jsonl" if rank == 0 else f"samples-rank{rank}.jsonl"), "a",
                  encoding="utf-8")

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32, d_ff=64))
            if a.double:  # ModelParallelStrategy refuses precision="64-true"; 32-true leaves the dtype as built
                self.model.double()

        def configure_model(self) -> None:  # ModelParallelStrategy: FSDP2 over its data-parallel mesh
            if a.strategy == "model_parallel":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def forward(self, tokens):  # the GRAPE probe calls module(tokens) -> logits
            return self.model(tokens)

        def training_step(self, batch, batch_idx):
            loss = per_sample_lm_loss(self.model, batch).mean()
            record.write(json.dumps({"batch": int(batch["batch_index"][0]), "ids": batch["sample_index"].tolist(),
                                     "domains": batch["domain"].tolist(), "loss": loss.item()}) + "\n")
            record.flush()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class KillAt(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    if a.devices > 1:  # torchrun set RANK / WORLD_SIZE: one process group, before streaming would make its own
        torch.distributed.init_process_group("gloo")  # Lightning's DDP strategy uses it as it is
    mixer = WeightedStreamingMixer([DomainStream(d, local=f"{a.data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=8 if a.global_batch is None else a.global_batch // a.devices,
                                   global_batch_size=a.global_batch, seed=0)
    tasks = [TaskStream(t, local=f"{a.data}/tasks/{t}") for t in TASKS]
    if a.method != "grape":
        short = SHORT_RUN.get(a.method, {})
        options = {**short.get("options", {}), **({"reference": a.reference} if a.reference else {})}
        grape = GrapeLightningCallback(mixer, method=a.method, alpha_every=short.get("alpha_every", 4),
                                       options=options, plots=False)
    else:
        in_step = {"steps": {"alignments": "steps", "alignment_steps": 2}, "rnb": {"alignment_steps": 2}}
        grape = GrapeLightningCallback(mixer, method="rnb" if a.alignments == "rnb" else "grape", tasks=tasks,
                                       alpha_every=4, z_every=4, probe_domain_batch=4, probe_task_batch=4,
                                       mu_alpha=3e-3, mu_z=3e-4, plots=False, probe_mode=a.probe_mode,
                                       **in_step.get(a.alignments, {}))
    ckpt_dir = os.path.join(a.out, "ckpt")
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=a.save_every, save_top_k=-1)
    torch.manual_seed(0)
    module = LitGPT()
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=a.devices, accumulate_grad_batches=a.accumulate,
                         strategy=_strategy(a.strategy, a.devices),
                         callbacks=[grape, checkpoints, KillAt()], default_root_dir=a.out,
                         logger=CSVLogger(a.out, name="csv", version=0), log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False)
    resume = None
    if a.resume:
        steps = [int(m.group(1)) for f in os.listdir(ckpt_dir) if (m := re.fullmatch(r"step=(\d+)\.ckpt", f))]
        resume = os.path.join(ckpt_dir, f"step={max(steps)}.ckpt")
    trainer.fit(module, datamodule=MixerDataModule(mixer), ckpt_path=resume)
    if a.strategy == "model_parallel":  # the run trained a sharded module
        from grape_stream.grape.gram.sharding import is_sharded

        assert is_sharded(module), "ModelParallelStrategy left the module unsharded"
    with open(os.path.join(a.out, f"alphas-rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump([[r["step"], r["alpha"]] for r in grape.controller.history], f)
    with open(os.path.join(a.out, f"history-rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(grape.controller.history, f)
    mixer.close()


def _strategy(name: str | None, devices: int):
    if name == "model_parallel":  # FSDP2 (configure_model); Lightning's FSDPStrategy refuses accelerator="cpu"
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return name or ("ddp" if devices > 1 else "auto")


if __name__ == "__main__":
    main()
