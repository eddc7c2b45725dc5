"""Typed configuration: every setting of a run, its default stated once, as plain dataclasses.

One object per consumer travels from the YAML recipe (or the command line, or a Python call) to the line
where each value takes effect (docs/design.md, "How a setting travels"):

* :class:`AlgorithmConfig` (``config.algorithm``): GRAPE, read by ``GrapeLoop`` / ``GrapeController``;
* :class:`MixerConfig` and :class:`DataConfig` (``config.data``): the mixer and the recipe's data section;
* :class:`ConvertConfig` (``config.convert``): ``grape-stream convert`` and ``convert()``;
* :class:`RecipeConfig` (``config.recipe``): a whole recipe, omegaconf's structured config;
* the few-valued settings as str-Enums (``config.choices``): :class:`Alignments`, :class:`Geometry`,
  :class:`ProbeMode`, :class:`Composition`.

Consumers take the object or keyword overrides of its fields (:func:`with_overrides`: a misspelt name is
one error naming the closest field). Level 0: imports nothing from grape_stream but ``errors``.
"""

from __future__ import annotations

from grape_stream.config.algorithm import (
    GRAM_CHUNK_ELEMENTS,
    PAPER_MU_ALPHA,
    PAPER_MU_Z,
    PROBE_BATCH_BOUNDS,
    AlgorithmConfig,
    GramConfig,
    GrapeConfig,
)
from grape_stream.config.choices import Alignments, Composition, Geometry, ProbeMode
from grape_stream.config.convert import ConvertConfig
from grape_stream.config.data import RETRY_DEADLINE_S, SHUFFLE_BLOCK_SIZE, DataConfig, MixerConfig, streaming_fields
from grape_stream.config.fields import (
    MISSING,
    field_default,
    field_names,
    free,
    is_free,
    is_required,
    with_overrides,
)
from grape_stream.config.recipe import (
    DecoderShape,
    ModelConfig,
    OptimizerConfig,
    RecipeConfig,
    SchedulerConfig,
    TrainerConfig,
)

__all__ = [
    "Alignments",
    "Composition",
    "Geometry",
    "ProbeMode",
    "GRAM_CHUNK_ELEMENTS",
    "MISSING",
    "PAPER_MU_ALPHA",
    "PAPER_MU_Z",
    "PROBE_BATCH_BOUNDS",
    "RETRY_DEADLINE_S",
    "SHUFFLE_BLOCK_SIZE",
    "AlgorithmConfig",
    "ConvertConfig",
    "DataConfig",
    "DecoderShape",
    "GramConfig",
    "GrapeConfig",
    "MixerConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RecipeConfig",
    "SchedulerConfig",
    "TrainerConfig",
    "field_default",
    "field_names",
    "free",
    "is_free",
    "is_required",
    "streaming_fields",
    "with_overrides",
]
