"""`--log-level` / `--quiet` on any sub-command (grape_stream.console)."""

from __future__ import annotations

import logging

import pytest

from grape_stream.cli import main as cli_main
from grape_stream.console import configure_logging, is_quiet, parse_console_args


@pytest.fixture(autouse=True)
def _restore_levels():
    names = ("", "grape_stream", "composer")
    old = {n: logging.getLogger(n).level for n in names}
    yield
    for n, lvl in old.items():
        logging.getLogger(n).setLevel(lvl)
    configure_logging.__globals__["_state"].update(quiet=False, given=False)
    logging.captureWarnings(False)


def test_options_anywhere_on_the_line():
    assert parse_console_args(["train", "r.yaml", "--log-level", "DEBUG", "a=1"]) == (["train", "r.yaml", "a=1"],
                                                                                      "debug", False)
    assert parse_console_args(["--quiet", "convert", "--log-level=warning"]) == (["convert"], "warning", True)
    with pytest.raises(ValueError, match="choose from debug, info, warning, error"):
        parse_console_args(["train", "--log-level", "verbose"])


def test_levels_own_messages_and_other_libraries():
    configure_logging(None)
    assert logging.getLogger("grape_stream").level == logging.INFO and logging.getLogger().level == logging.WARNING
    configure_logging(None, quiet=True)
    assert logging.getLogger("grape_stream").level == logging.WARNING and logging.getLogger().level == logging.ERROR
    assert is_quiet()
    configure_logging("debug", also=("composer",))
    assert logging.getLogger().level == logging.DEBUG and logging.getLogger("composer").level == logging.DEBUG


def test_bad_level_is_one_line(capsys):
    assert cli_main(["inspect", "--log-level", "loud"]) == 2
    assert capsys.readouterr().err.strip() == ("grape-stream: error: --log-level 'loud': choose from debug, info, "
                                               "warning, error")
