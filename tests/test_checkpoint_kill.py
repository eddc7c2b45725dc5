"""A SIGKILL at any moment of a checkpoint save leaves a run that autoresumes onto the same trajectory.

The training subprocess (tests/_grape_run.py ``--kill-during-save``) really dies inside Composer's save of
the step-12 checkpoint, so the folder holds what a kill at that moment leaves; the same command is then
run again with autoresume. Composer 0.32.1 alone refuses that folder forever (``FileExistsError: ... may
conflict with a future checkpoint``); ``grape-stream train`` recovers it first
(grape_stream/integrations/composer/checkpoints.py). Fast unit tests of the recovery come first.
"""

from __future__ import annotations

import os

import pytest
import torch

from _grape_data import write_dataset
from grape_stream.integrations.composer.checkpoints import (
    DISCARDED_DIR,
    checkpoint_is_complete,
    recover_checkpoint_folder,
)
from test_composer import (  # the helpers of the SIGKILL-between-saves test
    _losses,
    _run,
    _trajectory,
    metric_rows,
    tiny_recipe,
)

NAME = "ep0-ba{}-rank{}.pt"
LATEST = "latest-rank0.pt"


def _save(folder, batch: int, rank: int = 0, *, cut: float | None = None) -> str:
    """A torch.save archive named like Composer's; `cut`: keep only that fraction of its bytes."""
    path = os.path.join(folder, NAME.format(batch, rank))
    torch.save({"state": {"batch": batch}, "w": torch.arange(2000.0)}, path)
    if cut is not None:
        with open(path, "r+b") as f:
            f.truncate(int(os.path.getsize(path) * cut))
    return path


def _link(folder, batch: int) -> None:
    os.symlink(NAME.format(batch, 0), os.path.join(folder, LATEST))


def _latest(folder) -> str | None:
    path = os.path.join(folder, LATEST)
    return os.readlink(path) if os.path.islink(path) else None


def _composer_would_refuse(folder, batch: int) -> bool:
    """Composer's own start-up check after autoresume loaded the checkpoint of `batch` (0: started fresh)."""
    from composer.core import Timestamp
    from composer.utils import ensure_folder_has_no_conflicting_files

    try:
        ensure_folder_has_no_conflicting_files(str(folder), "ep{epoch}-ba{batch}-rank{rank}.pt",
                                               Timestamp(epoch=0, batch=batch, sample=8 * batch))
    except FileExistsError:
        return True
    return False


@pytest.mark.parametrize("cut", [0.0, 0.5, 0.999])
def test_a_cut_off_checkpoint_is_moved_aside_and_latest_kept(tmp_path, cut):
    _save(tmp_path, 6)
    _link(tmp_path, 6)
    _save(tmp_path, 12, cut=cut)
    assert _composer_would_refuse(tmp_path, 6)
    rec = recover_checkpoint_folder(str(tmp_path), rank=0)
    assert rec.discarded == [NAME.format(12, 0)] and rec.latest == NAME.format(6, 0) and not rec.relinked
    assert _latest(tmp_path) == NAME.format(6, 0)
    kept = tmp_path / DISCARDED_DIR / NAME.format(12, 0)
    assert kept.exists() and not checkpoint_is_complete(str(kept))  # kept for a post-mortem, not deleted
    assert not _composer_would_refuse(tmp_path, 6)


@pytest.mark.parametrize("old_latest", [6, None])
def test_a_complete_but_unlinked_checkpoint_becomes_latest(tmp_path, old_latest):
    _save(tmp_path, 6)
    if old_latest is not None:  # killed before Composer touched `latest`, or between its remove and symlink
        _link(tmp_path, old_latest)
    _save(tmp_path, 12)
    rec = recover_checkpoint_folder(str(tmp_path), rank=0)
    assert rec.discarded == [] and rec.relinked and rec.latest == NAME.format(12, 0)
    assert _latest(tmp_path) == NAME.format(12, 0)
    assert torch.load(tmp_path / LATEST, weights_only=True)["state"]["batch"] == 12
    assert not _composer_would_refuse(tmp_path, 12)


def test_only_a_cut_off_checkpoint_means_a_fresh_start(tmp_path):
    _save(tmp_path, 6, cut=0.0)
    _link(tmp_path, 6)
    rec = recover_checkpoint_folder(str(tmp_path), rank=0)
    assert rec.discarded == [NAME.format(6, 0)] and rec.latest is None and rec.relinked
    assert not os.path.lexists(tmp_path / LATEST)  # no dangling `latest`: autoresume starts from scratch
    assert not _composer_would_refuse(tmp_path, 0)


