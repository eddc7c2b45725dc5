"""Run UX of a GRAPE run in a real Composer Trainer with real trackers (TensorBoard, MLflow file store, W&B
offline): a progress line for every update, the end-of-run summary table, and the trajectory JSONL, the
summary and the plot logged as tracker artifacts. Plus the framework-free parts (summary table, progress)
on hand-built inputs."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import re

import pytest

from _grape_data import write_dataset
from grape_stream.integrations.progress import UpdateProgress
from grape_stream.integrations.summary import RunSummary, format_summary
from test_composer import tiny_recipe

_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
        "MLFLOW_ALLOW_FILE_STORE": "true"}  # mlflow 3.x refuses a file store unless told


@pytest.fixture(scope="module")
def ux_run(tmp_path_factory):
    """One tiny GRAPE fit with all three trackers; its console output captured."""
    from grape_stream.integrations.composer.callbacks import GrapeTrajectoryCallback, TaskEvalSummary
    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    root = tmp_path_factory.mktemp("run_ux")
    data, out = str(root / "data"), str(root / "out")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=96, n_val=16, n_test=16)
    loggers = {"tensorboard": {"log_dir": os.path.join(out, "tb")},
               "mlflow": {"tracking_uri": "file://" + os.path.join(out, "mlruns"), "experiment_name": "ux",
                          "log_system_metrics": False},
               "wandb": {"project": "ux"}}
    # 10 batches, evaluation every 8: Composer 0.32.1 evaluates once more after FIT_END (at 10), and the summary
    # must show that evaluation, not the one at 8 (every bundled paper recipe ends off its eval interval)
    cfg = load_recipe(tiny_recipe(data, out, trainer={"max_duration": "10ba", "eval_interval": "8ba",
                                                      "loggers": loggers}))
    saved = {k: os.environ.get(k) for k in [*_ENV, "WANDB_DIR"]}
    os.environ.update(_ENV, WANDB_DIR=out)
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            built = build(cfg)
            try:
                built.trainer.fit()
            finally:
                built.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    traj = next(cb for cb in built.callbacks if isinstance(cb, GrapeTrajectoryCallback))
    evals = next(cb for cb in built.callbacks if isinstance(cb, TaskEvalSummary))
    return {"out": out, "run": os.path.join(out, "tiny"), "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
            "traj": traj, "evals": evals, "controller": built.algorithm.controller}


def test_progress_line_for_every_update(ux_run):
    err = ux_run["stderr"]
    for i, step in ((1, 4), (2, 8)):
        assert f"GRAPE update {i} (step {step}): probing 5 groups (3 domains + 2 tasks), 20 samples ..." in err
        assert re.search(rf"GRAPE update {i} \(step {step}\) done in [0-9.]+s \(probe data [0-9.]+s, gram", err), err


def test_end_of_run_summary_table(ux_run):
    """The summary shows the run's last evaluation (Composer's extra one after FIT_END, at batch 10)."""
    out, evals, ctl = ux_run["stdout"], ux_run["evals"].last, ux_run["controller"]
    with open(os.path.join(ux_run["run"], "metrics.jsonl"), encoding="utf-8") as f:
        rounds = [r for r in map(json.loads, f) if "metrics/grape/avg_log_ppl" in r]
    assert [r["step"] for r in rounds] == [8, 10]
    assert rounds[-1]["metrics/grape/avg_log_ppl"] == pytest.approx(sum(evals.values()) / 2)
    assert out.count("GRAPE run summary") == 1
    assert "GRAPE run summary: method grape, 2 updates, last at step 8" in out
    assert set(evals) == {"t0", "t1"}
    for t, v in evals.items():
        assert re.search(rf"^{t}\s+{v:.4f}\s", out, re.M), out
    worst = max(evals, key=evals.get)
    assert re.search(rf"^avg \(eval log-ppl\)\s+{sum(evals.values()) / 2:.4f}$", out, re.M), out
    assert f"{evals[worst]:.4f} ({worst})" in out
    for d, a in zip(ctl.domain_names, ctl.alpha):
        assert re.search(rf"^{d}\s+0\.3333\s+{a:.4f}$", out, re.M), out
    traj = os.path.join(ux_run["run"], "grape_trajectory.jsonl")
    assert f"trajectory: {traj}" in out and f"plots:      {traj[:-6]}.png" in out
    with open(os.path.join(ux_run["run"], "grape_summary.txt"), encoding="utf-8") as f:
        assert f.read().strip() == ux_run["traj"].summary_text.strip()
    assert ux_run["traj"].summary_text in out


def test_mlflow_gets_the_files_and_the_image(ux_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient("file://" + os.path.join(ux_run["out"], "mlruns"))
    (exp,) = [e for e in client.search_experiments() if e.name == "ux"]
    (run,) = client.search_runs([exp.experiment_id])
    names = {os.path.basename(a.path) for a in client.list_artifacts(run.info.run_id, "grape")}
    assert names == {"grape_trajectory.jsonl", "grape_trajectory.png", "grape_summary.txt"}
    got = client.download_artifacts(run.info.run_id, "grape/grape_trajectory.jsonl", ux_run["out"])
    with open(got, encoding="utf-8") as a, open(os.path.join(ux_run["run"], "grape_trajectory.jsonl")) as b:
        assert a.read() == b.read()
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    assert any("grape~trajectory" in p and p.endswith(".png") for p in images), images
    assert "grape/alpha/d0" in client.get_run(run.info.run_id).data.metrics


def test_tensorboard_gets_the_plot_as_an_image(ux_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = []
    for events in glob.glob(os.path.join(ux_run["out"], "tb", "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(events, size_guidance={"images": 0})
        acc.Reload()
        if "grape/trajectory" in acc.Tags()["images"]:
            images += acc.Images("grape/trajectory")
    assert len(images) == 1 and images[0].step == 10  # logged after the final evaluation, at the last batch
    assert images[0].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n" and images[0].width > 200


def test_wandb_offline_run_keeps_the_files_and_the_image(ux_run):
    (run_dir,) = glob.glob(os.path.join(ux_run["out"], "wandb", "offline-run-*"))
    files = os.path.join(run_dir, "files")
    with open(os.path.join(files, "grape_trajectory.jsonl"), encoding="utf-8") as a, \
            open(os.path.join(ux_run["run"], "grape_trajectory.jsonl"), encoding="utf-8") as b:
        assert a.read() == b.read()
    assert os.path.getsize(os.path.join(files, "grape_summary.txt")) > 100
    media = glob.glob(os.path.join(files, "media", "**", "*.png"), recursive=True)
    assert media, os.listdir(files)
    assert os.path.getsize(glob.glob(os.path.join(run_dir, "*.wandb"))[0]) > 0


# -- the framework-free parts, on hand-built inputs ------------------------------------------------------------
def _summary(**kw) -> RunSummary:
    base = dict(method="grape", domains=["web", "code"], alpha=[0.7, 0.3], alpha_start=[0.5, 0.5],
                tasks=["qa", "math"], z=[0.25, 0.75], num_updates=3, last_step=30,
                trajectory="/r/grape_trajectory.jsonl", plot=None)
    base.update(kw)
    return RunSummary(**base)  # type: ignore[arg-type]


def test_summary_uses_evaluation_then_falls_back_to_the_probe_loss():
    s = _summary(eval_log_ppl={"qa": 2.0, "math": 3.5}, probe_loss={"qa": 9.0, "math": 1.0})
    assert s.average() == pytest.approx(2.75) and s.worst() == ("math", 3.5)
    text = format_summary(s)
    assert re.search(r"^avg \(eval log-ppl\)\s+2\.7500$", text, re.M), text
    assert "3.5000 (math)" in text and "plots:      (none)" in text
    assert re.search(r"^web\s+0\.5000\s+0\.7000$", text, re.M), text

    p = _summary(probe_loss={"qa": 9.0, "math": float("nan")})  # no evaluation: the probe loss, NaN skipped
    assert p.average() == 9.0 and p.worst() == ("qa", 9.0)
    assert re.search(r"^worst \(probe loss\)\s+9\.0000 \(qa\)$", format_summary(p), re.M)
    assert "eval log-ppl" not in format_summary(_summary(tasks=[], z=None)).split("\n")[1]


def test_progress_lines_ticks_and_rank_zero_only(monkeypatch):
    import torch

    buf = io.StringIO()
    prog = UpdateProgress(stream=buf, bar=False)
    loss = prog.wrap_loss(lambda model, batch: torch.zeros(len(batch)))
    loss(None, [0] * 3)  # outside an update: not counted
    with prog.update(2, 40, domains=3, tasks=10, samples=52):
        for _ in range(4):
            loss(None, [0] * 16)  # 64 > 52: capped
        assert prog._done == 52
    prog.finished(2, 40, {"seconds": {"probe_data": 0.5, "gram": 2.0, "total": 2.5}, "skipped": "no signal"})
    assert buf.getvalue().splitlines() == [
        "GRAPE update 2 (step 40): probing 13 groups (3 domains + 10 tasks), 52 samples ...",
        "GRAPE update 2 (step 40) done in 2.50s (probe data 0.50s, gram 2.00s); skipped: no signal",
    ]

    bar = io.StringIO()
    prog = UpdateProgress(stream=bar, bar=True)
    loss = prog.wrap_loss(lambda model, batch: torch.zeros(len(batch)))
    with prog.update(1, 4, domains=2, tasks=1, samples=12):
        loss(None, [0] * 12)
    assert "GRAPE update 1 (step 4): probing 3 groups" in bar.getvalue() and "0/12" in bar.getvalue()
    assert prog._done == 12 and prog.lines == []  # the bar replaces the start line

    monkeypatch.setenv("RANK", "1")
    quiet = io.StringIO()
    prog = UpdateProgress(stream=quiet, bar=False)
    with prog.update(1, 4, domains=2, tasks=1, samples=12):
        pass
    prog.finished(1, 4, {"seconds": {"total": 1.0}})
    assert quiet.getvalue() == ""


def test_trajectory_record_count_matches_the_summary(ux_run):
    with open(os.path.join(ux_run["run"], "grape_trajectory.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert [r.get("step") for r in rows if r.get("type") == "update"] == [0, 4, 8]


def test_train_command_prints_grape_lines_not_library_chatter(tmp_path):
    """`grape-stream train` at the default level, 6 batches of 7 domains x 7 targets with an update and an evaluation
    every 3 (issue 33: 328 lines): the console log stays under 80 lines: no alignment matrix, no per-group probe
    details, no evaluation progress lines, no "Cannot split tensor" warnings (each target's last evaluation batch is
    short here), no INFO lines of streaming / Composer / botocore; each GRAPE update reported once (its progress line);
    the matrix is still in metrics.jsonl. `--quiet`: nothing on stderr; the recipe's `python_log_level` (llm-foundry's
    key) brings grape_stream's and Composer's INFO lines back."""
    import subprocess
    import sys

    import yaml

    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    write_dataset(data, domains=7, tasks=tuple(range(7)), n_domain=48, n_val=8, n_test=20)
    names = {"domains": [f"d{k}" for k in range(7)], "tasks": [f"t{n}" for n in range(7)]}
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(data, out, data=names, algorithm={"alpha_every": 3, "z_every": 3},
                                                 trainer={"max_duration": "6ba", "eval_interval": "3ba",
                                                          "log_to_console": True})))
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def train(*extra: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "grape_stream.cli", "train", str(recipe), *extra],
                              capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    plain = train("run_name=plain")
    log = plain.stdout + plain.stderr
    assert len(log.splitlines()) < 80, log
    for noise in ("grape/alignment/", "grape/domain_loss/", "Eval batch=1/", "Cannot split", "warnings.warn",
                  " INFO composer", " INFO streaming", " INFO botocore", "Config:", "time/batch"):
        assert noise not in log, noise
    grape = [line for line in plain.stderr.splitlines() if line.startswith("GRAPE update")]
    assert grape[0] == "GRAPE update 1 (step 3): probing 14 groups (7 domains + 7 tasks), 56 samples ..."
    assert len(grape) == 4 and re.match(r"GRAPE update 2 \(step 6\) done in [0-9.]+s \(", grape[3]), grape
    assert "Eval on t6 data: LanguageCrossEntropy " in plain.stderr  # one line per evaluated target
    assert "GRAPE run summary" in plain.stdout
    with open(os.path.join(out, "plain", "metrics.jsonl"), encoding="utf-8") as f:
        assert any("grape/alignment/d6/t6" in json.loads(line) for line in f)  # kept for the trackers and files
    quiet = train("run_name=quiet", "--quiet", "trainer.max_duration=3ba")
    assert quiet.stderr == "" and "GRAPE run summary" in quiet.stdout
    chatty = train("run_name=chatty", "python_log_level=info", "trainer.max_duration=3ba")
    assert " INFO composer." in chatty.stderr and " INFO streaming." not in chatty.stderr


def test_metrics_jsonl_starts_from_scratch_unless_a_checkpoint_is_loaded(tmp_path):
    """A run killed before its first checkpoint and started again with the same command logged its first steps a
    second time (issue 33): a run that loads no checkpoint starts the file anew; a resumed one keeps the rows its
    checkpoint counted (the steps it trains again are logged again, once); a checkpoint of an earlier version
    (no row count) appends, as then."""
    from grape_stream.integrations.composer.callbacks import JSONLMetricsLogger

    path = tmp_path / "metrics.jsonl"

    def run(old_rows: int, state: dict | None) -> list[int]:
        path.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, old_rows + 1)))
        logger = JSONLMetricsLogger(str(path))
        if state is not None:
            logger.load_state_dict(state)
        assert logger.state_dict() == {"rows": 0 if state is None else state.get("rows", old_rows)}
        for step in (1, 2):
            logger.log_metrics({"loss": 1.0}, step=step)
        logger.close(None, None)  # type: ignore[arg-type]
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]

    assert run(10, None) == [1, 2]  # killed at step ~10 before any checkpoint, started again: 1, 2 once
    assert run(10, {"rows": 3}) == [1, 2, 3, 1, 2]  # resumed from the checkpoint at row 3
    assert run(4, {}) == [1, 2, 3, 4, 1, 2]  # an earlier version's checkpoint: appended
