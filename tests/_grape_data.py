"""Small real-format datasets for the controller / Composer / recipe tests.

Domains and tasks are real MDS datasets (streaming's MDSWriter, zstd) in the converter's layout:
``ROOT/<domain>/<split>/index.json`` with a ``tokens`` column, tasks with ``tokens`` + ``loss_mask``
and ``validation`` / ``test`` splits, and a ``manifest.json``. The text is synthetic but learnable:
each domain follows its own bigram rule ``next = (a * prev + b) % V`` (with some noise), and each
task copies the rule of one domain, so a GRAPE run has real alignments to find.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

VOCAB = 300
#: what lets a loss-driven method move inside a few-step test run (ADO's defaults wait 1,000 steps to fit, and a
#: fit needs three points of each domain's loss curve): its alpha_every and options, over the tests' own
SHORT_RUN: dict = {"ado": {"alpha_every": 2, "options": {"warmup_steps": 1, "fit_every": 1, "ignore_steps": 1}}}
SEQ = 32
PAD = 0

# (a, b) of each domain's bigram rule
RULES = [(3, 7), (5, 11), (7, 13), (11, 17), (13, 19), (17, 23), (19, 29)]


def _sequence(rng: np.random.Generator, rule: tuple[int, int], length: int, noise: float = 0.1) -> np.ndarray:
    a, b = rule
    out = np.empty(length, dtype=np.int64)
    out[0] = rng.integers(1, VOCAB)
    for i in range(1, length):
        out[i] = rng.integers(1, VOCAB) if rng.random() < noise else (a * out[i - 1] + b) % (VOCAB - 1) + 1
    return out


def write_domain(root: str, name: str, rule: tuple[int, int], n: int, *, split: str | None = "train",
                 seq_len: int = SEQ, seed: int = 0, size_limit: int = 1 << 14) -> str:
    from streaming import MDSWriter

    out = os.path.join(root, name, split) if split else os.path.join(root, name)
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    with MDSWriter(out=out, columns={"tokens": "ndarray:uint16"}, compression="zstd", size_limit=size_limit) as w:
        for _ in range(n):
            w.write({"tokens": _sequence(rng, rule, seq_len).astype(np.uint16)})
    return out


def write_task(root: str, name: str, rule: tuple[int, int], n_val: int, n_test: int, *,
               seq_len: int = SEQ, seed: int = 0) -> None:
    from streaming import MDSWriter

    rng = np.random.default_rng([seed, 7, sum(map(ord, name))])
    for split, n in (("validation", n_val), ("test", n_test)):
        out = os.path.join(root, name, split)
        with MDSWriter(out=out, columns={"tokens": "ndarray:uint16", "loss_mask": "ndarray:uint8"},
                       compression="zstd", size_limit=1 << 14) as w:
            for _ in range(n):
                length = int(rng.integers(seq_len // 2, seq_len + 1))
                toks = np.full(seq_len, PAD, dtype=np.int64)
                toks[:length] = _sequence(rng, rule, length, noise=0.05)
                mask = np.zeros(seq_len, dtype=np.uint8)
                mask[length // 2 : length] = 1  # "answer" half counts, the "question" and padding do not
                w.write({"tokens": toks.astype(np.uint16), "loss_mask": mask})


def write_dataset(root: str, *, domains: int = 3, tasks: Sequence[int] = (0, 2), n_domain: int = 256,
                  n_val: int = 32, n_test: int = 32, seq_len: int = SEQ) -> dict:
    """Domains d0..d{K-1} and tasks t<i> (copying the rule of domain tasks[i]); returns the manifest."""
    names = [f"d{k}" for k in range(domains)]
    for k, name in enumerate(names):
        write_domain(root, name, RULES[k], n_domain, seq_len=seq_len)
    tnames = []
    for i, k in enumerate(tasks):
        tname = f"t{i}"
        write_task(os.path.join(root, "tasks"), tname, RULES[k], n_val, n_test, seq_len=seq_len)
        tnames.append(tname)
    manifest = {"domains": names, "tasks": tnames, "splits": ["train"], "vocab_size": VOCAB, "seq_len": seq_len,
                "tokenizer": "synthetic", "eos_id": PAD}
    with open(os.path.join(root, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    return manifest
