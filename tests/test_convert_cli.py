"""The convert CLI stays light and its reader flags come from the reader registry."""

from __future__ import annotations

import os
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


def test_package_exports_the_main_names():
    import grape_stream.convert as gc
    from grape_stream.convert import pipeline

    assert gc.convert is pipeline.convert and gc.ConvertResult is pipeline.ConvertResult
    assert gc.ConvertInputError is pipeline.ConvertInputError and gc.ConvertStateError is pipeline.ConvertStateError
    assert gc.CONVERTER_VERSION == pipeline.CONVERTER_VERSION == 1
