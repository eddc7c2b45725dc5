"""Lazy package exports (PEP 562): a package names its public objects without importing their modules.

`import grape_stream` or `import grape_stream.convert` must stay light (the converter CLI runs without
torch; the core without Composer), yet users want `from grape_stream import WeightedStreamingMixer`.
Each package keeps a name -> module table and gets its `__getattr__` / `__dir__` from here; the first
access imports the module and caches the object in the package's namespace.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`, resolving each of `names` from its module on first use."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
