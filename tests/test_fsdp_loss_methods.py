"""The loss-driven methods (ODM, ADO, DoReMi) on a sharded model, for real: two gloo processes train a float64 GPT
sharded with FSDP2 (``fully_shard``) and with FSDP1 (``use_orig_params``), on the mixer's real MDS batches, two
micro-batches a step. Each update's per-domain losses (and DoReMi's excess losses, its reference sharded like the
training model: grape.sharded_reference) equal those of an unsharded single-process model holding the same
weights, sample by sample (rtol 1e-10), and alpha equals a single-process reweighter fed those numbers. The
reference swap leaves the training weights bit-identical. The HF Trainer's FSDP cannot run on CPU (accelerate
1.15 turns FSDP on only for GPU-type distributed setups), so ODM also runs through GrapeTrainer.compute_loss and
the GrapeTrainerCallback's events on an HF Llama sharded here with FSDP2 (and GRAPE's layer-by-layer probe runs
there, both ranks agreeing). R&B (the in-step engine) runs through GrapeTrainer.training_step on the Llama
sharded with FSDP1 and with FSDP2, on the same batches: both give the same Gram and weights (float64, rtol 1e-10;
tests/test_instep_fsdp.py checks the engine against the unsharded computation); FSDP1's HYBRID_SHARD is refused
in one line. One process group runs every case."""

from __future__ import annotations

import json
import os
import traceback

import numpy as np
import pytest
import torch

from _grape_data import SHORT_RUN, write_dataset
from _parallel import spawn
from test_loss_mode import DOMAINS, _model

WORLD = 2
METHODS = ("odm", "ado", "doremi")
KINDS = ("fsdp2", "fsdp1")
STEPS, EVERY = 4, 2


