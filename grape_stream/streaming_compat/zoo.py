"""Streaming's dataset zoo, imported when used rather than with the package.

mosaicml-streaming 0.12 / 0.13's ``streaming/__init__.py`` imports its ready-made datasets eagerly:
``streaming.text`` (whose C4 imports transformers' ``AutoTokenizer``, and through it most of transformers and
scikit-learn), ``streaming.vision`` (torchvision) and ``streaming.multimodal``. grape_stream uses only
``streaming.base``, yet every process that imports streaming paid for the zoo: 2.7 CPU-s of a 6-s import of
the mixer, in the mixer's process, each spawned DataLoader worker, each converter and each rank of a job.

:func:`defer_dataset_zoo` runs before streaming is first imported (``streaming_compat/__init__.py``). It puts a
placeholder module under each of the three names; ``import streaming`` then binds the placeholders, and
the first use of any name in one (``streaming.text.StreamingC4``, ``from streaming.vision import ...``)
imports the real subpackage, which replaces it. Submodule imports (``streaming.vision.base``) work from the
start, as the placeholder has the real package's path. Nothing is deferred when streaming is already
imported, or is not a release this was written for.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
import types
from typing import Any

__all__ = ["defer_dataset_zoo", "ZOO"]

ZOO = ("text", "vision", "multimodal")
_RELEASES = ("0.12.", "0.13.")  # the releases whose __init__ was read; a newer one is left as it is
_LOADING = threading.RLock()  # two threads using a placeholder at once: one swaps in the real subpackage


def defer_dataset_zoo() -> bool:
    """Install the placeholders if streaming is not imported yet; True when they are in place."""
    if "streaming" in sys.modules:
        return all(isinstance(sys.modules.get(f"streaming.{n}"), _Placeholder) for n in ZOO)
    try:
        if not importlib.metadata.version("mosaicml-streaming").startswith(_RELEASES):
            return False
        spec = importlib.util.find_spec("streaming")  # finds the package without running its __init__
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    for name in ZOO:
        full = f"streaming.{name}"
        path = [os.path.join(p, name) for p in spec.submodule_search_locations]
        if full not in sys.modules and any(os.path.isfile(os.path.join(p, "__init__.py")) for p in path):
            sys.modules[full] = _Placeholder(full, path)
    return True


class _Placeholder(types.ModuleType):
    """Stands for a zoo subpackage until a name in it is used."""

    def __init__(self, name: str, path: list[str]) -> None:
        super().__init__(name, f"streaming's {name} (imported on first use: grape_stream/streaming_compat/zoo.py)")
        self.__path__ = path

    def __getattr__(self, attr: str) -> Any:  # only for names the placeholder lacks
        if attr.startswith("__") and attr != "__all__":
            raise AttributeError(attr)  # introspection (copy, pickle, inspect) must not import the zoo
        real = self._load()
        return getattr(real, attr)

    def __dir__(self) -> list[str]:
        return dir(self._load())

    def _load(self) -> types.ModuleType:
        with _LOADING:
            if sys.modules.get(self.__name__) is self:
                del sys.modules[self.__name__]
            real = importlib.import_module(self.__name__)
            for key, value in list(self.__dict__.items()):  # submodules imported through the placeholder: the
                if isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{key}":  # real's too
                    real.__dict__.setdefault(key, value)
            # references taken before (the parent's attribute, ``import streaming.text as t``) see the real names
            self.__dict__.update({k: v for k, v in real.__dict__.items() if k not in ("__name__", "__path__")})
            return real