def test_nothing_to_do_changes_nothing(tmp_path):
    assert recover_checkpoint_folder(str(tmp_path / "missing"), rank=0).latest is None
    for b in (6, 12):
        _save(tmp_path, b)
    _link(tmp_path, 12)
    cut_other_rank = _save(tmp_path, 18, rank=1, cut=0.5)  # another rank's file is that rank's business
    before = {p: os.lstat(tmp_path / p).st_mtime_ns for p in os.listdir(tmp_path)}
    rec = recover_checkpoint_folder(str(tmp_path), rank=0)
    assert rec.discarded == [] and not rec.relinked and rec.latest == NAME.format(12, 0)
    assert {p: os.lstat(tmp_path / p).st_mtime_ns for p in os.listdir(tmp_path)} == before
    assert os.path.exists(cut_other_rank) and not (tmp_path / DISCARDED_DIR).exists()


def test_recover_before_autoresume_formats_the_folder_and_leaves_remote_ones(tmp_path):
    from grape_stream.integrations.composer.trainer import recover_before_autoresume

    folder = tmp_path / "myrun" / "ckpt"
    folder.mkdir(parents=True)
    _save(folder, 6)
    _link(folder, 6)
    _save(folder, 12, cut=0.5)
    rec = recover_before_autoresume(str(tmp_path / "{run_name}" / "ckpt"), "myrun")
    assert rec is not None and rec.discarded == [NAME.format(12, 0)]
    assert recover_before_autoresume("s3://bucket/{run_name}/ckpt", "myrun") is None
    assert recover_before_autoresume(None, "myrun") is None


# ------------------------------------------------------------------------------------------------------
# A real kill inside Composer's save, then the same command again (autoresume)
# ------------------------------------------------------------------------------------------------------
KILL_AT = 12  # checkpoints at 6, 12, 16; the kill hits the save of 12


def _recipe(data_dir: str, out, run_name: str) -> dict:
    trainer = {"max_duration": "16ba", "save_interval": "6ba", "autoresume": True,
               "save_folder": str(out / "{run_name}" / "ckpt")}
    base = tiny_recipe(data_dir, str(out), trainer=trainer, algorithm={"alpha_every": 3, "z_every": 3})
    return dict(base, run_name=run_name)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("ckpt_kill_data"))
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=160, n_val=24, n_test=16)  # as tests/test_composer.py
    return root


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    _run(_recipe(data_dir, out, "straight"), str(out / "straight.json"))
    run = out / "straight"
    return (_losses(str(run / "metrics.jsonl")), _trajectory(str(run / "grape_trajectory.jsonl")),
            metric_rows(run / "metrics.jsonl"))


@pytest.mark.parametrize("mode", ["empty", "partial", "unlinked", "nolink"])
def test_sigkill_during_a_save_then_autoresume_continues_the_same_trajectory(data_dir, straight, tmp_path, mode):
    recipe, path = _recipe(data_dir, tmp_path, "killed"), str(tmp_path / "killed.json")
    ckpt = tmp_path / "killed" / "ckpt"
    cut = ckpt / NAME.format(KILL_AT, 0)

    killed = _run(recipe, path, "--kill-during-save", mode, "--kill-save-batch", str(KILL_AT), check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    # what the kill left on disk
    assert checkpoint_is_complete(str(ckpt / NAME.format(6, 0)))
    if mode == "empty":
        assert cut.stat().st_size == 0
    elif mode == "partial":
        assert cut.stat().st_size > 0 and not checkpoint_is_complete(str(cut))
    else:
        assert checkpoint_is_complete(str(cut))
    assert _latest(ckpt) == (None if mode == "nolink" else NAME.format(6, 0))
    assert _composer_would_refuse(ckpt, 0 if mode == "nolink" else 6)  # Composer alone: FileExistsError

    resumed = _run(recipe, path)
    assert "FileExistsError" not in resumed.stderr
    assert "recovered after a kill during a save" in resumed.stderr  # logged, with what was moved
    assert _latest(ckpt) == NAME.format(16, 0)
    discarded = sorted(os.listdir(ckpt / DISCARDED_DIR)) if (ckpt / DISCARDED_DIR).exists() else []
    assert discarded == ([NAME.format(KILL_AT, 0)] if mode in ("empty", "partial") else [])
    # a cut-off save resumes from step 6 (batches 6..11 run twice), a complete one from step 12; either
    # way metrics.jsonl logs each step once, as the straight run does
    losses, trajectory, rows = straight
    assert metric_rows(tmp_path / "killed" / "metrics.jsonl") == rows

    got = _losses(str(tmp_path / "killed" / "metrics.jsonl"))
    assert sorted(got) == sorted(losses) == list(range(16))
    assert [got[s] for s in sorted(got)] == [losses[s] for s in sorted(got)]  # bit-identical
    assert _trajectory(str(tmp_path / "killed" / "grape_trajectory.jsonl")) == trajectory
