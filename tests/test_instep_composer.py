"""alignments: steps in a real Composer Trainer (recipe -> build -> fit) on real MDS shards, with
micro-batches: the observed step's per-domain alignments equal explicit per-domain gradients of the same
batch at the same parameters; a run SIGKILLed after a checkpoint taken in the middle of an interval resumes
onto the uninterrupted trajectory (also with method rnb, whose checkpoint holds the open round's sums)."""

from __future__ import annotations

import copy

import pytest
import torch

from _grape_data import write_dataset
from _instep_helpers import truth
from test_composer import _losses, _run, _trajectory, tiny_recipe

STEPS = {"alignments": "steps", "alignment_steps": 2}  # with alpha_every 4: steps 2, 4, 6, 8, ... observed


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("instep_composer_data"))
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=160, n_val=24, n_test=16)
    return root


def test_observed_step_in_a_trainer_is_exact(data_dir, tmp_path) -> None:
    from composer.core import Callback

    from grape_stream.integrations.composer.trainer import build
    from grape_stream.models import per_sample_lm_loss
    from grape_stream.recipe import load_recipe

    cfg = load_recipe(tiny_recipe(data_dir, str(tmp_path), algorithm=STEPS, trainer={
        "max_duration": "8ba", "device_train_microbatch_size": 3, "eval_interval": "100ba", "precision": "fp32"}))
    seen: dict = {}

    class Capture(Callback):  # callbacks run after GrapeAlgorithm at each event
        def after_dataloader(self, state, logger):
            if int(state.timestamp.batch) == 1:  # step 2: the first observed step, not an update step
                seen["batch"] = {k: v.clone() for k, v in state.batch.items()}
                seen["model"] = copy.deepcopy(state.model.model).double()

        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 2:
                instep = built.algorithm.controller.signal
                seen["totals"] = {k: v.clone() for k, v in instep.totals.items()}
                seen["direction"] = instep.alignments.state_dict()["directions"]

    built = build(cfg, extra_callbacks=[Capture()])
    try:
        built.trainer.fit()
        history = built.algorithm.controller.history
    finally:
        built.close()
    batch = seen["batch"]
    assert torch.equal(batch["domain"], batch["domain"].sort().values)  # the observed batch was put in domain order
    model = seen["model"]
    direction = {p: seen["direction"][f"model.{n}"][0].double() for n, p in model.named_parameters()}
    want = truth(model, per_sample_lm_loss, {"tokens": batch["tokens"]}, batch["domain"], [direction], 3)[:, 0]
    got = seen["totals"]["sums"] / seen["totals"]["weights"]
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok], want[ok], rtol=2e-5, atol=1e-7)  # the trainer runs in float32
    updates = [r for r in history if not r.get("initial")]
    assert [r["step"] for r in updates] == [4, 8] and all(r["instep"]["observed_steps"] == 2 for r in updates)
    assert updates[-1]["alpha"] != history[0]["alpha"]


@pytest.mark.parametrize("algorithm", [STEPS, {"method": "rnb", "alignment_steps": 2}], ids=["steps", "rnb"])
def test_sigkill_mid_interval_then_autoresume_continues_the_same_trajectory(data_dir, tmp_path, algorithm) -> None:
    trainer = {"max_duration": "12ba", "save_interval": "6ba", "autoresume": True, "eval_interval": "100ba",
               "save_folder": str(tmp_path / "{run_name}" / "ckpt")}
    base = tiny_recipe(data_dir, str(tmp_path), trainer=trainer, algorithm=algorithm)
    straight, resumed = dict(base, run_name="straight"), dict(base, run_name="resumed")
    _run(straight, str(tmp_path / "straight.json"))
    killed = _run(resumed, str(tmp_path / "resumed.json"), "--kill-at", "7", check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    _run(resumed, str(tmp_path / "resumed.json"))  # from the step-6 checkpoint: one observed step of 5..8 in it
    a = _losses(str(tmp_path / "straight" / "metrics.jsonl"))
    b = _losses(str(tmp_path / "resumed" / "metrics.jsonl"))
    assert sorted(a) == list(range(12)) and [a[s] for s in sorted(a)] == [b[s] for s in sorted(a)]
    ta = _trajectory(str(tmp_path / "straight" / "grape_trajectory.jsonl"))
    tb = _trajectory(str(tmp_path / "resumed" / "grape_trajectory.jsonl"))
    assert [r[0] for r in ta] == [0, 4, 8, 12] and ta == tb
