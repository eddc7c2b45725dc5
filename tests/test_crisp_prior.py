"""``algorithm.options.alpha0: crisp``: CRISP's weights computed in the run's set-up from its own MDS shards
(decoded with the manifest's tokenizer), checked against an explicit computation that reads the shards with
streaming directly, then in a real Composer run with the real embedding model."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from grape_stream.errors import ConfigError

DOMAINS = {
    "cooking": ["Whisk the eggs with sugar, then fold in the flour and bake the cake for twenty minutes.",
                "Simmer the tomato sauce with garlic and basil until it thickens, stirring now and then.",
                "Season the roast chicken with salt, pepper and rosemary before roasting it in the oven.",
                "Knead the bread dough for ten minutes and let it rise in a warm place for an hour.",
                "Fry the onions in butter until golden, then add the mushrooms and a splash of cream."] * 3,
    "astronomy": ["The telescope revealed four moons orbiting the giant planet Jupiter on a clear night.",
                  "A supernova is the explosion of a massive star at the end of its life, bright as a galaxy.",
                  "The Andromeda galaxy is the nearest large spiral galaxy to our own Milky Way galaxy.",
                  "Comets develop long tails of gas and dust as they approach the Sun on their orbits.",
                  "Neutron stars are the collapsed cores of massive stars, dense beyond all imagination."] * 3,
    "law": ["The court held that the contract was void for lack of consideration between the parties.",
            "The defendant appealed the verdict of the jury to the supreme court of the state.",
            "A tenant may terminate the lease with thirty days of written notice to the landlord.",
            "The statute of limitations for fraud claims is six years in this jurisdiction by law.",
            "The judge instructed the jury to disregard the witness's last statement in the record."] * 3,
}
TARGET = ["Question: How long should you knead bread dough before it rises?\nAnswer: about ten minutes",
          "Question: What herb goes with a roast chicken in the oven?\nAnswer: rosemary and pepper",
          "Question: What do you fold into whisked eggs and sugar for a cake?\nAnswer: the flour",
          "Question: How do you thicken a tomato sauce with garlic?\nAnswer: simmer it slowly"] * 2
SEQ = 32


@pytest.fixture(scope="module")
def mds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus above converted as users convert theirs (bytes tokenizer: every sequence decodes exactly)."""
    import zstandard

    from grape_stream.apps.demo_corpus import ensure_converted

    corpus = tmp_path_factory.mktemp("prior_corpus")
    for split, docs in (("train", DOMAINS), ("probe", {"kitchen_qa": TARGET}), ("test", {"kitchen_qa": TARGET})):
        (corpus / split).mkdir()
        for name, texts in docs.items():
            raw = "".join(json.dumps({"text": t, "domain": name, "split": split}) + "\n" for t in texts).encode()
            (corpus / split / f"{name}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    out = tmp_path_factory.mktemp("prior_mds")
    ensure_converted(corpus, out, seq_len=SEQ, progress=False, tokenizer="bytes", domain_field="domain")
    return out


def _streams(mds: Path) -> tuple[list, list]:
    from grape_stream.grape.tasks import TaskStream

    domains = [TaskStream(name=d, local=str(mds / d), split="train", test_split=None) for d in DOMAINS]
    return domains, [TaskStream(name="kitchen_qa", local=str(mds / "kitchen_qa"), split="probe")]


def letters(texts: list[str]) -> np.ndarray:
    """A transparent stand-in embedder: letter counts (the prior's plumbing, not the model, is under test)."""
    return np.array([[t.lower().count(c) for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts], dtype=np.float64)


def _explicit(mds: Path, name: str, split: str, n: int, seed: int) -> np.ndarray:
    """The documented draw, read with streaming's StreamingDataset itself and decoded byte by byte."""
    from streaming import StreamingDataset

    from grape_stream.streaming_compat.registration import create_registered
    from grape_stream.streaming_compat.shm import release_streaming_dataset

    # under the registration lock, as the library opens every dataset: a bare StreamingDataset can take a shared-
    # memory prefix another test worker's job is registering (streaming 0.13 picks prefixes without a lock)
    ds = create_registered(lambda: StreamingDataset(local=str(mds / name), split=split, shuffle=False))
    try:
        idx = sorted(random.Random(f"{seed}/{split}/{name}").sample(range(ds.num_samples), min(n, ds.num_samples)))
        texts = [bytes(int(x) for x in np.asarray(ds[i]["tokens"]) if x != 256).decode("utf-8", "replace")
                 for i in idx]
    finally:
        release_streaming_dataset(ds)
    return letters(texts)


def test_the_crisp_prior_matches_an_explicit_nearest_centroid_count_over_the_same_draw(mds: Path) -> None:
    from grape_stream.mixture.prior import crisp_prior

    domains, tasks = _streams(mds)
    try:
        doc = crisp_prior(domains, tasks, "bytes", samples=6, seed=3, smoothing=1.0, embedder=letters)
    finally:
        for s in domains + tasks:
            s.close()

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    cents = np.stack([unit(unit(_explicit(mds, d, "train", 6, 3)).mean(axis=0)) for d in DOMAINS])
    nearest = np.argmax(unit(_explicit(mds, "kitchen_qa", "probe", 6, 3)) @ cents.T, axis=1)
    counts = np.bincount(nearest, minlength=len(DOMAINS)) + 1.0
    assert doc["weights"] == pytest.approx((counts / counts.sum()).tolist(), abs=1e-12)
    assert list(doc["alpha"]) == list(DOMAINS) and min(doc["weights"]) > 0  # smoothing: every domain > 0
    assert doc["details"]["embedded"] == {"cooking": 6, "astronomy": 6, "law": 6, "kitchen_qa": 6}
    assert doc["details"]["task_split"] == ["probe"] and doc["seconds"] > 0
    # another draw seed reads other sequences: the seed reaches the draw
    other = [_explicit(mds, "cooking", "train", 6, s).sum() for s in (3, 4)]
    assert other[0] != other[1]


def test_a_tokenizer_that_cannot_be_loaded_is_one_line_naming_it(mds: Path) -> None:
    from grape_stream.mixture.prior import crisp_prior

    domains, tasks = _streams(mds)
    with pytest.raises(ConfigError, match=r"converted with \('/nowhere/tokenizer.json'") as info:
        crisp_prior(domains, tasks, "/nowhere/tokenizer.json", embedder=letters)
    assert "\n" not in str(info.value)


def _recipe(mds: Path, out: Path, **algorithm: object) -> dict:
    from grape_stream.recipe import load_recipe

    return load_recipe({
        "run_name": "prior", "seed": 1, "output_dir": str(out / "{run_name}"),
        "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32},
        "data": {"local": str(mds), "split": "train", "seq_len": SEQ, "domains": list(DOMAINS),
                 "tasks": ["kitchen_qa"], "task_probe_split": "probe", "task_test_split": "test",
                 "eval_batch_size": 8},
        "algorithm": {"alpha_every": 2, "z_every": 2, "probe_domain_batch": 2, "probe_task_batch": 2,
                      "options": {"alpha0": "crisp"}, **algorithm},
        "trainer": {"max_duration": "2ba", "global_train_batch_size": 4, "eval_interval": "2ba",
                    "log_to_console": False, "device": "cpu", "progress_bar": False},
    })


def test_the_recipe_names_the_prior_and_a_misspelt_one_is_one_line(mds: Path, tmp_path: Path) -> None:
    cfg = _recipe(mds, tmp_path)
    assert cfg["algorithm"]["options"]["alpha0"] == "crisp"  # checked by name at load, computed in the set-up
    with pytest.raises(ConfigError, match="give a list of weights .* crisp") as info:
        _recipe(mds, tmp_path, options={"alpha0": "crips"})
    assert "\n" not in str(info.value)
    # outside a recipe run (a GrapeController of one's own) the name says where its weights come from
    from grape_stream.grape.reweighting import build_reweighter

    with pytest.raises(ConfigError, match=r"crisp_prior\(\.\.\.\) and pass its 'weights'"):
        build_reweighter("grape", num_domains=3, num_tasks=1, alpha0="crisp")


@pytest.mark.timeout(300)
def test_a_composer_run_starts_from_the_crisp_prior_of_its_own_data(mds: Path, tmp_path: Path) -> None:
    """The real embedding model on the real shards: the cooking questions put the most mass on cooking, the
    run's first alpha is those weights, and a dry run computes nothing (it stays offline)."""
    from grape_stream.integrations.composer.trainer import build

    dry = build(_recipe(mds, tmp_path), dry_run=True, progress=False, console=False)
    assert dry.prior is None
    built = build(_recipe(mds, tmp_path), progress=False, console=False)
    try:
        built.trainer.fit()
        prior = built.prior
        assert prior is not None and max(prior["alpha"], key=prior["alpha"].get) == "cooking"
        assert prior["alpha"]["cooking"] > 0.5 and prior["details"]["tokenizer"] == "bytes"
        first = built.algorithm.controller.history[0]
        assert first.get("initial") and first["alpha"] == pytest.approx(prior["weights"], abs=1e-12)
        meta = json.loads(Path(tmp_path / "prior" / "grape_trajectory.jsonl").read_text().splitlines()[0])
        assert meta["options"]["alpha0"] == pytest.approx(prior["weights"], abs=1e-12)
    finally:
        built.close()
    assert os.path.isdir(tmp_path / "prior")


@pytest.mark.timeout(300)
def test_a_run_started_from_the_prior_resumes_from_its_checkpoint(mds: Path, tmp_path: Path) -> None:
    """The resumed run computes the prior again (the same seeded draw, the same weights), so the checkpoint's
    strictly compared options match and the run continues where it stopped."""
    from grape_stream.integrations.composer.trainer import build

    def run(batches: int) -> list[dict]:
        cfg = _recipe(mds, tmp_path)
        cfg["trainer"].update(max_duration=f"{batches}ba", save_interval="2ba", autoresume=True,
                              save_folder=str(tmp_path / "ckpt"))
        built = build(cfg, progress=False, console=False)
        try:
            built.trainer.fit()
            return list(built.algorithm.controller.history)
        finally:
            built.close()

    first = run(2)
    resumed = run(4)
    assert resumed[: len(first)] == first and resumed[-1]["step"] == 4


def test_the_prior_reads_a_bucket_domain_by_the_shards_its_draw_lands_in(tmp_path: Path, s3_bucket: str) -> None:
    """A domain's training split in a bucket is large: the prior downloads only the shards holding the sequences
    it draws, not the split (a task's small splits are fetched whole, as before)."""
    import boto3

    from grape_stream.grape.tasks import TaskStream
    from grape_stream.mixture.prior import crisp_prior
    from grape_stream.testing.mds import write_domain

    src = tmp_path / "src"
    write_domain(src / "d0" / "train", 0, 400, samples_per_shard=50)  # several shards (MDSWriter's sizing: 10)
    write_domain(src / "t0" / "probe", 9, 20, samples_per_shard=50)
    s3 = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    for path in (src / "d0").rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), s3_bucket, f"mds/{path.relative_to(src)}")
    shards = len(json.loads((src / "d0" / "train" / "index.json").read_text())["shards"])
    domain = TaskStream(name="d0", remote=f"s3://{s3_bucket}/mds/d0", local=str(tmp_path / "cache" / "d0"),
                        split="train", test_split=None, fetch_all=False)
    task = TaskStream(name="t0", local=str(src / "t0"), split="probe", test_split=None)
    try:
        doc = crisp_prior([domain], [task], "gpt2", samples=3, seed=0, embedder=letters)
        from grape_stream.streaming_compat.shard_state import shard_is_local, shards_of

        ds = domain.dataset()
        drawn = sorted(random.Random("0/train/d0").sample(range(400), 3))
        local = [i for i in range(shards) if shard_is_local(ds, i)]
    finally:
        domain.close()
        task.close()
    assert shards >= 8 and doc["details"]["embedded"] == {"d0": 3, "t0": 3}
    assert local == shards_of(ds, drawn) and len(local) <= 3  # the draw's shards, no others


