"""``algorithm.options.alpha0: crisp``: the recipe's named prior, turned into weights in the run's set-up.

Why in the set-up rather than at load: the weights depend on the data (its shards and the tokenizer its
manifest names), which a recipe check must not open (``--dry-run`` stays offline). After this step the recipe
holds a plain list, so the controller, the checkpoint and the trajectory's ``meta`` line see ordinary weights;
a resumed run computes the same list again (the draw is seeded) and then takes alpha from its checkpoint.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from grape_stream.config import RecipeConfig
from grape_stream.errors import ConfigError
from grape_stream.mixture.prior import DEFAULT_PRIOR_SAMPLES, PRIORS, crisp_prior

if TYPE_CHECKING:  # validate.py imports this module: a recipe check must not import streaming (seconds)
    from grape_stream.grape.tasks import TaskStream

__all__ = ["BUILTIN_TOKENIZERS", "named_prior", "prior_tokenizer", "resolve_prior"]

log = logging.getLogger(__name__)


def named_prior(options: Mapping[str, Any]) -> str | None:
    """The prior ``alpha0`` names (``"crisp"``), or None when it is a list or unset; any other string is one
    line naming the choices."""
    value = options.get("alpha0")
    if not isinstance(value, str):
        return None
    if value not in PRIORS:
        raise ConfigError(f"recipe key 'algorithm.options.alpha0' is {value!r}: give a list of weights (one per "
                          f"domain) or a prior computed from the data: {', '.join(PRIORS)}")
    return value


#: Tokenizers a data manifest may name for the prior: built in, nothing read from a path or fetched from a hub.
BUILTIN_TOKENIZERS = ("gpt2", "bytes")


def prior_tokenizer(cfg: RecipeConfig, manifest: Mapping[str, Any] | None) -> str:
    """The tokenizer to decode the data with: the recipe's ``data.tokenizer`` (trusted), else the manifest's
    ``tokenizer.name`` when it is a built-in one. A manifest comes with the data (a shared bucket's contents are
    not ours), so a path or a hub name in it is never opened: the recipe has to say it."""
    if cfg.data.tokenizer:
        return str(cfg.data.tokenizer)
    tok = (manifest or {}).get("tokenizer")
    named = tok.get("name") if isinstance(tok, Mapping) else None
    if named in BUILTIN_TOKENIZERS:
        return str(named)
    found = f"the data's manifest names {named!r}" if named else "no data manifest names one"
    raise ConfigError(f"alpha0: crisp decodes the data with the tokenizer it was converted with, and {found}; "
                      "set data.tokenizer to that tokenizer (a tokenizer.json path or a name: a path or name that "
                      "comes with the data is not opened)")


def resolve_prior(cfg: RecipeConfig, domains: Sequence[Mapping[str, Any]], tasks: Sequence[TaskStream],
                  manifest: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """When ``alpha0`` names a prior: compute it from the run's data, write the weights into
    ``cfg.algorithm.options["alpha0"]`` (``cfg`` is the run's own copy) and return the prior's document
    (weights, seconds, details); else None. It reads :data:`DEFAULT_PRIOR_SAMPLES` sequences per domain and
    task, drawn by ``algorithm.seed``, decoded with :func:`prior_tokenizer`."""
    options = cfg.algorithm.options
    if named_prior(options) is None:
        return None
    spec = prior_tokenizer(cfg, manifest)
    from grape_stream.grape.tasks import TaskStream

    streams = [TaskStream(name=d["name"], remote=d["remote"], local=d["local"], split=d["split"], test_split=None,
                          fetch_all=False) for d in domains]
    try:
        doc = crisp_prior(streams, tasks, spec, samples=DEFAULT_PRIOR_SAMPLES, seed=int(cfg.algorithm.seed))
    finally:  # the mixer opens these folders again: streaming refuses one folder open twice in a process
        for s in streams:
            s.close()
    options["alpha0"] = list(doc["weights"])
    log.info("alpha0 from the crisp prior (%d sequences per domain and task, %.1f s): %s", doc["details"]["samples"],
             doc["seconds"], ", ".join(f"{k} {v:.3f}" for k, v in doc["alpha"].items()))
    return doc
