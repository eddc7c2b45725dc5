"""Two ranks (torch.distributed gloo, spawned processes) x two DataLoader workers each."""

from __future__ import annotations

import json
import os
import shutil
import traceback
from collections import defaultdict

import pytest
import torch.multiprocessing as mp

from _mds_fixtures import write_domains
from _parallel import free_port

B = 8
SIZES = [96, 64, 48]
WORLD = 2



def _rank_main(rank: int, cfg: dict) -> None:
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg["port"])})
    out: dict = {"rank": rank}
    try:
        from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        # 1) A rank whose `local` differs from the others' is named before streaming hangs or fails obscurely.
        bad = [DomainStream(f"d{k}", local=(cfg["copy"] if rank == 1 and k == 0 else d))
               for k, d in enumerate(cfg["dirs"])]
        try:
            WeightedStreamingMixer(bad, batch_size=B)
            out["mismatch_error"] = None
        except ValueError as exc:
            out["mismatch_error"] = str(exc)
        # 2) The real run.
        doms = [DomainStream(f"d{k}", local=d) for k, d in enumerate(cfg["dirs"])]
        with WeightedStreamingMixer(doms, weights=[0.5, 0.3, 0.2], batch_size=B, seed=17) as mixer:
            # Ranks started by torch.multiprocessing.spawn default to spawning their DataLoader workers too
            # (seconds per worker); torchrun-launched ranks fork them, as here.
            loader = mixer.dataloader(num_workers=2, multiprocessing_context="fork", batches_per_message=2)
            samples, versions = [], []
            for batch in loader:
                i = int(batch["batch_index"][0])
                samples += list(zip(batch["domain"].tolist(), batch["sample_index"].tolist(),
                                    batch["epoch"].tolist()))
                versions.append(int(batch["weights_version"][0]))
                if i + 1 == 10:
                    mixer.set_weights([0.2, 0.3, 0.5])  # the controller calls this on every rank alike
                if i + 1 == cfg["batches"]:
                    break
            out.update(samples=samples, versions=versions, state=mixer.state_dict(), stats=mixer.stats())
        dist.barrier()
    except BaseException:  # report to the parent instead of a bare non-zero exit
        out["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_ranks_two_workers_draw_disjoint_samples(tmp_path):
    dirs = write_domains(tmp_path / "mds", SIZES, samples_per_shard=16)
    copy = str(tmp_path / "copy_d0")
    shutil.copytree(dirs[0], copy)
    cfg = {"dirs": dirs, "copy": copy, "port": free_port(), "out": str(tmp_path), "batches": 40}
    mp.spawn(_rank_main, args=(cfg,), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["mismatch_error"] and "different local directories" in r["mismatch_error"]
        # lag = (2 workers x prefetch 1 + 1) x 2 batches a message - 1 = 5, on every rank
        assert r["versions"] == [0] * 15 + [1] * 25
    # Both ranks wrote the same rank-independent state (what a checkpoint from rank 0 holds).
    assert results[0]["state"] == results[1]["state"]
    assert results[0]["state"]["num_samples"] == 40 * B * WORLD
    seen: dict[tuple[int, int], dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        for d, i, e in r["samples"]:
            seen[(d, e)][r["rank"]].append(i)
    full_epochs = 0
    for (d, _e), per_rank in seen.items():
        a, b = per_rank.get(0, []), per_rank.get(1, [])
        assert len(set(a)) == len(a) and len(set(b)) == len(b)  # no repeat within a rank's epoch
        assert not set(a) & set(b)  # ranks never share a sample within an epoch
        if len(a) + len(b) == SIZES[d]:
            assert sorted(a + b) == list(range(SIZES[d]))
            full_epochs += 1
    assert full_epochs >= 3
    # Each rank reads its own slice of every global batch; the stats are the global stream's, alike on both.
    assert results[0]["samples"][:B] != results[1]["samples"][:B]
    assert results[0]["stats"]["domains"] == results[1]["stats"]["domains"]
    for r in results:
        st = r["stats"]["domains"]
        drawn = sum(x["samples_drawn"] for x in st)
        assert drawn == 40 * B * WORLD
