"""How much of the log the command line shows: ``--log-level LEVEL`` and ``--quiet`` (any sub-command).

grape_stream's own messages show at the chosen level (default ``info``); every other library's (Composer,
streaming, botocore, torch, and Python warnings, captured into logging) at ``warning`` and above, ``error``
and above with ``--quiet``, which also turns off progress lines. ``--log-level debug`` shows everything.

Why: with the root logger at INFO a 6-batch ``train`` printed ~28 streaming INFO lines (the defaults it
chose), Composer's seeding notes and botocore's credential lookups around the few lines that matter.
A recipe's ``python_log_level`` (llm-foundry's key) sets the level of grape_stream and Composer, as it
sets llm-foundry's and Composer's there, unless ``--log-level`` was given.
"""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

__all__ = ["LEVELS", "add_console_arguments", "configure_logging", "is_quiet", "level_given", "parse_console_args"]

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_state = {"quiet": False, "given": False}


def parse_console_args(argv: Sequence[str]) -> tuple[list[str], str | None, bool]:
    """``argv`` without ``--log-level LEVEL`` / ``--log-level=LEVEL`` / ``--quiet``, the level and quiet.

    A level outside :data:`LEVELS` raises ValueError naming the choices."""
    rest: list[str] = []
    level: str | None = None
    quiet = False
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--quiet":
            quiet = True
        elif a == "--log-level" or a.startswith("--log-level="):
            if "=" in a:
                level = a.split("=", 1)[1]
            elif i + 1 < len(args):
                i += 1
                level = args[i]
            else:
                raise ValueError(f"--log-level needs a level: {', '.join(LEVELS)}")
            if level.lower() not in LEVELS:
                raise ValueError(f"--log-level {level!r}: choose from {', '.join(LEVELS)}")
            level = level.lower()
        else:
            rest.append(a)
        i += 1
    return rest, level, quiet


def add_console_arguments(parser: argparse.ArgumentParser) -> None:
    """List ``--log-level`` / ``--quiet`` / ``--debug`` in a sub-command's ``--help``: ``grape-stream`` takes them
    anywhere on the line and applies them before the sub-command parses the rest (:func:`parse_console_args`),
    so a user reading one sub-command's help sees them there."""
    group = parser.add_argument_group("output (any command)")
    group.add_argument("--log-level", choices=LEVELS, default=None,
                       help="grape_stream's messages at this level (default info); other libraries' (Composer, "
                            "streaming, botocore) at warning and above")
    group.add_argument("--quiet", action="store_true",
                       help="warnings and errors only: no progress lines, no training log on the console")
    group.add_argument("--debug", action="store_true",
                       help="an error shows its full traceback instead of one line (or GRAPE_STREAM_DEBUG=1)")


def configure_logging(level: str | None = None, *, quiet: bool = False, given: bool | None = None,
                      also: Sequence[str] = ()) -> None:
    """Set grape_stream's level (default info; warning with ``quiet``) and every other library's (warning;
    error with ``quiet``; debug with level debug). ``also``: other loggers set to grape_stream's level
    (``python_log_level`` sets Composer's too). ``given``: the level came from the command line."""
    own = (level or ("warning" if quiet else "info")).upper()
    others = "DEBUG" if own == "DEBUG" else ("ERROR" if quiet else "WARNING")
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format=FORMAT)
    root.setLevel(others)
    logging.captureWarnings(True)  # Python warnings (Composer's UserWarnings) follow the same levels
    for name in ("grape_stream", *also):
        logging.getLogger(name).setLevel(own)
    _state["quiet"] = quiet
    if given is not None:
        _state["given"] = given


def is_quiet() -> bool:
    """``--quiet`` was given: progress lines stay off."""
    return _state["quiet"]


def level_given() -> bool:
    """``--log-level`` was given on the command line (it wins over a recipe's ``python_log_level``)."""
    return _state["given"]
