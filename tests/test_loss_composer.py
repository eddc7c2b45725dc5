"""Loss-driven methods in a real Composer Trainer (recipe -> build -> fit) on real MDS shards, the reference a
Composer checkpoint of a short uniform run: the per-domain sums over micro-batches equal losses computed
separately per sample, every registered loss-driven method trains from a recipe, and a run SIGKILLed in the
middle of an interval autoresumes onto the uninterrupted trajectory."""

from __future__ import annotations

import copy
import glob
import os

import numpy as np
import pytest
import torch

from _grape_data import SHORT_RUN, write_dataset
from grape_stream.config.choices import Signal
from grape_stream.grape.reweighting import REWEIGHTERS
from test_composer import _run, _trajectory, tiny_recipe
from test_loss_mode import _slow_doremi, _slow_truth

LOSS_METHODS = [m for m, c in REWEIGHTERS.items() if c.signal is Signal.training_losses]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("loss_composer_data"))
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=160, n_val=24, n_test=16)
    return root


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> str:
    """The Composer checkpoint of a 4-step uniform run."""
    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    out = str(tmp_path_factory.mktemp("reference_run"))
    cfg = load_recipe(tiny_recipe(data_dir, out, run_name="ref", algorithm={"method": "uniform"}, trainer={
        "max_duration": "4ba", "save_interval": "4ba", "save_folder": os.path.join(out, "ckpt"),
        "eval_interval": "100ba"}))
    built = build(cfg)
    try:
        built.trainer.fit()
    finally:
        built.close()
    (path,) = [p for p in glob.glob(os.path.join(out, "ckpt", "*.pt")) if "ba4" in os.path.basename(p)
               and not os.path.islink(p)]
    return path


def _options(method: str, reference: str) -> dict:
    return {**SHORT_RUN.get(method, {}).get("options", {}),
            **({"reference": reference} if REWEIGHTERS[method].needs_reference else {})}


def test_micro_batch_sums_in_a_trainer_are_exact(data_dir, reference, tmp_path) -> None:
    from composer.core import Callback

    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    algorithm = {"method": "doremi", "alpha_every": 2, "options": {"reference": reference, "eta": 2.0}}
    cfg = load_recipe(tiny_recipe(data_dir, str(tmp_path), algorithm=algorithm, trainer={
        "max_duration": "4ba", "device_train_microbatch_size": 3, "eval_interval": "100ba", "precision": "fp32"}))
    seen: list = []

    class Capture(Callback):
        def after_dataloader(self, state, logger):
            seen.append((int(state.timestamp.batch) + 1, {k: v.clone() for k, v in state.batch.items()},
                         copy.deepcopy(state.model.model)))

    built = build(cfg, extra_callbacks=[Capture()])
    try:
        built.trainer.fit()
        history = built.algorithm.controller.history
    finally:
        built.close()
    saved = torch.load(reference, map_location="cpu", weights_only=False)["state"]["model"]
    ref = copy.deepcopy(seen[0][2])  # the architecture; the weights are the checkpoint's
    ref.load_state_dict({k.removeprefix("model."): v for k, v in saved.items()})
    ref.eval()
    updates = [r for r in history if not r.get("initial")]
    assert [r["step"] for r in updates] == [2, 4]
    alpha = [1 / 3] * 3
    for rec in updates:
        rows = [row for step, batch, model in seen if rec["step"] - 2 < step <= rec["step"]
                for row in _slow_truth(model.eval(), ref, batch)]
        excess = []
        for k in range(3):
            mine = [r for r in rows if r[0] == k]
            assert rec["domain_samples"][k] == len(mine)
            assert rec["domain_loss"][k] == pytest.approx(sum(r[1] for r in mine) / len(mine), rel=2e-5)
            excess.append(sum(r[2] for r in mine) / sum(r[3] for r in mine))
            assert rec["domain_excess"][k] == pytest.approx(excess[-1], rel=1e-4, abs=1e-6)
        alpha = _slow_doremi(alpha, excess, 2.0, 1e-3)
        np.testing.assert_allclose(rec["alpha"], alpha, rtol=1e-4)


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_every_loss_driven_method_trains_from_a_recipe(data_dir, reference, tmp_path, method) -> None:
    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    cfg = load_recipe(tiny_recipe(data_dir, str(tmp_path), algorithm={
        "method": method, "alpha_every": 2, "options": _options(method, reference)},
        trainer={"max_duration": "6ba", "eval_interval": "100ba"}))
    built = build(cfg)
    try:
        built.trainer.fit()
        history = built.algorithm.controller.history
        schedule = built.mixer.weight_history
    finally:
        built.close()
    updates = [r for r in history if not r.get("initial")]
    assert [r["step"] for r in updates] == [2, 4, 6] and not any(r.get("skipped") for r in updates)
    assert updates[-1]["alpha"] != history[0]["alpha"]
    assert len(schedule) >= 2  # the new weights reached the mixer
    assert all(sum(r["domain_samples"]) == 16 for r in updates)  # 2 steps x 8 samples


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_sigkill_mid_interval_then_autoresume_continues_the_same_trajectory(data_dir, reference, tmp_path,
                                                                           method) -> None:
    every = SHORT_RUN.get(method, {}).get("alpha_every", 4)
    trainer = {"max_duration": "12ba", "save_interval": "6ba", "autoresume": True, "eval_interval": "100ba",
               "save_folder": str(tmp_path / "{run_name}" / "ckpt")}
    base = tiny_recipe(data_dir, str(tmp_path), trainer=trainer,
                       algorithm={"method": method, "alpha_every": every, "options": _options(method, reference)})
    straight, resumed = dict(base, run_name="straight"), dict(base, run_name="resumed")
    _run(straight, str(tmp_path / "straight.json"))
    killed = _run(resumed, str(tmp_path / "resumed.json"), "--kill-at", "7", check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    _run(resumed, str(tmp_path / "resumed.json"))  # from the step-6 checkpoint: mid-interval (every 4) or at its start
    ta = _trajectory(str(tmp_path / "straight" / "grape_trajectory.jsonl"))
    tb = _trajectory(str(tmp_path / "resumed" / "grape_trajectory.jsonl"))
    assert [r[0] for r in ta] == list(range(0, 13, every)) and ta == tb
    assert ta[-1][1] != ta[0][1]
