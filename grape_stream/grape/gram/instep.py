"""In-step alignments: each domain's alignment with fixed directions, from the training step's own backward.

GRAPE's domain side needs b_k = <g_k, v>: the gradient g_k of domain k's mean loss against one target
direction v (the task gradients combined by the method, kept from the last task probe). Every training
batch already holds samples of each domain, and per-sample losses are separable, so

    sum_{s in k} w_s <grad l_s, v>   and   sum_{s in k} w_s

are additive over micro-batches, steps and ranks, and their ratio is the alignment of domain k's share of
the training loss (w_s: the weight of sample s's loss in the objective that is backpropagated; for a
mean, b_k = (1/n_k) sum_{s in k} <grad l_s, v>). :class:`StepAlignments` accumulates both on the
training forward/backward of the steps it observes, at almost no extra cost: the hooked modules' weight
gradients are computed per domain (the same matmuls as the step's, split by rows) and returned to autograd
(``grape/gram/instep_grads.py``); one inner product per domain and layer is all that is added.

The weights w_s are read, exactly, from the gradient that reaches the per-sample loss vector: through
:func:`grape_stream.models.loss_watch.watch_losses` (``models.per_sample_lm_loss_from_logits`` calls it, so
ComposerGPT's and the plain loop's losses are seen), or :meth:`StepAlignments.watch` for a loss of your
own. Whatever scales the loss (a mean, Composer's micro-batch fraction, a gradient scaler) is divided out.

Refused, with one line (:class:`~grape_stream.errors.ConfigError`): parameters without a fast path (the
probe's exact fallback costs one backward per group), tensor parallel and FSDP1 hybrid sharding (FSDP2 and FSDP1
run: directions and kept parts sharded like the parameters, shard_layout.py),
modules that mix samples (BatchNorm), a parameter used outside its module's forward, a module run twice per
forward by activation checkpointing, and a backward whose per-sample loss was not watched.
docs/alignment.md, "In-step alignments".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from grape_stream.errors import ConfigError
from grape_stream.grape.gram.batches import MicroBatch, batch_signature, map_tensors
from grape_stream.grape.gram.hooks import FusedGramEngine, Use
from grape_stream.grape.gram.instep_grads import DomainParts, GradUse, PartStore, use_grads
from grape_stream.grape.gram.instep_scope import check_model, hooked_modules, stray_uses
from grape_stream.grape.gram.instep_shards import scatter_parts
from grape_stream.grape.gram.layout_probe import probe_layouts
from grape_stream.grape.gram.shard_layout import ShardLayout, named_parameters, shard_layouts
from grape_stream.models.loss_watch import watching_losses

__all__ = ["INSTEP_STATE_FORMAT", "StepAlignments", "domain_order", "reorder_rows", "sort_by_domain"]

INSTEP_STATE_FORMAT = "grape_stream.instep/1"

PerSampleLoss = Callable[[nn.Module, Any], Tensor]


def sort_by_domain(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch with its samples in domain order (stable): every tensor with the batch's leading size is
    reordered. A training loss that is a mean over the batch is unchanged; the observed step's per-domain
    gradients then take views of contiguous rows instead of gathering them."""
    return reorder_rows(batch, domain_order(batch))


def domain_order(batch: Mapping[str, Any]) -> Tensor:
    """The permutation that puts the batch's samples in domain order (stable)."""
    return torch.sort(torch.as_tensor(batch["domain"]), stable=True).indices


def reorder_rows(batch: Mapping[str, Any], order: Tensor) -> dict[str, Any]:
    """``batch`` with every tensor whose leading size is the batch's (``len(order)``) taken in ``order``; the
    model's inputs and the mixer batch beside them (the HF Trainer's case) stay aligned row for row."""
    n = order.shape[0]
    return {k: (v.index_select(0, order.to(v.device)) if isinstance(v, Tensor) and v.dim() and v.shape[0] == n else v)
            for k, v in batch.items()}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass(eq=False)
class _StepUse(Use):
    """A hooked call of an observed step: what its backward needs, and its parameters in the Function's order."""

    grad_use: Optional[GradUse] = None
    param_order: tuple[str, ...] = ()
    live: Optional[dict[str, Any]] = None  # the tensors the call computed with (FSDP2: the gathered ones)


