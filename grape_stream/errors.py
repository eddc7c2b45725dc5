"""Errors a user can fix, and how the command line reports them: one line, traceback on request.

A known failure (bad config key, missing data, unreachable or forbidden storage, a corrupt record under
--strict) is a `UserFacingError` (the library's own error types subclass it beside their builtin base,
so `except ValueError` callers keep working); the CLI prints
``grape-stream: error: <message>`` (one line) and exits 2 (1 for storage), without a 30-frame traceback. The
traceback comes back with ``--debug`` or ``GRAPE_STREAM_DEBUG=1``. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from typing import Callable, Iterable, Sequence

__all__ = [
    "UserFacingError",
    "ConfigError",
    "ConfigKeyError",
    "ConfigTypeError",
    "DataError",
    "StorageError",
    "UnknownOptionError",
    "debug_enabled",
    "did_you_mean",
    "run_cli",
]

#: How alike a misspelt key and a valid one must be (difflib's ratio) for the error to suggest it: close
#: enough for a typo (clip_nrom -> clip_norm: 0.89), not so loose that any key of the section is offered
#: (model.name -> model.n_layer: 0.55).
SUGGEST_CUTOFF = 0.75

DEBUG_ENV = "GRAPE_STREAM_DEBUG"


_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@?#]*@")


def redact_url(text: str) -> str:
    """``text`` with the user-info of every URL in it (``sftp://user:password@host`` -> ``sftp://***@host``):
    the one rule for every message and file that shows a remote, so a password in a URL is never repeated
    into logs, error lines or cache markers."""
    return _USERINFO.sub(r"\1***@", text)


class UserFacingError(Exception):
    """A failure the user can act on; its message names the key / path / endpoint and the fix (any URL in it
    shown without its user-info)."""

    exit_code = 2

    def __str__(self) -> str:
        return redact_url(super().__str__())


class ConfigError(UserFacingError, ValueError):
    """A recipe or option is wrong (unknown key, bad type, inconsistent values)."""


class ConfigKeyError(ConfigError, KeyError):
    """An unknown key (still a KeyError for callers that catch one); printed without KeyError's quotes."""

    def __str__(self) -> str:
        return redact_url(str(self.args[0])) if self.args else ""


class UnknownOptionError(ConfigKeyError, TypeError):
    """A keyword option the receiver does not take (still a TypeError, as Python's unexpected keyword is)."""


class ConfigTypeError(ConfigError, TypeError):
    """A value of the wrong type for its key (still a TypeError for callers that catch one)."""


class DataError(UserFacingError, ValueError):
    """The data is missing, of the wrong shape, or inconsistent with the model/recipe."""


class StorageError(UserFacingError, ConnectionError):
    """Remote storage is unreachable, forbidden, or kept failing past the retry deadline."""

    exit_code = 1


def did_you_mean(name: str, valid: Iterable[str], *, prefix: str = "") -> str:
    """``"; did you mean '<prefix><closest>'?"`` for the valid name closest to ``name``, or ``""`` when none is
    close (:data:`SUGGEST_CUTOFF`). The one rule every unknown-key error (recipe, options, mixer) follows."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=SUGGEST_CUTOFF)
    return f"; did you mean {prefix + close[0]!r}?" if close else ""


def debug_enabled(argv: Sequence[str] = ()) -> bool:
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0", "false", "no")


def run_cli(prog: str, entry: Callable[[list[str]], int], argv: Sequence[str]) -> int:
    """Run a sub-command; known failures become one line on stderr (unless --debug)."""
    args = [a for a in argv if a != "--debug"]
    debug = debug_enabled(argv)
    try:
        return int(entry(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - user errors become one line; anything else re-raises
        if debug or not isinstance(exc, UserFacingError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{prog}: error: {first}  [--debug or {DEBUG_ENV}=1 shows the traceback]", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
