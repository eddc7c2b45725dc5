"""The per-domain Gram of the training steps' own gradients, for methods that need no probe (R&B).

R&B (Ge et al. 2025) sums each domain's part of the gradient over the steps of a round and sets the mixture
from the Gram of those sums. On the observed steps (``alignment_steps`` of every ``alpha_every``; all of them
with ``alignment_steps = alpha_every``, the authors' setting) the in-step engine
(:class:`~grape_stream.grape.gram.instep.StepAlignments`, no direction) splits the backward's weight gradients
by domain -- the same matmuls, one per domain present -- and keeps the parts (a
:class:`~grape_stream.grape.gram.instep_grads.PartStore`: K gradient copies). With the weights W_k (sum of the
samples' weights in the objective, read from the per-sample loss's gradient) the sums are additive over
micro-batches, steps and ranks, so at the round's end

    G_ij = <A_i, A_j> / (W_i W_j),     A_k = sum over observed steps, micro-batches, ranks of domain k's part

is exactly the Gram of the domains' mean gradients over the round (the paper's |S_i||S_j| normalisation when
every sample weighs the same). Several ranks: each observed step's parts are summed over the ranks (one
all-reduce of K gradient copies) so that every rank holds and checkpoints the same sums. It is the signal source
``Signal.step_gram`` (grape.signal), observed where in-step alignments are (``Signal.reads_step_gradients``):
every trainer integration that observes steps for ``alignments: steps`` observes them for this too, and its state
sits under the same checkpoint entry (``instep``). docs/reweighting.md, "R&B".
"""

from __future__ import annotations

import contextlib
import fnmatch
import time
from typing import Any, Callable, ClassVar, ContextManager, Mapping, Optional, Protocol, Sequence, cast

import numpy as np
import torch
from torch import nn

from grape_stream.config.choices import Geometry, Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.gram.instep import StepAlignments
from grape_stream.grape.gram.instep_grads import PartStore
from grape_stream.grape.gram.instep_shards import sharded_gram
from grape_stream.grape.gram.shard_layout import named_parameters
from grape_stream.grape.instep_mode import InstepMode
from grape_stream.grape.probes import unwrap_for_probe
from grape_stream.grape.signal import SignalParts, UpdateCall
from grape_stream.world import dist_active

__all__ = ["STEP_GRAM_FORMAT", "FromStepGram", "StepGramMode", "gram_of_sums", "kept_parameters"]

STEP_GRAM_FORMAT = "grape_stream.step_gram/1"


class FromStepGram(Protocol):
    """What a ``Signal.step_gram`` method's reweighter takes (grape.reweighting.rnb)."""

    def update_from_step_gram(self, gram: Any, samples: Any, lr: float | None = None,
                              step: int | None = None) -> tuple[np.ndarray, np.ndarray]: ...


def gram_of_sums(sums: Mapping[Any, torch.Tensor], weights: torch.Tensor, squared: bool = False) -> np.ndarray:
    """(K, K) float64: sum over parameters of <A_i, A_j>, divided by W_i W_j (NaN where a W is 0);
    ``squared``: ``sums`` holds that sum of dots already (one (K, K) tensor)."""
    k = int(weights.shape[0])
    g = torch.zeros((k, k), dtype=torch.float64)
    for t in sums.values():
        if squared:
            g += t.to(torch.float64).cpu()
            continue
        flat = t.reshape(k, -1).to(torch.float64)
        g += (flat @ flat.t()).cpu()
    w = weights.to(torch.float64).cpu()
    with np.errstate(invalid="ignore", divide="ignore"):
        return (g / torch.outer(w, w)).numpy()


def kept_parameters(model: nn.Module, patterns: Optional[Sequence[str]]) -> Optional[set[int]]:
    """The ids of the trainable parameters whose names match one of ``patterns`` (fnmatch; None: all)."""
    if patterns is None:
        return None
    named = [(n, p) for n, p in named_parameters(model) if p.requires_grad]
    keep = {id(p) for n, p in named if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)}
    if not keep:
        raise ConfigError(f"rnb_params {list(patterns)} match no trainable parameter (names: "
                          f"{', '.join(n for n, _ in named[:6])}{', ...' if len(named) > 6 else ''})")
    return keep