class _AlignedGrad(torch.autograd.Function):
    """Identity on a hooked call's output; its backward hands dY to the engine and returns the gradients of
    the call's (detached-in-forward) parameters to autograd, so ``.grad`` and DDP see them as usual."""

    @staticmethod
    def forward(ctx: Any, engine: "_Engine", use: _StepUse, output: Tensor, *params: Tensor) -> Tensor:
        ctx.engine, ctx.use = engine, use
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        grads = ctx.engine.backward_use(ctx.use, grad)
        return (None, None, grad, *grads)


class _Engine(FusedGramEngine):
    """The fused Gram's hooks (layouts, capability checks, parameter aliasing), with the per-group Gram
    replaced by per-domain alignments and the parameters' gradients handed back to autograd."""

    def __init__(self, modules: list, num_domains: int, device: torch.device,
                 pieces: Optional[dict[int, ShardLayout]] = None) -> None:
        super().__init__(modules, num_domains, device, _compute_dtype, sharded=bool(pieces))
        self.num_domains = num_domains
        self.pieces = pieces or {}  # id(param) -> where each rank holds its piece (FSDP1 / FSDP2)
        self.directions: dict[int, Tensor] = {}  # id(param) -> (D, *shape); sharded: held like the parameter
        self.sums: Optional[Tensor] = None  # (K, D) float64: sum_{s in k} w_s <grad l_s, u_d>
        self.parts: Optional[DomainParts] = None
        self.errors: list[str] = []
        self.in_backward = False
        self.handled = False
        self.keep_inputs = False  # the graph will be backpropagated again (retain_graph)
        self.store: Optional[PartStore] = None  # also keep each domain's part of every gradient
        self.param_grads = True  # False: the parts only (a probe under FSDP2: no whole gradient held to the end)

    def _make_post_hook(self, name: str, module: nn.Module, kind: str, params: dict[str, nn.Parameter]):
        base = super()._make_post_hook(name, module, kind, params)

        def post_hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if self.capturing and self.mode is None and self.in_backward:
                self.errors.append(f"{name} ran during the backward (activation checkpointing recomputes it)")
            self.handled = False
            returned = base(mod, args, kwargs, output)
            if self.capturing and self.mode is None and not self.handled:
                # A call that could not be taken (an unverified form): re-run it with its real parameters so
                # that training gets its gradients through autograd; the alignment cannot count it.
                self.errors.append(f"{name}: {self.layout_errors.get(id(next(iter(params.values()))), 'not taken')}")
                return self.quietly(lambda: mod.forward(*args, **kwargs))
            return returned

        return post_hook

    def _capture(self, name, mod, kind, params, key, inp, output, lead) -> Any:
        attributed = self._attribute(name, mod, kind, params, key, inp, output, lead)
        rows: Optional[int] = None
        if attributed is not None:
            inp, output, _, rows = attributed
        elif not isinstance(output, Tensor) or not isinstance(inp, Tensor):
            return None  # the post hook re-runs this call
        else:  # rows not attributable: gradients only; the error is raised after the backward
            self.errors.append(self.layout_errors.get(id(next(iter(params.values()))), f"{name}: layout"))
        gu = GradUse(kind=kind, inp=inp.detach(), rows=rows, padding_idx=getattr(mod, "padding_idx", None))
        if kind in ("layernorm", "rmsnorm"):
            gu.normalized_shape, gu.eps = tuple(mod.normalized_shape), mod.eps
        elif kind == "affine":
            gu.normalized_shape = tuple(mod._parameters["weight"].shape)
        use = _StepUse(name=name, kind=kind, module=mod, params=params, inp=None, rows_per_sample=rows or 0,
                       grad_use=gu, param_order=tuple(params))
        # FSDP: the gradient goes to the unit's gathered parameter (back on the module since _restore; FSDP1: a
        # view of the unit's gathered FlatParameter), which FSDP reduce-scatters into the sharded one as usual
        live = {n: mod._parameters[n] for n in use.param_order} if self.sharded else params
        use.live = live
        out = _AlignedGrad.apply(self, use, output, *[live[n] for n in use.param_order])
        use.node = out.grad_fn
        self.uses.append(use)
        self.handled = True
        return out

    def backward_use(self, use: _StepUse, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        self.in_backward = True
        use.fired = True
        gu = use.grad_use
        assert gu is not None, "_capture sets it"
        with torch.autocast(device_type=grad.device.type, enabled=False):
            parts = self.parts if self.processing else None
            # FSDP: each direction all-gathered for this call only (every rank runs the same calls in order)
            dirs = {n: None if (u := self.directions.get(id(p))) is None or parts is None
                    else self.pieces[id(p)].gather(u) if self.sharded else u for n, p in use.params.items()}
            live = use.live or use.params
            store = self.store if parts is not None else None
            local = PartStore(self.num_domains) if self.sharded and store is not None else store
            grads, dots = use_grads(gu, grad, dict(live), parts, {n: dirs[n] for n in live},
                                    self.compute_dtype(grad.dtype), local)
            if local is not store and store is not None:
                scatter_parts(use.params, live, local, store, self.num_domains, self.compute_dtype, self.pieces,
                              self.uses)
        if dots is not None and self.sums is not None and parts is not None:
            self.sums.index_add_(0, parts.domains, dots.to(torch.float64))
        if not self.keep_inputs:
            gu.inp = None  # type: ignore[assignment]  # free the input as soon as it is used
        return tuple(grads.get(n) if self.param_grads else None for n in use.param_order)


class StepAlignments:
    """Per-domain alignments with fixed directions, accumulated over observed training backwards.

    ``model``: the module the training step differentiates (a DDP / DataParallel wrapper is unwrapped as for the
    probe; a torch.compile'd model is refused, see ``instep_scope.check_model``).
    ``per_sample_loss``: the probe's ``f(model, batch) -> Tensor[B]``, run under no_grad on one and two samples of
    the first observed batch of each shape to learn which rows of each call belong to which sample.
    ``num_domains``: K. Directions are set with :meth:`set_directions`.

    After observed backwards: ``sums`` (K, D) and ``weights`` (K,) float64 hold sum_{s in k} w_s <grad l_s, u_d>
    and sum_{s in k} w_s; :meth:`alignments` is their ratio. Everything is additive: :meth:`reduce` sums
    them over ranks.
    """

    def __init__(self, model: nn.Module, per_sample_loss: PerSampleLoss, num_domains: int) -> None:
        self.model = check_model(model)
        self.per_sample_loss = per_sample_loss
        self.num_domains = int(num_domains)
        modules, scope = hooked_modules(self.model)
        self.scope = scope
        self.device = scope[0].device
        # FSDP1 / FSDP2: directions and kept parts sharded like the parameters (shard_layout.py; a collective)
        self.pieces = shard_layouts(self.model)
        self.sharded = bool(self.pieces)
        self.engine = _Engine(modules, self.num_domains, self.device, pieces=self.pieces)
        self.sums = torch.zeros((self.num_domains, 0), dtype=torch.float64, device=self.device)
        self.weights = torch.zeros(self.num_domains, dtype=torch.float64, device=self.device)
        self.samples = torch.zeros(self.num_domains, dtype=torch.float64, device=self.device)
        self._layouts: dict[tuple, Any] = {}
        self._watched = 0
        self._handles: list[Any] = []

    # -------------------------------------------------------------------------------------------- state
    def set_directions(self, directions: Sequence[Mapping[Any, Tensor]]) -> None:
        """The D fixed directions u_d, each {parameter or its name: tensor of its shape} (a parameter left
        out counts as zero). Clears the accumulated sums."""
        names = {n: p for n, p in named_parameters(self.model)}
        stacks: dict[int, list[Optional[Tensor]]] = {id(p): [None] * len(directions) for p in self.scope}
        for d, direction in enumerate(directions):
            for key, t in direction.items():
                p = names.get(key) if isinstance(key, str) else key
                if p is None or id(p) not in stacks:
                    raise ValueError(f"direction {d}: {key!r} is not a trainable parameter of the model")
                whole = self.pieces[id(p)].shape if id(p) in self.pieces else p.shape  # (FSDP1: p is a piece)
                if tuple(t.shape) not in {tuple(p.shape), tuple(whole)}:
                    raise ValueError(f"direction {d}: {key!r} has shape {tuple(t.shape)}, the parameter "
                                     f"{tuple(whole)}")
                stacks[id(p)][d] = t
        self.engine.directions = {}
        for p in self.scope:
            ts = stacks[id(p)]
            if any(t is not None for t in ts) and self.sharded:  # each rank stacks its pieces, no gather
                self.engine.directions[id(p)] = self.pieces[id(p)].stack(ts)
            elif any(t is not None for t in ts):
                self.engine.directions[id(p)] = torch.stack([torch.zeros(p.shape, dtype=p.dtype, device=p.device)
                                                             if t is None else t.detach().to(p.device, p.dtype)
                                                             for t in ts])
        self.num_directions = len(directions)
        self.reset()

    def reset(self) -> None:
        d = getattr(self, "num_directions", 0)
        self.sums = torch.zeros((self.num_domains, d), dtype=torch.float64, device=self.device)
        self.weights.zero_()
        self.samples.zero_()

    def alignments(self) -> Tensor:
        """(K, D) float64 on CPU: sums / weights (NaN for a domain no observed sample came from)."""
        return (self.sums / self.weights.unsqueeze(1)).cpu()

    # -------------------------------------------------------------------------------------------- observing
    @contextlib.contextmanager
    def observe(self, batch: Any, domains: Optional[Tensor] = None, auto_watch: bool = True,
                retain_graph: bool = False, store: Optional[PartStore] = None) -> Iterator["StepAlignments"]:
        """Hooks for ONE forward + backward of a (micro-)batch inside the block; the per-sample loss of that
        forward must be watched once (automatic through grape_stream's per-sample LM loss, else :meth:`watch`;
        ``auto_watch=False``: only explicit :meth:`watch` calls count).

        ``domains``: (B,) domain of each sample (default ``batch["domain"]``, the mixer's column).
        ``retain_graph``: the graph will be backpropagated again after the block (gradients only).
        ``store``: also keep each domain's part of every parameter's gradient there (K gradient copies).
        """
        if domains is None:
            domains = batch["domain"] if isinstance(batch, Mapping) and "domain" in batch else None
            if domains is None:
                raise ConfigError("in-step alignments need each sample's domain: the batch has no 'domain' column "
                                  "(the WeightedStreamingMixer adds it); pass domains=")
        parts = DomainParts(torch.as_tensor(domains).to(self.device), self.num_domains)
        eng = self.engine
        eng.install()
        try:
            self._layouts_for(batch, parts.batch_size)
            eng.begin(MicroBatch(torch.zeros(parts.batch_size, dtype=torch.long), is_last=True), None)
            eng.parts, eng.sums, eng.errors, eng.in_backward = parts, self.sums, [], False
            eng.processing, eng.keep_inputs, eng.store = True, retain_graph, store
            self._watched = 0
            with watching_losses(self) if auto_watch else contextlib.nullcontext():
                yield self
            self._finish(parts)
        finally:
            for h in self._handles:  # a later backward of the same graph (retain_graph) is not this step's
                h.remove()
            self._handles = []
            eng.processing, eng.store = False, None
            eng.parts = None
            eng.remove()
            eng.capturing = False

    def watch(self, losses: Tensor) -> None:
        """Read each sample's weight in the objective from the gradient its loss receives (losses: (B,))."""
        if not isinstance(losses, Tensor) or not losses.requires_grad:
            return  # a no-grad forward (layout probing, evaluation): nothing will be backpropagated
        parts = self.engine.parts
        if parts is None or not self.engine.capturing:
            return
        if losses.dim() != 1 or losses.shape[0] != parts.batch_size:
            self.engine.errors.append(f"the watched per-sample loss has shape {tuple(losses.shape)}, the batch "
                                      f"{parts.batch_size} samples")
            return
        self._watched += 1
        self.engine.errors.extend(stray_uses(losses, self.engine.uses, _AlignedGrad))
        domains = parts.sample_domains

        def capture(g: Tensor) -> None:
            self.weights.index_add_(0, domains, g.detach().to(torch.float64))

        self._handles.append(losses.register_hook(capture))

    def _layouts_for(self, batch: Any, size: int) -> None:
        eng = self.engine
        key = batch_signature(batch)
        if key not in self._layouts:
            with torch.no_grad():
                self._layouts[key] = probe_layouts(eng, self.model, self.per_sample_loss,
                                                   map_tensors(batch, lambda t: t[: min(2, size)]), min(2, size))
            bad = sorted({f"{n}" for n, m, k, _ in eng.modules for ck, kind in self._layouts[key][1].items()
                          if ck[0] == id(m) and kind is None})
            if bad:
                raise ConfigError(f"in-step alignments: no exact per-sample form for {', '.join(bad)} (their "
                                  "forward is not a supported function of weight/bias); use alignments: probe")
        eng.use_layouts(*self._layouts[key])

    def _finish(self, parts: DomainParts) -> None:
        eng = self.engine
        eng.end_forward()
        missing = [u.name for u in eng.uses if not u.fired]
        if not eng.uses:
            raise ConfigError("in-step alignments: no hooked module ran in the observed forward (is the model that "
                              "trains the one given to StepAlignments?)")
        if self._watched == 0:
            raise ConfigError(
                "in-step alignments: the training loss of this step was not a watched per-sample loss (compute it "
                "with grape_stream.models.per_sample_lm_loss / ComposerGPT, or call StepAlignments.watch(losses))")
        if eng.errors:
            raise ConfigError(f"in-step alignments cannot be exact for this model: {eng.errors[0]}"
                              + (f" (and {len(eng.errors) - 1} more)" if len(eng.errors) > 1 else ""))
        if not eng.in_backward:
            raise ConfigError("in-step alignments: the backward of the observed forward must run inside observe()")
        if missing:
            raise ConfigError(f"in-step alignments: no gradient reached {', '.join(sorted(set(missing))[:3])} "
                              "(an output modified in place or detached?)")
        self.samples.index_add_(0, parts.sample_domains, torch.ones_like(parts.sample_domains, dtype=torch.float64))
        eng.finish_micro()

    # -------------------------------------------------------------------------------------------- ranks
    def reduce(self, group: Any = None) -> None:
        """Sum ``sums``, ``weights`` and ``samples`` over the ranks (one all-reduce), in place."""
        import torch.distributed as dist

        from grape_stream.grape.collectives import collective_device

        k, d = self.sums.shape
        packed = torch.cat([self.sums.reshape(-1), self.weights, self.samples]).to(collective_device(None, group))
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        packed = packed.to(self.device)
        self.sums = packed[: k * d].reshape(k, d).clone()
        self.weights = packed[k * d : k * d + k].clone()
        self.samples = packed[k * d + k :].clone()

    # -------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The directions (by parameter name, on CPU) and the accumulated sums: tensors and plain types only."""
        names = {id(p): n for n, p in named_parameters(self.model)}
        return {
            "format": INSTEP_STATE_FORMAT,
            "num_domains": self.num_domains,
            "num_directions": getattr(self, "num_directions", 0),
            # sharded: gathered whole (an all-gather per parameter: call it on every rank)
            "directions": {names[k]: (self.pieces[k].gather(t) if self.sharded else t).detach().cpu().clone()
                           for k, t in self.engine.directions.items()},
            "sums": self.sums.cpu().clone(), "weights": self.weights.cpu().clone(),
            "samples": self.samples.cpu().clone(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != INSTEP_STATE_FORMAT or int(state["num_domains"]) != self.num_domains:
            raise ValueError(f"not an in-step alignment state for {self.num_domains} domains "
                             f"(format {state.get('format')!r})")
        d = int(state["num_directions"])
        stacks = state["directions"]
        self.set_directions([{n: t[i] for n, t in stacks.items()} for i in range(d)])
        self.sums = state["sums"].to(self.device, torch.float64).clone()
        self.weights = state["weights"].to(self.device, torch.float64).clone()
        self.samples = state["samples"].to(self.device, torch.float64).clone()

    def memory_elements(self) -> int:
        """Elements held for the directions (D gradient-sized copies)."""
        held = [self.pieces[k].local(t) if self.sharded else t for k, t in self.engine.directions.items()]
        return sum(t.numel() for t in held)
