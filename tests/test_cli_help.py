"""Every sub-command's ``--help`` lists ``--quiet`` / ``--log-level`` (grape-stream takes them anywhere on the line)
and every option of every sub-command has help text: each parser is the one the command really builds, caught
when it parses (``argparse.ArgumentParser.parse_known_args``), nothing run."""

from __future__ import annotations

import argparse
import importlib

import pytest

from grape_stream.cli import COMMANDS


class _Caught(Exception):
    pass


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and its sub-command parsers (``mixture crisp|regmix``), recursively."""
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                out += _parsers(sub)
    return out


def _parser_of(command: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    caught: list[argparse.ArgumentParser] = []

    def catch(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        caught.append(self)
        raise _Caught

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    module, func, _ = COMMANDS[command]
    with pytest.raises(_Caught):
        getattr(importlib.import_module(module), func)(["x"])
    return caught[0]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_and_the_console_options_are_listed(command, monkeypatch):
    parser = _parser_of(command, monkeypatch)
    for p in _parsers(parser):
        options = {s for a in p._actions for s in a.option_strings}
        assert {"--quiet", "--log-level", "--debug"} <= options, (p.prog, sorted(options))
        no_help = [a.option_strings or a.dest for a in p._actions
                   if not isinstance(a, argparse._SubParsersAction) and a.help is None]
        assert not no_help, f"{p.prog}: no help text for {no_help}"
