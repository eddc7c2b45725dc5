"""What a corpus reader is: the `Reader` base class, the options it declares, and the registry it joins.

A reader module defines one `Reader` subclass per source, lists the options it accepts in `options`
(each a `ReaderOption`: keyword name, CLI flag, help, default) and decorates the class with
`@register`. The CLI's flags, `build_reader`'s option checks and the plan's `reader` entry all come
from there, so adding a corpus is one module in this folder plus its import in `readers/__init__.py`.

Readers only read: they turn files into `Record`s (text or token ids, with a domain and maybe a split)
and `BadInput`s. Tokenizing, packing and writing MDS shards live in the converter core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, TypeVar

import numpy as np

from grape_stream.convert.records import BAD_KINDS, BadInput, Record

__all__ = [
    "Record",
    "BadInput",
    "BAD_KINDS",
    "Reader",
    "ReaderOption",
    "register",
    "REGISTRY",
    "get_field",
    "as_token_array",
    "DOMAIN",
    "DOMAIN_FIELD",
    "SPLIT_FIELD",
    "TEXT_FIELD",
    "SPLIT_FROM_PATH",
]


@dataclass(frozen=True)
class ReaderOption:
    """One option a reader accepts: `name` is the keyword of `build_reader`/`convert`, `flag` the CLI flag.

    default: what the reader uses when the option is not given (the CLI itself defaults to "not given",
    so that an option a source does not accept can be reported instead of silently ignored).
    is_flag: a boolean switch (`store_true`); choices: the values a string option may take.
    """

    name: str
    flag: str
    help: str
    default: Any = None
    choices: tuple[str, ...] | None = None
    is_flag: bool = False
    metavar: str | None = None


# Options several readers share: declared once so that their flag and help read the same everywhere.
DOMAIN = ReaderOption("domain", "--domain", "put every record in this domain")
DOMAIN_FIELD = ReaderOption("domain_field", "--domain-field", "record field (dotted path) naming the domain")
SPLIT_FIELD = ReaderOption("split_field", "--split-field", "record field naming the split")
TEXT_FIELD = ReaderOption("text_field", "--text-field", "record field holding the text", default="text")
SPLIT_FROM_PATH = ReaderOption(
    "split_from_path", "--split-from-path", "split named by the file path: train/validation/test",
    default=False, is_flag=True,
)


class Reader:
    """Base class of the dataset readers. Subclasses are small picklable dataclasses (they travel to
    worker processes).

    source: the SOURCE name on the command line. patterns: file suffixes a directory input is searched for.
    pretokenized: records carry `tokens` (GPT-2 ids) instead of `text`.
    per_example: records are task examples (padded one per sample), not documents to pack.
    options: what `from_options` accepts; anything else given for this source is an error.
    """

    source: ClassVar[str] = ""
    pretokenized: ClassVar[bool] = False
    per_example: ClassVar[bool] = False
    patterns: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[ReaderOption, ...]] = ()

    @classmethod
    def from_options(cls, **options: Any) -> "Reader":
        """The reader for the given options (only declared ones, unset ones at their default)."""
        return cls(**options)

    def path_domain(self, path: str) -> str | None:
        """The domain of every record of `path` when the path alone decides it, else None.

        Lets the converter finalise a domain as soon as its files are done (and skip it on a re-run).
        """
        return None

    def read(self, path: str) -> Iterator[Record | BadInput]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The options that change the output (stored in the plan; a re-run must match them)."""
        return {}


REGISTRY: dict[str, type[Reader]] = {}

R = TypeVar("R", bound=type[Reader])


def register(cls: R) -> R:
    """Class decorator: make `cls` the reader of `cls.source` (sources are listed in registration order)."""
    if not cls.source:
        raise TypeError(f"{cls.__name__} has no `source` name")
    bad = [o for o in cls.options if not isinstance(o, ReaderOption)]
    if bad:
        raise TypeError(f"{cls.__name__}.options must hold ReaderOption objects, got {bad!r}")
    if cls.source in REGISTRY and REGISTRY[cls.source] is not cls:
        raise TypeError(f"source {cls.source!r} is already registered by {REGISTRY[cls.source].__name__}")
    REGISTRY[cls.source] = cls
    return cls


def get_field(obj: Any, dotted: str) -> Any:
    """`obj["a"]["b"]` for "a.b"; raises KeyError naming the missing part."""
    cur = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(part)
        cur = cur[part]
    return cur


def as_token_array(value: Any, vocab_size: int) -> tuple[np.ndarray | None, str | None]:
    """Validate pre-tokenized ids; (array, None) or (None, reason)."""
    if value is None:
        return None, "tokens is null"
    try:
        arr = np.asarray(value)
    except Exception as e:  # ragged / non-numeric
        return None, f"tokens is not a list of integers ({e})"
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        return None, f"tokens is not a flat list of integers (dtype {arr.dtype}, shape {arr.shape})"
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        return None, f"token ids outside [0, {vocab_size}): min {int(arr.min())}, max {int(arr.max())}"
    return arr.astype(np.uint32, copy=False), None


