"""RegMix: the regressor and argmin on a synthetic loss with a known minimum, and one tiny real proxy
run through the recipe / Composer Trainer (``grape-stream mixture regmix``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from grape_stream.cli import main as cli_main
from grape_stream.mixture.regmix import dirichlet_mixtures, fit_regressor, regmix_argmin

BEST = np.array([0.6, 0.3, 0.1, 0.0])


def _loss(x: np.ndarray) -> np.ndarray:
    return 2.0 + ((x - BEST) ** 2).sum(axis=1)


def test_dirichlet_mixtures_are_seeded_points_of_the_simplex() -> None:
    x = dirichlet_mixtures(4, 50, seed=3)
    assert x.shape == (50, 4) and np.allclose(x.sum(1), 1.0) and (x >= 0).all()
    assert np.allclose(x[0], 0.25)  # the first proxy is uniform
    assert np.array_equal(x, dirichlet_mixtures(4, 50, seed=3))
    assert not np.array_equal(x, dirichlet_mixtures(4, 50, seed=4))


@pytest.mark.parametrize("kind", ["lightgbm", "linear"])
def test_regressor_argmin_finds_the_known_minimum(kind: str) -> None:
    x = dirichlet_mixtures(4, 256, seed=0)
    if kind == "linear":  # a linear loss: the argmin is the vertex with the smallest slope
        y = x @ np.array([3.0, 1.0, 2.0, 4.0])
        alpha = regmix_argmin(fit_regressor(x, y, kind), 4, samples=20_000, top_k=20)
        assert alpha.argmax() == 1 and alpha[1] > 0.8
        return
    alpha = regmix_argmin(fit_regressor(x, _loss(x), kind), 4, samples=20_000, top_k=50)
    assert np.isclose(alpha.sum(), 1.0)
    # the regressor's argmin is near the true one, far nearer than uniform
    assert _loss(alpha[None])[0] - 2.0 < 0.3 * (_loss(np.full((1, 4), 0.25))[0] - 2.0)
    assert np.abs(alpha - BEST).max() < 0.15


def test_fit_regressor_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="regressor must be"):
        fit_regressor(np.eye(3), np.ones(3), "forest")
    with pytest.raises(ValueError, match="at least 2"):
        fit_regressor(np.ones((1, 3)) / 3, np.ones(1))


@pytest.mark.timeout(900)
def test_regmix_cli_runs_real_proxies_and_writes_weights(tmp_path: Path) -> None:
    from grape_stream.apps.demo_corpus import ensure_converted, find_corpus

    corpus = find_corpus(None)
    meta = json.loads((corpus / "corpus.json").read_text())
    mds = tmp_path / "mds"
    ensure_converted(corpus, mds, progress=False)
    sources, targets = meta["roles"]["sources"][:3], meta["roles"]["targets"][:2]
    out = tmp_path / "regmix.json"
    rc = cli_main(["mixture", "regmix", "--mds", str(mds), "--sources", ",".join(sources), "--targets",
                   ",".join(targets), "--proxies", "3", "--steps", "5", "--regressor", "linear",
                   "--workdir", str(tmp_path / "proxies"), "--set", "trainer.global_train_batch_size=8",
                   "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    runs = doc["details"]["proxy_runs"]
    assert len(runs) == 3 and np.allclose(runs[0]["mixture"], 1 / 3)
    for r in runs:  # each proxy trained on its own mixture and was scored on the targets' probe split
        assert sorted(r["per_target"]) == sorted(targets) and 0 < r["loss"] < 6
        res = json.loads((tmp_path / "proxies" / f"proxy-{runs.index(r):03d}" / "result.json").read_text())
        assert res["method"] == "static" and "data.task_test_split=probe" in res["overrides"]
        assert np.allclose(res["trajectory"][0]["alpha"], r["mixture"], atol=1e-9)
    assert doc["domains"] == sources and sum(doc["weights"]) == pytest.approx(1.0, abs=1e-9)
    assert len({round(r["loss"], 9) for r in runs}) == 3  # different mixtures, different losses
