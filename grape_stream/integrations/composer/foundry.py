"""llm-foundry entry points: the ``grape_mixture`` train loader (``llmfoundry_dataloaders``).

llm-foundry discovers GrapeAlgorithm, this loader and the callbacks through pyproject's
``llmfoundry_*`` entry-point groups; :func:`find_mixer` finds the mixer behind the loader it returns.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from composer.core import DataSpec

from grape_stream.errors import ConfigError
from grape_stream.grape.tasks import TaskStream
from grape_stream.integrations.common import find_mixer
from grape_stream.integrations.composer.foundry_dataset import (
    LoaderShape,
    check_manifest,
    labels_from_loss_mask,
    read_dataset_block,
)
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from grape_stream.recipe.data import join_location

__all__ = ["build_grape_mixture_dataloader", "build_grape_task_eval_dataloader", "find_mixer"]


def _streams(shape: LoaderShape) -> list[DomainStream]:
    streams = []
    for d in shape.domains:
        if isinstance(d, str):
            streams.append(DomainStream(d, remote=join_location(shape.remote, d), local=join_location(shape.local, d),
                                        split=shape.split))
        elif isinstance(d, Mapping):
            d = dict(d)
            name = d.pop("name")
            d.setdefault("remote", join_location(shape.remote, name))
            d.setdefault("local", join_location(shape.local, name))
            d.setdefault("split", shape.split)
            streams.append(DomainStream(name, **d))
        else:
            raise ConfigError(f"grape_mixture: a domain is a name or a mapping, got {type(d).__name__}")
    return streams


def build_grape_mixture_dataloader(
    tokenizer: Any = None,
    device_batch_size: int | float = 8,
    *,
    domains: Sequence[Any] | None = None,
    dataset: Mapping[str, Any] | None = None,
    remote: str | None = None,
    local: str | None = None,
    split: str | None = "train",
    weights: Sequence[float] | None = None,
    seed: int | None = None,
    num_workers: int = 0,
    drop_last: bool = True,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    pin_memory: bool = False,
    timeout: float = 0,
    batches_per_message: int | None = None,
    **mixer_kwargs: Any,
) -> Any:
    """A Composer ``DataSpec`` over a :class:`~grape_stream.mixing.mixer.WeightedStreamingMixer`, built the way
    llm-foundry builds a train loader (``train_loader: {name: grape_mixture, ...}``).

    Two shapes: ours (``domains``, ``remote``/``local``/``split``, ``weights``, ``seed`` and mixer keywords at
    the top) and llm-foundry's (a ``dataset: {remote, local, split, max_seq_len, shuffle, shuffle_seed,
    eos_token_id, streams, ...}`` block, see :mod:`.foundry_dataset`); ``domains`` default to the
    conversion manifest's. ``drop_last`` is accepted either way: the mixer's stream is endless, every
    batch is full. Before anything is opened, the manifest is checked against ``tokenizer`` (vocab size),
    ``max_seq_len`` and ``eos_token_id``. Batches hold ``tokens`` and, for llm-foundry's models,
    ``input_ids`` and ``labels`` (positions the shards' ``loss_mask`` marks 0 are -100; the models shift
    labels themselves).
    """
    if int(device_batch_size) != device_batch_size or device_batch_size < 1:
        raise ConfigError(f"grape_mixture needs a whole device_batch_size >= 1, got {device_batch_size!r}")
    shape = LoaderShape(remote=remote, local=local, split=split, domains=list(domains or []),
                        weights=list(weights) if weights is not None else None)
    if dataset is not None:
        if domains and ("domains" in dataset or "streams" in dataset):
            raise ConfigError("grape_mixture: give the domains once (domains, dataset.domains or dataset.streams)")
        shape = read_dataset_block(shape, dataset)
    if seed is not None:
        if "seed" in shape.mixer_kwargs and shape.mixer_kwargs["seed"] != seed:
            raise ConfigError(f"grape_mixture: seed={seed} and dataset.shuffle_seed={shape.mixer_kwargs['seed']} "
                              "disagree; give one")
        shape.mixer_kwargs["seed"] = seed
    manifest = check_manifest(shape, tokenizer)
    if not shape.domains:
        if not manifest or not manifest.get("domains"):
            raise ConfigError("grape_mixture needs domains: list them (domains: [...] or dataset.streams), or point "
                              "dataset.remote / dataset.local at a conversion with a manifest.json")
        shape.domains = list(manifest["domains"])
    mixer = WeightedStreamingMixer(domains=_streams(shape), weights=shape.weights, batch_size=int(device_batch_size),
                                   **{**shape.mixer_kwargs, **mixer_kwargs})
    kwargs: dict[str, Any] = {"pin_memory": pin_memory, "timeout": timeout}
    if num_workers > 0:
        kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    loader = mixer.dataloader(num_workers=num_workers, batches_per_message=batches_per_message, **kwargs)
    return DataSpec(loader, batch_transforms=labels_from_loss_mask,
                    get_num_tokens_in_batch=lambda b: int(b["tokens"].numel()))


def build_grape_task_eval_dataloader(
    tokenizer: Any = None,
    device_batch_size: int | float = 8,
    *,
    task: str,
    remote: str | None = None,
    local: str | None = None,
    split: str = "test",
    num_workers: int = 0,
    drop_last: bool = False,
    **streaming_kwargs: Any,
) -> Any:
    """A target task's test split as an llm-foundry eval loader (``eval_loader: [{label: <task>, name:
    grape_task_eval, task: <task>, remote/local}]``): finite, each rank reads its own part, ``labels`` are
    -100 where the task's ``loss_mask`` is 0 (the prompt and the padding), so the evaluator's
    cross-entropy is the task's answer log-perplexity that ``grape_eval_summary`` averages. ``drop_last``
    is accepted and ignored (an evaluation reads every sample)."""
    if int(device_batch_size) != device_batch_size or device_batch_size < 1:
        raise ConfigError(f"grape_task_eval needs a whole device_batch_size >= 1, got {device_batch_size!r}")
    t = TaskStream(name=task, remote=remote, local=local, split=None, test_split=split,
                   streaming_kwargs=dict(streaming_kwargs))
    loader = t.eval_dataloader(int(device_batch_size), num_workers=num_workers)
    return DataSpec(loader, batch_transforms=labels_from_loss_mask,
                    get_num_tokens_in_batch=lambda b: int(b["tokens"].numel()))
