"""The training-loss mode over two real gloo ranks (DDP, the mixer giving each rank its slice of every global
batch, two micro-batches per step): each update's per-domain sums are those of *all* samples trained on (checked
against losses computed separately per sample on each rank), and both ranks hold identical records and sums."""

from __future__ import annotations

import json
import os
import traceback

import pytest

from _grape_data import write_dataset
from _parallel import free_port, spawn
from test_loss_mode import DOMAINS, _model, _slow_truth

WORLD = 2



def _worker(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg["port"])})
    torch.set_num_threads(1)
    out: dict = {"rank": rank}
    try:
        from grape_stream import DomainStream, GrapeController, WeightedStreamingMixer
        from grape_stream.grape.gram.batches import map_tensors
        from grape_stream.models import per_sample_lm_loss

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        data = cfg["data"]
        mixer = WeightedStreamingMixer([DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                       batch_size=8, seed=0)
        ref = _model(5)
        torch.save(ref.state_dict(), cfg["reference"]) if rank == 0 else None
        dist.barrier()
        ref.load_state_dict(torch.load(cfg["reference"]))
        ref.eval()
        model = DistributedDataParallel(_model(0))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ctl = GrapeController(mixer, [], method="doremi", alpha_every=2, options={"reference": cfg["reference"]})
        ctl.start()
        loader = iter(mixer.dataloader(num_workers=0))
        truth = []
        for step in range(1, 5):
            batch = next(loader)
            for i, half in enumerate((slice(0, 3), slice(3, 8))):
                micro = map_tensors(batch, lambda t, h=half: t[h])
                truth.append([step, _slow_truth(model.module, ref, micro)])
                sync = model.no_sync() if i == 0 else torch.enable_grad()
                with sync, ctl.observe(model, step, micro):
                    (per_sample_lm_loss(model, micro).mean() * (micro["tokens"].shape[0] / 8)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ctl.maybe_update(model, step, lr=0.05)
            if step == 3:  # mid-interval: the checkpointed sums hold step 3 of both ranks
                out["state"] = ctl.state_dict()["training_losses"]["totals"].tolist()
        out.update(truth=truth, history=ctl.history)
        mixer.close()
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_ranks_sum_every_sample_and_agree(tmp_path) -> None:
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0,), n_domain=160, n_val=16, n_test=8)
    cfg = {"data": data, "out": str(tmp_path), "port": free_port(), "reference": str(tmp_path / "ref.pt")}
    spawn(_worker, args=(cfg,), nprocs=WORLD)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]
    for r in ranks:
        assert "error" not in r, r["error"]
    def untimed(history: list) -> list:
        return [{k: v for k, v in rec.items() if k != "seconds"} for rec in history]

    assert untimed(ranks[0]["history"]) == untimed(ranks[1]["history"]) and ranks[0]["state"] == ranks[1]["state"]
    assert sum(ranks[0]["state"][1]) == 16  # step 3's samples of both ranks
    updates = [r for r in ranks[0]["history"] if not r.get("initial")]
    assert [r["step"] for r in updates] == [2, 4]
    for rec in updates:
        rows = [row for r in ranks for step, micro in r["truth"] if rec["step"] - 2 < step <= rec["step"]
                for row in micro]
        assert sum(rec["domain_samples"]) == 2 * 16 == len(rows)
        for k in range(3):
            mine = [row for row in rows if row[0] == k]
            assert rec["domain_samples"][k] == len(mine)
            assert rec["domain_loss"][k] == pytest.approx(sum(m[1] for m in mine) / len(mine), rel=1e-5)
            assert rec["domain_excess"][k] == pytest.approx(sum(m[2] for m in mine) / sum(m[3] for m in mine),
                                                            rel=1e-4, abs=1e-6)
