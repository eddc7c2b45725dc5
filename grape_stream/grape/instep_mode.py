"""``alignments: steps``: the controller's domain side from the training steps' own backwards.

Instead of K domain probes per update, ``alignment_steps`` training steps of each interval are observed
(:class:`~grape_stream.grape.gram.instep.StepAlignments`): each domain's share of the step's gradient is
aligned with the target direction v = sum_n c_n h_n kept from the last task probe, and the sums are added
up over the interval (exact and additive over micro-batches, steps and ranks). At an update:

1. b_k = (sum of domain k's alignments) / (sum of its sample weights) over the interval's observed steps;
2. the task probe (:func:`~grape_stream.grape.instep_probe.task_probe`, N groups, one forward and one
   backward) gives each task's loss l_n and r_n = <h_n, d>, d the optimizer's bias-corrected first moment
   (Adam's exp_avg / (1 - beta1^t), SGD's momentum buffer): the mean training gradient of the last steps,
   which is what the paper's d = sum_k alpha_k g_k estimates (batches are drawn from mix(alpha));
3. the method's task scores a(r, l) and the domain scores b move z and alpha (Reweighter.update_from_scores),
   then v is rebuilt from the same task probe with the *updated* z (Reweighter.target_coefficients).

``geometry: adam`` preconditions both d and v by Adam's 1 / (sqrt(v_hat) + eps). Options that need each
domain gradient's norm or a Gram (``clip_norm``, ``alignment: cosine``, ``gram_ema``, ``probe_rse``) and
different alpha / z periods are refused with one line. docs/alignment.md, "In-step alignments".
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Mapping, Optional

import numpy as np
import torch
from torch import nn

from grape_stream.config.choices import Alignments, Signal, values
from grape_stream.errors import ConfigError
from grape_stream.grape.geometry import adam_preconditioner
from grape_stream.grape.gram.instep import StepAlignments
from grape_stream.grape.gram.sharding import common_length, is_sharded
from grape_stream.grape.instep_probe import task_probe
from grape_stream.grape.probes import module_device, pad_groups, unwrap_for_probe
from grape_stream.grape.signal import SignalParts, UpdateCall
from grape_stream.world import collective_rank_size, dist_active

__all__ = ["ALIGNMENTS", "InstepMode", "first_moment", "probe_context"]

ALIGNMENTS = values(Alignments)
_WHERE = "docs/alignment.md, 'In-step alignments'"
_STATS = ("sums", "weights", "samples", "sq", "cross", "wsq")


@contextlib.contextmanager
def probe_context(model: nn.Module, train_mode: bool, autocast: Optional[Callable[[], ContextManager[Any]]]
                  ) -> Iterator[None]:
    """The task probe's mode (dropout off unless ``train_mode``), the training RNG untouched, the precision."""
    was = model.training
    model.train(train_mode)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and module_device(model).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), (autocast() if autocast is not None else contextlib.nullcontext()):
            yield
    finally:
        model.train(was)


def first_moment(optimizer: Any, params: list[nn.Parameter]) -> Optional[dict[nn.Parameter, torch.Tensor]]:
    """The optimizer's running mean of the training gradients: Adam's exp_avg / (1 - beta1^step) or SGD's
    momentum buffer, per parameter (zero where it has no state yet); None before its first step."""
    groups = {id(p): g for g in getattr(optimizer, "param_groups", []) for p in g["params"]}
    out, seen = {}, False
    for p in params:
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        if "exp_avg" in state:
            step = state["step"]
            step = float(step.item() if isinstance(step, torch.Tensor) else step)
            out[p] = state["exp_avg"] / (1.0 - float(groups[id(p)]["betas"][0]) ** step)
            seen = True
        elif state.get("momentum_buffer") is not None:
            out[p], seen = state["momentum_buffer"], True
        else:
            out[p] = torch.zeros_like(p)
    return out if seen else None


