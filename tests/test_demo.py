"""`grape-stream demo` end to end on the bundled corpus (a 12-step variant of --quick: BPE training, conversion,
uniform and GRAPE; a 4-step run of the byte-level setting), plus its helpers.

The end-to-end runs go through the real tokenizer trainer and converter, the demo-cpu recipe, Composer's Trainer
with GrapeAlgorithm and the real MDS shards; nothing is mocked.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from grape_stream.apps import demo, demo_pool
from grape_stream.cli import main as cli_main

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "data" / "demo"
METHODS = ["uniform", "grape"]  # the default


def _run_demo(out: Path, *args: str, stderr: Path | None = None) -> tuple[int, str]:
    """The demo's exit status and stdout; ``stderr``: also keep file descriptor 2 there (the runs' own processes
    write to it too)."""
    import contextlib
    import io
    import os
    import sys

    buf = io.StringIO()
    saved = None
    if stderr is not None:
        sys.stderr.flush()
        saved = os.dup(2)
        with open(stderr, "wb") as f:
            os.dup2(f.fileno(), 2)
    try:
        with contextlib.redirect_stdout(buf):
            rc = cli_main(["demo", "--out", str(out), "--data", str(CORPUS), "--no-progress", *args])
    finally:
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    out = tmp_path_factory.mktemp("demo")
    rc, stdout = _run_demo(out, "--quick", "--steps", "12", stderr=out.with_name(out.name + "_stderr.txt"))
    return out, rc, stdout


def test_no_progress_keeps_grape_s_update_lines_quiet_too(demo_run: tuple[Path, int, str]) -> None:
    out, rc, stdout = demo_run
    err = out.with_name(out.name + "_stderr.txt").read_text(errors="replace")
    assert rc == 0 and "GRAPE update" not in err + stdout
    assert len(json.loads((out / "summary.json").read_text())["methods"]["grape"]["trajectory"]) >= 3  # it updated


def _table(stdout: str, targets: list[str]) -> tuple[list[str], dict[str, list[float]]]:
    """The console table: its method columns and, per target plus average and worst, one value per method."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["target"])
    rows = {line.split()[0]: [float(v.rstrip("*")) for v in line.split()[1:]]
            for line in lines[header + 2: header + 2 + len(targets) + 3] if line and not line.startswith("-")}
    return lines[header].split()[1:], rows


def _finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)


