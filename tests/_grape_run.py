"""Subprocess entry for the Composer tests: train a recipe (JSON file), optionally SIGKILL itself.

    python tests/_grape_run.py RECIPE.json [--kill-at STEP] [--kill-during-save MODE [--kill-save-batch B]]
                                           [--dump DIR]

``--kill-at`` sends SIGKILL to this process at BATCH_END of that step (after the checkpoint of an earlier
step exists): nothing is flushed or closed, exactly like an OOM kill or a preempted node.
``--kill-during-save`` sends SIGKILL *inside* Composer's real save of the checkpoint of batch B (default
12), so the folder holds what a kill at that moment leaves: ``empty`` (the file is created, then killed
before torch.save writes a byte), ``partial`` (killed inside torch.save once half the archive's bytes are
written), ``unlinked`` (the file is complete, killed before ``latest`` is touched), ``nolink`` (killed after
Composer removed the old ``latest`` and before it made the new one).
``--dump`` writes, per rank, what that rank saw: the mixer's weight schedule, the controller's alpha
history and the first batch's sample ids (``DIR/rank<r>.json``). Launched by ``composer -n 2`` too.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


KILL_MODES = ("empty", "partial", "unlinked", "nolink")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # delivered before os.kill returns: nothing after it runs


class _DiesAfter(io.RawIOBase):
    """A file that writes its first `limit` bytes, flushes them to the OS, then SIGKILLs the process."""

    def __init__(self, f, limit: int):
        self.f, self.limit, self.written = f, limit, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = bytes(b)
        if self.written + len(b) >= self.limit:
            self.f.write(b[: self.limit - self.written])
            self.f.flush()  # in the page cache: a SIGKILL keeps it, as it keeps a real half-written save
            _die()
        self.f.write(b)
        self.written += len(b)
        return len(b)


def arm_kill_during_save(mode: str, at_batch: int) -> None:
    """Patch Composer's checkpoint writing (this process only) to SIGKILL itself during the save of `at_batch`."""
    import torch
    from composer.callbacks import checkpoint_saver
    from composer.utils import checkpoint

    def chosen(path: str) -> bool:
        m = re.search(r"-ba(\d+)-", os.path.basename(path))
        return m is not None and int(m.group(1)) == at_batch

    write_checkpoint_file = checkpoint._write_checkpoint_file

    def write(state_dict, filename: str) -> None:
        if not chosen(filename) or mode == "nolink":
            write_checkpoint_file(state_dict, filename)
            return
        if mode == "unlinked":
            write_checkpoint_file(state_dict, filename)
            _die()
        size = 0
        if mode == "partial":
            buf = io.BytesIO()
            torch.save(state_dict, buf)
            size = buf.tell()
        with open(filename, "wb") as f:  # what Composer 0.32.1 does: torch.save into the final name
            torch.save(state_dict, _DiesAfter(f, size // 2))

    checkpoint._write_checkpoint_file = write
    if mode == "nolink":
        symlink = checkpoint_saver.os.symlink

        def link(src, dst, *args, **kwargs):
            if chosen(str(src)):
                assert not os.path.lexists(dst)  # Composer removed the old `latest` just before
                _die()
            return symlink(src, dst, *args, **kwargs)

        checkpoint_saver.os.symlink = link


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("recipe")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-during-save", choices=KILL_MODES, default=None)
    p.add_argument("--kill-save-batch", type=int, default=12)
    p.add_argument("--dump", default=None)
    args = p.parse_args()
    if args.kill_during_save:
        arm_kill_during_save(args.kill_during_save, args.kill_save_batch)

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
