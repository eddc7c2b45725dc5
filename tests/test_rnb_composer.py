"""Method rnb (R&B) from a recipe in a real Composer Trainer (recipe -> build -> fit) on real MDS shards, with
micro-batches: every observed step of a round is summed into the round's per-domain Gram, the mixture moves
at each update, and no probe runs (no target tasks are read)."""

from __future__ import annotations

import numpy as np
import pytest

from _grape_data import write_dataset
from grape_stream.config.choices import Signal
from test_composer import tiny_recipe


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("rnb_composer_data"))
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=160, n_val=24, n_test=16)
    return root


def test_rnb_trains_from_a_recipe(data_dir, tmp_path) -> None:
    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    cfg = load_recipe(tiny_recipe(data_dir, str(tmp_path), algorithm={"method": "rnb", "alignment_steps": 4,
                                                                       "options": {"rnb_lambda": 2.0}},
                                  trainer={"max_duration": "8ba", "device_train_microbatch_size": 3,
                                           "eval_interval": "100ba", "precision": "fp32"}))
    built = build(cfg)
    try:
        built.trainer.fit()
        controller = built.algorithm.controller
        history = controller.history
    finally:
        built.close()
    assert controller.signal.kind is Signal.step_gram and controller.reweighter.options["rnb_lambda"] == 2.0
    updates = [r for r in history if not r.get("initial")]
    assert [r["step"] for r in updates] == [4, 8] and all(r.get("skipped") is None for r in updates)
    assert all(r["instep"]["observed_steps"] == 4 and sum(r["instep"]["samples"]) == 32 for r in updates)
    for r in updates:  # alpha = softmax(lambda s / ||s||), s = G p with p uniform: the record's own numbers
        s = np.asarray(r["domain_gram"]) @ np.full(3, 1 / 3)
        e = np.exp(2.0 * s / np.linalg.norm(s))
        np.testing.assert_allclose(r["alpha"], e / e.sum(), rtol=1e-12)
    assert updates[-1]["alpha"] != history[0]["alpha"]
