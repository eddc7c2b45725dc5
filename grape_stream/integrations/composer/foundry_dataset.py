"""llm-foundry's train-loader shape, read for the mixer: the ``dataset: {...}`` block, the checks of the
conversion manifest against the run's tokenizer and ``max_seq_len``, and labels from ``loss_mask``.

An llm-foundry YAML says ``train_loader: {name: text, dataset: {remote, local, split, shuffle,
max_seq_len, shuffle_seed, eos_token_id, ...}, drop_last, num_workers}``; switching ``name`` to
``grape_mixture`` keeps that block. What the mixer plans itself (``shuffle_algo``, ``num_canonical_nodes``,
...) and what only a fine-tuning loader means (``hf_name``, ``decoder_only_format``, ...) is refused with
one line naming ``dataset.<key>``. No Composer import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from grape_stream.errors import ConfigError
from grape_stream.mixing.domains import PASSTHROUGH, PLANNED_BY_MIXER
from grape_stream.recipe.data import join_location, manifest_at, manifest_vocab_size

__all__ = ["IGNORE_INDEX", "LoaderShape", "check_manifest", "labels_from_loss_mask", "read_dataset_block"]

#: llm-foundry's (and torch's cross_entropy) ignore index for label positions that are not trained on.
IGNORE_INDEX = -100

#: dataset keys the mixer reads itself (the rest of PASSTHROUGH go to every domain's StreamingDataset)
_MAPPED = ("remote", "local", "split", "max_seq_len", "shuffle", "shuffle_seed", "shuffle_block_size",
           "eos_token_id", "domains", "streams")


@dataclass
class LoaderShape:
    """What a ``dataset`` block (plus the loader's own keys) means for the mixer."""

    remote: str | None = None
    local: str | None = None
    split: str | None = "train"
    domains: list[Any] = field(default_factory=list)
    weights: list[float] | None = None
    max_seq_len: int | None = None
    eos_token_id: int | None = None
    mixer_kwargs: dict[str, Any] = field(default_factory=dict)


def _streams_as_domains(streams: Mapping[str, Any]) -> tuple[list[Any], list[float] | None]:
    """llm-foundry's ``streams: {name: {remote, local, split, proportion}}`` -> domains and initial weights."""
    domains, props = [], []
    for name, s in streams.items():
        s = dict(s or {})
        props.append(s.pop("proportion", None))
        bad = sorted(set(s) - {"remote", "local", "split"})
        if bad:
            raise ConfigError(f"grape_mixture: dataset.streams.{name}.{bad[0]} is not supported "
                              "(a stream takes remote, local, split, proportion)")
        domains.append({"name": name, **s})
    if all(p is None for p in props):
        return domains, None
    if any(p is None for p in props):
        raise ConfigError("grape_mixture: give every dataset.streams entry a proportion, or none")
    return domains, [float(p) for p in props]


def read_dataset_block(shape: LoaderShape, dataset: Mapping[str, Any]) -> LoaderShape:
    """``shape`` updated from llm-foundry's ``dataset`` block; an unknown or unsupported key is one line."""
    for key in dataset:
        if key in _MAPPED or key in PASSTHROUGH:
            continue
        why = PLANNED_BY_MIXER.get(key, "it belongs to llm-foundry's own text / fine-tuning loaders")
        raise ConfigError(f"grape_mixture: dataset.{key} is not supported: {why}")
    for key in ("remote", "local", "split", "max_seq_len", "eos_token_id"):
        if key in dataset:
            setattr(shape, key, dataset[key])
    if "domains" in dataset:
        shape.domains = list(dataset["domains"])
    if "streams" in dataset:
        shape.domains, shape.weights = _streams_as_domains(dataset["streams"])
    if "shuffle_seed" in dataset:
        shape.mixer_kwargs["seed"] = int(dataset["shuffle_seed"])
    for key in ("shuffle", "shuffle_block_size", *PASSTHROUGH):
        if key in dataset:
            shape.mixer_kwargs[key] = dataset[key]
    return shape


def _tokenizer_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
        return int(size) if size else None


def check_manifest(shape: LoaderShape, tokenizer: Any) -> dict[str, Any] | None:
    """The conversion manifest (at ``remote`` or ``local``) agrees with the run: the data was tokenized with
    a vocabulary of the tokenizer's size, its samples fit ``max_seq_len``, its EOS is ``eos_token_id``.
    Each disagreement is one :class:`ConfigError` naming both values (byte data against GPT-2's 50,257
    tokens would otherwise train silently on the wrong token ids). No manifest: nothing to check."""
    manifest = manifest_at(shape.remote, shape.local)
    if not manifest:
        return None
    where = join_location(shape.remote or shape.local, "manifest.json")
    tok_entry = manifest.get("tokenizer")
    tok: Mapping[str, Any] = tok_entry if isinstance(tok_entry, Mapping) else {}
    data_vocab, data_seq = manifest_vocab_size(manifest), manifest.get("seq_len")
    size = _tokenizer_size(tokenizer) if tokenizer is not None else None
    if data_vocab and size and data_vocab != size:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ConfigError(f"grape_mixture: the data ({where}) was tokenized with {tok.get('name', '?')!r} "
                          f"(vocab_size={data_vocab}) but the run's tokenizer {name!r} has {size} tokens; "
                          "convert the data with the run's tokenizer (grape-stream convert --tokenizer ...) "
                          "or set the run's tokenizer to the data's")
    if data_seq and shape.max_seq_len and int(data_seq) > int(shape.max_seq_len):
        raise ConfigError(f"grape_mixture: the data ({where}) has seq_len={data_seq} but dataset.max_seq_len is "
                          f"{shape.max_seq_len}; set max_seq_len >= {data_seq} or convert with --seq-len "
                          f"{shape.max_seq_len}")
    eos = tok.get("eos_id")
    if shape.eos_token_id is not None and eos is not None and int(eos) != int(shape.eos_token_id):
        raise ConfigError(f"grape_mixture: dataset.eos_token_id is {shape.eos_token_id} but the data ({where}) "
                          f"separates documents with eos_id={eos}")
    return manifest


def labels_from_loss_mask(batch: dict[str, Any]) -> dict[str, Any]:
    """llm-foundry's model inputs: ``input_ids`` = the tokens, ``labels`` = the tokens with every position
    the shards' ``loss_mask`` marks 0 (padding of a packed remainder, a task's prompt) set to
    :data:`IGNORE_INDEX`; the models shift labels themselves."""
    tokens = batch["tokens"]
    batch["input_ids"] = tokens
    mask = batch.get("loss_mask")
    if mask is None:
        batch["labels"] = tokens
    else:
        batch["labels"] = torch.where(mask.bool(), tokens, torch.full_like(tokens, IGNORE_INDEX))
    return batch
