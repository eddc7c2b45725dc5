"""bench/results/ holds one current result file per measure, each named on a docs page (docs/results.md's table
says which file holds which measure), and bench/common.py writes a result whole or not at all."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench(name: str) -> ModuleType:
    """A bench/ module, imported as its scripts import each other (bench/ on the path)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_every_result_file_is_named_in_the_docs() -> None:
    pages = "\n".join(p.read_text(encoding="utf-8") for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    files = sorted(p.name for p in (REPO / "bench" / "results").glob("*.json"))
    assert files
    assert [f for f in files if f not in pages] == []


def test_write_json_replaces_a_result_whole(tmp_path: Path) -> None:
    common = _bench("common")
    out = tmp_path / "new" / "x.json"
    common.write_json(out, {"a": 1}, indent=2, newline=True)
    assert out.read_text() == '{\n  "a": 1\n}\n' and [p.name for p in out.parent.iterdir()] == ["x.json"]
    assert common.parser("doc", "soak").parse_args([]).out == str(REPO / "bench" / "results" / "soak.json")
    assert json.loads(common.write_json(out, [2]).read_text()) == [2]


def test_the_value_table_shows_each_runs_own_peak_rss_or_na() -> None:
    """bench/value.py records a run's own process's peak RSS (``peak_rss_mb``); runs recorded before a run had a
    process of its own lack it, and the table says "n/a" for them rather than a number from another run."""
    value_report = _bench("value_report")
    doc = json.loads((REPO / "bench" / "results" / "value.json").read_text(encoding="utf-8"))
    setting, tokens = doc["setting"], doc["setting"]["train_tokens"]
    # the committed runs as if recorded before a run had a process of its own (none has the field)
    runs = {m: {int(s): {"train_tokens": tokens, **{k: v for k, v in r.items() if k != "peak_rss_mb"}}
                for s, r in doc["runs"][m].items()} for m in ("uniform", "grape")}
    seeds = sorted(runs["grape"])
    for i, s in enumerate(seeds[:-1]):  # all but one seed recorded one
        runs["grape"][s]["peak_rss_mb"] = 1500.0 + 100 * i
    agg = value_report.aggregate(runs, setting["targets"], setting["sources"])
    rows = {line.split()[0]: line for line in value_report.table(agg, setting["targets"]).splitlines()[:4]}
    assert rows["uniform"].endswith("n/a")
    assert rows["grape"].endswith(f"{1500 + 100 * (len(seeds) - 2)} ({len(seeds) - 1}/{len(seeds)})")
    assert agg["grape"]["peak_rss_mb"]["values"][-1] is None


def test_the_part2_choice_reads_only_probe_scored_runs_on_shared_seeds() -> None:
    """Issue 32 part 2's variants are chosen on their probe-split runs (``sel_*``: GRAPE fitted on one half, scored
    on the other), on the seeds every variant ran, by the worst target."""
    value = _bench("value")
    for m in (m for m in value.METHODS if m.startswith("sel_")):
        overrides = value.METHODS[m][1](1e-3, {}, 0, {})
        assert overrides[-2:] == ["data.task_probe_split=probe_fit", "data.task_test_split=probe_score"], m
        assert not any(o.endswith("=test") for o in overrides)  # neither GRAPE nor the score sees the test split

    def run(avg: float, worst: float) -> dict[str, float]:
        return {"final_avg": avg, "final_worst": worst}

    runs = {"sel_grape": {0: run(5.0, 5.6), 1: run(5.0, 5.2)},
            "sel_grape_klconst": {0: run(5.1, 5.5), 1: run(5.1, 5.5)},  # best on seed 0 alone, not on the mean
            "sel_grape_klconst_ema": {0: run(4.0, 5.4)},  # seed 1 missing: compared on seed 0 only
            "grape": {0: run(1.0, 1.0)}}
    sel = value._selection(runs)
    assert sel["variants"]["grape"]["seeds"] == [0] and sel["chosen"] == "grape_klconst_ema"
    del runs["sel_grape_klconst_ema"]
    sel = value._selection(runs)
    assert sel["variants"]["grape"]["probe_worst"] == 5.4 and sel["chosen"] == "grape"
    assert value._selection({"grape": {0: run(1.0, 1.0)}}) is None


def test_the_selection_corpus_deals_each_targets_probe_documents_into_two_disjoint_halves(tmp_path: Path) -> None:
    import zstandard

    value = _bench("value")
    corpus = tmp_path / "c"
    for split, langs in (("train", value.SOURCES), ("probe", value.TARGETS), ("test", value.TARGETS)):
        (corpus / split).mkdir(parents=True)
        for lang in langs:
            docs = [json.dumps({"text": f"{lang} {split} {i}", "lang": lang, "split": split}) for i in range(5)]
            (corpus / split / f"{lang}.jsonl.zst").write_bytes(zstandard.compress("\n".join(docs).encode()))
    out = value.selection_corpus(corpus, tmp_path / "derived")
    assert (out / "train" / "en.jsonl.zst").resolve() == (corpus / "train" / "en.jsonl.zst").resolve()

    def read(p: Path) -> list[dict]:
        return [json.loads(x) for x in zstandard.decompress(p.read_bytes()).decode().splitlines() if x]

    fit, score = (read(out / s / "tr.jsonl.zst") for s in ("probe_fit", "probe_score"))
    assert [d["text"] for d in fit] == ["tr probe 0", "tr probe 2", "tr probe 4"]
    assert [d["text"] for d in score] == ["tr probe 1", "tr probe 3"]
    assert {d["split"] for d in fit} == {"probe_fit"} and {d["split"] for d in score} == {"probe_score"}
    assert not (out / "probe_fit" / "en.jsonl.zst").exists()  # sources have no probe split


def test_another_trees_runs_join_the_table_only_when_they_reproduce_it(tmp_path: Path) -> None:
    """``--join``: runs of another library tree are added to the table only when every run both files hold (a
    uniform and a GRAPE one among them) agrees to within the tolerance on every target."""
    value = _bench("value")

    def run(tree: str, loss: float) -> dict:
        return {"final": {t: loss for t in value.TARGETS}, "final_avg": loss, "final_worst": loss,
                "code": {"library_tree": tree}}

    table = {"uniform": {0: run("old", 5.3)}, "grape": {0: run("old", 5.1)}}

    def joined(other: dict, steps: int = 400) -> tuple[dict, dict]:
        path = tmp_path / "other.json"
        path.write_text(json.dumps({"setting": {"steps": 400, "train_tokens": 1}, "runs": other}))
        runs = {m: dict(b) for m, b in table.items()}
        return runs, value.join(runs, path, steps)

    same = {"uniform": {"0": run("new", 5.3 + 5e-7)}, "grape": {"0": run("new", 5.1 - 1e-6)},
            "grape_klconst": {"0": run("new", 5.0), "1": run("new", 5.05)}}
    runs, ev = joined(same)
    assert ev["joined"] and ev["trees"] == ["new"] and ev["added"] == ["grape_klconst:0", "grape_klconst:1"]
    assert runs["grape"][0]["code"]["library_tree"] == "old"  # a run both hold stays the table's
    assert runs["grape_klconst"][1]["final_avg"] == 5.05
    assert value.split_by_version(runs, "old", equivalent=ev["trees"])[1] == {}
    assert value.split_by_version(runs, "old")[1] == {"grape_klconst": runs["grape_klconst"]}

    drifted = {**same, "grape": {"0": run("new", 5.1 + 2e-4)}}  # one target off by more than the tolerance
    runs, ev = joined(drifted)
    assert not ev["joined"] and ev["added"] == [] and "grape_klconst" not in runs
    no_grape = {k: v for k, v in same.items() if k != "grape"}  # nothing shows GRAPE's numerics reproduce
    assert not joined(no_grape)[1]["joined"]
    mixed = {**same, "grape_klconst": {"0": run("third", 5.0)}}  # two trees: only one was shown to reproduce
    assert not joined(mixed)[1]["joined"]
    # --join repeated: files of several trees join one after another, each reproducing the table on its own; the
    # table counts exactly the trees that did (a file that did not reproduce adds no tree)
    value._JOINED.clear()
    runs = {m: dict(b) for m, b in table.items()}
    for tree, extra in (("new", "grape_klconst"), ("third", "grape_crisp_prior"), ("drift", "grape_x")):
        off = 2e-4 if tree == "drift" else 0.0
        other = {"uniform": {"0": run(tree, 5.3 + off)}, "grape": {"0": run(tree, 5.1)}, extra: {"0": run(tree, 4.9)}}
        path = tmp_path / f"{tree}.json"
        path.write_text(json.dumps({"setting": {"steps": 400, "train_tokens": 1}, "runs": other}))
        value.join(runs, path, 400)
    assert value._joined_trees() == ["new", "third"] and set(runs) == {"uniform", "grape", "grape_klconst",
                                                                        "grape_crisp_prior"}
    value._JOINED.clear()


def test_a_shared_run_accepted_as_diverged_is_recorded_where_it_parts_and_never_joins(tmp_path: Path) -> None:
    """``--accept-diverged``: a shared GRAPE run that parted from the table's by round-off is named by hand; the
    evidence says at which step its weights first differ beyond the tolerance, it is not added, and the file
    joins only on the runs that do reproduce (a uniform and a GRAPE one)."""
    value = _bench("value")

    def run(tree: str, loss: float, alphas: list[float]) -> dict:
        return {"final": {t: loss for t in value.TARGETS}, "final_avg": loss, "final_worst": loss,
                "code": {"library_tree": tree},
                "trajectory": [{"step": 25 * i, "alpha": [a, 1.0 - a]} for i, a in enumerate(alphas)],
                "train_loss": [[25 * i + 1, 8.0 - a] for i, a in enumerate(alphas)]}

    table = {"uniform": {0: run("old", 5.3, [0.5])}, "grape": {0: run("old", 5.1, [0.5, 0.6]),
                                                              1: run("old", 5.2, [0.5, 0.55, 0.6, 0.7])}}
    other = {"uniform": {"0": run("new", 5.3, [0.5])}, "grape": {"0": run("new", 5.1, [0.5, 0.6]),
                                                                 "1": run("new", 5.21, [0.5, 0.55 + 3e-6, 0.62, 0.7])},
             "grape_probe32": {"0": run("new", 5.0, [0.5])}}
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"setting": {"steps": 400, "train_tokens": 1}, "runs": other}))

    def attempt(accept: list[str]) -> tuple[dict, dict]:
        runs = {m: dict(b) for m, b in table.items()}
        return runs, value.join(runs, path, 400, accept)

    runs, ev = attempt([])
    assert not ev["joined"] and "diverged" not in ev  # not named: a run that does not reproduce fails the join
    runs, ev = attempt(["grape:1"])
    assert ev["joined"] and ev["added"] == ["grape_probe32:0"] and "grape:1" not in ev["reproduced"]
    d = ev["diverged"]["grape:1"]
    assert d["alpha_first_differs_at_step"] == 50 and 1e-6 < d["alpha_max_diff_before"] < 1e-5
    assert d["train_loss_first_differs_at_step"] == 51 and 1e-6 < d["train_loss_max_diff_before"] < 1e-5
    assert abs(d["max_abs_diff"] - 0.01) < 1e-9 and runs["grape"][1]["final_avg"] == 5.2  # the table's run stays
    runs, ev = attempt(["grape:0", "grape:1"])  # nothing left that shows GRAPE reproduces
    assert not ev["joined"]
    with pytest.raises(SystemExit, match="grape:7 not a run both"):  # a misspelt name is one line, not ignored
        attempt(["grape:7"])
    value._JOINED.clear()