@pytest.mark.timeout(600)
def test_demo_writes_table_json_and_plots(demo_run: tuple[Path, int, str]) -> None:
    out, rc, stdout = demo_run
    assert rc == 0, stdout
    targets = json.loads((CORPUS / "corpus.json").read_text())["roles"]["targets"]
    assert list(demo_pool.TARGETS) == targets
    # the console table: one row per target plus average and worst, one column per method
    columns, rows = _table(stdout, targets)
    assert columns == METHODS
    for name in [*targets, "average", "worst"]:
        values = rows[name]
        assert len(values) == len(METHODS) and all(math.isfinite(v) and 0 < v < 9 for v in values), (name, values)
    assert "nats per token" in stdout
    assert "value benchmark" not in stdout  # the reference figures only beside a run at the benchmark's settings
    # the BPE was trained on the sources and the corpus converted with it
    assert (out / "tokenizer.json").is_file() and (out / "mds" / "manifest.json").is_file()

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["methods"]) == METHODS
    for m in METHODS:
        s = summary["methods"][m]
        assert sorted(s["final"]) == sorted(targets)
        assert all(_finite(v) for v in s["final"].values())
        assert s["average"] == pytest.approx(sum(s["final"].values()) / len(targets))
        assert s["worst"] == max(s["final"].values())
        # trained: every method ends well below the loss of a uniform guess over the BPE (log 4096 = 8.32)
        assert s["average"] < math.log(demo_pool.VOCAB) - 0.3
        curve = s["curve"]
        assert curve["step"][0] == 0 and curve["step"][-1] == 12
        for t in targets:
            assert len(curve["loss"][t]) == len(curve["step"]) and all(_finite(v) for v in curve["loss"][t])
        (out / m / "result.json").stat()
        assert (out / m / "metrics.jsonl").stat().st_size > 0
    for png in ("test_loss.png", "weights.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    assert "summary.json" in stdout and "test_loss.png" in stdout
    # the command that reproduces each run: printed, saved, and the recipe plus what this run changed
    for m in METHODS:
        cmd = summary["methods"][m]["command"]
        assert f"  {cmd}" in stdout.splitlines()
        assert cmd.startswith(f"grape-stream train demo-cpu run_name=demo-{m} data.local={out / 'mds'} ")
        assert "trainer.max_duration=12ba" in cmd and "output_dir" not in cmd


def test_grape_alpha_moves_and_uniform_stays(demo_run: tuple[Path, int, str]) -> None:
    out, rc, _ = demo_run
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    uni, grape = summary["methods"]["uniform"], summary["methods"]["grape"]
    assert uni["alpha_moved_tv"] == 0.0
    assert list(uni["alpha_final"]) == list(demo_pool.SOURCES)
    assert all(a == pytest.approx(1 / 13) for a in uni["alpha_final"].values())
    assert grape["alpha_moved_tv"] > 1e-3
    assert sum(grape["alpha_final"].values()) == pytest.approx(1.0)
    assert len(grape["trajectory"]) >= 3  # the initial weights plus at least two updates
    # GRAPE moves z too (the worst targets gain weight); uniform has none
    assert max(grape["z_final"].values()) > 1 / 7 + 1e-3
    assert uni["z_final"] is None


def test_byte_setting_still_runs(tmp_path: Path) -> None:
    rc, stdout = _run_demo(tmp_path, "--setting", "bytes", "--quick", "--steps", "4", "--methods", "doge")
    assert rc == 0, stdout
    targets = json.loads((CORPUS / "corpus.json").read_text())["roles"]["targets"]
    columns, rows = _table(stdout, targets)
    assert columns == ["doge"] and "nats per byte" in stdout
    assert rows["average"][0] < math.log(257)  # below a uniform byte guess
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["setting"] == "bytes" and summary["seed"] == 17
    assert list(summary["methods"]["doge"]["alpha_final"]) == json.loads(
        (CORPUS / "corpus.json").read_text())["roles"]["sources"]


def test_default_is_the_value_benchmarks_setting() -> None:
    """One definition: bench/value.py runs exactly what `grape-stream demo` runs by default."""
    import importlib.util

    args, methods, settings = demo._parse([])
    assert methods == ["uniform", "grape"] and args.setting == "pool" and args.seed == 0
    assert settings == demo_pool.pool_settings(demo_pool.STEPS)
    assert demo._parse(["--quick"])[2].steps == demo_pool.QUICK_STEPS
    spec = importlib.util.spec_from_file_location("bench_value", REPO / "bench" / "value.py")
    assert spec is not None and spec.loader is not None
    value = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(value)
    pool = value.SETTINGS["languages"]  # the benchmark's default setting is the demo's pool, defined once
    assert pool.sources is demo_pool.SOURCES and pool.targets is demo_pool.TARGETS and value.MODEL is demo_pool.MODEL
    assert pool.data_overrides == demo_pool.DATA and pool.domain_field == "lang"
    assert value.settings(400) == settings


def _training_keys(overrides: list[str]) -> dict[str, object]:
    from grape_stream.apps.demo_run import RECIPE, RUN_ONLY_KEYS, _flat
    from grape_stream.recipe import load_recipe

    return {k: v for k, v in _flat(load_recipe(RECIPE, overrides)).items() if k not in RUN_ONLY_KEYS}


@pytest.mark.parametrize("quick", [False, True])
def test_the_printed_command_trains_what_the_demo_run_trained(quick: bool) -> None:
    """The demo-cpu recipe is the default demo's GRAPE run (its command names only the run), and the command printed
    for any run loads to the same training settings as the demo's own overrides (nothing trained here)."""
    import shlex

    from grape_stream.apps.demo_run import recipe_overrides, reproduce_command

    settings = demo_pool.quick_settings() if quick else demo_pool.pool_settings()
    mds = "/elsewhere/mds" if quick else "runs/demo/mds"
    for method in ("grape", "uniform", "doge"):
        overrides = recipe_overrides(method, settings, mds=mds, out_dir=f"runs/demo/{method}", seed=0)
        cmd = reproduce_command(overrides)
        if not quick:
            other = "" if method == "grape" else f" algorithm.method={method}"
            assert cmd == f"grape-stream train demo-cpu run_name=demo-{method}{other}"
        printed = shlex.split(cmd)[3:]
        assert _training_keys(printed) == _training_keys(overrides)
def _bench_module(name: str):  # type: ignore[no-untyped-def]
    """A bench/ script as a module (bench/ is not a package; its scripts import each other by name)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_run(level: float, seed: int, tree: str = "t1") -> dict:
    """A finished value-benchmark run whose every target sits at ``level`` (+ 0.1 on pt, the worst)."""
    final = {t: level + (0.1 if t == "pt" else 0.0) for t in demo_pool.TARGETS}
    avg = sum(final.values()) / len(final)
    return {"final": final, "final_avg": avg, "final_worst": max(final.values()), "steps": 400,
            "train_tokens": 400 * 4096, "trajectory": [], "code": {"commit": f"c{tree}", "library_tree": tree},
            "curve": {"step": [0, 200, 400], "tokens": [0, 200 * 4096, 400 * 4096], "avg": [8.0, avg + 0.3, avg]},
            "seconds": {"total": 100.0 + seed, "curve_eval": 10.0, "reweighting": 9.0}}


def test_value_report_rows_are_one_version_with_t_intervals() -> None:
    """n, the 95% t half-width (against scipy), 'n=1' for one run, other versions kept out of the rows."""
    from scipy import stats

    report = _bench_module("value_report")
    runs = {"uniform": {s: _fake_run(5.3 + 0.02 * s, s) for s in range(3)},
            "oracle": {s: _fake_run(4.9 + 0.01 * s, s) for s in range(3)},
            "grape": {0: _fake_run(5.0, 0), 1: _fake_run(5.6, 1, tree="t0")}}
    same, other, version = report.split_by_version(runs, None)
    assert version == "t1" and list(other) == ["grape"] and list(same["grape"]) == [0]
    agg = report.aggregate(same, demo_pool.TARGETS, demo_pool.SOURCES)
    xs = agg["uniform"]["avg"]["values"]
    want = stats.t.ppf(0.975, len(xs) - 1) * stats.sem(xs)
    assert agg["uniform"]["avg"]["n"] == 3 and math.isclose(agg["uniform"]["avg"]["ci"], want, rel_tol=1e-3)
    assert agg["grape"]["avg"]["ci"] is None and agg["grape"]["targets_better_than_uniform"] == [7]
    text = report.table(agg, demo_pool.TARGETS)
    assert "(n=1)" in text and "+- 0.0000" not in text
    c = report.claims(agg)
    assert c["worst_target_improved_seeds"] == {"improved": 1, "n": 1, "reference": c["worst_target_improved_seeds"][
        "reference"]}
    assert c["targets_improved_per_seed"]["grape"] == {"per_seed": {"0": 7}, "of": 7}
    # probe cost: 9 s of reweighting against (100 - 10 - 9) / 400 s per training step
    assert math.isclose(agg["grape"]["probe_step_equivalents"]["mean"], 9.0 / (81.0 / 400))


def test_reuse_is_priced_with_its_source_runs_and_regmix_with_its_proxies() -> None:
    """Issue 32 part 3's reuse claim: a reused run costs itself plus every source run it was built from (steps and
    probes); RegMix costs its proxies plus its final run; a pooled reuse reads every other seed's run."""
    report = _bench_module("value_report")
    value = _bench_module("value")
    grape_runs = {s: _fake_run(5.0, s) for s in (0, 1, 2)}
    assert value._reuse_sources("grape_final_mean", 1, {"grape": grape_runs}) == {"method": "grape", "seeds": [0, 2]}
    assert value._reuse_sources("grape_replay", 0, {"grape": grape_runs}) == {"method": "grape", "seeds": [2]}
    assert value._reuse_sources("grape", 0, {"grape": grape_runs}) is None
    pooled = {s: {**_fake_run(4.9, s), "reuse_sources": {"method": "grape", "seeds": [x for x in (0, 1, 2) if x != s]}}
              for s in (0, 1, 2)}
    runs = {"uniform": {s: _fake_run(5.3, s) for s in (0, 1)}, "oracle": {0: _fake_run(4.8, 0)},
            "grape": grape_runs, "grape_final_static": {0: _fake_run(4.95, 0)}, "grape_final_mean": pooled,
            "regmix": {0: _fake_run(4.97, 0)}}
    agg = report.aggregate(runs, demo_pool.TARGETS, demo_pool.SOURCES)
    reuse = report.claims(agg, search_settings={"proxies": 24, "proxy_steps": 100})["reuse"]
    # every fake run spends 9 s reweighting at (total - 10 - 9) / 400 s a step (seed 0: 100 s; seeds 1, 2: 101, 102)
    probe = {s: 9.0 / ((100.0 + s - 19.0) / 400) for s in (0, 1, 2)}
    grape_cost = 400 + sum(probe.values()) / 3
    assert math.isclose(reuse["grape_final_static"]["total_steps"], 400 + probe[0] + grape_cost)
    assert math.isclose(reuse["grape_final_mean"]["total_steps"], grape_cost + 2 * grape_cost)
    assert reuse["grape_final_mean"]["source"]["runs"] == 2.0
    assert math.isclose(reuse["regmix"]["total_steps"], 400 + probe[0] + 24 * 100)
    uniform_cost = 400 + (probe[0] + probe[1]) / 2
    assert math.isclose(reuse["regmix"]["total_of_uniform"], reuse["regmix"]["total_steps"] / uniform_cost)
    assert "regmix" not in report.claims(agg)["reuse"]  # no search settings: RegMix's price is unknown, not 400


