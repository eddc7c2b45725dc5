"""A training-loop stand-in run as a subprocess by the mixer tests (kill-and-resume, leak checks).

    python _mixer_run.py CONFIG.json

CONFIG: dirs, seed, batch_size, workers, batches, changes ({consumed: alpha}), log, state (path), every
(state_dict period), resume (optional state path), lag, batches_per_message; hold_after (sleep after that many
batches); caches (read ``dirs`` as remotes into these local caches); hold (construct the mixer, print its shm
prefixes, then sleep until killed). Writes one JSON line per batch to ``log`` (batch index, versions, sample
identities) and, every ``every`` batches, the mixer's state_dict to ``state`` atomically (what a checkpoint
callback does). Prints the shm prefixes first.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mds_fixtures import batch_identities  # noqa: E402


def main(cfg_path: str) -> int:
    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    cfg = json.loads(open(cfg_path).read())
    if cfg.get("caches"):
        doms = [DomainStream(f"d{k}", remote=d, local=c) for k, (d, c) in enumerate(zip(cfg["dirs"], cfg["caches"]))]
    else:
        doms = [DomainStream(f"d{k}", local=d) for k, d in enumerate(cfg["dirs"])]
    mixer = WeightedStreamingMixer(doms, batch_size=cfg["batch_size"], seed=cfg["seed"], lag=cfg.get("lag"))
    print(json.dumps({"prefixes": mixer.shm_prefixes, "pid": os.getpid()}), flush=True)
    if cfg.get("hold"):
        time.sleep(3600)
    if cfg.get("resume"):
        mixer.load_state_dict(json.loads(open(cfg["resume"]).read()))
    changes = {int(k): v for k, v in cfg.get("changes", {}).items()}
    loader = mixer.dataloader(num_workers=cfg["workers"], batches_per_message=cfg.get("batches_per_message"))
    with open(cfg.get("log") or os.devnull, "a") as log:
        for batch in loader:
            i = int(batch["batch_index"][0])
            log.write(json.dumps({"batch": i, "versions": sorted(set(batch["weights_version"].tolist())),
                                  "ids": batch_identities(batch)}) + "\n")
            log.flush()
            consumed = i + 1
            if consumed in changes:
                mixer.set_weights(changes[consumed])
            if cfg.get("state") and consumed % cfg["every"] == 0:
                tmp = cfg["state"] + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(mixer.state_dict(), f)
                os.replace(tmp, cfg["state"])
            if consumed >= cfg["batches"]:
                break
            if consumed == cfg.get("hold_after"):  # bound how far a run gets before the test kills it
                time.sleep(3600)
    mixer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
