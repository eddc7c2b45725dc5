"""What in-step alignments can hook, and where they must refuse: checked before and during an observed step.

In-step alignments (``instep.py``) replace the training step's parameter gradients by per-domain sums, so a
parameter they cannot take exactly must be refused rather than approximated: the probe's exact fallback
(one backward per group) would cost a step per domain on every observed step. Each refusal is one line
naming the parameter or module (:class:`~grape_stream.errors.ConfigError`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from grape_stream.errors import ConfigError
from grape_stream.grape.gram.graph import graph_nodes
from grape_stream.grape.gram.plan import _classify, check_batch_coupling
from grape_stream.grape.probes import sharded_parameter, unwrap_for_probe

__all__ = ["check_model", "hooked_modules", "refuse_sharded", "stray_uses"]

_WHERE = "docs/alignment.md, 'In-step alignments'"


def refuse_sharded(model: nn.Module) -> None:
    """One line for sharding the in-step engine cannot take exactly: FSDP1 without ``use_orig_params``, tensor
    parallel (a module computes with a shard). FSDP2 (``fully_shard``) and FSDP1 (``use_orig_params=True``) run,
    their pieces placed as ``shard_layout.py`` says; FSDP1's hybrid sharding is refused."""
    from grape_stream.grape.gram.shard_layout import check_fsdp1
    from grape_stream.grape.gram.sharding import ShardedGramError, check_sharded

    try:
        kind = check_sharded(model)
    except ShardedGramError as exc:
        raise ConfigError(f"alignments: steps and R&B's step Gram: {exc}") from exc
    if kind == "fsdp1":
        check_fsdp1(model)
    why = sharded_parameter(model) if kind is None else None
    if why is not None:
        raise ConfigError(f"alignments: steps and R&B's step Gram run on models sharded by FSDP2 (fully_shard) or "
                          f"FSDP1 (use_orig_params=True), not on {why}; use alignments: probe ({_WHERE})")


def check_model(model: nn.Module) -> nn.Module:
    """The module whose calls are hooked (DDP / DataParallel unwrapped); refused when hooks cannot see its
    training forward or its per-sample gradients are not separable."""
    refuse_sharded(model)
    if isinstance(getattr(model, "_orig_mod", None), nn.Module) or _compiled(model):
        raise ConfigError("in-step alignments do not take a torch.compile'd model: dynamo traces their module hooks "
                          "with graph breaks and recompiles at every observed step (exact, but no longer compiled); "
                          f"compile nothing or use alignments: probe ({_WHERE})")
    try:
        inner = unwrap_for_probe(model, sharded_ok=True)
        check_batch_coupling(inner)
    except (NotImplementedError, ValueError) as exc:
        raise ConfigError(f"in-step alignments: {str(exc).splitlines()[0]}") from exc
    for name, m in inner.named_modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            raise ConfigError(f"in-step alignments: {name or type(m).__name__} uses gradient checkpointing (its "
                              "forward is re-run inside the backward); turn it off or use alignments: probe "
                              f"({_WHERE})")
        if isinstance(m, nn.Embedding) and (m.sparse or m.max_norm is not None):
            raise ConfigError(f"in-step alignments: embedding {name!r} has sparse=True or max_norm (a sparse gradient "
                              f"/ weights renormalised in the forward); use alignments: probe ({_WHERE})")
    return inner


def _compiled(model: nn.Module) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


Hooked = list[tuple[str, nn.Module, str, dict[str, nn.Parameter]]]


def hooked_modules(model: nn.Module) -> tuple[Hooked, list[nn.Parameter]]:
    """(fast-path modules with their in-scope parameters, every trainable parameter); refused when a
    parameter has no exact per-sample form."""
    scope = [p for p in model.parameters() if p.requires_grad]
    if not scope:
        raise ConfigError("in-step alignments: the model has no trainable parameter")
    fast, fallback_params, reasons = _classify(model, scope, {})
    if fallback_params:
        names = {id(p): n for n, p in model.named_parameters()}
        first = fallback_params[0]
        more = f" and {len(fallback_params) - 1} more parameters" if len(fallback_params) > 1 else ""
        raise ConfigError(f"in-step alignments: no exact per-sample form for {names.get(id(first), '?')} "
                          f"({reasons[id(first)][1]}){more}; use alignments: probe ({_WHERE})")
    return fast, scope


def stray_uses(losses: Tensor, uses: list[Any], hooked_fn: type) -> list[str]:
    """Walk the graph behind the per-sample losses: a hooked parameter reached by any node other than a hooked
    call's own (a functional use elsewhere) is an error; hooked calls that do not reach the losses are marked
    done (their gradient never arrives)."""
    mine = {id(p): u.name for u in uses for p in u.params.values()}
    seen: set[int] = set()
    keep: list[Any] = []  # the nodes stay alive while their ids are compared
    errors: list[str] = []
    for node in graph_nodes(losses):
        seen.add(id(node))
        keep.append(node)
        ours = getattr(node, "_forward_cls", None) is hooked_fn
        for nxt, _ in node.next_functions:
            var = getattr(nxt, "variable", None)
            if isinstance(var, Tensor) and id(var) in mine and not ours:
                errors.append(f"a parameter of {mine[id(var)]} is used outside its module's forward (functional use)")
    for u in uses:
        if id(u.node) not in seen:
            u.fired = True
    return errors
