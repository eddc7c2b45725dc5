"""Composer (and llm-foundry) integration: a thin GrapeAlgorithm over GrapeController, callbacks, the model
wrapper, the llm-foundry loader, and ``grape-stream train``'s Trainer build.

Names are resolved lazily: importing this package does not import Composer; using a name does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grape_stream.lazy import lazy_exports

if TYPE_CHECKING:
    from grape_stream.integrations.common import find_mixer
    from grape_stream.integrations.composer.algorithm import GrapeAlgorithm
    from grape_stream.integrations.composer.callbacks import (
        GrapeTrajectoryCallback,
        JSONLMetricsLogger,
        TaskEvalSummary,
        grape_algorithm_of,
    )
    from grape_stream.integrations.composer.foundry import (
        build_grape_mixture_dataloader,
        build_grape_task_eval_dataloader,
    )
    from grape_stream.integrations.composer.model import ComposerGPT, composer_model, composer_per_sample_loss
    from grape_stream.integrations.composer.schedulers import WarmupStableDecayScheduler
    from grape_stream.integrations.composer.trainer import Built, build, build_algorithm

_LAZY = {
    "GrapeAlgorithm": "grape_stream.integrations.composer.algorithm",
    "GrapeTrajectoryCallback": "grape_stream.integrations.composer.callbacks",
    "JSONLMetricsLogger": "grape_stream.integrations.composer.callbacks",
    "TaskEvalSummary": "grape_stream.integrations.composer.callbacks",
    "grape_algorithm_of": "grape_stream.integrations.composer.callbacks",
    "ComposerGPT": "grape_stream.integrations.composer.model",
    "composer_per_sample_loss": "grape_stream.integrations.composer.model",
    "build_grape_mixture_dataloader": "grape_stream.integrations.composer.foundry",
    "build_grape_task_eval_dataloader": "grape_stream.integrations.composer.foundry",
    "find_mixer": "grape_stream.integrations.common",
    "WarmupStableDecayScheduler": "grape_stream.integrations.composer.schedulers",
    "Built": "grape_stream.integrations.composer.trainer",
    "build": "grape_stream.integrations.composer.trainer",
    "build_algorithm": "grape_stream.integrations.composer.trainer",
    "composer_model": "grape_stream.integrations.composer.model",
}

__all__ = [
    "Built",
    "ComposerGPT",
    "GrapeAlgorithm",
    "GrapeTrajectoryCallback",
    "JSONLMetricsLogger",
    "TaskEvalSummary",
    "WarmupStableDecayScheduler",
    "build",
    "build_algorithm",
    "build_grape_mixture_dataloader",
    "build_grape_task_eval_dataloader",
    "composer_model",
    "composer_per_sample_loss",
    "find_mixer",
    "grape_algorithm_of",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
