"""The two conversion errors the CLI turns into exit status 1 (everything else is a usage error, 2)."""

from __future__ import annotations

__all__ = ["ConvertInputError", "ConvertStateError"]


class ConvertInputError(ValueError):
    """Bad input under --strict: the message names the file, the line/row and what is wrong."""


class ConvertStateError(RuntimeError):
    """OUT holds something this run must not overwrite (another conversion, or foreign files)."""
