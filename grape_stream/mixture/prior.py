"""A static prior computed from what a run streams: CRISP's weights as GRAPE's start (``alpha0: crisp``).

Why here and not only as ``grape-stream mixture crisp``: that command reads the raw corpus, which a training
job on shared buckets usually does not have beside it; the run does have its MDS shards and the tokenizer they
were converted with. So the prior reads ``samples`` sequences of each domain's training split and of each
task's probe split (the split GRAPE may look at, never the test split), decodes them back to text, embeds them
and takes shares of nearest centroids (:func:`grape_stream.mixture.crisp.crisp_weights`). A sequence is a
window of packed text rather than a document, which is what CRISP's embedder reads anyway (its first 256
tokens). Why a prior at all: on the value benchmark GRAPE started from CRISP's weights beat GRAPE from uniform
on the average in every seed (docs/results.md, issue 32 part 3); the seconds it takes are returned so a
comparison can count them.
"""

from __future__ import annotations

import random
import time
from typing import Any, Sequence

import numpy as np

from grape_stream.errors import ConfigError

__all__ = ["DEFAULT_PRIOR_SAMPLES", "PRIORS", "crisp_prior", "decoded_samples"]

#: The priors ``alpha0`` may name instead of a list of weights.
PRIORS = ("crisp",)
#: Sequences read per domain and per task (the value benchmark's CRISP embedded 64 documents of each).
DEFAULT_PRIOR_SAMPLES = 64


def decoded_samples(stream: Any, n: int, seed: int, tokenizer: Any) -> list[str]:
    """Up to ``n`` sequences of ``stream``'s split (a :class:`~grape_stream.grape.tasks.TaskStream`; a domain's
    opened with ``fetch_all=False``, so only the shards the draw lands in are downloaded), drawn without
    replacement by ``(seed, split, name)`` (the same draw on every rank and every resume), decoded with
    end-of-sequence ids dropped (they separate packed documents; they are not text)."""
    total = stream.num_samples()
    pick = sorted(random.Random(f"{seed}/{stream.split}/{stream.name}").sample(range(total), min(n, total)))
    eos = getattr(tokenizer, "eos_id", None)
    out = []
    for sample in stream.samples(pick):
        ids = np.asarray(sample["tokens"]).reshape(-1)
        if eos is not None:
            ids = ids[ids != eos]
        out.append(tokenizer.decode(ids))
    return out


def crisp_prior(domains: Sequence[Any], tasks: Sequence[Any], tokenizer: str, *,
                samples: int = DEFAULT_PRIOR_SAMPLES, seed: int = 0, smoothing: float = 1.0,
                embedder: Any = None) -> dict[str, Any]:
    """CRISP's weights over ``domains`` for ``tasks``, from their MDS data: ``{"weights": [...] (domains'
    order), "alpha": {name: w}, "seconds", "details"}``.

    ``domains``: TaskStreams whose ``split`` is the training split read (``fetch_all=False``: a few samples of a
    large split); ``tasks``: TaskStreams whose ``split`` is the probe split. ``tokenizer``: the spec the data
    was converted with (``gpt2``, ``bytes`` or a ``tokenizer.json``), from a trusted source: the caller's.
    ``smoothing`` > 0 keeps every weight above zero, which a GRAPE start needs (a zero weight never recovers in
    log space). ``embedder``: a callable texts -> (n, d) array
    (default: :class:`~grape_stream.mixture.embed.Embedder`, the paper's all-MiniLM-L6-v2)."""
    from grape_stream.convert.tokenization import load_tokenizer
    from grape_stream.mixture.crisp import crisp_weights

    if samples < 1:
        raise ConfigError(f"the crisp prior needs samples >= 1, got {samples}")
    if not domains or not tasks:
        raise ConfigError("the crisp prior needs at least one domain and one target task")
    t0 = time.perf_counter()
    try:
        tok = load_tokenizer(tokenizer)
    except Exception as exc:  # a path on the converting machine, a hub name offline: one line, what to do
        raise ConfigError(f"alpha0: crisp decodes the data with the tokenizer it was converted with ({tokenizer!r}), "
                          f"which cannot be loaded here: {exc}") from None
    if embedder is None:
        from grape_stream.mixture.embed import Embedder

        embedder = Embedder()
    src = {d.name: np.asarray(embedder(decoded_samples(d, samples, seed, tok))) for d in domains}
    tgt = {t.name: np.asarray(embedder(decoded_samples(t, samples, seed, tok))) for t in tasks}
    alpha = crisp_weights(src, tgt, smoothing=smoothing)
    names = [d.name for d in domains]
    return {"prior": "crisp", "weights": [alpha[n] for n in names], "alpha": {n: alpha[n] for n in names},
            "seconds": time.perf_counter() - t0,
            "details": {"samples": samples, "seed": seed, "smoothing": smoothing, "tokenizer": tokenizer,
                        "domain_split": sorted({str(d.split) for d in domains}),
                        "task_split": sorted({str(t.split) for t in tasks}),
                        "embedded": {k: int(len(v)) for k, v in {**src, **tgt}.items()}}}
