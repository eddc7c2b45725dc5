"""The mixer's data position as plain numbers: the checkpoint state and the per-domain stats.

The whole position of a rank is ``(batches consumed, weight schedule)``: every domain's read position is
recomputed from it (and the seed), so a checkpoint stores just that plus a fingerprint of everything
the recomputation assumes (seed, batch size, world size, domains and their sizes, ...). A checkpoint
whose fingerprint differs from the mixer's would replay different samples, so it is refused.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from grape_stream.mixing.domains import DomainStream
from grape_stream.mixing.epoch_order import DomainOrder

__all__ = ["STATE_FORMAT", "check_state", "domain_stats", "make_state", "state_batch"]

STATE_FORMAT = "grape_stream.mixer/1"  # on disk in checkpoints: unchanged by the re-layout


def state_batch(num_samples: int | None, from_beginning: bool, *, batch_size: int, world_size: int,
                consumed: int, consumed_known: bool, resume_batch: int) -> int:
    """The batch a ``state_dict(num_samples, from_beginning)`` call refers to (see the mixer's docstring)."""
    per = batch_size * world_size
    if num_samples is None:
        if not consumed_known:
            raise ValueError(
                "state_dict(num_samples=None) with a plain DataLoader with workers: the mixer cannot know "
                "how many batches were consumed; pass num_samples= (global samples) or use mixer.dataloader()"
            )
        return consumed
    if int(num_samples) != num_samples or num_samples < 0 or num_samples % per:
        raise ValueError(
            f"num_samples={num_samples!r} is not a whole number of global batches of {per} samples "
            f"(batch_size={batch_size} x world_size={world_size})"
        )
    return int(num_samples) // per + (0 if from_beginning else resume_batch)


def make_state(batch: int, fingerprint: Mapping[str, Any], schedule: list[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint dict: format, position, the fingerprint's keys, and the weight schedule."""
    per = int(fingerprint["batch_size"]) * int(fingerprint["world_size"])
    return {"format": STATE_FORMAT, "batch": batch, "num_samples": batch * per, **fingerprint, "schedule": schedule}


def check_state(state: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """(batch, schedule entries) of a checkpoint that fits this mixer; ValueError naming what does not."""
    if state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"not a WeightedStreamingMixer state (format {state.get('format')!r}, expected {STATE_FORMAT!r})"
        )
    diff = {k: (state.get(k), v) for k, v in fingerprint.items() if state.get(k) != v}
    if diff:
        detail = "; ".join(f"{k}: checkpoint {a!r} vs this mixer {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"the checkpoint's data position does not fit this mixer ({detail})")
    schedule = state.get("schedule") or []
    if not schedule or [e["version"] for e in schedule] != list(range(len(schedule))):
        raise ValueError("the checkpoint's weight schedule is empty or its versions are not 0, 1, 2, ...")
    return int(state["batch"]), list(schedule)


def domain_stats(domains: Sequence[DomainStream], orders: Sequence[DomainOrder], counts: np.ndarray,
                 available: np.ndarray, alpha: np.ndarray, effective: np.ndarray) -> list[dict[str, Any]]:
    """Per-domain samples drawn, epochs, budget state and weights after ``counts`` reads."""
    doms = []
    for k, d in enumerate(domains):
        o = orders[k]
        doms.append({
            "name": d.name,
            "samples_drawn": int(counts[k]),
            "epochs_completed": int(counts[k] // o.epoch_len),
            "epoch_progress": float(counts[k] / o.epoch_len),
            "samples_per_epoch": int(o.epoch_len),
            "num_samples": int(o.num_samples),
            "max_epochs": d.max_epochs,
            "spent": bool(not available[k]),
            "weight": float(alpha[k]),
            "effective_weight": float(effective[k]),
        })
    return doms
