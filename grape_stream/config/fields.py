"""The field markers the recipe schema reads, and the one rule for keyword overrides of a config object.

Every typed config is a plain dataclass of the types omegaconf's structured configs accept
(``Optional[...]``, ``Any``, ``list``/``dict`` fields built with ``default_factory``, nested dataclasses,
and :data:`MISSING` as omegaconf spells a required value); no Union other than Optional. Two markers carry
the recipe's rules (read by :func:`is_free` / :func:`is_required`):

* ``free()``: a mapping whose keys are not checked by the schema (a library's keyword arguments, or
  options checked by their consumer, e.g. ``algorithm.options`` by the reweighting registry);
* a default of :data:`MISSING`: the key is required.

A consumer takes its config object *or* keyword overrides of its fields (:func:`with_overrides`), so a
Python user writes ``WeightedStreamingMixer(domains, batch_size=8, lag=0)`` and a recipe hands over
``data.mixer``; a misspelt name is one error naming it and the closest field.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any, Mapping, TypeVar

from grape_stream.errors import UnknownOptionError, did_you_mean

__all__ = ["MISSING", "field_default", "field_names", "free", "is_free", "is_required", "with_overrides"]

#: A required value (omegaconf's literal for one, so the dataclasses keep their meaning there).
MISSING: Any = "???"

T = TypeVar("T")


def free() -> Any:
    """A free-form mapping field (keys not checked against a schema)."""
    return field(default_factory=dict, metadata={"free": True})


def is_free(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("free"))


def is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is MISSING


def field_names(cls: type) -> tuple[str, ...]:
    """The fields of a config dataclass, in order."""
    return tuple(f.name for f in dataclasses.fields(cls))


def field_default(cls: type, name: str) -> Any:
    """The default of one field of a config dataclass (what a command-line flag shows as its default)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{name} has no default")
            return f.default
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def with_overrides(config: T | Mapping[str, Any] | None, cls: type[T], overrides: Mapping[str, Any], *,
                   where: str) -> T:
    """``config`` (an instance of ``cls``, a mapping of its fields, or None for the defaults) with
    ``overrides`` applied (a new object; ``config`` itself when there are none); a nested config field may be
    given as a mapping of its fields.

    A name that is not a field is one :class:`~grape_stream.errors.UnknownOptionError` (a TypeError, as an
    unexpected keyword argument is) naming it, ``where`` it was given and the closest field.
    """
    if config is None:
        base = cls()
    elif isinstance(config, Mapping):
        base, overrides = cls(), {**config, **overrides}
    elif isinstance(config, cls):
        base = config
    else:
        raise TypeError(f"{where} takes a {cls.__name__} (or a mapping of its fields), got {type(config).__name__}")
    if not overrides:
        return base  # the object itself travels on: nothing to copy
    names = field_names(cls)
    unknown = [k for k in overrides if k not in names]
    if unknown:
        raise UnknownOptionError(f"{where} got an unexpected keyword argument {unknown[0]!r}"
                                 f"{did_you_mean(unknown[0], names)}")
    hints = typing.get_type_hints(cls)
    values = dict(overrides)
    for name, value in overrides.items():
        tp = hints[name]
        if isinstance(value, Mapping) and isinstance(tp, type) and dataclasses.is_dataclass(tp):
            values[name] = with_overrides(getattr(base, name), tp, value, where=f"{where} {name}")
    return dataclasses.replace(base, **values)  # type: ignore[type-var]
