"""The convert CLI stays light and its reader flags come from the reader registry."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from grape_stream.convert.cli import build_parser
from grape_stream.convert.readers import SOURCES, build_reader, reader_class, reader_options


def test_convert_cli_help_imports_no_torch():
    code = (
        "import sys\n"
        "from grape_stream.cli import main\n"
        "try:\n"
        "    main(['convert', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "import grape_stream.convert, grape_stream.convert.pipeline, grape_stream.convert.spark\n"
        "heavy = sorted(m for m in ('torch', 'streaming', 'pyspark', 'transformers', 'composer') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--domain-field" in r.stdout and "--layout" in r.stdout


def test_every_reader_option_is_a_cli_flag_naming_its_sources():
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    for name, (opt, sources) in reader_options().items():
        assert name in flags and opt.flag in flags[name].option_strings
        assert all(s in flags[name].help for s in sources)
    assert list(SOURCES) == ["slimpajama", "climblab", "climbmix", "wiki40b", "jsonl", "parquet", "task"]


def test_registry_lookup_and_unknown_source():
    assert reader_class("jsonl").source == "jsonl"
    with pytest.raises(ValueError, match="unknown source 'nope'; choose one of slimpajama"):
        build_reader("nope")
    with pytest.raises(TypeError, match="unknown reader option"):
        build_reader("jsonl", colour="red")


def test_the_command_line_is_one_convert_config_with_its_defaults(tmp_path):
    """Every flag left out takes ConvertConfig's default (stated there once); the flags given set its fields;
    a misspelt keyword of convert() is one error naming the closest field."""
    from grape_stream.config import ConvertConfig
    from grape_stream.convert import convert
    from grape_stream.convert.cli import config_from_args
    from grape_stream.errors import UnknownOptionError

    unset = {name: None if not opt.is_flag else False for name, (opt, _) in reader_options().items()}
    plain = config_from_args(build_parser().parse_args(["jsonl", "-i", "a.jsonl", "-o", "out"]))
    assert plain == ConvertConfig(source="jsonl", inputs=["a.jsonl"], out="out", reader=unset)
    given = config_from_args(build_parser().parse_args(
        ["jsonl", "-i", "a.jsonl", "-o", "out", "--shard-size", "2kb", "--compression", "none",
         "--hashes", "sha1,xxh64", "--no-progress", "--text-errors", "skip", "--domain-field", "lang",
         "--per-example"]))
    assert (given.shard_size, given.compression, given.hashes, given.progress, given.text_policy, given.per_example) \
        == ("2kb", None, ["sha1", "xxh64"], False, "skip", True)
    assert given.reader["domain_field"] == "lang"
    with pytest.raises(UnknownOptionError, match=r"argument 'shard_sise'; did you mean 'shard_size'"):
        convert("jsonl", [str(tmp_path)], str(tmp_path / "o"), shard_sise="1kb")


def test_package_exports_the_main_names():
    import grape_stream.convert as gc
    from grape_stream.convert import pipeline

    assert gc.convert is pipeline.convert and gc.ConvertResult is pipeline.ConvertResult
    assert gc.ConvertInputError is pipeline.ConvertInputError and gc.ConvertStateError is pipeline.ConvertStateError
    assert gc.CONVERTER_VERSION == pipeline.CONVERTER_VERSION == 1


def test_a_new_reader_is_one_registered_class(tmp_path, capsys):
    """The docs/converters.md example: a reader module with its own option reaches the CLI and convert."""
    from dataclasses import dataclass

    from grape_stream.convert.cli import main as cli_main
    from grape_stream.convert.formats import iter_jsonl
    from grape_stream.convert.inputs import check_domain_name
    from grape_stream.convert.readers.base import DOMAIN, REGISTRY, BadInput, Reader, ReaderOption, Record, register

    MIN_CHARS = ReaderOption("min_chars", "--min-chars", "skip documents shorter than this", default="0")

    @register
    @dataclass
    class MyCorpusReader(Reader):
        domain: str | None = None
        min_chars: str = "0"
        source = "mycorpus"
        patterns = (".jsonl",)
        options = (DOMAIN, MIN_CHARS)

        def describe(self):
            return {"domain": self.domain, "min_chars": self.min_chars}

        def read(self, path):
            for item in iter_jsonl(path):
                if isinstance(item, BadInput):
                    yield item
                    continue
                idx, obj = item
                domain = self.domain or obj.get("source")
                if check_domain_name(domain):
                    yield BadInput("bad_field", idx, "line", check_domain_name(domain))
                elif len(obj.get("text") or "") >= int(self.min_chars):
                    yield Record(idx, "line", domain, text=obj["text"])

    try:
        assert "--min-chars" in build_parser().format_help()
        with pytest.raises(ValueError, match="--min-chars does not apply to source 'jsonl'"):
            build_reader("jsonl", min_chars="3")
        src = tmp_path / "in.jsonl"
        src.write_text('{"text": "a long enough document", "source": "web"}\n{"text": "tiny", "source": "web"}\n')
        rc = cli_main(["mycorpus", "-i", str(src), "-o", str(tmp_path / "out"), "--tokenizer", "bytes",
                       "--seq-len", "4", "--min-chars", "10", "--no-progress"])
        assert rc == 0, capsys.readouterr().err
        m = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert m["reader"] == {"domain": None, "min_chars": "10"} and m["domains"]["web"]["documents"] == 1
    finally:
        REGISTRY.pop("mycorpus", None)


def test_progress_in_a_log_is_plain_lines_and_on_a_terminal_bars(tmp_path, monkeypatch):
    """stderr not a terminal (a log file): no tqdm control codes, a plain line every `interval` seconds and one at
    the end; a terminal gets the bars. A real conversion with stderr sent to a file writes no carriage return."""
    import io

    from grape_stream.convert.progress import Progress

    log = io.StringIO()
    p = Progress(enabled=True, total_units=2, done_units=0, done_markers=[], stream=log, interval=3600)
    p.update({"tokens": {"en": 1500}})
    p.unit_done({})
    p.update({"tokens": {"fr": 2_500_000}})
    p.close()
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()
    assert re.fullmatch(r"convert: 1/2 units, 2\.5M tokens \(en 1\.5k, fr 2\.5M\), \d+s\n", log.getvalue())

    every = io.StringIO()
    p = Progress(enabled=True, total_units=3, done_units=1, done_markers=[], stream=every, interval=0)
    p.unit_done({})
    p.close()
    assert every.getvalue().splitlines()[0].startswith("convert: 2/3 units")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    p = Progress(enabled=True, total_units=2, done_units=0, done_markers=[], stream=tty)
    p.update({"tokens": {"en": 10}})
    p.close()
    assert "\r" in tty.getvalue() and "convert:" not in tty.getvalue()

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i} " * 5, "source": "web"}) + "\n"
                           for i in range(50)))
    with open(tmp_path / "stderr.log", "w") as err:
        r = subprocess.run([sys.executable, "-m", "grape_stream.cli", "convert", "jsonl", "-i", str(src), "-o",
                            str(tmp_path / "out"), "--tokenizer", "bytes", "--seq-len", "16"],
                           stdout=subprocess.PIPE, stderr=err, text=True, timeout=300)
    text = (tmp_path / "stderr.log").read_text()
    assert r.returncode == 0, text
    assert "\r" not in text and re.search(r"^convert: 1/1 units, [0-9.]+k tokens \(in ", text, re.M), text
