"""The settings that take one of a few named values, as str-Enums: one place names every choice.

Why str-Enums: a recipe writes the plain word (``alignments: steps``) and omegaconf's structured config checks it
against the members (one line naming the allowed values); in Python a member *is* its string
(``Alignments.steps == "steps"``), so a caller passing the word, a JSON record and ``--print-config`` all see the
same value. Member names equal their values for that reason (omegaconf matches a string by member name).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Alignments", "Composition", "Geometry", "ProbeMode", "Signal", "values"]


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


class Signal(StrEnum):
    """Where a reweighting update's numbers come from: one value per method class (``Reweighter.signal``) and one
    per run (``grape.algorithm_config.signal_source``, which adds the two a config decides: ``alignments: steps``
    turns ``probe`` into ``step_alignments``, ``method: schedule`` is ``replay``). Not a setting: a capability,
    read by the controller (which source it builds) and by the trainer integrations (what they must show it)."""

    none = "none"  # the weights never move (uniform, static): nothing is read
    probe = "probe"  # the K domain + N task probes' Gram (GRAPE, DoGE, ...; grape.probe_stage)
    step_alignments = "step_alignments"  # alignments: steps: the domain side from the steps (grape.instep_mode)
    step_gram = "step_gram"  # the per-domain Gram of the training steps (R&B; grape.instep_gram)
    training_losses = "training_losses"  # each domain's training loss (DoReMi, ODM, ADO; grape.loss_mode)
    replay = "replay"  # a recorded trajectory (method: schedule; grape.replay)

    @property
    def probes_tasks(self) -> bool:
        """Whether updates run a task probe (so the run needs target tasks): the probe and in-step alignments."""
        return self in (Signal.probe, Signal.step_alignments)

    @property
    def reads_step_gradients(self) -> bool:
        """Whether the training steps' own backward is observed (the integrations put an observed step's batch
        in domain order and keep each sample's loss in the backward's graph)."""
        return self in (Signal.step_alignments, Signal.step_gram)

    @property
    def reads_training_losses(self) -> bool:
        """Whether each (micro-)batch's per-sample training loss and domains are read (every step)."""
        return self is Signal.training_losses

    @property
    def watches_steps(self) -> bool:
        """Whether the trainer must wrap training steps' forward + backward in ``observe`` at all."""
        return self.reads_step_gradients or self.reads_training_losses


def values(choice: type[StrEnum]) -> tuple[str, ...]:
    """The allowed words, in declaration order (for checks of values passed from Python, and their messages)."""
    return tuple(m.value for m in choice)
