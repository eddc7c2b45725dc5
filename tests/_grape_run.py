"""Subprocess entry for the Composer tests: train a recipe (JSON file), optionally SIGKILL itself.

    python tests/_grape_run.py RECIPE.json [--kill-at STEP] [--dump DIR]

``--kill-at`` sends SIGKILL to this process at BATCH_END of that step (after the checkpoint of an earlier
step exists): nothing is flushed or closed, exactly like an OOM kill or a preempted node.
``--dump`` writes, per rank, what that rank saw: the mixer's weight schedule, the controller's alpha
history and the first batch's sample ids (``DIR/rank<r>.json``). Launched by ``composer -n 2`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("recipe")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--dump", default=None)
    args = p.parse_args()

    from composer.core import Callback

    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    with open(args.recipe, encoding="utf-8") as f:
        cfg = load_recipe(json.load(f))

    seen: dict = {"first_batch": None, "batches": []}

    class Probe(Callback):
        def after_dataloader(self, state, logger):
            b = state.batch
            ids = [int(x) for x in b["sample_index"]]
            doms = [int(x) for x in b["domain"]]
            seen["batches"].append({"step": int(state.timestamp.batch), "domain": doms, "sample_index": ids,
                                    "weights_version": [int(x) for x in b["weights_version"]]})

        def batch_end(self, state, logger):
            if args.kill_at is not None and int(state.timestamp.batch) == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    built = build(cfg, extra_callbacks=[Probe()])
    built.trainer.fit()
    if args.dump:
        from composer.utils import dist

        os.makedirs(args.dump, exist_ok=True)
        ctl = built.algorithm.controller
        out = {
            "rank": dist.get_global_rank(),
            "world_size": dist.get_world_size(),
            "schedule": built.mixer.weight_history,
            "history": [{"step": r["step"], "alpha": r["alpha"], "z": r.get("z")} for r in ctl.history],
            "batches": seen["batches"],
        }
        with open(os.path.join(args.dump, f"rank{out['rank']}.json"), "w", encoding="utf-8") as f:
            json.dump(out, f)
    built.close()


if __name__ == "__main__":
    main()
