"""llm-foundry entry points: the ``grape_mixture`` train loader (``llmfoundry_dataloaders``).

llm-foundry discovers GrapeAlgorithm, this loader and the callbacks through pyproject's
``llmfoundry_*`` entry-point groups; :func:`find_mixer` finds the mixer behind the loader it returns.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from composer.core import DataSpec

from grape_stream.integrations.common import find_mixer
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from grape_stream.recipe.data import join_location

__all__ = ["build_grape_mixture_dataloader", "find_mixer"]


def build_grape_mixture_dataloader(
    tokenizer: Any = None,
    device_batch_size: int | float = 8,
    *,
    domains: Sequence[Any],
    remote: str | None = None,
    local: str | None = None,
    split: str | None = "train",
    weights: Sequence[float] | None = None,
    seed: int = 0,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    pin_memory: bool = False,
    **mixer_kwargs: Any,
) -> Any:
    """A Composer ``DataSpec`` over a :class:`~grape_stream.mixing.mixer.WeightedStreamingMixer`, built the way
    llm-foundry builds a train loader (``train_loader: {name: grape_mixture, ...}``).

    ``domains`` are names (read from ``<remote or local>/<name>/<split>``) or mappings of
    :class:`~grape_stream.mixing.mixer.DomainStream` arguments. Batches hold ``tokens`` and, for llm-foundry's
    models, ``input_ids`` and ``labels`` (the same ids; the models shift labels themselves). ``tokenizer``
    is accepted for the registry's signature and unused: the data is already tokenized.
    """
    if int(device_batch_size) != device_batch_size or device_batch_size < 1:
        raise ValueError(f"grape_mixture needs a whole device_batch_size >= 1, got {device_batch_size!r}")

    streams = []
    for d in domains:
        if isinstance(d, str):
            streams.append(DomainStream(d, remote=join_location(remote, d), local=join_location(local, d), split=split))
        elif isinstance(d, Mapping):
            d = dict(d)
            name = d.pop("name")
            d.setdefault("remote", join_location(remote, name))
            d.setdefault("local", join_location(local, name))
            d.setdefault("split", split)
            streams.append(DomainStream(name, **d))
        else:
            raise TypeError(f"grape_mixture: a domain is a name or a mapping, got {type(d).__name__}")
    mixer = WeightedStreamingMixer(domains=streams, weights=weights, batch_size=int(device_batch_size), seed=seed,
                                   **mixer_kwargs)

    def add_model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
        batch["input_ids"] = batch["tokens"]
        batch["labels"] = batch["tokens"]
        return batch

    kwargs: dict[str, Any] = {"pin_memory": pin_memory}
    if num_workers > 0:
        kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    loader = mixer.dataloader(num_workers=num_workers, **kwargs)
    return DataSpec(loader, batch_transforms=add_model_inputs,
                    get_num_tokens_in_batch=lambda b: int(b["tokens"].numel()))
