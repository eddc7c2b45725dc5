"""The one list of reweighting methods: every other list (recipe choices, controller methods, docs
tables, the demo) is derived from it.

A method class states its own facts as class attributes (``method``, ``description``, ``Options`` --
the dataclass whose fields are its options, read here as ``options_accepted`` -- and ``signal``: where its
updates' numbers come from) and
joins the registry with ``@register``; nothing else needs editing. The registry keeps registration order,
which is the order methods are listed everywhere.
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

from grape_stream.config.choices import Signal
from grape_stream.errors import UnknownOptionError
from grape_stream.grape.reweighting.base import Reweighter

__all__ = [
    "REWEIGHTERS",
    "all_options",
    "available_methods",
    "build_reweighter",
    "canonical_method",
    "method_description",
    "method_needs_probe",
    "method_signal",
    "method_options",
    "method_options_class",
    "register",
    "reweighter_from_state_dict",
]

#: method name -> Reweighter subclass, in registration order.
REWEIGHTERS: dict[str, type[Reweighter]] = {}

R = TypeVar("R", bound="type[Reweighter]")

#: the booleans ``signal`` replaced (a class setting one is refused with a line naming ``signal``)
_OLD_FLAGS = ("needs_probe", "needs_training_losses", "needs_step_gram")


def register(cls: R) -> R:
    """Class decorator: add a Reweighter subclass under its ``method`` name (which must be new)."""
    name = getattr(cls, "method", "")
    if not isinstance(name, str) or not name or name != name.strip().lower().replace("-", "_"):
        raise ValueError(f"{cls.__name__}.method must be a lower-case snake_case name, got {name!r}")
    old = sorted(f for f in _OLD_FLAGS if hasattr(cls, f))
    if old:  # a method written for an older release: one line saying what replaced the flag
        raise TypeError(f"{cls.__name__} sets {', '.join(old)}: a method states where its updates' numbers come "
                        f"from in one class attribute, signal = Signal.<{'|'.join(Signal)}> "
                        "(grape_stream.config.choices.Signal; docs/reweighting.md)")
    if name in REWEIGHTERS and REWEIGHTERS[name] is not cls:
        raise ValueError(f"reweighting method {name!r} is registered twice "
                         f"({REWEIGHTERS[name].__name__}, {cls.__name__})")
    REWEIGHTERS[name] = cls
    return cls


def canonical_method(name: str) -> str:
    """The registry key for a user-given name ('-' and '_' are interchangeable, case is ignored)."""
    if not isinstance(name, str):
        raise TypeError(f"method name must be a string, got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_")
    if key not in REWEIGHTERS:
        raise ValueError(f"unknown reweighting method {name!r}; available: {', '.join(REWEIGHTERS)}")
    return key


def available_methods() -> list[str]:
    """Method names accepted by build_reweighter, in registration order (docs/reweighting.md's order)."""
    return list(REWEIGHTERS)


def all_options() -> set[str]:
    """Every option some method accepts (to tell a misspelt option from one of another method)."""
    return {o for cls in REWEIGHTERS.values() for o in cls.options_accepted}


def method_options(name: str) -> tuple[str, ...]:
    """The options a method accepts, so a recipe can pass only those (others raise TypeError)."""
    return REWEIGHTERS[canonical_method(name)].options_accepted


def method_signal(name: str) -> Signal:
    """Where `name`'s updates read their numbers from (its class's ``signal``; for a whole config, with
    ``alignments: steps`` and ``method: schedule``, grape.algorithm_config.signal_source)."""
    return REWEIGHTERS[canonical_method(name)].signal


def method_needs_probe(name: str) -> bool:
    """Whether `name`'s updates read the probe Gram (``method_signal(name) is Signal.probe``; uniform and static
    never do, nor the methods that read the training steps)."""
    return method_signal(name) is Signal.probe


def method_description(name: str) -> str:
    """The one-line description a method class states (for CLI help and the demo)."""
    return REWEIGHTERS[canonical_method(name)].description


def method_options_class(name: str) -> type:
    """The options dataclass of a method (its fields are the options it accepts)."""
    return REWEIGHTERS[canonical_method(name)].Options


def build_reweighter(name: str, num_domains: int, num_tasks: int, **options: Any) -> Reweighter:
    """Create a reweighter by name ('grape', 'doge', ...; '-' and '_' are interchangeable).

    Defaults reproduce the paper's equations (docs/reweighting.md): eta = lr / mu with the paper's mu,
    no clipping, no smoothing, no floor. Unknown or inapplicable options raise an UnknownOptionError (a
    TypeError) listing the valid ones.
    """
    cls = REWEIGHTERS[canonical_method(name)]
    other = sorted(o for o in options if o not in cls.options_accepted and o in all_options())
    if other and all(o in all_options() for o in options if o not in cls.options_accepted):
        raise UnknownOptionError(f"option(s) {', '.join(map(repr, other))} does not apply to method {cls.method!r}; "
                                 f"options of {cls.method!r}: {', '.join(cls.options_accepted)}")
    return cls(num_domains, num_tasks, **options)


def reweighter_from_state_dict(state: Mapping[str, Any]) -> Reweighter:
    """Rebuild a reweighter (method, sizes, options) from a state_dict() and load its state."""
    opts = {k: v for k, v in dict(state.get("options") or {}).items() if v is not None}
    cls = REWEIGHTERS[canonical_method(str(state.get("method")))]
    r = cls(state["num_domains"], state["num_tasks"], **{k: v for k, v in opts.items() if k in cls.options_accepted})
    r.load_state_dict(state)
    return r
