"""One rank of a torch.distributed (gloo) job reading the mixer's global stream, run as a subprocess by
tests/test_mixer_elastic_dist.py (started per rank with RANK / WORLD_SIZE / MASTER_* in the environment).

    python _elastic_run.py CONFIG.json

CONFIG: dirs (local domains) or remotes + caches (or node_caches: one list of caches per node, node = RANK //
LOCAL_WORLD_SIZE), canonical_nodes and predownload (optional mixer settings), seed, global_batch_size,
workers, lag, changes ({global batches consumed: alpha}), until (global batches), every (checkpoint period),
state (path rank 0 writes the mixer state to after every rank finished that step), resume (a state path),
log (folder: one JSON line per loader batch per rank: global batch, rank, the rows' identities),
hold_after (sleep there until killed), kill_at (rank 0 SIGKILLs itself once it has logged that many global
batches: a warm launch, tests/_warm.py, then kills the other ranks as torchrun would).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mds_fixtures import identity  # noqa: E402


def main(cfg_path: str) -> int:
    import numpy as np
    import torch.distributed as dist

    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    cfg = json.loads(open(cfg_path).read())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    caches = cfg.get("caches")
    if cfg.get("node_caches"):
        caches = cfg["node_caches"][rank // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))]
    if cfg.get("remotes"):
        doms = [DomainStream(f"d{k}", remote=r, local=c) for k, (r, c) in enumerate(zip(cfg["remotes"], caches))]
    else:
        doms = [DomainStream(f"d{k}", local=d) for k, d in enumerate(cfg["dirs"])]
    g = cfg["global_batch_size"]
    extra = {k: cfg[k] for k in ("canonical_nodes", "predownload") if cfg.get(k) is not None}
    mixer = WeightedStreamingMixer(doms, batch_size=g // world, global_batch_size=g, seed=cfg["seed"], lag=cfg["lag"],
                                   retry_deadline=120, **extra)
    if cfg.get("resume"):
        mixer.load_state_dict(json.loads(open(cfg["resume"]).read()))
    changes = {int(k): v for k, v in cfg.get("changes", {}).items()}
    workers = cfg["workers"]
    loader = mixer.dataloader(num_workers=workers, **({"multiprocessing_context": "fork"} if workers else {}))
    with open(os.path.join(cfg["log"], f"rank{rank}.jsonl"), "a") as log:
        for batch in loader:
            rows = [[*identity({"tokens": t}), int(e), int(v)] for t, e, v in
                    zip(np.asarray(batch["tokens"]), batch["epoch"].tolist(), batch["weights_version"].tolist())]
            log.write(json.dumps({"batch": int(batch["batch_index"][0]), "rank": rank, "rows": rows}) + "\n")
            log.flush()
            consumed = mixer.consumed_batches  # micro-batches: 1 a global batch here
            if consumed in changes:
                mixer.set_weights(changes[consumed])  # a controller calls this on every rank alike
            if consumed % cfg["every"] == 0:
                state = mixer.state_dict()
                dist.barrier()  # every rank finished this step: the checkpoint a trainer would write
                if rank == 0:
                    tmp = cfg["state"] + ".tmp"
                    with open(tmp, "w") as f:
                        json.dump(state, f)
                    os.replace(tmp, cfg["state"])
            if consumed == cfg.get("kill_at") and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if consumed == cfg["until"]:
                break
            if consumed == cfg.get("hold_after"):  # bound how far a run gets before the test kills it
                time.sleep(3600)
    dist.barrier()
    mixer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
