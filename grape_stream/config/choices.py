"""The settings that take one of a few named values, as str-Enums: one place names every choice.

Why str-Enums: a recipe writes the plain word (``alignments: steps``) and omegaconf's structured config checks it
against the members (one line naming the allowed values); in Python a member *is* its string
(``Alignments.steps == "steps"``), so a caller passing the word, a JSON record and ``--print-config`` all see the
same value. Member names equal their values for that reason (omegaconf matches a string by member name).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Alignments", "Composition", "Geometry", "ProbeMode", "values"]


class Alignments(StrEnum):
    """Where an update's domain side comes from (docs/alignment.md)."""

    probe = "probe"  # the paper's K domain + N task probes per update
    steps = "steps"  # the domain side from alignment_steps training steps' own backwards


class Geometry(StrEnum):
    """The inner product of the alignments (docs/reweighting.md)."""

    sgd = "sgd"  # plain inner products (the paper)
    adam = "adam"  # preconditioned by AdamW's 1 / (sqrt(v_hat) + eps)


class ProbeMode(StrEnum):
    """What the ranks of a job probe (only matters with several ranks)."""

    sharded = "sharded"  # each rank its own samples, the Grams averaged over the ranks
    replicated = "replicated"  # every rank the same samples (a resume on another world size draws the same ones)


class Composition(StrEnum):
    """How a global batch's per-domain counts are drawn from alpha (docs/mixer.md)."""

    systematic = "systematic"  # exact quotas: systematic sampling of the cumulative weights
    multinomial = "multinomial"  # independent draws


def values(choice: type[StrEnum]) -> tuple[str, ...]:
    """The allowed words, in declaration order (for checks of values passed from Python, and their messages)."""
    return tuple(m.value for m in choice)
