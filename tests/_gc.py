"""What only Python's cycle collector would free: the leak checks of the probe and in-step engines."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def cycle_garbage(kind: type) -> Iterator[list]:
    """Run the block with the collector off; the list it yields then holds the objects of ``kind`` that a
    collection at the block's end finds in reference cycles (with DEBUG_SAVEALL they land in gc.garbage instead
    of being freed), i.e. what stayed resident until the next full collection."""
    gc.collect()
    gc.disable()
    flags = gc.get_debug()
    found: list = []
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        yield found
        gc.collect()
        found.extend(o for o in gc.garbage if isinstance(o, kind))
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        gc.enable()
