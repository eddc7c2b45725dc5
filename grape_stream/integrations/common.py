"""What every trainer integration needs, with no trainer imported: find the mixer behind a train
dataloader, and split an algorithm's keyword options between controller and reweighter. (The metrics
dict for a logger is the controller's own: ``GrapeController.metrics(record)``.)
"""

from __future__ import annotations

from typing import Any, Mapping

from grape_stream.config import AlgorithmConfig
from grape_stream.grape.controller import filter_reweighter_options
from grape_stream.grape.tasks import TaskStream
from grape_stream.mixing.mixer import WeightedStreamingMixer

__all__ = ["CONTROLLER_OPTIONS", "as_task", "find_mixer", "split_algorithm_options"]

#: Keyword options of an algorithm that go to GrapeController itself (everything else: the reweighter).
CONTROLLER_OPTIONS = frozenset({"probe_mode", "probe_train_mode", "schedule_path", "schedule_stretch", "gram_options",
                                "geometry", "probe_rse", "probe_batch_bounds"})

_DEFAULTS = AlgorithmConfig()


def find_mixer(dataloader: Any, who: str = "GrapeAlgorithm") -> WeightedStreamingMixer:
    """The WeightedStreamingMixer behind a train dataloader (a DataSpec, a DataLoader, the mixer's own
    loader), or an error that says what was found instead."""
    obj = getattr(dataloader, "dataloader", dataloader)  # DataSpec -> DataLoader
    dataset = getattr(obj, "dataset", None)
    # mixer.dataloader() (MixerDataLoader) keeps the mixer as `.mixer`; a plain DataLoader over the mixer
    # has it as `.dataset`.
    for candidate in (getattr(obj, "mixer", None), dataset, getattr(dataset, "mixer", None), obj):
        if isinstance(candidate, WeightedStreamingMixer):
            return candidate
    raise RuntimeError(
        f"{who} needs the train dataloader to read from a grape_stream.WeightedStreamingMixer "
        f"(DataLoader(dataset=mixer, ...)); the trainer's train dataloader is {type(obj).__name__} over "
        f"{type(dataset).__name__ if dataset is not None else 'no dataset'}"
    )


def as_task(t: Any) -> TaskStream:
    """A TaskStream from itself or from a mapping of its arguments (the form a YAML config gives)."""
    if isinstance(t, TaskStream):
        return t
    if isinstance(t, Mapping):
        return TaskStream(**dict(t))
    raise TypeError(f"a task must be a TaskStream or a mapping of its arguments, got {type(t).__name__}")


def split_algorithm_options(
    method: str,
    options: Mapping[str, Any],
    mu_alpha: float | None = _DEFAULTS.mu_alpha,
    mu_z: float | None = _DEFAULTS.mu_z,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(controller options, reweighter options) of an algorithm's keyword options.

    ``mu_alpha`` / ``mu_z`` are defaults given only to methods that take them (and not with
    ``step_size="constant"``), so ``method="uniform"`` accepts the same arguments; an explicit option in
    ``options`` wins. The result is validated strictly: a wrong option name fails at construction, not
    at the first update an hour into training.
    """
    options = dict(options)
    controller = {k: options.pop(k) for k in list(options) if k in CONTROLLER_OPTIONS}
    defaults = {k: v for k, v in {"mu_alpha": mu_alpha, "mu_z": mu_z}.items() if v is not None and k not in options}
    if options.get("step_size") == "constant":
        defaults = {}
    kept_defaults, _ = filter_reweighter_options(method, defaults, strict=False)
    reweighter = {**kept_defaults, **options}
    filter_reweighter_options(method, reweighter, strict=True)
    return controller, reweighter
