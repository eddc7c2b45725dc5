"""DoReMi's reference model when the training model is sharded (FSDP1, FSDP2): the reference's weights sharded
exactly as the training model's, swapped into it for the reference's no-grad forward.

Why a swap and not a copy: a sharded module cannot be deep-copied (its FSDP state holds process groups and
hooks), and sharding a fresh copy the same way needs the wrap policy, mesh and mixed-precision policy, which
only the trainer knows. The training model already *is* the reference's architecture with that sharding. So,
once, every rank loads the reference's full state dict into the training model
(:func:`torch.distributed.checkpoint.state_dict.set_model_state_dict`: each rank keeps its own shard of each
weight), keeps a copy of its local shards, and puts its training shards back. Each reference forward then
swaps the two sets of local shards in place (one storage at a time), runs the training model's own forward in
eval mode under no_grad -- FSDP gathers each unit's reference weights exactly as it gathers the training
weights -- and swaps back.

Memory per rank: one sharded copy of the weights (1 / world of the model) plus one storage at a time; never
a full replica. Exact: the per-token losses are the training model's own forward on the reference's weights.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator

import torch
from torch import nn

from grape_stream.errors import ConfigError

__all__ = ["ShardedReference"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (FSDP2: the DTensor's local tensor; FSDP1: the sharded view itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storages(model: nn.Module) -> list[torch.Tensor]:
    """Every storage behind the model's local parameter shards and buffers, once each, as flat bytes: FSDP1's
    original parameters are views of one flat parameter, swapped together as its storage."""
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            local = _local(t)
            storage = local.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in out:
                flat = torch.empty(0, dtype=torch.uint8, device=local.device)
                out[storage.data_ptr()] = flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return list(out.values())


def _reshard(model: nn.Module) -> None:
    """Free every gathered (unsharded) parameter, so that the next forward gathers the swapped-back training
    shards: FSDP2 keeps a module's gathered weights after a forward when ``reshard_after_forward=False``, FSDP1
    keeps the root unit's."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    _reshard_fsdp1(model)


def _reshard_fsdp1(model: nn.Module) -> None:
    """FSDP1 (torch 2.4-2.14): the root unit keeps its gathered flat parameter after a forward (for the backward
    it expects) and the next forward reuses it without gathering; there is no public call that frees it, so the
    handle is resharded here (``FlatParamHandle.reshard(free_unsharded_flat_param=True)``), the one place that
    touches FSDP1's internals."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for m in model.modules():
        handle = getattr(m, "_handle", None) if isinstance(m, FullyShardedDataParallel) else None
        if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
            handle.reshard(True)
            handle.post_reshard()
            handle._prefetched = False


class ShardedReference:
    """The reference's local shards for a sharded training ``model`` (built on every rank: a collective)."""

    def __init__(self, model: nn.Module, full_state: Callable[[dict[str, Any]], dict[str, torch.Tensor]]) -> None:
        """``full_state(keys)``: the reference's full state dict keyed as ``keys`` (the model's own, without
        wrapper prefixes)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        self.model = model
        storages = _storages(model)
        self._ptrs = [s.data_ptr() for s in storages]
        training = [s.clone() for s in storages]
        full: dict[str, Any] = dict(full_state(get_model_state_dict(model)))
        with torch.no_grad():
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=True))
            self._storages()  # loaded in place: the same storages
            self.shards = [s.clone() for s in storages]
            for s, t in zip(storages, training):
                s.copy_(t)

    def _storages(self) -> list[torch.Tensor]:
        """The model's storages now; one line when they are not those the reference was loaded into."""
        storages = _storages(self.model)
        if [s.data_ptr() for s in storages] != self._ptrs:
            raise ConfigError("DoReMi's sharded reference: the model's parameter shards are not where they were when "
                              "the reference was loaded (re-sharded, or left gathered between micro-batches); keep "
                              "FSDP's default resharding after each backward")
        return storages

    def _swap(self) -> None:
        storages = self._storages()
        with torch.no_grad():
            for s, r in zip(storages, self.shards):
                held = s.clone()
                s.copy_(r)
                r.copy_(held)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[nn.Module]:
        """The training model holding the reference's weights, in eval mode (every module's mode restored after)."""
        modes = [(m, m.training) for m in self.model.modules()]
        self._swap()
        try:
            self.model.eval()
            yield self.model
        finally:
            _reshard(self.model)
            self._swap()
            for m, was in modes:
                m.training = was
