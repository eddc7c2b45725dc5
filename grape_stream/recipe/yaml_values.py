"""YAML as recipes read it: PyYAML's safe loader, with exponent floats such as ``1e-4`` read as floats.

YAML 1.1 (PyYAML) reads ``1e-4`` as a *string* (it wants ``1.0e-4``); recipes are full of learning rates
and mu's written that way. Both the recipe files and ``key=value`` overrides go through :func:`yaml_load`.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["RecipeLoader", "yaml_load"]


class RecipeLoader(yaml.SafeLoader):
    """A SafeLoader whose float resolver also accepts exponent notation without a dot."""


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text: Any) -> Any:
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - a SafeLoader subclass
