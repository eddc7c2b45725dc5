"""Corpus readers, one module per dataset family, collected in a registry keyed by SOURCE name.

Each module registers its readers with `@register` and declares the options they accept (see
`readers/base.py`); importing the modules below fills `REGISTRY` in this order, which is the order
`SOURCES` (and `grape-stream convert --help`) lists them in. A new corpus: one module here, one import
line below, one section in docs/converters.md.

The converter core uses readers only through `SOURCES`, `build_reader`, `reader_class` and
`reader_options`; readers use the core's general helpers (grape_stream.convert.inputs / formats /
records), never the other way round.
"""

from __future__ import annotations

from typing import Any

from grape_stream.errors import UnknownOptionError, did_you_mean

# Import order = registration order = the order of SOURCES (and of --help): keep it, sorters off.
# isort: off
from . import slimpajama  # noqa: F401
from . import climblab  # noqa: F401
from . import wiki40b  # noqa: F401
from . import generic  # noqa: F401
from . import tasks  # noqa: F401
# isort: on
from .base import BAD_KINDS, REGISTRY, BadInput, Reader, ReaderOption, Record
from .slimpajama import SLIMPAJAMA_DOMAINS
from .tasks import TASK_LAYOUTS

__all__ = [
    "SOURCES",
    "REGISTRY",
    "build_reader",
    "reader_class",
    "reader_options",
    "Reader",
    "ReaderOption",
    "Record",
    "BadInput",
    "BAD_KINDS",
    "SLIMPAJAMA_DOMAINS",
    "TASK_LAYOUTS",
]

SOURCES: tuple[str, ...] = tuple(REGISTRY)  # the bundled readers; REGISTRY also holds any registered later


def reader_class(source: str) -> type[Reader]:
    """The registered reader class of `source`; ValueError naming the known sources otherwise."""
    cls = REGISTRY.get(source)
    if cls is None:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(REGISTRY)}")
    return cls


def reader_options() -> dict[str, tuple[ReaderOption, list[str]]]:
    """Every option any reader accepts: name -> (its declaration, the sources accepting it).

    Readers that share an option must declare it the same way (same flag, choices, switch or not),
    since it becomes one CLI flag; a clash is a programming error raised here.
    """
    out: dict[str, tuple[ReaderOption, list[str]]] = {}
    for source, cls in REGISTRY.items():
        for opt in cls.options:
            seen = out.get(opt.name)
            if seen is None:
                out[opt.name] = (opt, [source])
                continue
            first = seen[0]
            if (first.flag, first.choices, first.is_flag) != (opt.flag, opt.choices, opt.is_flag):
                raise TypeError(f"reader option {opt.name!r} is declared differently by {seen[1]} and {source!r}")
            seen[1].append(source)
    return out


def build_reader(source: str, **options: Any) -> Reader:
    """The reader for `source`; options left at None/False are unset. Unsupported options raise."""
    cls = reader_class(source)
    given = {k: v for k, v in options.items() if v not in (None, False)}
    known = reader_options()
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise UnknownOptionError(f"unknown reader option(s) {unknown}{did_you_mean(unknown[0], known)}")
    accepts = {o.name: o for o in cls.options}
    extra = sorted(set(given) - set(accepts))
    if extra:
        flags = ", ".join(known[k][0].flag for k in extra)
        raise ValueError(f"{flags} does not apply to source {source!r}")
    if given.get("domain") and given.get("domain_field"):
        raise ValueError("--domain and --domain-field are exclusive: a fixed domain, or one per record")
    kwargs = {
        name: (bool(given.get(name)) if o.is_flag else given.get(name, o.default)) for name, o in accepts.items()
    }
    return cls.from_options(**kwargs)