def test_reference_lines_read_the_benchmark_json(tmp_path: Path) -> None:
    report = _bench_module("value_report")
    runs = {"uniform": {s: _fake_run(5.3 + 0.02 * s, s) for s in range(2)},
            "oracle": {s: _fake_run(4.9 + 0.01 * s, s) for s in range(3)}, "grape": {0: _fake_run(5.0, 0)}}
    agg = report.aggregate(runs, demo_pool.TARGETS, demo_pool.SOURCES)
    doc = {"methods": agg, "version": {"commits": ["ct1"]}, "search_settings": {"proxies": 24},
           "search": {"oracle": {"chosen": "crisp"}}}
    (tmp_path / "value.json").write_text(json.dumps(doc))
    lines = demo_pool.reference_lines(["uniform", "grape", "nosuch"], seed=0, path=tmp_path / "value.json")
    u = agg["uniform"]["avg"]
    mean = sum(u["values"]) / 2  # recomputed, not the JSON's summary
    line = next(x for x in lines if x.startswith("  uniform "))
    assert f"average {mean:.4f} +- {u['ci']:.4f}" in line and "(n=2; seed 0: average" in line, line
    line = next(x for x in lines if x.startswith("  grape "))
    assert f"average {agg['grape']['avg']['mean']:.4f} (n=1)" in line, line
    assert next(x for x in lines if x.startswith("  best static ")).endswith("(n=3)")
    assert "commit ct1" in lines[0] and "24-proxy" in lines[-1] and not any("nosuch" in x for x in lines)
    assert demo_pool.reference_lines(["uniform"], path=tmp_path / "absent.json") == []
    # the older format (no recorded library version: rows of two data streams) is not shown as a reference
    (tmp_path / "old.json").write_text(json.dumps({"methods": {"uniform": {"seeds": [0], "avg": [5.3, 0.0]}}}))
    assert demo_pool.reference_lines(["uniform"], path=tmp_path / "old.json") == []
    (tmp_path / "v.json").write_text(json.dumps({"methods": {}, "version": {}}))
    assert demo_pool.reference_lines(["uniform"], path=tmp_path / "v.json") == []


