"""A plain PyTorch loop training an FSDP2-sharded float64 GPT under GRAPE on ``--world`` gloo ranks, run as a
subprocess by tests/test_fsdp_resume.py.

    python _fsdp_resume_run.py DATA OUT --world N [--steps 12] [--save-every 3] [--global-batch 8]
                               [--hold-after STEP] [--resume]

This process is the launcher: it imports torch, streaming and grape_stream once and forks one process per rank
(RANK / WORLD_SIZE / MASTER_* set in each, as torchrun sets them), so a 4-rank job on a 2-core machine pays one
import, not four. It exits 0 when every rank did; when a rank fails it kills the others (as torchrun does) and exits
with 128 + the signal that ended that rank, or its exit code.

Each rank runs the loop a user writes (docs/composer.md's plain loop, sharded): ``fully_shard`` on every block and
the root, AdamW, a GrapeController with ``probe_mode="replicated"``, ``maybe_update`` after every optimizer step.
The global batch is ``--global-batch`` on every world size (per-rank batch = global / world), so the data stream
does not depend on the topology.

Checkpoints: every ``--save-every`` steps into ``OUT/ckpt/step-N``, written the way an FSDP2 job writes them:
the model's and the optimizer's sharded state dicts through torch.distributed.checkpoint (DCP: each rank writes
its own shards; a load on another world size reshards them), plus ``grape.pt`` (rank 0: the step, the LR
schedule, the mixer's position and the controller's state, plain types, loaded with ``weights_only=True``). A
checkpoint is written into a temporary folder and renamed once complete, so a kill during a save leaves the
previous one. ``--resume`` restores the newest ``step-N``.

``--hold-after S``: after step S each rank writes its pid to ``OUT/held-rank<r>`` and sleeps until it is killed
(the test SIGKILLs it there). Every rank appends the samples of each step it trained on to
``OUT/samples-rank<r>.jsonl`` (flushed per line) and, at the end, writes its controller's update records to
``OUT/history-rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DOMAINS = ["d0", "d1", "d2"]
TASKS = ["t0", "t1"]


def _newest(ckpt_dir: str) -> str | None:
    steps = [int(m.group(1)) for f in os.listdir(ckpt_dir) if (m := re.fullmatch(r"step-(\d+)", f))]
    return os.path.join(ckpt_dir, f"step-{max(steps)}") if steps else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--hold-after", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--world", type=int, required=True)
    a = p.parse_args(argv)
    _imports()
    port = _free_port()
    children = []
    for r in range(a.world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # a rank
            code = 0
            try:
                os.environ.update(RANK=str(r), WORLD_SIZE=str(a.world), LOCAL_RANK=str(r),
                                  LOCAL_WORLD_SIZE=str(a.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                rank_main(a)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    status, left = 0, dict(zip(children, range(a.world)))
    while left:  # like torchrun: the first rank that fails takes the others down (they would wait in a collective)
        pid, raw = os.wait()
        r = left.pop(pid)
        code = 128 + os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
        if code and not status:
            print(f"rank {r} ended with {code}", file=sys.stderr)
            status = code
            for other in left:
                os.kill(other, signal.SIGKILL)
    return status


def _imports() -> None:
    """What every rank needs, imported before the fork (once for all ranks)."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import grape_stream.grape.controller  # noqa: F401
    import grape_stream.mixing.mixer  # noqa: F401
    import grape_stream.models  # noqa: F401


def _free_port() -> int:
    from _parallel import free_port

    return free_port()


def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from _grape_data import SEQ, VOCAB
    from grape_stream import DomainStream, GrapeController, TaskStream, WeightedStreamingMixer
    from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # before the mixer: streaming reads the same ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(os.path.join(a.out, "ckpt"), exist_ok=True)
    mixer = WeightedStreamingMixer([DomainStream(d, local=f"{a.data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=a.global_batch // world, global_batch_size=a.global_batch, seed=0)
    tasks = [TaskStream(t, local=f"{a.data}/tasks/{t}") for t in TASKS]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32, d_ff=64)).double()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2 * a.steps)  # lr > 0 at the last update
    grape = GrapeController(mixer, tasks, method="grape", alpha_every=4, z_every=4, probe_domain_batch=4,
                            probe_task_batch=4, mu_alpha=3e-2, mu_z=3e-3, probe_mode="replicated")
    first = 1
    resume = _newest(os.path.join(a.out, "ckpt")) if a.resume else None
    if resume:  # restore before the first batch is drawn
        model_sd, optim_sd = get_state_dict(model, opt)  # this run's sharding: DCP loads (and reshards) into it
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=resume)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = torch.load(os.path.join(resume, "grape.pt"), weights_only=True)
        sched.load_state_dict(extra["sched"])
        mixer.load_state_dict(extra["mixer"])
        grape.load_state_dict(extra["grape"])
        first = extra["step"] + 1
    grape.start()
    loader = iter(mixer.dataloader(num_workers=0))
    record = open(os.path.join(a.out, f"samples-rank{rank}.jsonl"), "a", encoding="utf-8")
    for step in range(first, a.steps + 1):
        batch = next(loader)
        loss = per_sample_lm_loss(model, batch).mean()  # FSDP2 averages the gradients over the ranks
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        grape.maybe_update(model, step, lr=sched.get_last_lr()[0])
        record.write(json.dumps({"step": step, "batch": int(batch["batch_index"][0]),
                                 "ids": batch["sample_index"].tolist(), "domains": batch["domain"].tolist()}) + "\n")
        record.flush()
        if step % a.save_every == 0:
            _save(os.path.join(a.out, "ckpt"), step, model, opt, sched, mixer, grape, rank)
        if step == a.hold_after:
            held = os.path.join(a.out, f"held-rank{rank}")
            with open(held + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(held + ".tmp", held)
            while True:  # killed here, mid-interval, after a checkpoint
                time.sleep(1)
    with open(os.path.join(a.out, f"history-rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(grape.history, f)
    mixer.close()
    dist.destroy_process_group()


def _save(ckpt_dir: str, step: int, model, opt, sched, mixer, grape, rank: int) -> None:
    """Every rank writes its shards (DCP), rank 0 the rest; the folder appears under its name once complete."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp, final = os.path.join(ckpt_dir, f".step-{step}.tmp"), os.path.join(ckpt_dir, f"step-{step}")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    state = {"step": step, "sched": sched.state_dict(), "mixer": mixer.state_dict(), "grape": grape.state_dict()}
    if rank == 0:
        torch.save(state, os.path.join(tmp, "grape.pt"))
        os.replace(tmp, final)
    dist.barrier()  # no rank trains on before the checkpoint exists


if __name__ == "__main__":
    sys.exit(main())