def test_a_tokenizer_path_from_the_data_is_never_opened_the_recipe_names_it() -> None:
    """A manifest comes with the data (a shared bucket's contents): the prior decodes with a built-in name from
    it, or with the tokenizer the recipe names; a path or hub name in a manifest is refused in one line."""
    from grape_stream.recipe import load_recipe
    from grape_stream.recipe.prior import prior_tokenizer
    from grape_stream.recipe.schema import as_recipe

    def cfg(**data: object):
        return as_recipe(load_recipe({"data": {"local": "/nowhere", "domains": ["a"], "tasks": ["t"], **data},
                                      "algorithm": {"options": {"alpha0": "crisp"}}}))

    assert prior_tokenizer(cfg(), {"tokenizer": {"name": "gpt2"}}) == "gpt2"
    for named in ("/home/someone/.ssh/tokenizer.json", "../../tokenizer.json", "evil/hub-model"):
        with pytest.raises(ConfigError, match="set data.tokenizer") as info:
            prior_tokenizer(cfg(), {"tokenizer": {"name": named}})
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="no data manifest names one"):
        prior_tokenizer(cfg(), None)
    assert prior_tokenizer(cfg(tokenizer="/data/tok.json"), {"tokenizer": {"name": "evil/hub-model"}}) == \
        "/data/tok.json"
