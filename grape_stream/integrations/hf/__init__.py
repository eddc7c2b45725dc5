"""Hugging Face ``transformers.Trainer`` integration: GrapeTrainerCallback (GRAPE updates, metrics, state in
``checkpoint-N/``) and GrapeTrainer (the mixer as the train dataloader). See docs/hf.md.

Names are resolved lazily: importing this package does not import transformers; using a name does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grape_stream.lazy import lazy_exports

if TYPE_CHECKING:
    from grape_stream.integrations.common import MixerTrainLoader, causal_lm_inputs, logits_per_sample_loss
    from grape_stream.integrations.hf.callback import STATE_FILE, GrapeTrainerCallback
    from grape_stream.integrations.hf.trainer import GrapeTrainer

_LAZY = {
    "GrapeTrainerCallback": "grape_stream.integrations.hf.callback",
    "STATE_FILE": "grape_stream.integrations.hf.callback",
    "GrapeTrainer": "grape_stream.integrations.hf.trainer",
    "MixerTrainLoader": "grape_stream.integrations.common",
    "causal_lm_inputs": "grape_stream.integrations.common",
    "logits_per_sample_loss": "grape_stream.integrations.common",
}

__all__ = [
    "STATE_FILE",
    "GrapeTrainer",
    "GrapeTrainerCallback",
    "MixerTrainLoader",
    "causal_lm_inputs",
    "logits_per_sample_loss",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
