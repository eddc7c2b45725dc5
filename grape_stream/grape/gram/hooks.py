"""Module hooks that turn one fused backward pass into per-group gradient contributions.

How a fast-path module is observed (`FusedGramEngine`):

* forward pre-hook: the module's in-scope parameters are swapped for detached aliases for the duration
  of its forward, so autograd never computes (nor stores inputs for) their full gradients; the module
  output still carries the graph back to earlier layers through its input;
* forward hook: records the call (a "use": module, input, rows per sample) and registers a tensor hook
  on the output; an output that does not require grad (e.g. an embedding of integer ids) is replaced by
  a detached leaf that does, so the backward reaches it;
* tensor hook (fires inside the backward with dY): builds the per-group contribution of each of the
  module's parameters and feeds it to that parameter's `RowAccumulator`, then drops the input.

A parameter used outside the forward of a hooked module (functional use, e.g. `F.linear(x, m.weight)`
elsewhere) would still reach autograd through the real Parameter: `scan_graph` finds such edges before
the backward and the caller re-runs with that parameter on the exact fallback.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from grape_stream.grape.gram.accumulators import DEFAULT_BUDGET, RowAccumulator, TensorContribution
from grape_stream.grape.gram.batches import MicroBatch
from grape_stream.grape.gram.capabilities import AUTO, demote, demoted_reason, unit_output, verify_call
from grape_stream.grape.gram.contributions import Use, contributions
from grape_stream.grape.gram.layouts import (
    CallKey,
    Lead,
    expand_shared,
    is_sample_major_view,
    lead_shape,
)
from grape_stream.grape.gram.shard_sums import ShardedGroupSums


class FusedGramEngine:
    """Hooks on fast-path modules + per-parameter accumulators for one `group_gram` call."""

    def __init__(
        self,
        modules: list[tuple[str, nn.Module, str, dict[str, nn.Parameter]]],
        num_groups: int,
        device: torch.device,
        compute_dtype: Callable[[torch.dtype], torch.dtype],
        budget: int = DEFAULT_BUDGET,
        allow_ghost: bool = True,
        scales: Optional[dict[int, Tensor]] = None,
        sharded: bool = False,
        sums: Optional[ShardedGroupSums] = None,
    ) -> None:
        self.modules = modules
        self.shard_sums = sums  # FSDP with micro-batches: per-group gradients summed over the ranks, sharded
        # FSDP (gram/sharding.py): a module computes with FSDP's gathered tensor, not the scope's parameter
        self.sharded = sharded
        self.shapes: dict[int, torch.Size] = {}  # id(scope parameter) -> its full shape, as its module saw it
        self.scales = scales or {}  # id(param) -> sqrt of its preconditioner weight (precondition.py)
        self.num_groups = num_groups
        self.device = device
        self.compute_dtype = compute_dtype
        self.budget = budget
        self.allow_ghost = allow_ghost
        self.gram = torch.zeros((num_groups, num_groups), dtype=torch.float64, device=device)
        self.acc: dict[int, RowAccumulator] = {}
        self.param_names: dict[int, str] = {}
        self.handles: list[Any] = []
        # (module, name, the tensor it held, where: "_parameters" or "__dict__") while a detached alias stands in
        self.originals: list[tuple[nn.Module, str, Tensor, str]] = []
        self.micro: Optional[MicroBatch] = None
        self.uses: list[Use] = []
        self.pending: dict[int, list[Use]] = {}
        self.hook_seconds = 0.0  # time spent forming contributions inside the backward
        self.capturing = False  # forward hooks record uses
        self.processing = False  # tensor hooks compute contributions (off during fallback backwards)
        self.layout_errors: dict[int, str] = {}
        self.roots: list[Tensor] = []
        # layout probing: "probe" records leading shapes, "verify" expands chosen shared calls
        self.mode: Optional[str] = None
        self.call_counts: dict[int, int] = {}
        self.recorded: dict[CallKey, Lead] = {}
        self.expand_keys: dict[CallKey, str] = {}
        self.layouts: dict[CallKey, tuple[str, Lead]] = {}
        self.probe_batch = 0
        # capability kinds (capabilities.py): verified per call of an AUTO module on the one-sample probe
        self.verifying = False
        self.call_kinds: dict[CallKey, Optional[str]] = {}

    # ------------------------------------------------------------------ install / remove
    def install(self) -> None:
        for name, module, kind, params in self.modules:
            for pname, p in params.items():
                self.param_names.setdefault(id(p), f"{name}.{pname}" if name else pname)
            self.handles.append(module.register_forward_pre_hook(self._make_pre_hook(module, params)))
            self.handles.append(
                module.register_forward_hook(self._make_post_hook(name, module, kind, params), with_kwargs=True,
                                             prepend=True)
            )

    def remove(self) -> None:
        self._release_uses()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for module, pname, p, where in self.originals:
            getattr(module, where)[pname] = p
        self.originals.clear()
        self.uses.clear()
        self.pending.clear()
        self.roots.clear()

    def _make_pre_hook(self, module: nn.Module, params: dict[str, nn.Parameter]):
        def pre_hook(mod: nn.Module, args: Any) -> None:
            if not self.capturing or self.mode is not None:
                return
            for pname, p in params.items():
                live = mod._parameters.get(pname)
                if live is p or (self.sharded and live is not None):  # FSDP: the unit's gathered tensor
                    self.originals.append((mod, pname, live, "_parameters"))
                    self.shapes[id(p)] = live.shape
                    # A detached alias: the module computes exactly as before, but autograd neither
                    # computes this parameter's full gradient nor saves an input just for it.
                    mod._parameters[pname] = live.detach()  # type: ignore[assignment]  # torch types it Parameter-only
                shadow = mod.__dict__.get(pname) if self.sharded else None
                if isinstance(shadow, Tensor):  # FSDP1 also sets the gathered view as a plain attribute (read first)
                    self.originals.append((mod, pname, shadow, "__dict__"))
                    mod.__dict__[pname] = shadow.detach()

        return pre_hook

    def _restore(self, mod: nn.Module) -> None:
        keep = []
        for m, pname, p, where in self.originals:
            if m is mod:
                getattr(m, where)[pname] = p
            else:
                keep.append((m, pname, p, where))
        self.originals = keep

    def _make_post_hook(self, name: str, module: nn.Module, kind: str, params: dict[str, nn.Parameter]):
        def post_hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if not self.capturing:
                return None
            self._restore(mod)
            key = (id(mod), self.call_counts.get(id(mod), 0))
            self.call_counts[key[0]] = key[1] + 1
            inp = args[0] if args else next(iter(kwargs.values()), None)
            ckind: Optional[str] = kind
            if kind == AUTO:  # capability module: this call's verified kind (capabilities.py)
                ckind = self._auto_kind(name, mod, key, args, kwargs, output, params)
                if ckind == "affine" and self.mode is None:  # keep its basis n(x), not x
                    inp = self.quietly(unit_output, mod, args, kwargs)
            lead = None if ckind is None else (
                lead_shape(ckind, mod, inp) if isinstance(output, Tensor) and isinstance(inp, Tensor) else None)
            if self.mode == "probe":
                self.recorded[key] = lead
                return None
            if self.mode == "verify":
                layout = self.expand_keys.get(key)
                return expand_shared(output, layout, self.probe_batch) if layout else None
            if ckind is None:
                return None  # an unverified AUTO call: _auto_kind recorded the layout error
            return self._capture(name, mod, ckind, params, key, inp, output, lead)

        return post_hook

    def quietly(self, fn: Callable, *args: Any) -> Any:
        """Run `fn` (which re-runs a module's forward) with every hook of this engine silent."""
        self.capturing = False
        try:
            return fn(*args)
        finally:
            self.capturing = True

    def _auto_kind(self, name, mod, key, args, kwargs, output, params) -> Optional[str]:
        """The verified kind of this call of an AUTO module; None (and the module demoted) when it has none."""
        if self.verifying and key not in self.call_kinds:
            kind, why = self.quietly(verify_call, mod, args, kwargs, output, params)
            self.call_kinds[key] = kind
            if kind is None:
                demote(mod, f"{name}: {why}")
        kind = self.call_kinds.get(key)
        if kind is None and self.mode is None:
            self._layout_error(params, demoted_reason(mod) or f"{name}: call {key[1]} was not verified on the probe")
        return kind

    def _capture(self, name, mod, kind, params, key, inp, output, lead) -> Any:
        """Run mode: record the use and hook its output gradient."""
        attributed = self._attribute(name, mod, kind, params, key, inp, output, lead)
        if attributed is None:
            return None
        inp, output, returned, rows = attributed
        use = Use(name=name, kind=kind, module=mod, params=params, inp=inp, rows_per_sample=rows,
                  shapes={k: self.shape(p) for k, p in params.items()})
        if kind == "embedding":
            ids = inp.reshape(-1)
            pad = getattr(mod, "padding_idx", None)  # verified embeddings need not be nn.Embedding
            if pad is not None:
                ids = ids[ids != pad]
            use.keep_ids = torch.unique(ids)
        if not output.requires_grad:
            output = output.detach().requires_grad_(True)
            self.roots.append(output)
            returned = output
        use.node = output.grad_fn if output.grad_fn is not None else output
        output.register_hook(lambda grad, use=use: self._on_grad(use, grad))
        self.uses.append(use)
        for p in params.values():
            self.pending.setdefault(id(p), []).append(use)
        return returned

    def _attribute(self, name, mod, kind, params, key, inp, output, lead) -> Optional[tuple[Tensor, Tensor, Any, int]]:
        """(input, output, what the hook returns, token rows per sample) of a run-mode call; None (a layout
        error for its parameters) when rows cannot be attributed. A broadcast call comes back expanded."""
        batch = self._mb.batch_size
        layout, lead1 = self.layouts.get(key, ("unsupported", None))
        if lead is None:
            self._layout_error(params, f"{name}: non-tensor input or output")
            return None
        returned = None
        same_tail = lead1 is not None and len(lead) == len(lead1) and lead[1:] == lead1[1:]
        if layout in ("shared", "shared1") and lead != lead1:
            layout = "unsupported"  # not the call the layout probe saw: never guess
        if batch == 1:
            rows = max(1, math.prod(lead))  # one sample owns every row, whatever the layout
        elif layout == "batch" and same_tail and lead[0] == batch:
            rows = math.prod(lead) // batch
        elif (layout == "flat" and same_tail and lead1 is not None and lead[0] == batch * lead1[0]
              and is_sample_major_view(inp, batch)):
            rows = math.prod(lead) // batch
        elif layout in ("shared", "shared1"):
            # Broadcast over the batch: a per-sample expansion keeps each sample's gradient share apart (verified)
            inp = expand_shared(inp, layout, batch)
            returned = output = expand_shared(output, layout, batch)  # _capture makes it a leaf if need be
            lead = lead_shape(kind, mod, inp)
            rows = math.prod(lead) // batch
        else:
            self._layout_error(params, f"{name}: rows of input shape {tuple(inp.shape)} cannot be attributed to "
                                       f"samples (layout {layout!r})")
            return None
        return inp, output, returned, rows

    def _layout_error(self, params: dict[str, nn.Parameter], why: str) -> None:
        for p in params.values():
            self.layout_errors.setdefault(id(p), why)

    # ------------------------------------------------------------------ layout probing (layout_probe.py)
    @contextlib.contextmanager
    def layout_probing(self) -> Iterator[None]:
        """Around the layout probe's no-grad forwards: the hooks record, and every probing field is reset
        afterwards whatever happens."""
        self.capturing = True
        self.call_kinds = {}
        try:
            yield
        finally:
            self.capturing = False
            self.verifying = False
            self.mode = None
            self.expand_keys = {}
            self.recorded = {}

    def record_leads(self, forward: Callable[[], Any], *, verify: bool = False) -> tuple[dict[CallKey, Lead], Any]:
        """(the leading shape of every hooked call, the output) of one recording forward; ``verify``: the calls
        of ``AUTO`` modules are verified on it too (capabilities.py; :meth:`verified_kinds` has the result)."""
        self.begin(None, "probe")
        self.verifying = verify
        try:
            out = forward()
        finally:
            self.verifying = False
        recorded, self.recorded = self.recorded, {}
        return recorded, out

    def verified_kinds(self) -> dict[CallKey, Optional[str]]:
        """The verified kind of each call of an ``AUTO`` module (None: no supported function)."""
        return dict(self.call_kinds)

    def forward_expanded(self, forward: Callable[[], Any], key: CallKey, layout: str, batch: int) -> Any:
        """One forward with the broadcast call ``key`` expanded per sample (``batch`` samples)."""
        self.begin(None, "verify")
        self.expand_keys, self.probe_batch = {key: layout}, batch
        return forward()

    def use_layouts(self, layouts: dict[CallKey, tuple[str, Lead]], kinds: dict[CallKey, Optional[str]]) -> None:
        """The layouts and verified kinds the run-mode hooks attribute rows by (cached per batch signature)."""
        self.layouts, self.call_kinds = layouts, kinds

    @contextlib.contextmanager
    def forming_contributions(self) -> Iterator[None]:
        """Around the fused backward: the tensor hooks form contributions (not during fallback backwards)."""
        self.processing = True
        try:
            yield
        finally:
            self.processing = False

    # ------------------------------------------------------------------ per micro-batch
    def begin(self, micro: Optional[MicroBatch], mode: Optional[str] = None) -> None:
        self.micro = micro
        self.mode = mode
        self.call_counts = {}
        self.uses = []
        self.pending = {}
        self.roots = []
        self.layout_errors = {}
        self.capturing = True

    def end_forward(self) -> None:
        self.capturing = False

    def drop_unreachable(self, reachable_nodes: set[int]) -> None:
        """Uses whose output does not reach the loss contribute nothing and will never fire."""
        for use in self.uses:
            if id(use.node) not in reachable_nodes:
                use.fired = True  # nothing to wait for
                use.inp = None
                for p in use.params.values():
                    lst = self.pending.get(id(p), [])
                    if use in lst:
                        lst.remove(use)

    def check_all_fired(self) -> None:
        missing = [u.name for u in self.uses if not u.fired]
        if missing:
            raise RuntimeError(
                "group_gram: the gradient of these module outputs never arrived although they reach the loss "
                f"({', '.join(sorted(set(missing)))}); is the output modified in place or detached?"
            )

    @property
    def _mb(self) -> MicroBatch:
        """The current micro-batch: set by `begin` for the run-mode forward and backward the hooks serve."""
        assert self.micro is not None, "no micro-batch: FusedGramEngine.begin(micro) was not called"
        return self.micro

    def finish_micro(self) -> None:
        self._release_uses()
        self.uses = []
        self.pending = {}
        self.roots = []
        self.micro = None

    def _release_uses(self) -> None:
        """Break the cycle use -> use.node (its output's autograd node) -> the node's hooks -> the hook's closure
        -> use (the probe's tensor hook, the in-step engine's ``ctx.use``). Autograd's nodes are invisible to the
        cycle collector's size heuristics: left to it, every probe's (and every observed step's) graph stayed
        resident until a full collection, which a process holding ~700k long-lived objects runs every few
        hundred steps (grape_steps grew to 9 GB, grape by ~7 MB a step: docs/results.md, "Memory"). The node is
        needed only between the forward and the end of the backward (which calls reach the loss)."""
        for use in self.uses:
            use.node = None

    # ------------------------------------------------------------------ backward
    def keep_rows(self, p: nn.Parameter) -> Optional[Tensor]:
        """Rows of `p` that a later contribution can still touch (None: all of them)."""
        if not self._mb.is_last:
            return None
        rest = self.pending.get(id(p), [])
        if not rest:
            return torch.empty(0, dtype=torch.long, device=self.device)
        if any(u.kind != "embedding" for u in rest):
            return None
        return torch.unique(torch.cat([u.keep_ids for u in rest if u.keep_ids is not None]))  # all embeddings

    def shape(self, p: nn.Parameter) -> torch.Size:
        """`p`'s full shape (under FSDP1 the parameter outside its unit's forward is a flat shard)."""
        return self.shapes.get(id(p), p.shape)

    def accumulator(self, p: nn.Parameter, dtype: torch.dtype) -> RowAccumulator:
        acc = self.acc.get(id(p))
        if acc is None:
            shape = self.shape(p)
            row_shape = tuple(shape[1:]) if len(shape) > 0 else ()
            num_rows = shape[0] if len(shape) > 0 else 1
            acc = RowAccumulator(self.num_groups, num_rows, row_shape, dtype, p.device)
            self.acc[id(p)] = acc
        return acc

    def _on_grad(self, use: Use, grad: Tensor) -> None:
        if not self.processing or use.fired:
            return
        use.fired = True
        t0 = time.perf_counter()
        try:
            # our own arithmetic runs at full precision whatever autocast context the probe runs in
            with torch.autocast(device_type=grad.device.type, enabled=False):
                self._absorb_use(use, grad)
        finally:
            use.inp = None
            self.hook_seconds += time.perf_counter() - t0

    def _absorb_use(self, use: Use, grad: Tensor) -> None:
        parts = contributions(use, grad, self._mb, compute_dtype=self.compute_dtype, allow_ghost=self.allow_ghost,
                              scales=self.scales)
        for pname, contrib in parts.items():
            p = use.params[pname]
            s = self.scales.get(id(p))
            if s is not None and isinstance(contrib, TensorContribution):
                contrib.per_group = contrib.per_group * s
            lst = self.pending.get(id(p), [])
            if use in lst:
                lst.remove(use)
            if self.shard_sums is not None:
                self.shard_sums.add(id(p), self.shape(p), contrib, self._mb.groups, p.device)
                continue
            acc = self.accumulator(p, contrib.dtype)
            acc.absorb(contrib, self.keep_rows(p), self.gram, self.budget)

    # ------------------------------------------------------------------ results
    def strategies(self) -> dict[str, str]:
        return {self.param_names.get(k, str(k)): "+".join(sorted(a.strategies)) for k, a in self.acc.items()}

    def peak_accumulator_elements(self) -> int:
        return sum(a.peak_elements for a in self.acc.values()) + (self.shard_sums.elements() if self.shard_sums else 0)
