"""GRAPE under FSDP: probe an unsharded replica of the sharded model, rebuilt at each GRAPE update.

Under FSDP (FSDP1 ``FullyShardedDataParallel`` or FSDP2 ``fully_shard``) each rank holds a shard of every
parameter, and a per-rank gradient of a shard is not the per-sample gradient the alignment Gram needs.
So at an update every rank gathers the full weights (one all-gather, the collective behind a full state
dict: :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`), loads them into a replica of
the architecture kept on the meta device since before the model was wrapped (:func:`probe_skeleton`), and
probes that replica exactly as under DDP: rank-disjoint probes, Grams averaged with one all-reduce,
identical alpha / z everywhere. The training model, its shards, gradients and optimizer are not touched.

Cost: one full copy of the weights per rank while the probe runs (every ``alpha_every`` steps), freed
after; the optimizer state and gradients stay sharded, so this fits any model whose weights fit one
device (the case where FSDP is used to shard optimizer state, as in llm-foundry's 125M-7B pretrain
YAMLs). A model whose weights alone exceed one device is beyond it (say so, do not probe a shard).
No trainer import here.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from grape_stream.grape.probes import sharded_parameter

__all__ = ["is_sharded", "probe_skeleton", "unsharded_replica"]


def is_sharded(model: nn.Module) -> bool:
    """True for a model holding FSDP1 modules, FlatParameters or DTensor parameters (grape.probes'
    :func:`~grape_stream.grape.probes.sharded_parameter`), or FSDP2 modules."""
    if sharded_parameter(model) is not None:
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def probe_skeleton(model: nn.Module) -> nn.Module:
    """A replica of ``model``'s architecture on the meta device (no memory), taken *before* FSDP wraps it
    (Composer: at ``Event.INIT``). A model already built on meta (llm-foundry's ``init_device: meta``)
    copies for free; otherwise the copy is transient."""
    if is_sharded(model):
        raise ValueError("probe_skeleton needs the model before FSDP wraps it (Composer: Event.INIT)")
    skeleton = copy.deepcopy(model)  # deepcopy keeps tied parameters tied; .to("meta") would untie them
    tied: dict[int, list[str]] = {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    skeleton = skeleton.to("meta")
    for first, *others in tied.values():
        for name in others:
            _set_tensor(skeleton, name, skeleton.get_parameter(first), parameter=True)
    return skeleton


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor, *, parameter: bool,
                requires_grad: bool = True) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    if parameter:
        setattr(owner, attr, value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad))
    else:
        owner._buffers[attr] = value


def unsharded_replica(model: nn.Module, skeleton: nn.Module) -> nn.Module:
    """The skeleton holding ``model``'s full current weights (a collective: every rank must call it).

    Parameters come from the full state dict (on the device the model computes on); buffers, which FSDP
    never shards, are copied from the model (non-persistent ones too: causal masks, rotary caches); tied
    parameters (a shared embedding and output head) stay one parameter, so the probe's per-sample
    gradient is the one training sees. Same train / eval mode as ``model``. Without sharding (one rank) the
    tensors may alias the model's; the probe only reads them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    replica = copy.deepcopy(skeleton)
    first_name: dict[int, str] = {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        first = first_name.setdefault(id(p), name)
        if first != name:  # tied to an earlier name: the same parameter again
            _set_tensor(replica, name, replica.get_parameter(first), parameter=True)
        elif name not in full:
            raise RuntimeError(f"the FSDP model's full state dict has no {name!r} (keys like {list(full)[:3]}): "
                               "was the model changed after the probe skeleton was taken (Event.INIT)?")
        else:
            value = full[name]
            assert isinstance(value, torch.Tensor), f"{name}: a full state dict holds plain tensors"
            _set_tensor(replica, name, value.detach(), parameter=True, requires_grad=p.requires_grad)
    buffers = {_clean(n): b for n, b in model.named_buffers()}
    for name, _ in skeleton.named_buffers():
        if name not in buffers:
            raise RuntimeError(f"the FSDP model has no buffer {name!r} for the probe replica")
        _set_tensor(replica, name, buffers[name].detach(), parameter=False)
    replica.train(model.training)
    return replica
