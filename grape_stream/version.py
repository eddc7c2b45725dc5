"""The package's version, stated once: pyproject.toml reads it (``[tool.setuptools.dynamic]``), the package
root re-exports it, and the converter's manifest records it.

Level 0 and a leaf: it imports nothing, so any module may read the version without importing the package's
public API (``grape_stream/__init__.py``).
"""

__version__ = "0.1.0"
