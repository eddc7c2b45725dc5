"""`grape-stream train --dry-run` catches, in one line, what the real run would only refuse after building
everything (issue 22): static weights / alpha0 off the simplex, unknown callbacks and loggers, a missing
trainer.load_path, a domain missing from local data; it accepts a recipe whose vocab_size comes from the local
data's manifest. Plus `--resume` and a misspelt built-in tokenizer."""

from __future__ import annotations

import os
import time

import pytest
import yaml

from _grape_data import write_dataset
from grape_stream.cli import main as cli_main
from test_composer import tiny_recipe


def _err(capsys, *argv: str) -> str:
    assert cli_main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("override, message", [
    ("algorithm.options.weights=[0.5,0.6,0,0,0,0,0,0,0,0,0,0,0]", "'algorithm.options.weights' sums to 1.1, not 1"),
    ("algorithm.options.weights=[1.5,-0.5,0,0,0,0,0,0,0,0,0,0,0]", "must be non-negative finite numbers"),
    ("algorithm.options.weights=[0.5,0.5]", "has 2 numbers but data.domains has 13 domains"),
    ("algorithm.options.alpha0=[0.2,0.2,0.2,0.2,0.2,0.2,0,0,0,0,0,0,0]", "'algorithm.options.alpha0' sums to 1.2"),
    ("callbacks.lr_monitr={}", "unknown callback 'callbacks.lr_monitr'; did you mean 'lr_monitor'?"),
    ("trainer.loggers.wandbb={}", "unknown logger 'trainer.loggers.wandbb'; did you mean 'wandb'?"),
    ("trainer.load_path=runs/nope/ep0-ba100-rank0.pt", "'trainer.load_path' is 'runs/nope/ep0-ba100-rank0.pt', "
                                                       "which does not exist; to continue a run"),
])
def test_dry_run_refuses_in_one_line(capsys, override, message):
    method = ["algorithm.method=static"] if "weights" in override else []
    assert message in _err(capsys, "demo-cpu", "--dry-run", *method, override)


def test_recipe_names_checked_before_composer_match_the_built_ones():
    from grape_stream.integrations.composer.recipe_callbacks import CALLBACKS
    from grape_stream.integrations.composer.train_cli import CALLBACK_NAMES, LOGGER_NAMES
    from grape_stream.integrations.composer.trainer import LOGGERS

    assert set(CALLBACK_NAMES) == set(CALLBACKS) and tuple(LOGGERS) == LOGGER_NAMES


def test_dry_run_refuses_missing_local_data_at_once_without_composer(tmp_path):
    """`train demo-cpu --dry-run` before `make demo`: one line naming data.local, from a process that has not
    imported Composer (the check runs before it)."""
    import subprocess
    import sys

    code = ("import sys; from grape_stream.cli import main; rc = main(['train', 'demo-cpu', '--dry-run']); "
            "assert 'composer' not in sys.modules, 'Composer imported before the recipe was checked'; sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "recipe key 'data.local' is 'runs/demo/mds', which does not exist" in r.stderr
    assert "make demo" in r.stderr


def test_resume_points_at_the_recipe_keys(capsys):
    err = _err(capsys, "demo-cpu", "--resume", "runs/x")
    assert "set trainer.autoresume=true" in err and "trainer.load_path=runs/x" in err


def test_dry_run_reads_a_local_manifest_and_checks_its_domains(tmp_path, capsys):
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=32, n_val=8, n_test=8)
    cfg = tiny_recipe(data, str(tmp_path / "out"))
    del cfg["model"]["vocab_size"]  # the real run takes it from data/manifest.json
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    assert cli_main(["train", str(recipe), "--dry-run"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    err = _err(capsys, str(recipe), "--dry-run", "data.domains=[d0,d1,d9]")
    assert "d9" in err and os.path.join(data, "d9") in err


def test_a_misspelt_builtin_tokenizer_fails_at_once_with_a_suggestion(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n')
    t = time.monotonic()
    assert cli_main(["convert", "jsonl", "-i", str(src), "-o", str(tmp_path / "o"), "--tokenizer", "gtp2"]) == 2
    assert "tokenizer 'gtp2' is not known; did you mean 'gpt2'?" in capsys.readouterr().err
    assert time.monotonic() - t < 30  # no hub round trips (it waited 63 s offline)


def test_an_uncached_hub_tokenizer_offline_is_one_line_at_once(tmp_path, capsys, monkeypatch):
    """A Hugging Face name that is not in the local cache, with the hub out of reach: one line in seconds (it retried
    for 61 s and printed 45 warnings twice)."""
    from huggingface_hub import constants

    from grape_stream.convert.tokenization import hub_reachable

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    t = time.monotonic()
    assert not hub_reachable()
    assert time.monotonic() - t < 15  # a 3 s connection timeout, name resolution included
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not hub_reachable()
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n')
    assert cli_main(["convert", "jsonl", "-i", str(src), "-o", str(tmp_path / "o"),
                     "--tokenizer", "some-org/no-such-tokenizer"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "'some-org/no-such-tokenizer' is not in the local Hugging Face cache and the hub cannot be reached" in err