class InstepMode:
    """The signal source of ``alignments: steps`` (``Signal.step_alignments``; grape.signal.SignalSource)."""

    kind: ClassVar[Signal] = Signal.step_alignments
    #: the controller's state_dict entry (the name it has always had: older checkpoints load)
    state_key: ClassVar[Optional[str]] = "instep"

    def __init__(self, parts: SignalParts) -> None:
        config = parts.config
        reweighter, alpha_every, steps = parts.reweighter, config.alpha_every, config.alignment_steps
        reweighter_options = parts.reweighter_options
        refused = {"alpha_every != z_every": alpha_every != config.z_every, "probe_rse": config.probe_rse is not None,
                   "clip_norm": reweighter_options.get("clip_norm") is not None,
                   "alignment: cosine": reweighter_options.get("alignment", "inner") != "inner",
                   "gram_ema": bool(reweighter_options.get("gram_ema", 0))}
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise ConfigError(f"alignments: steps does not take {bad[0]} (it needs each domain gradient's norm, a "
                              f"Gram, or one period for alpha and z); use alignments: probe ({_WHERE})")
        if not reweighter.moves_alpha:
            raise ConfigError(f"alignments: steps needs a method that moves alpha (got {reweighter.method!r})")
        self.parts = parts  # its probe stage draws the task probe groups
        self.config = config  # its probe mode and train mode apply to the task probe
        self.reweighter = reweighter
        self.num_domains = num_domains = len(parts.domain_names)
        self.period = alpha_every
        self.steps = min(steps, alpha_every)  # observed steps per interval, evenly spaced, the last one included
        self.per_sample_loss: Callable[[nn.Module, Any], torch.Tensor] = parts.per_sample_loss
        self.geometry = config.geometry
        self.alignments: Optional[StepAlignments] = None
        self._tasks: Optional[StepAlignments] = None
        self.has_direction = False
        self.totals = {k: torch.zeros(num_domains, dtype=torch.float64) for k in _STATS}
        self.observed_steps = 0
        self._pending_state: Optional[dict[str, Any]] = None
        self._stack: Optional[contextlib.ExitStack] = None
        self._step_observed = False

    # ------------------------------------------------------------------------------------------ steps
    def observed(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based: the step being trained) is observed: ``steps`` of every
        interval of ``period``, at offsets ceil(j * period / steps), j = 1..steps (the update's step included)."""
        if step <= 0:
            return False
        offset = (step - 1) % self.period + 1
        return (offset * self.steps) // self.period != ((offset - 1) * self.steps) // self.period

    def _engine(self, model: nn.Module) -> StepAlignments:
        inner = unwrap_for_probe(model, sharded_ok=True)  # FSDP1 / FSDP2 run; tensor parallel: StepAlignments refuses
        if self.alignments is None or self.alignments.model is not inner:
            if self.alignments is not None:  # another module object trains now (re-wrapped): keep the direction
                self._pending_state = self.alignments.state_dict()
            self.alignments = StepAlignments(model, self.per_sample_loss, self.num_domains)
            if self._pending_state is not None:
                self.alignments.load_state_dict(self._pending_state)
                self.has_direction = int(self._pending_state["num_directions"]) > 0
                self._pending_state = None
        return self.alignments

    def begin(self, model: nn.Module, step: int, batch: Any, domains: Optional[torch.Tensor] = None, *,
              optimizer: Any = None, autocast: Optional[Callable[[], ContextManager[Any]]] = None) -> None:
        """Start observing the forward + backward of one (micro-)batch of step ``step`` (nothing on other steps).
        The first target direction, when there is none yet, comes from a task probe at this step."""
        if not self.observed(step):
            return
        sa = self._engine(model)
        if not self.has_direction:
            self.first_direction(model, step, optimizer, autocast)
        self.end(failed=True)  # a micro-batch whose end was never signalled (an exception in the trainer) is dropped
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(sa.observe(batch, domains))
        self._step_observed = True

    def end(self, failed: bool = False) -> None:
        """The backward of the micro-batch begun last has run; ``failed``: it did not (an exception in the
        forward or backward), so its hooks are removed and nothing is counted or checked (the checks would
        hide the exception that stopped it)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        if not failed:
            stack.close()
            return
        why: tuple[Any, Any, Any] = sys.exc_info()
        if why[0] is None:  # (begin() dropping a micro-batch nobody ended: no exception is being handled)
            why = (RuntimeError, RuntimeError("the observed micro-batch did not finish"), None)
        stack.__exit__(*why)

    @contextlib.contextmanager
    def observe(self, model: nn.Module, step: int, batch: Any, domains: Optional[torch.Tensor] = None, *,
                optimizer: Any = None, autocast: Optional[Callable[[], ContextManager[Any]]] = None) -> Iterator[None]:
        self.begin(model, step, batch, domains, optimizer=optimizer, autocast=autocast)
        try:
            yield
        except BaseException:
            self.end(failed=True)
            raise
        self.end()

    @property
    def pending(self) -> bool:
        """Whether an observed step's sums wait for :meth:`after_step`."""
        return self._step_observed

    def after_step(self) -> None:
        """After an optimizer step (every rank, every step): fold an observed step's sums into the interval's
        totals, summed over ranks, so that every rank holds (and checkpoints) the same numbers."""
        if not self._step_observed or self.alignments is None:
            return
        self._step_observed = False
        sa = self.alignments
        if dist_active():
            sa.reduce()
        m, w = sa.sums[:, 0].cpu(), sa.weights.cpu()
        for key, val in (("sums", m), ("weights", w), ("samples", sa.samples.cpu()), ("sq", m * m),
                         ("cross", m * w), ("wsq", w * w)):
            self.totals[key] += val
        self.observed_steps += 1
        sa.reset()

    # ------------------------------------------------------------------------------------------ the update
    def domain_scores(self) -> tuple[np.ndarray, np.ndarray]:
        """(b, its standard error) over the interval's observed steps (ratio estimator over steps). A domain
        without an observed sample gets the weighted mean of the others (no evidence: no move)."""
        t = {k: v.numpy() for k, v in self.totals.items()}
        with np.errstate(invalid="ignore", divide="ignore"):
            b = t["sums"] / t["weights"]
            n = max(self.observed_steps, 1)
            var = (t["sq"] - 2 * b * t["cross"] + b * b * t["wsq"]) / max(n - 1, 1) / n / (t["weights"] / n) ** 2
        seen = t["weights"] > 0
        if not seen.all() and seen.any():
            b = np.where(seen, b, np.sum(t["sums"][seen]) / np.sum(t["weights"][seen]))
        return b, np.sqrt(np.maximum(var, 0.0))

    def meta(self) -> dict[str, Any]:
        """The trajectory's meta entries: the observed steps per interval."""
        return {"alignments": "steps", "alignment_steps": self.steps}

    def update(self, call: UpdateCall, rec: dict[str, Any], seconds: dict[str, float]) -> None:
        """Task probe, both weight steps, the next direction; fills the update record ``rec``."""
        model, step, lr, optimizer, autocast = call.model, call.step, call.lr, call.optimizer, call.autocast
        t0 = time.perf_counter()
        rw = self.reweighter
        groups = self._task_groups(model, step)
        seconds["probe_data"] = time.perf_counter() - t0
        params = [p for p in unwrap_for_probe(model, sharded_ok=True).parameters() if p.requires_grad]
        b, se = self.domain_scores()
        pre = self._preconditioner(optimizer, model, rec)
        d = first_moment(optimizer, params) if rw.moves_z else None
        if rw.moves_z and d is None:
            raise ConfigError("alignments: steps takes the task side's update direction from the optimizer's first "
                              "moment (Adam/AdamW exp_avg, SGD momentum); pass optimizer= to maybe_update (an "
                              f"optimizer with momentum) or use alignments: probe ({_WHERE})")
        fixed = [] if d is None else [{p: t * pre[p] if pre is not None else t for p, t in d.items()}]
        seen: dict[str, Any] = {}

        def coefficients(losses: np.ndarray, r: np.ndarray, task_gram: Optional[np.ndarray]) -> np.ndarray:
            a, ema = rw.task_scores(r[:, 0] if r.shape[1] else np.zeros(len(losses)), losses)
            rw.update_from_scores(a, b, losses, lr, step=step, loss_ema=ema)
            seen.update(a=a, r=r)
            return rw.target_coefficients(losses, task_gram)

        t1 = time.perf_counter()
        with probe_context(model, self.config.probe_train_mode, autocast):
            probe = task_probe(model, self.per_sample_loss, groups, fixed=fixed, coefficients=coefficients,
                               reduce=self.config.probe_mode == "sharded", engine=self._task_engine(model))
        self._set_direction(probe.direction, pre)
        seconds["gram"] = time.perf_counter() - t1
        last = rw.history[-1] if rw.history else {}
        rec.update(task_loss=probe.losses.tolist(), domain_alignment=b.tolist(), domain_alignment_se=se.tolist(),
                   task_alignment=last.get("a"), instep={"observed_steps": self.observed_steps,
                                                         "samples": self.totals["samples"].tolist()})
        if last.get("skipped"):
            rec["skipped"] = last["skipped"]
        self.observed_steps = 0
        for v in self.totals.values():
            v.zero_()

    def first_direction(self, model: nn.Module, step: int, optimizer: Any,
                        autocast: Optional[Callable[[], ContextManager[Any]]]) -> None:
        """The target direction before the first update (the current z; no weight moves)."""
        rw = self.reweighter
        groups = self._task_groups(model, step)
        with probe_context(model, self.config.probe_train_mode, autocast):
            probe = task_probe(model, self.per_sample_loss, groups, fixed=[], engine=self._task_engine(model),
                               reduce=self.config.probe_mode == "sharded",
                               coefficients=lambda losses, r, gram: rw.target_coefficients(losses, gram))
        self._set_direction(probe.direction, self._preconditioner(optimizer, model, {}))

    def _task_groups(self, model: nn.Module, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's N task probe batches; under FSDP padded to the longest of all ranks (every rank's
        forward gathers the units: one batch shape)."""
        inner = unwrap_for_probe(model, sharded_ok=True)
        rank, world = collective_rank_size()
        groups = self.parts.probe.groups(step, rank, world, module_device(inner), tasks_only=True)
        if dist_active() and is_sharded(inner):
            groups = pad_groups(groups, common_length(groups, module_device(inner)))
        return groups

    def _task_engine(self, model: nn.Module) -> StepAlignments:
        """The task probe's hooks (one "domain" per task), kept: their layouts are learnt once."""
        inner = unwrap_for_probe(model, sharded_ok=True)
        if self._tasks is None or self._tasks.model is not inner:
            self._tasks = StepAlignments(model, self.per_sample_loss, len(self.parts.task_names))
        return self._tasks

    def _preconditioner(self, optimizer: Any, model: nn.Module, rec: dict[str, Any]) -> Optional[dict]:
        if self.geometry != "adam" or optimizer is None:  # (the first direction may come before any optimizer)
            return None
        pre, used = adam_preconditioner(optimizer, unwrap_for_probe(model, sharded_ok=True))
        rec["geometry"] = used
        return None if pre is None else {p: pre[p] for p in pre}

    def _set_direction(self, direction: dict[nn.Parameter, torch.Tensor], pre: Optional[dict]) -> None:
        assert self.alignments is not None, "begin() builds the engine before the first direction"
        self.alignments.set_directions([{p: t * pre[p] if pre is not None else t for p, t in direction.items()}])
        self.has_direction = True

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        engine = self.alignments.state_dict() if self.alignments is not None else self._pending_state
        return {"engine": engine, "observed_steps": self.observed_steps,
                "totals": {k: v.clone() for k, v in self.totals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.observed_steps = int(state["observed_steps"])
        self.totals = {k: torch.as_tensor(state["totals"][k], dtype=torch.float64).clone() for k in _STATS}
        engine = state.get("engine")
        if engine is not None:
            if self.alignments is not None:
                self.alignments.load_state_dict(engine)
                self.has_direction = int(engine["num_directions"]) > 0
            else:
                self._pending_state = dict(engine)
