"""Replacing one streaming method, only where its signature is the one the replacement was written for.

Each workaround that must change what streaming does inside one of its methods (``s3_session.py``,
``decompress.py``) replaces that method on its class, once, and only when the method still takes the parameters
it took in the versions the workaround was written for (0.12 / 0.13): another version keeps its own method and
the workaround says so in the debug log, rather than calling it with the wrong arguments.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Sequence

__all__ = ["replace_method"]

logger = logging.getLogger(__name__)


def replace_method(owner: Any, name: str, replacement: Callable[..., Any], parameters: Sequence[str]) -> bool:
    """Set ``owner.name = replacement`` (idempotent); False, and nothing changed, when ``owner.name`` is missing
    or its parameters are not ``parameters``."""
    current = getattr(owner, name, None)
    if current is replacement:
        return True
    if current is None or list(inspect.signature(current).parameters) != list(parameters):
        logger.debug("streaming's %s has no %s(%s): not patched", owner.__name__, name, ", ".join(parameters))
        return False
    setattr(owner, name, replacement)
    return True
