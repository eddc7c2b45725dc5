"""CRISP: the math on embeddings with a known answer, and the real embedding model on a tiny hand-made
corpus where the targets are drawn from one source domain (so that domain must get the mass)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from grape_stream.cli import main as cli_main
from grape_stream.mixture.crisp import crisp_weights, nearest_centroid

DOMAINS = {
    "cooking": ["Whisk the eggs with sugar, then fold in the flour and bake for twenty minutes.",
                "Simmer the tomato sauce with garlic and basil until it thickens.",
                "Season the roast chicken with salt, pepper and rosemary before roasting.",
                "Knead the bread dough for ten minutes and let it rise in a warm place.",
                "Fry the onions in butter until golden, then add the mushrooms."],
    "astronomy": ["The telescope revealed four moons orbiting the giant planet Jupiter.",
                  "A supernova is the explosion of a massive star at the end of its life.",
                  "The Andromeda galaxy is the nearest large spiral galaxy to the Milky Way.",
                  "Comets develop tails of gas and dust as they approach the Sun.",
                  "Neutron stars are the collapsed cores of stars, dense beyond imagination."],
    "law": ["The court held that the contract was void for lack of consideration.",
            "The defendant appealed the verdict to the supreme court of the state.",
            "A tenant may terminate the lease with thirty days written notice.",
            "The statute of limitations for fraud claims is six years in this jurisdiction.",
            "The judge instructed the jury to disregard the witness's last statement."],
}
TARGET = ["Question: How long should you knead bread dough?\nAnswer: about ten minutes",
          "Question: What herb goes with roast chicken?\nAnswer: rosemary",
          "Question: What do you fold into whisked eggs and sugar for a cake?\nAnswer: flour",
          "Question: How do you thicken a tomato sauce?\nAnswer: simmer it"]


def test_crisp_weights_are_shares_of_nearest_centroids() -> None:
    src = {"a": np.array([[1.0, 0.0, 0.0], [0.9, 0.1, 0.0]]), "b": np.array([[0.0, 1.0, 0.0]]),
           "c": np.array([[0.0, 0.0, 1.0], [0.0, 0.2, 0.9]])}
    tgt = np.array([[1.0, 0.05, 0.0], [0.8, 0.0, 0.1], [0.1, 0.0, 1.0], [0.0, 0.9, 0.1]])
    names, idx = nearest_centroid(src, tgt)
    assert names == ["a", "b", "c"] and idx.tolist() == [0, 0, 2, 1]
    assert crisp_weights(src, tgt) == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})
    # Laplace smoothing keeps every domain above zero (a GRAPE start needs it) and still sums to 1
    w = crisp_weights(src, {"t": tgt[:2]}, smoothing=1.0)
    assert w == pytest.approx({"a": 3 / 5, "b": 1 / 5, "c": 1 / 5})
    # per target: each task counts equally however many samples it has
    w = crisp_weights(src, {"big": np.repeat(tgt[:1], 30, axis=0), "small": tgt[3:4]})
    assert w == pytest.approx({"a": 0.5, "b": 0.5, "c": 0.0})
    with pytest.raises(ValueError, match="target embeddings"):
        crisp_weights(src, np.zeros((2, 5)))


def _write_corpus(root: Path) -> None:
    import zstandard

    for split, docs in [("train", DOMAINS), ("probe", {"kitchen_qa": TARGET})]:
        (root / split).mkdir(parents=True)
        for name, texts in docs.items():
            raw = "".join(json.dumps({"text": t, "domain": name}) + "\n" for t in texts).encode()
            (root / split / f"{name}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))


@pytest.mark.timeout(300)
def test_crisp_cli_with_the_real_embedding_model_puts_mass_on_the_matching_domain(tmp_path: Path) -> None:
    _write_corpus(tmp_path / "corpus")
    out = tmp_path / "crisp.json"
    rc = cli_main(["mixture", "crisp", "--data", str(tmp_path / "corpus"), "--sources", "cooking,astronomy,law",
                   "--targets", "kitchen_qa", "--samples", "16", "--smoothing", "0", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["method"] == "crisp" and doc["domains"] == ["cooking", "astronomy", "law"]
    assert doc["alpha"]["cooking"] == pytest.approx(1.0)  # every cooking question is nearest the cooking centroid
    assert sum(doc["weights"]) == pytest.approx(1.0, abs=1e-9)
    assert doc["static_overrides"][0] == "algorithm.method=static"
    assert doc["grape_start_overrides"][1].startswith("algorithm.options.alpha0=[1.0,")
    assert doc["details"]["embedded"] == {"cooking": 5, "astronomy": 5, "law": 5, "kitchen_qa": 4}