class StepGramMode(InstepMode):
    """The Gram side of a controller whose method reads the training steps' per-domain Gram (R&B).

    It shares :class:`InstepMode`'s observed-step schedule and its begin / end / observe protocol (what the
    trainer integrations call), but keeps per-domain gradient sums instead of alignments with a direction:
    no task probe runs.
    """

    kind: ClassVar[Signal] = Signal.step_gram

    def __init__(self, parts: SignalParts) -> None:  # noqa: D107 (no InstepMode checks)
        config = parts.config
        self.parts = parts
        self.config = config
        self.reweighter = parts.reweighter
        self.num_domains = len(parts.domain_names)
        self.period = config.alpha_every
        self.steps = min(config.alignment_steps, config.alpha_every)
        self.per_sample_loss: Callable[[nn.Module, Any], torch.Tensor] = parts.per_sample_loss
        self.geometry = Geometry.sgd
        self.alignments: Optional[StepAlignments] = None
        self._tasks = None
        self.has_direction = True  # no direction to probe for
        self.observed_steps = 0
        self.keep: Optional[set[int]] = None  # option rnb_params: the parameters in G (None: all)
        self.store = PartStore(self.num_domains)  # the interval's sums A_k, by id(parameter)
        self.weights = torch.zeros(self.num_domains, dtype=torch.float64)
        self.samples = torch.zeros(self.num_domains, dtype=torch.float64)
        self._step_store: Optional[PartStore] = None
        self._pending_named: Optional[dict[str, torch.Tensor]] = None
        self._stack: Optional[contextlib.ExitStack] = None
        self._step_observed = False

    # ------------------------------------------------------------------------------------------ steps
    def _engine(self, model: nn.Module) -> StepAlignments:
        inner = unwrap_for_probe(model, sharded_ok=True)
        if self.alignments is None or self.alignments.model is not inner:
            named = self._pending_named if self.alignments is None else self._named_sums()
            self.alignments = StepAlignments(model, self.per_sample_loss, self.num_domains)
            self.alignments.set_directions([])
            self.keep = kept_parameters(inner, self.reweighter.options.get("rnb_params"))
            self.store = PartStore(self.num_domains, self.keep)
            if named:
                self._load_sums(named)
            self._pending_named = None
        return self.alignments

    def begin(self, model: nn.Module, step: int, batch: Any, domains: Optional[torch.Tensor] = None, *,
              optimizer: Any = None, autocast: Optional[Callable[[], ContextManager[Any]]] = None) -> None:
        """Start observing the forward + backward of one (micro-)batch of step ``step`` (nothing on other steps)."""
        if not self.observed(step):
            return
        sa = self._engine(model)
        self.end()  # a micro-batch whose end was never signalled (an exception in the trainer) is dropped
        if self._step_store is None:  # one process or FSDP2 (parts summed over ranks as formed): straight in
            self._step_store = PartStore(self.num_domains, self.keep) if dist_active() and not sa.sharded else \
                self.store
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(sa.observe(batch, domains, store=self._step_store))
        self._step_observed = True

    def after_step(self) -> None:
        """After an optimizer step: fold an observed step's parts and weights into the interval's sums (summed
        over ranks first, so that every rank holds the same numbers)."""
        if not self._step_observed or self.alignments is None:
            return
        self._step_observed = False
        sa, step_store, self._step_store = self.alignments, self._step_store, None
        assert step_store is not None, "begin() sets it"
        w, n = sa.weights, sa.samples
        if step_store is not self.store:
            w, n = self._reduce(step_store, w, n)
            for key, t in step_store.grads.items():
                mine = self.store.grads.get(key)
                self.store.grads[key] = t if mine is None else mine.add_(t)
        elif sa.sharded and dist_active():  # FSDP2: the parts are summed already, the weights not yet
            w, n = self._reduce(PartStore(self.num_domains), w, n)
        self.weights += w.cpu()
        self.samples += n.cpu()
        self.observed_steps += 1
        sa.reset()

    def _reduce(self, store: PartStore, w: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum one step's parts, weights and sample counts over the ranks (one all-reduce, in place)."""
        import torch.distributed as dist

        from grape_stream.grape.collectives import collective_device

        keys = sorted(store.grads, key=lambda k: self._order()[k])
        dtype = store.grads[keys[0]].dtype if keys else torch.float64
        packed = torch.cat([*(store.grads[k].reshape(-1) for k in keys), w.to(dtype), n.to(dtype)])
        device = collective_device(None, None)
        out = packed.to(device)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        out = out.to(packed.device)
        at = 0
        for k in keys:
            t = store.grads[k]
            t.copy_(out[at: at + t.numel()].reshape(t.shape))
            at += t.numel()
        k_ = self.num_domains
        return out[at: at + k_].to(torch.float64), out[at + k_: at + 2 * k_].to(torch.float64)

    def _order(self) -> dict[int, int]:
        """id(parameter) -> its position in the model: the same order on every rank."""
        assert self.alignments is not None
        return {id(p): i for i, p in enumerate(self.alignments.model.parameters())}

    def _named_sums(self) -> dict[str, torch.Tensor]:
        if self.alignments is None:
            return dict(self._pending_named or {})
        named = dict(named_parameters(self.alignments.model))
        names = {id(p): n for n, p in named.items()}
        if self.alignments.sharded:  # FSDP: each sum gathered whole (an all-gather: every rank calls this)
            return {names[k]: self.alignments.pieces[k].whole(t) for k, t in self.store.grads.items()}
        return {names[k]: t for k, t in self.store.grads.items()}

    def _load_sums(self, named: Mapping[str, torch.Tensor]) -> None:
        """Whole sums by name into the store (FSDP: this rank's piece of each)."""
        assert self.alignments is not None
        params = dict(named_parameters(self.alignments.model))
        sharded = self.alignments.sharded
        lay = self.alignments.pieces
        self.store.grads = {id(params[n]): lay[id(params[n])].local_of(t) if sharded else t.to(params[n].device)
                            for n, t in named.items()}

    # ------------------------------------------------------------------------------------------ the update
    def gram(self) -> np.ndarray:
        """The interval's (K, K) Gram of the domains' mean gradients (NaN rows for unseen domains)."""
        sums = self.store.grads if self.alignments is not None else (self._pending_named or {})
        if self.alignments is not None and self.alignments.sharded:  # FSDP: local dots + one K x K all-reduce
            lay = self.alignments.pieces
            copies = {k: lay[k].replicas for k in sums if k in lay}  # HSDP, NO_SHARD: a piece on several ranks, once
            return gram_of_sums({0: sharded_gram(sums, self.num_domains, copies=copies)}, self.weights, squared=True)
        return gram_of_sums(sums, self.weights)

    def update(self, call: UpdateCall, rec: dict[str, Any], seconds: dict[str, float]) -> None:
        """The round's Gram, the method's update; fills the update record ``rec``."""
        step, lr = call.step, call.lr
        t0 = time.perf_counter()
        gram = self.gram()
        samples = self.samples.numpy().copy()
        seconds["gram"] = time.perf_counter() - t0
        rw = self.reweighter
        t1 = time.perf_counter()
        cast(FromStepGram, rw).update_from_step_gram(gram, samples, lr, step=step)
        seconds["reweight"] = time.perf_counter() - t1
        last = rw.history[-1] if rw.history else {}
        rec.update(domain_gram=np.where(np.isfinite(gram), gram, np.nan).tolist(), domain_score=last.get("b"),
                   instep={"observed_steps": self.observed_steps, "samples": samples.tolist()})
        if last.get("skipped"):
            rec["skipped"] = last["skipped"]
        self.observed_steps = 0
        self.store.grads = {}
        self.weights.zero_()
        self.samples.zero_()

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The interval's sums by parameter name (on CPU), its weights, sample counts and observed steps."""
        return {"format": STEP_GRAM_FORMAT, "observed_steps": self.observed_steps,
                "weights": self.weights.clone(), "samples": self.samples.clone(),
                "sums": {n: t.detach().cpu().clone() for n, t in self._named_sums().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != STEP_GRAM_FORMAT:
            raise ValueError(f"not a step-Gram state (format {state.get('format')!r})")
        self.observed_steps = int(state["observed_steps"])
        self.weights = torch.as_tensor(state["weights"], dtype=torch.float64).clone()
        self.samples = torch.as_tensor(state["samples"], dtype=torch.float64).clone()
        named = {n: torch.as_tensor(t).clone() for n, t in dict(state["sums"]).items()}
        if self.alignments is None:
            self._pending_named = named
        else:
            self._load_sums(named)
