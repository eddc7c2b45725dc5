"""GrapeAlgorithm under FSDP, for real: two gloo processes on CPU, the model wrapped by torch's FSDP1
(use_orig_params, the wrapping Composer's ``fsdp_config`` applies) on a real Composer State; the probe runs on the
sharded model unit by unit (grape/gram/sharding.py; the Gram's exactness against the unsharded computation is
tests/test_fsdp_gram.py). (Composer's own FSDP wrapping needs CUDA: composer/distributed/dist_strategy.py passes
``device_id=torch.cuda.current_device()``; torch's FSDP runs on CPU with ``device_id=cpu``.) The training steps'
own numbers (``alignments: steps`` and R&B) under Composer's FSDP1: GrapeAlgorithm's step events around real
training steps on the FSDP1 model, against the same steps under DDP."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from _alignment_helpers import gpt
from _parallel import spawn
from grape_stream.grape.gram.sharding import is_sharded


def _algorithm_run(data: str, sharded: bool) -> dict:
    """GrapeAlgorithm driven through Composer's events on a real State: the model wrapped by torch's FSDP1 as
    Composer wraps it, FIT_START, then one update at BATCH_END (probing the sharded model: no replica)."""
    from composer.core import Event, State, Time
    from composer.devices import DeviceCPU
    from composer.loggers import Logger
    from composer.utils.parallelism import FSDPConfig, ParallelismConfig
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from _grape_data import SEQ, VOCAB
    from grape_stream.integrations.composer import ComposerGPT, GrapeAlgorithm
    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    mixer = WeightedStreamingMixer([DomainStream(d, local=f"{data}/{d}", split="train") for d in ("d0", "d1")],
                                   batch_size=4, seed=0)
    model = ComposerGPT(gpt(torch.float32, seed=0, vocab_size=VOCAB, seq_len=SEQ).train())
    algo = GrapeAlgorithm(tasks=[{"name": "t0", "local": f"{data}/tasks/t0"}], alpha_every=1, z_every=1,
                          probe_domain_batch=4, probe_task_batch=4, probe_mode="replicated")
    parallel = ParallelismConfig(fsdp=FSDPConfig(use_orig_params=True)) if sharded else None
    state = State(model=model, rank_zero_seed=0, run_name="fsdp", device=DeviceCPU(), max_duration="4ba",
                  train_dataloader=mixer.dataloader(), parallelism_config=parallel)
    logger = Logger(state, [])
    if sharded:
        block = type(model.model.blocks[0])
        model.model = FullyShardedDataParallel(model.model, auto_wrap_policy=ModuleWrapPolicy({block}),
                                               use_orig_params=True, device_id=torch.device("cpu"))
        assert state.fsdp_enabled and is_sharded(state.model)
    algo.apply(Event.FIT_START, state, logger)
    state.timestamp = state.timestamp.copy(batch=Time(1, "ba"))
    algo.apply(Event.BATCH_END, state, logger)
    rec = algo.controller.history[-1]
    mixer.close()
    return {k: rec[k] for k in ("alpha", "z", "alignment", "task_loss")}


def _steps_run(data: str, sharded: bool, options: dict) -> dict:
    """GrapeAlgorithm through Composer's events around three real training steps (AFTER_DATALOADER, BEFORE_FORWARD,
    the forward and backward, AFTER_BACKWARD, the optimizer step, BATCH_END): FSDP1 as Composer wraps the model,
    or DDP (the reference)."""
    from composer.core import Event, State, Time
    from composer.devices import DeviceCPU
    from composer.loggers import Logger
    from composer.utils.parallelism import FSDPConfig, ParallelismConfig
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.nn.parallel import DistributedDataParallel

    from _grape_data import SEQ, VOCAB
    from grape_stream.integrations.composer import ComposerGPT, GrapeAlgorithm
    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    mixer = WeightedStreamingMixer([DomainStream(d, local=f"{data}/{d}", split="train") for d in ("d0", "d1")],
                                   batch_size=4, seed=0)
    model = ComposerGPT(gpt(torch.float32, seed=0, vocab_size=VOCAB, seq_len=SEQ).train())
    algo = GrapeAlgorithm(tasks=[{"name": "t0", "local": f"{data}/tasks/t0"}], alpha_every=2, z_every=2,
                          probe_task_batch=4, alignment_steps=2, **options)
    parallel = ParallelismConfig(fsdp=FSDPConfig(use_orig_params=True)) if sharded else None
    loader = mixer.dataloader()
    state = State(model=model, rank_zero_seed=0, run_name="steps", device=DeviceCPU(), max_duration="4ba",
                  train_dataloader=loader, parallelism_config=parallel)
    logger = Logger(state, [])
    block = type(model.model.blocks[0])
    model.model = FullyShardedDataParallel(model.model, auto_wrap_policy=ModuleWrapPolicy({block}),
                                           use_orig_params=True, device_id=torch.device("cpu")) if sharded else \
        DistributedDataParallel(model.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    state.optimizers = [opt]
    algo.apply(Event.FIT_START, state, logger)
    batches = iter(loader)
    for step in range(3):
        state.batch = next(batches)
        algo.apply(Event.AFTER_DATALOADER, state, logger)
        algo.apply(Event.BEFORE_FORWARD, state, logger)
        model.loss(model(state.batch), state.batch).backward()
        algo.apply(Event.AFTER_BACKWARD, state, logger)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state.timestamp = state.timestamp.copy(batch=Time(step + 1, "ba"))
        algo.apply(Event.BATCH_END, state, logger)
    history = [{k: rec.get(k) for k in ("step", "alpha", "z", "domain_alignment", "domain_gram")}
               for rec in algo.controller.history]
    mixer.close()
    return {"history": history}


STEP_METHODS = {"steps": {"alignments": "steps"}, "rnb": {"method": "rnb"}}


def _algorithm_worker(rank: int, world: int, tmp: str, data: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous-algo", rank=rank, world_size=world)
    try:
        out = {"plain": _algorithm_run(f"{data}/plain", sharded=False)}
        dist.barrier()
        out["fsdp"] = _algorithm_run(f"{data}/fsdp", sharded=True)  # the same data, its own streaming dirs
        for name, options in STEP_METHODS.items():
            for sharded in (False, True):
                dist.barrier()
                out[(name, sharded)] = _steps_run(f"{data}/{name}-{sharded}", sharded, options)
        torch.save(out, os.path.join(tmp, f"algo-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_grape_algorithm_under_fsdp_matches_the_unsharded_run(tmp_path: Path) -> None:
    from _grape_data import write_dataset

    data = str(tmp_path / "data")
    for copy in ("plain", "fsdp") + tuple(f"{m}-{s}" for m in STEP_METHODS for s in (False, True)):
        write_dataset(f"{data}/{copy}", domains=2, tasks=(1,), n_domain=64, n_val=16, n_test=8)
    spawn(_algorithm_worker, args=(2, str(tmp_path), data), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"algo-rank{r}.pt", weights_only=False) for r in (0, 1))
    for got in (r0, r1):
        for key in ("alignment", "task_loss", "alpha", "z"):
            np_plain, np_fsdp = (torch.as_tensor(got[m][key], dtype=torch.float64) for m in ("plain", "fsdp"))
            torch.testing.assert_close(np_fsdp, np_plain, rtol=1e-5, atol=1e-7)
    assert r0["fsdp"]["alpha"] == r1["fsdp"]["alpha"]  # identical weights on both ranks
    assert float(torch.as_tensor(r0["fsdp"]["alignment"]).abs().sum()) > 0  # a probe happened

    # the training steps' own numbers under Composer's FSDP1: as under DDP (float32: to rounding)
    for name in STEP_METHODS:
        for got in (r0, r1):
            plain, fsdp = got[(name, False)]["history"], got[(name, True)]["history"]
            assert [r["step"] for r in fsdp] == [r["step"] for r in plain] and len(fsdp) >= 2, name
            key = "domain_gram" if name == "rnb" else "domain_alignment"
            for a, b in zip(plain, fsdp):
                for k in ("alpha", "z", key):
                    if a[k] is None:
                        assert b[k] is None, (name, k)
                        continue
                    torch.testing.assert_close(torch.as_tensor(b[k], dtype=torch.float64),
                                               torch.as_tensor(a[k], dtype=torch.float64), rtol=1e-4, atol=1e-6)
            assert fsdp[-1]["alpha"] != fsdp[0]["alpha"], name  # the weights moved
        assert r0[(name, True)]["history"] == r1[(name, True)]["history"], name
