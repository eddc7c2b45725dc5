"""The converter's own errors: each a :class:`~grape_stream.errors.UserFacingError` (one line on the command
line, exit status 1), keeping its builtin base so ``except ValueError`` / ``except RuntimeError`` still work."""

from __future__ import annotations

from grape_stream.errors import DataError, UserFacingError

__all__ = ["ConvertInputError", "ConvertStateError"]


class ConvertInputError(DataError):
    """Bad input under --strict: the message names the file, the line/row and what is wrong."""

    exit_code = 1


class ConvertStateError(UserFacingError, RuntimeError):
    """OUT holds something this run must not overwrite (another conversion, or foreign files)."""

    exit_code = 1