def test_conversion_is_reused_and_redone_when_the_corpus_changes(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "train").mkdir(parents=True)
    (corpus / "test").mkdir()
    import zstandard

    def write(split: str, lang: str, n: int) -> None:
        rows = "".join(json.dumps({"text": f"{lang} paragraph {i} " * 20, "lang": lang, "split": split,
                                   "source": "t", "doc_id": f"{lang}{i}"}) + "\n" for i in range(n))
        (corpus / split / f"{lang}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))

    for lang in ("aa", "bb"):
        write("train", lang, 20)
        write("test", lang, 5)
    (corpus / "corpus.json").write_text("{}")
    out = tmp_path / "mds"
    manifest, converted = demo.ensure_converted(corpus, out, seq_len=64, progress=False)
    assert converted and sorted(manifest["domains"]) == ["aa", "bb"]
    t = time.perf_counter()
    manifest2, converted2 = demo.ensure_converted(corpus, out, seq_len=64, progress=False)
    assert not converted2 and manifest2 == manifest
    write("train", "aa", 40)  # an edited corpus converts again, over the old output
    manifest3, converted3 = demo.ensure_converted(corpus, out, seq_len=64, progress=False)
    assert converted3
    train_samples = manifest["domains"]["aa"]["splits"]["train"]["samples"]
    assert manifest3["domains"]["aa"]["splits"]["train"]["samples"] > train_samples
    del t


def test_unknown_method_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--methods", "uniform,grap"])
    assert exc.value.code == 2
    assert "grap" in capsys.readouterr().err


def test_missing_corpus_names_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["demo", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_strided_indices_cover_the_split() -> None:
    idx = demo._strided_indices(1000, 5)
    assert idx == [0, 250, 500, 749, 999] or idx == [0, 250, 500, 750, 999]
    assert demo._strided_indices(3, 10) == [0, 1, 2]


def test_tokens_to_reach_interpolates() -> None:
    mq = _bench_module("mixture_quality")
    curve = {"tokens": [0, 100, 200, 300], "avg": [5.0, 4.0, 3.0, 2.5]}
    assert mq.tokens_to_reach(curve, 3.5) == pytest.approx(150.0)
    assert mq.tokens_to_reach(curve, 3.0) == pytest.approx(200.0)
    assert mq.tokens_to_reach(curve, 2.0) is None
