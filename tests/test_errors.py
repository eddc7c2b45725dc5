"""Known failures print one line naming the key / path / fix and exit 2 (config, data) or 1 (storage);
``--debug`` / GRAPE_STREAM_DEBUG=1 re-raise with the traceback; anything else (a bug) keeps its traceback.
Recipes are validated up front: types per key, time strings, vocab_size against the data's manifest, the
data directories, before any model or trainer is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from convert_data import make_docs, write_jsonl
from grape_stream.cli import main as cli_main
from grape_stream.errors import DEBUG_ENV, ConfigError, DataError, StorageError, UserFacingError

REPO = Path(__file__).resolve().parents[1]


def one_line(err: str, *needles: str) -> str:
    """``err`` is exactly one ``grape-stream: error: ...`` line holding every needle."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("grape-stream: error: ") and f"--debug or {DEBUG_ENV}=1" in line, line
    for n in needles:
        assert n in line, (n, line)
    return line


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A real `grape-stream convert` output (bytes tokenizer, vocab 257): OUT/{en,fr}/index.json + manifest.json."""
    from grape_stream.convert.pipeline import convert

    root = tmp_path_factory.mktemp("errors_data")
    for i, d in enumerate(["en", "fr"]):
        write_jsonl(root / "src" / f"{d}.jsonl", [{"text": t} for t in make_docs(40, i)])
    convert("jsonl", [str(root / "src")], str(root / "out"), tokenizer="bytes", seq_len=32, progress=False)
    return root / "out"


def _train_args(data: Path | str, tmp_path: Path, *extra: str) -> list[str]:
    return ["train", "demo-cpu", f"data.local={data}", "data.split=null", "data.domains=[en, fr]", "data.tasks=[]",
            "algorithm.method=uniform", "trainer.max_duration=2ba", "trainer.global_train_batch_size=4",
            "model.d_model=32", "model.n_head=2", "model.d_ff=64", "trainer.device=cpu",
            f"trainer.save_folder={tmp_path}/ckpt", f"output_dir={tmp_path}/{{run_name}}", *extra]


# ---------------------------------------------------------------------------------------------------
# recipe keys: types and time strings (through the real command line, --dry-run: no data needed)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, needles", [
    ("model.n_layer=two", ["recipe key 'model.n_layer' must be an int, got 'two'"]),
    ("model.n_layer=true", ["'model.n_layer' must be an int, got True"]),
    ("optimizer.lr=fast", ["recipe key 'optimizer.lr' must be a number, got 'fast'"]),
    ("optimizer.betas=[0.9, x]", ["'optimizer.betas' must be a list of numbers"]),
    ("trainer.max_duration=40", ["'trainer.max_duration'", "add a unit: '40ba' (batches)"]),
    ("trainer.max_duration=1ep",
     ["'trainer.max_duration'", "the mixer's stream is endless (no epochs): use 'Nba' or 'Ntok'"]),
    ("trainer.max_duration=0.5dur", ["'trainer.max_duration'", "'Nba'"]),
    ("trainer.eval_interval=100", ["'trainer.eval_interval'", "add a unit: '100ba'"]),
    ("trainer.save_interval=2ep", ["'trainer.save_interval'", "no epochs"]),
    ("scheduler.t_warmup=1.5ba", ["'scheduler.t_warmup'", "whole numbers"]),
    ("trainer.max_duration=10min", ["'trainer.max_duration'", "unit 'min'"]),
    ("trainer.max_durations=1ba",
     ["unknown recipe key 'trainer.max_durations'", "did you mean 'trainer.max_duration'"]),
    ("trainer.autoresume=true|trainer.save_folder=null", ["'trainer.autoresume'", "trainer.save_folder"]),
    # the typed sections: a misspelt key anywhere is one line with the closest valid one
    ("algorithm.options.clip_nrom=1",
     ["unknown recipe key 'algorithm.options.clip_nrom'", "did you mean 'algorithm.options.clip_norm'"]),
    ("data.mixer.retry_deadlin=5",
     ["unknown recipe key 'data.mixer.retry_deadlin'", "did you mean 'data.mixer.retry_deadline'"]),
    ("algorithm.gram_options.micro_batch=4",
     ["unknown recipe key 'algorithm.gram_options.micro_batch'",
      "did you mean 'algorithm.gram_options.micro_batch_size'"]),
    ("algorithm.alpha_every=0", ["algorithm.alpha_every must be a positive integer, got 0"]),
    ("algorithm.options.clip_norm=-1", ["algorithm (method grape)", "clip_norm must be None (no clipping) or"]),
    ("algorithm.method=static", ["algorithm (method static)", "needs weights=[...] (7 domain weights"]),
])
def test_bad_recipe_keys_are_one_line_naming_the_key(override, needles, capsys):
    assert cli_main(["train", "slimpajama-125m", "--dry-run", *override.split("|")]) == 2
    captured = capsys.readouterr()
    one_line(captured.err, *needles)
    assert captured.out == ""  # failed before anything was built or printed


def test_a_key_with_no_close_match_gets_no_suggestion(capsys):
    assert cli_main(["train", "slimpajama-125m", "--dry-run", "model.name=x"]) == 2
    line = one_line(capsys.readouterr().err, "unknown recipe key 'model.name'")
    assert "did you mean" not in line  # not model.n_layer: only close matches are suggested


def test_python_keywords_misspelt_are_one_line_with_the_closest(converted):
    """The same rule for Python users: a keyword override of a typed config, misspelt, is one
    UnknownOptionError (a TypeError) naming it and the closest field."""
    from grape_stream.errors import UnknownOptionError
    from grape_stream.integrations.grape_loop import GrapeLoop
    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    with pytest.raises(UnknownOptionError, match=r"^GRAPE got an unexpected option 'clip_nrom'; did you mean "
                                                 r"'clip_norm'\?$"):
        GrapeLoop(clip_nrom=1.0)
    with pytest.raises(UnknownOptionError, match=r"unknown option 'algorithm.options.z_smooth'.*'algorithm.options."
                                                 r"z_smoothing'"):
        GrapeLoop(options={"z_smooth": 0.1})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'retry_deadlin'; did you mean 'retry_deadline'"):
        WeightedStreamingMixer([DomainStream("en", local=str(converted / "en"))], batch_size=4, retry_deadlin=5)


def test_the_recipe_s_typed_sections_reach_their_consumers_as_they_are(converted):
    """data.mixer is the mixer's own config object (its retry_deadline in the retry policies of the reads, a
    domain's own value winning); algorithm is the GRAPE loop's config object."""
    from grape_stream.integrations.grape_loop import GrapeLoop
    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
    from grape_stream.recipe import build_mixer, load_config

    recipe = load_config("demo-cpu", [f"data.local={converted}", "data.split=null", "data.domains=[en, fr]",
                                      "data.mixer.retry_deadline=7.5", "algorithm.alpha_every=3"])
    with build_mixer(recipe, [{"name": d, "remote": None, "local": str(converted / d), "split": None}
                              for d in ("en", "fr")], batch_size=4, seed=0) as mixer:
        assert mixer.config is recipe.data.mixer
        assert [r.deadline for r in mixer._composer.retry] == [7.5, 7.5]
    own = [DomainStream("en", local=str(converted / "en"), retry_deadline=2.0),
           DomainStream("fr", local=str(converted / "fr"))]
    with WeightedStreamingMixer(own, batch_size=4, config=recipe.data.mixer) as mixer:
        assert [r.deadline for r in mixer._composer.retry] == [2.0, 7.5]  # DomainStream.own_or: the domain's first
    loop = GrapeLoop(recipe.algorithm)
    assert loop.config is recipe.algorithm and loop.config.alpha_every == 3


@pytest.mark.parametrize("override", [
    "optimizer.lr=1", "model.dropout=0", "model.seq_len=null", "trainer.max_duration=100sp",
    "trainer.max_duration=1e4tok", "trainer.eval_interval=0.25dur", "scheduler.t_warmup=0ba", "trainer.precision=null",
])
def test_sound_values_pass_validation(override):
    from grape_stream.recipe import load_recipe

    load_recipe("slimpajama-125m", [override])


def test_recipe_errors_keep_their_builtin_bases():
    from grape_stream.recipe import load_recipe

    with pytest.raises(KeyError, match="trainer.max_durations"):
        load_recipe("slimpajama-125m", ["trainer.max_durations=1ba"])
    with pytest.raises(TypeError, match="model.n_layer"):
        load_recipe("slimpajama-125m", ["model.n_layer=two"])
    with pytest.raises(ValueError, match="max_duration"):
        load_recipe("slimpajama-125m", ["trainer.max_duration=40"])
    with pytest.raises(FileNotFoundError, match="no recipe"):
        load_recipe("no-such-recipe")


def test_unknown_recipe_name_is_one_line(capsys):
    assert cli_main(["train", "no-such-recipe", "--dry-run"]) == 2
    one_line(capsys.readouterr().err, "no recipe 'no-such-recipe'")


# ---------------------------------------------------------------------------------------------------
# recipe vs data: the manifest's vocab_size, missing directories and domains (before any model is built)
# ---------------------------------------------------------------------------------------------------
def test_vocab_smaller_than_the_data_is_one_line_naming_both(converted, tmp_path, capsys):
    assert cli_main(_train_args(converted, tmp_path, "model.vocab_size=100")) == 2
    one_line(capsys.readouterr().err, "'model.vocab_size' is 100", "vocab_size=257", "manifest.json")


def test_vocab_from_the_converters_manifest_and_padding_allowed(converted):
    from grape_stream.recipe import load_recipe, read_manifest, resolved_sizes

    cfg = load_recipe("demo-cpu", [f"data.local={converted}", "model.vocab_size=null", "data.seq_len=null"])
    manifest = read_manifest(cfg)
    assert "vocab_size" not in manifest and manifest["tokenizer"]["vocab_size"] == 257  # the converter's layout
    assert resolved_sizes(cfg, manifest) == (257, 32)
    cfg["model"]["vocab_size"] = 320  # a padded vocabulary is fine
    assert resolved_sizes(cfg, manifest) == (320, 32)
    cfg["model"]["vocab_size"] = 256
    with pytest.raises(ConfigError, match="256 .* vocab_size=257"):
        resolved_sizes(cfg, manifest)


def test_missing_data_dir_is_one_line(tmp_path, capsys):
    missing = tmp_path / "no-such-data"
    assert cli_main(_train_args(missing, tmp_path)) == 2
    one_line(capsys.readouterr().err, str(missing), "'data.local'", "grape-stream convert")


def test_domain_not_in_the_shards_lists_what_exists(converted, tmp_path, capsys):
    assert cli_main(_train_args(converted, tmp_path, "data.domains=[en, de]")) == 2
    one_line(capsys.readouterr().err, "domain 'de'", str(converted / "de"), "['en', 'fr']")


def test_split_the_data_does_not_have(converted, tmp_path, capsys):
    assert cli_main(_train_args(converted, tmp_path, "data.split=train")) == 2
    one_line(capsys.readouterr().err, "no split 'train'", "data.split=null")


@pytest.fixture(scope="module")
def converted_task(tmp_path_factory) -> Path:
    """A target task converted with splits named as the demo corpus names them: OUT/t0/{probe,test}."""
    from grape_stream.convert.pipeline import convert

    root = tmp_path_factory.mktemp("errors_task")
    recs = [{"text": t, "split": "probe" if i % 2 else "test"} for i, t in enumerate(make_docs(40, 9))]
    write_jsonl(root / "src" / "t0.jsonl", recs)
    convert("jsonl", [str(root / "src")], str(root / "out"), tokenizer="bytes", seq_len=32, split_field="split",
            progress=False)
    return root / "out"


@pytest.mark.parametrize("override, key, wrong", [
    ("data.task_probe_split=validation", "'data.task_probe_split'", "validation"),
    ("data.task_test_split=nope", "'data.task_test_split'", "nope"),
    ("data.tasks=[{name: t0, split: validation}]", "'data.tasks[name=t0].split'", "validation"),
])
def test_a_task_split_the_data_does_not_have_names_its_own_key(converted, converted_task, tmp_path, capsys,
                                                                override, key, wrong):
    args = _train_args(converted, tmp_path, f"data.task_local={converted_task}", "data.tasks=[t0]",
                       "data.task_probe_split=probe", "data.task_test_split=test", override)
    assert cli_main(args) == 2
    line = one_line(capsys.readouterr().err, f"task 't0': no MDS index at {converted_task / 't0' / wrong}",
                    "splits there: ['probe', 'test']", key)
    assert "data.split" not in line


# ---------------------------------------------------------------------------------------------------
# --debug, GRAPE_STREAM_DEBUG, bugs
# ---------------------------------------------------------------------------------------------------
def test_debug_flag_and_env_reraise(monkeypatch, capsys):
    with pytest.raises(ConfigError, match="model.n_layer"):
        cli_main(["train", "slimpajama-125m", "--dry-run", "model.n_layer=two", "--debug"])
    with pytest.raises(ConfigError, match="model.n_layer"):
        cli_main(["--debug", "train", "slimpajama-125m", "--dry-run", "model.n_layer=two"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ConfigError, match="model.n_layer"):
        cli_main(["train", "slimpajama-125m", "--dry-run", "model.n_layer=two"])
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert cli_main(["train", "slimpajama-125m", "--dry-run", "model.n_layer=two"]) == 2


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    import grape_stream.apps.inspect as inspect_app

    def boom(path):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(inspect_app, "summarize", boom)
    with pytest.raises(ZeroDivisionError):
        cli_main(["inspect", "anything"])


def test_storage_errors_exit_1(monkeypatch, capsys):
    import grape_stream.apps.inspect as inspect_app

    def unreachable(path):
        raise StorageError(f"cannot reach {path}: connection refused; check S3_ENDPOINT_URL")

    monkeypatch.setattr(inspect_app, "summarize", unreachable)
    assert cli_main(["inspect", "s3://b/p"]) == 1
    one_line(capsys.readouterr().err, "s3://b/p", "S3_ENDPOINT_URL")


def test_subprocess_stderr_is_exactly_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(DEBUG_ENV, None)
    cmd = [sys.executable, "-m", "grape_stream.cli", "train", "demo-cpu", "--dry-run", "trainer.max_duration=1ep"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2
    one_line(r.stderr, "'trainer.max_duration'", "no epochs")
    r = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr and "ConfigError" in r.stderr


# ---------------------------------------------------------------------------------------------------
# the other commands
# ---------------------------------------------------------------------------------------------------
def test_convert_missing_input_is_one_line(tmp_path, capsys):
    rc = cli_main(["convert", "jsonl", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o"),
                   "--tokenizer", "bytes", "--no-progress"])
    assert rc == 2
    one_line(capsys.readouterr().err, "nope.jsonl")


def test_convert_into_another_conversion_is_one_line_exit_1(converted, tmp_path, capsys):
    src = tmp_path / "de.jsonl"
    write_jsonl(src, [{"text": t} for t in make_docs(5, 9)])
    rc = cli_main(["convert", "jsonl", "-i", str(src), "-o", str(converted), "--tokenizer", "bytes", "--seq-len", "64",
                   "--no-progress"])
    assert rc == 1
    one_line(capsys.readouterr().err, str(converted))


def test_inspect_plot_demo_missing_paths_are_one_line(tmp_path, capsys):
    assert cli_main(["inspect", str(tmp_path / "nothing")]) == 2
    one_line(capsys.readouterr().err, "nothing", "no such file")
    assert cli_main(["plot", str(tmp_path / "t.jsonl")]) == 2
    one_line(capsys.readouterr().err, "t.jsonl")
    assert cli_main(["demo", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    one_line(capsys.readouterr().err, "nowhere", "--data")


# ---------------------------------------------------------------------------------------------------
# the library's error classes: user-facing, builtin bases kept
# ---------------------------------------------------------------------------------------------------
def test_error_classes_are_user_facing_with_their_old_bases():
    from grape_stream.convert.errors import ConvertInputError, ConvertStateError
    from grape_stream.streaming_compat.local_index import DomainUnavailableError, RemoteMismatchError

    assert issubclass(ConvertInputError, DataError) and issubclass(ConvertInputError, ValueError)
    assert issubclass(ConvertStateError, UserFacingError) and issubclass(ConvertStateError, RuntimeError)
    assert ConvertInputError.exit_code == ConvertStateError.exit_code == 1  # the converter's documented status
    for cls in (DomainUnavailableError, RemoteMismatchError):
        assert issubclass(cls, StorageError) and issubclass(cls, RuntimeError)


def test_domain_stream_types_are_checked_naming_the_field(tmp_path):
    from grape_stream.mixing.domains import DomainStream

    with pytest.raises(TypeError, match="name must be a non-empty str, got 3"):
        DomainStream(3, local=str(tmp_path))
    with pytest.raises(TypeError, match="DomainStream 'en': local must be a str"):
        DomainStream("en", local=3)
    with pytest.raises(TypeError, match="DomainStream 'en': remote must be a str"):
        DomainStream("en", remote=["s3://b/en"])
    with pytest.raises(TypeError, match="split"):
        DomainStream("en", local=str(tmp_path), split=1)
    d = DomainStream("en", local=tmp_path)  # a path object is accepted (as its str)
    assert d.local == str(tmp_path)


def test_a_password_in_a_url_is_never_repeated(tmp_path, capsys):
    from grape_stream.errors import DataError, redact_url, run_cli
    from grape_stream.streaming_compat.local_index import DomainUnavailableError, sync_local_index

    assert redact_url("sftp://alice:s3cret@host:22/p and s3://b/k@v, https://tok@h/x") == (
        "sftp://***@host:22/p and s3://b/k@v, https://***@h/x")
    assert str(DataError("cannot read sftp://alice:s3cret@h/x")) == "cannot read sftp://***@h/x"
    with pytest.raises(DomainUnavailableError) as info:  # a real sftp attempt to a closed port
        sync_local_index("d", "sftp://alice:s3cret@127.0.0.1:9/data", str(tmp_path / "c"), download_timeout=2,
                         retry_deadline=1)
    msg = str(info.value)
    assert "s3cret" not in msg and "alice" not in msg and "sftp://***@127.0.0.1:9" in msg

    def fails(argv):
        raise DataError("cannot read sftp://alice:s3cret@h/x")
    assert run_cli("grape-stream", fails, []) == 2
    assert "sftp://***@h/x" in capsys.readouterr().err


def test_a_domain_name_with_a_trailing_newline_is_refused():
    from grape_stream.convert.inputs import check_domain_name

    assert check_domain_name("web") is None
    assert check_domain_name("web\n") and check_domain_name("web\nx")