def shard(model: torch.nn.Module, kind: str, world: int) -> torch.nn.Module:
    """FSDP2 on each block and the root, or FSDP1 wrapping each block (use_orig_params, full shard), on CPU."""
    block = type(model.blocks[0])
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block}), use_orig_params=True,
                                        device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unsharded_copy(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A plain float64 model holding the sharded model's full current weights (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = _model(seed).double()
    plain.load_state_dict(full)
    return plain.eval()


def _sample_truth(model: torch.nn.Module, ref: torch.nn.Module | None, micro: dict) -> list[list[float]]:
    """(domain, mean token loss, excess sum, tokens) of each sample, from plain logits (an independent formula)."""
    tokens = micro["tokens"].long()
    with torch.no_grad():
        lp = torch.log_softmax(model(tokens[:, :-1]).double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        lr = None if ref is None else torch.log_softmax(ref(tokens[:, :-1]).double(), -1).gather(
            -1, tokens[:, 1:, None])[..., 0]
    rows = []
    for i in range(tokens.shape[0]):
        excess = 0.0 if lr is None else float((lr[i] - lp[i]).clamp_min(0).sum())
        rows.append([int(micro["domain"][i]), float(-lp[i].mean()), excess, float(tokens.shape[1] - 1)])
    return rows


def _run_case(kind: str, method: str, mixer, loader, reference: str, world: int) -> dict:
    from grape_stream import GrapeController
    from grape_stream.grape.gram.batches import map_tensors
    from grape_stream.models import per_sample_lm_loss

    model = shard(_model(0).double(), kind, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    short = SHORT_RUN.get(method, {})
    options = {**short.get("options", {}), **({"reference": reference} if method == "doremi" else {})}
    ctl = GrapeController(mixer, [], method=method, alpha_every=EVERY, options=options)
    ctl.start()
    ref = None
    if method == "doremi":
        ref = _model(5).double().eval()
        ref.load_state_dict(torch.load(reference))
    truth, swap_exact = [], True
    for step in range(1, STEPS + 1):
        batch = next(loader)
        for half in (slice(0, 1), slice(1, 4)):
            micro = map_tensors(batch, lambda t, h=half: t[h])
            plain = unsharded_copy(model, 0)
            truth.append([step, _sample_truth(plain, ref, micro)])
            with ctl.observe(model, step, micro):
                (per_sample_lm_loss(model, micro).mean() * (micro["tokens"].shape[0] / 4)).backward()
            if ref is not None:  # the swap put the training weights back, bit for bit
                after = unsharded_copy(model, 0)
                swap_exact &= all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                                    after.state_dict().values()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        ctl.maybe_update(model, step, lr=0.5)
    return {"truth": truth, "history": ctl.history, "swap_exact": swap_exact, "options": options}


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from _grape_data import SEQ, VOCAB

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=SEQ)).double()


def _hf_truth(model: torch.nn.Module, inputs: dict) -> list[list[float]]:
    """(domain, mean loss over the counted labels, 0, counted) of each sample, from an unsharded Llama's logits."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    plain = _llama().eval()
    plain.load_state_dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    with torch.no_grad():
        lp = torch.log_softmax(plain(input_ids=inputs["input_ids"]).logits.double()[:, :-1], -1)
    labels = inputs["labels"][:, 1:]
    mask = labels != -100
    token = -lp.gather(-1, labels.clamp_min(0)[..., None])[..., 0] * mask
    domains = inputs["grape_batch"]["domain"]
    return [[int(domains[i]), float(token[i].sum() / mask[i].sum()), 0.0, float(mask[i].sum())]
            for i in range(labels.shape[0])]


def _hf_case(mixer, out: str, world: int, method: str = "odm", data: str = "", kind: str = "fsdp2") -> dict:
    """ODM, GRAPE's probe or R&B through GrapeTrainer's step and loss and GrapeTrainerCallback's events, the Llama
    sharded with FSDP2 (or FSDP1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import TrainerControl, TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainer, GrapeTrainerCallback

    model = _llama()
    if kind == "fsdp1":
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                                         use_orig_params=True, device_id=torch.device("cpu"))
    else:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    args = TrainingArguments(output_dir=f"{out}/hf", max_steps=STEPS, report_to=[], use_cpu=True, save_strategy="no")
    from grape_stream import TaskStream

    grape = dict(tasks=[TaskStream("t0", local=f"{data}/tasks/t0")], z_every=EVERY, probe_domain_batch=2,
                 probe_task_batch=2, mu_alpha=1e-3, mu_z=1e-3) if method == "grape" else {}
    callback = GrapeTrainerCallback(method=method, alpha_every=EVERY, plots=False, trajectory=False, summary=False,
                                    **grape)
    trainer = GrapeTrainer(model=model, args=args, mixer=mixer, callbacks=[callback])
    callback.bind(trainer)
    trainer.current_gradient_accumulation_steps = 1  # (the Trainer's train loop sets it)
    state, control = trainer.state, TrainerControl()
    loader = trainer.get_train_dataloader()
    callback.on_train_begin(args, state, control, model=model, train_dataloader=loader)  # refused FSDP before
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batches, truth = iter(loader), []
    for step in range(1, STEPS + 1):
        inputs = next(batches)
        if method == "odm":  # (a probe method's loader carries no mixer batch)
            truth.append([step, _hf_truth(model, inputs)])
        if method == "rnb":  # the Trainer's step: the observed step's forward and backward inside the engine
            trainer.training_step(model, dict(inputs))
        else:
            trainer.compute_loss(model, dict(inputs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state.global_step = step
        callback.on_step_end(args, state, control, model=model, optimizer=opt)
    return {"truth": truth, "history": callback.controller.history, "swap_exact": True, "options": {}}


def _step_gram_refusal(mixer) -> str:
    """R&B (the in-step engine) at the callbacks' train begin (GrapeLoop.check_model): FSDP2 and FSDP1 models are
    taken (tests/test_instep_fsdp.py checks them exactly), FSDP1's HYBRID_SHARD is refused in one line."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from grape_stream.errors import ConfigError
    from grape_stream.integrations.grape_loop import GrapeLoop

    loop = GrapeLoop(method="rnb", alpha_every=EVERY, trajectory=False)
    loop.attach(mixer)
    loop.check_model(shard(_model(0), "fsdp2", WORLD))
    loop.check_model(shard(_model(0), "fsdp1", WORLD))
    model = _model(0)
    hybrid = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}),
                                      use_orig_params=True, device_id=torch.device("cpu"),
                                      sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(ConfigError) as err:
        loop.check_model(hybrid)
    return str(err.value)


def _worker(rank: int, cfg: dict) -> None:
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(WORLD)})
    torch.set_num_threads(1)
    out: dict = {"rank": rank, "cases": {}}
    try:
        from grape_stream import DomainStream, WeightedStreamingMixer

        dist.init_process_group("gloo", init_method=f"file://{cfg['out']}/rendezvous", rank=rank, world_size=WORLD)
        data = cfg["data"]
        mixer = WeightedStreamingMixer([DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                       batch_size=4, seed=0)
        if rank == 0:
            torch.save(_model(5).double().state_dict(), cfg["reference"])
        dist.barrier()
        loader = iter(mixer.dataloader(num_workers=0))
        for kind in KINDS:
            for method in METHODS:
                out["cases"][f"{kind}/{method}"] = _run_case(kind, method, mixer, loader, cfg["reference"], WORLD)
        out["cases"]["hf/odm"] = _hf_case(mixer, cfg["out"], WORLD)
        out["hf_grape"] = _hf_case(mixer, cfg["out"], WORLD, "grape", data)["history"]
        for kind in KINDS:  # R&B: a fresh stream on its own copy of the data for each, the same batches
            fresh = WeightedStreamingMixer([DomainStream(d, local=f"{data}-rnb-{kind}/{d}", split="train")
                                            for d in DOMAINS], batch_size=4, seed=0)
            out[f"hf_rnb_{kind}"] = _hf_case(fresh, cfg["out"], WORLD, "rnb", kind=kind)["history"]
            fresh.close()
        out["refusal"] = _step_gram_refusal(mixer)
        mixer.close()
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def _expected(case_ranks: list[dict], method: str, options: dict) -> list[dict]:
    """Each update's per-domain means from every sample's truth, and the alpha a single-process reweighter gives."""
    from grape_stream.grape.reweighting import DomainLosses, build_reweighter

    rw = build_reweighter(method, num_domains=3, num_tasks=1, **{k: v for k, v in options.items()})
    out = []
    for step in range(EVERY, STEPS + 1, EVERY):
        rows = [row for r in case_ranks for s, micro in r["truth"] if step - EVERY < s <= step for row in micro]
        d = np.array([row[0] for row in rows])
        loss = np.array([np.mean([row[1] for row in rows if row[0] == k]) if (d == k).any() else np.nan
                         for k in range(3)])
        samples = np.array([(d == k).sum() for k in range(3)], dtype=np.float64)
        excess = None
        if method == "doremi":
            excess = np.array([sum(row[2] for row in rows if row[0] == k) / sum(row[3] for row in rows if row[0] == k)
                               if (d == k).any() else np.nan for k in range(3)])
        alpha, _ = rw.update_from_losses(DomainLosses(loss=loss, samples=samples, steps=EVERY, excess=excess),
                                         0.5, step=step)
        out.append({"step": step, "loss": loss, "excess": excess, "alpha": alpha, "samples": samples})
    return out


@pytest.mark.timeout(600)
def test_loss_driven_methods_on_fsdp_equal_the_unsharded_computation(tmp_path) -> None:
    data = str(tmp_path / "data")
    for copy in ("", "-rnb-fsdp1", "-rnb-fsdp2"):
        write_dataset(data + copy, domains=3, tasks=(0,), n_domain=160, n_val=16, n_test=8)
    cfg = {"data": data, "out": str(tmp_path), "reference": str(tmp_path / "ref.pt")}
    spawn(_worker, args=(cfg,), nprocs=WORLD)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]
    for r in ranks:
        assert "error" not in r, r["error"]
    for case in [f"{k}/{m}" for k in KINDS for m in METHODS] + ["hf/odm"]:
        method = case.split("/")[1]
        per_rank = [r["cases"][case] for r in ranks]
        history = [rec for rec in per_rank[0]["history"] if not rec.get("initial")]
        assert [rec["alpha"] for rec in history] == [rec["alpha"] for rec in per_rank[1]["history"]
                                                     if not rec.get("initial")], case
        expected = _expected(per_rank, method, per_rank[0]["options"])
        assert [rec["step"] for rec in history] == [e["step"] for e in expected], case
        for rec, exp in zip(history, expected):
            assert rec["domain_samples"] == exp["samples"].tolist(), case
            np.testing.assert_allclose(np.array(rec["domain_loss"], dtype=float), exp["loss"], rtol=1e-10,
                                       err_msg=case)
            if exp["excess"] is not None:
                assert max(rec["domain_excess"]) > 0, case  # the reference differs from the proxy
                np.testing.assert_allclose(np.array(rec["domain_excess"], dtype=float), exp["excess"], rtol=1e-10,
                                           err_msg=case)
            np.testing.assert_allclose(rec["alpha"], exp["alpha"], rtol=1e-10, err_msg=case)
        assert all(r["swap_exact"] for r in per_rank), case
    grape = [[{k: v for k, v in rec.items() if k != "seconds"} for rec in r["hf_grape"]] for r in ranks]
    assert grape[0] == grape[1] and [rec["step"] for rec in grape[0]] == [0, EVERY, 2 * EVERY]  # the probe ran
    assert all(len(rec["domain_alignment"]) == 3 for rec in grape[0][1:])
    assert grape[0][-1]["alpha"] != grape[0][0]["alpha"]
    # R&B through the HF Trainer's step under FSDP1 and FSDP2: the same Gram and weights, on both ranks
    rnb = {k: [[{f: rec.get(f) for f in ("step", "alpha", "domain_gram")} for rec in r[f"hf_rnb_{k}"]]
               for r in ranks] for k in KINDS}
    for k in KINDS:
        assert rnb[k][0] == rnb[k][1] and len(rnb[k][0]) >= 2, k
        assert rnb[k][0][-1]["alpha"] != rnb[k][0][0]["alpha"], k  # the weights moved
    for a, b in zip(rnb["fsdp1"][0], rnb["fsdp2"][0]):
        assert a["step"] == b["step"]
        np.testing.assert_allclose(a["alpha"], b["alpha"], rtol=1e-10)
        if a["domain_gram"] is not None:
            np.testing.assert_allclose(np.array(a["domain_gram"], dtype=float), np.array(b["domain_gram"], dtype=float),
                                       rtol=1e-10)
    msg = ranks[0]["refusal"]
    assert "\n" not in msg and "HYBRID_SHARD" in msg and "R&B's step Gram under FSDP1" in msg, msg
