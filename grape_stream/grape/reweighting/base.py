"""The Reweighter base class: the state and the checks every method shares.

Every method (docs/reweighting.md: uniform, static, DoGE, DoGE-PCGrad and the three GRAPE progress
metrics) needs only inner products between the K domain gradients g_k and the N task gradients h_n, so a
reweighter takes the (K+N)x(K+N) Gram matrix of those gradients (domains first) and never sees a model.
That keeps the package pure numpy (torch tensors are accepted and copied to float64), testable against
explicit vectors, and cheap: O((K+N)^2) memory for every method, PCGrad included.

A method is a subclass that names its options dataclass (``Options``, grape.reweighting.options) and
implements :meth:`Reweighter._scores` and :meth:`Reweighter._step` by calling its pure functions (the
functional core: grape.reweighting.step and the method's file). This class holds the state (weights in
log space, EMAs, counters, history), checks the inputs, conditions the Gram (clipping, cosine, EMA),
records every update and (de)serialises.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any, ClassVar, Mapping

import numpy as np

from grape_stream.config.choices import Signal
from grape_stream.errors import UnknownOptionError, did_you_mean
from grape_stream.grape.reweighting import noise, step_rule
from grape_stream.grape.reweighting.from_losses import FromLosses
from grape_stream.grape.reweighting.from_scores import FromScores
from grape_stream.grape.reweighting.gram_input import GRAM_ASYMMETRY_RTOL, check_and_symmetrise, to_matrix
from grape_stream.grape.reweighting.options import ReweighterOptions, option_names, positive_int, real
from grape_stream.grape.reweighting.state import (
    STATE_FORMAT,
    json_floats,
    log_weights_from_json,
    log_weights_to_json,
)
from grape_stream.grape.reweighting.step import WeightStep, condition_gram, mirror_step, raw_scores
from grape_stream.simplex import as_float_vector, log_normalize, probs_from_log, uniform

__all__ = ["BOOKKEEPING_OPTIONS", "GRAM_ASYMMETRY_RTOL", "Reweighter"]

#: Options that change what is remembered, not the weights: a strict load does not compare them (the
#: controller keeps its own update records and asks its reweighter for the last one only).
#: Nor is how a file is loaded (``reference_trusted``: a resumed run may add it).
BOOKKEEPING_OPTIONS = ("history_limit", "reference_trusted")


class Reweighter(FromScores, FromLosses):
    """Domain weights alpha (K) and task weights z (N), moved by one Gram matrix per update.

    ``Reweighter(K, N, config=Options(...), **options)``: ``config`` an instance of the method's options
    dataclass, keyword options override its fields (``build_reweighter("grape", K, N, clip_norm=1.0)``).
    Subclasses set ``Options`` and implement :meth:`_scores` (the per-task alignment ``a`` (N) and
    per-domain alignment ``b`` (K) the exponents use) and :meth:`_step` (calling their pure step function).
    """

    method: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: The options dataclass of this method: its fields are the options it accepts.
    Options: ClassVar[type[ReweighterOptions]] = ReweighterOptions
    #: The names of those fields (derived from ``Options`` for every subclass; read by the registry).
    options_accepted: ClassVar[tuple[str, ...]] = option_names(ReweighterOptions)
    moves_alpha: ClassVar[bool] = False
    moves_z: ClassVar[bool] = False
    #: Where an update's numbers come from (the one capability; config.choices.Signal): the probe Gram (the
    #: default), nothing (the weights never move), the training losses, the training steps' per-domain Gram.
    signal: ClassVar[Signal] = Signal.probe

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.options_accepted = option_names(cls.Options)

    def __init__(self, num_domains: int, num_tasks: int, config: ReweighterOptions | None = None,
                 **options: Any) -> None:
        self.num_domains = positive_int(num_domains, "num_domains")
        self.num_tasks = positive_int(num_tasks, "num_tasks")
        unknown = sorted(set(options) - set(self.options_accepted))
        if unknown:  # build_reweighter says first whether they are other methods' (the registry knows them all)
            raise UnknownOptionError(
                f"option(s) {', '.join(map(repr, unknown))} is not an option of method {self.method!r}; "
                f"options of {self.method!r}: {', '.join(self.options_accepted)}"
                f"{did_you_mean(unknown[0], self.options_accepted)}"
            )
        if config is not None and not isinstance(config, self.Options):
            raise TypeError(f"method {self.method!r} takes options {self.Options.__name__}, "
                            f"got {type(config).__name__}")
        #: the options as given (a dataclass instance; ``options`` is the resolved form kept in the state)
        self.config = dataclasses.replace(config if config is not None else self.Options(), **options)
        self._options = self.config.resolve(self.num_domains, self.num_tasks)
        limit = self._options["history_limit"]
        self._history: deque[dict[str, Any]] = deque(maxlen=limit)
        self._history_dropped = 0
        self._num_updates = 0
        self._num_skipped = 0
        alpha0 = self._options.get("alpha0")
        z0 = self._options.get("z0")
        alpha_init = np.asarray(alpha0, dtype=np.float64) if alpha0 is not None else uniform(self.num_domains)
        z_init = np.asarray(z0, dtype=np.float64) if z0 is not None else uniform(self.num_tasks)
        with np.errstate(divide="ignore"):
            self._log_alpha = log_normalize(np.log(alpha_init))
            self._log_z = log_normalize(np.log(z_init))
        self._alpha = probs_from_log(self._log_alpha)
        self._z = probs_from_log(self._log_z)
        self._loss_ema: np.ndarray | None = None
        self._gram_ema: np.ndarray | None = None  # option gram_ema: the running Gram the alignments use
        self._lr_peak: float | None = None  # the trust region's lr reference (the largest lr seen)

    # -- public state --------------------------------------------------------------------------------
    @property
    def alpha(self) -> np.ndarray:
        """Current domain weights (a float64 copy)."""
        return self._alpha.copy()

    @property
    def z(self) -> np.ndarray:
        """Current task weights (a float64 copy)."""
        return self._z.copy()

    @property
    def options(self) -> dict[str, Any]:
        """The resolved options (defaults filled in), as stored in state_dict()."""
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self._options.items()}

    @property
    def history(self) -> list[dict[str, Any]]:
        """One plain-dict record per update call (the newest ``history_limit`` if a limit is set)."""
        return list(self._history)

    @property
    def num_updates(self) -> int:
        """Number of update() calls so far, skipped ones included (the PCGrad order is keyed on it)."""
        return self._num_updates

    @property
    def num_skipped(self) -> int:
        return self._num_skipped

    @property
    def history_dropped(self) -> int:
        """How many of the oldest history records were discarded because of ``history_limit``."""
        return self._history_dropped

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(method={self.method!r}, num_domains={self.num_domains}, "
            f"num_tasks={self.num_tasks}, updates={self._num_updates})"
        )

    # -- the update ----------------------------------------------------------------------------------
    def step_sizes(self, lr: float | None, a: Any = None, b: Any = None) -> tuple[float, float]:
        """(eta_alpha, eta_z) for this learning rate (and, under the trust region, these exponents a, b);
        0 for a side the method never moves (grape.reweighting.step_rule)."""
        o, peak = self._options, max(self._lr_peak or 0.0, lr or 0.0) or None
        return (step_rule.side_eta(o, "alpha", lr, peak, self._log_alpha, b) if self.moves_alpha else 0.0,
                step_rule.side_eta(o, "z", lr, peak, self._log_z, None if a is None else -np.asarray(a))
                if self.moves_z else 0.0)

    def update(
        self,
        gram: Any,
        task_losses: Any,
        lr: float | None,
        step: int | None = None,
        *,
        update_alpha: bool = True,
        update_z: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One reweighting step from the Gram matrix of this probe's K domain + N task gradients.

        ``gram`` is (K+N)x(K+N), domains first (numpy or torch); ``task_losses`` are the N probe mean
        losses (> 0); ``lr`` is the optimizer's current learning rate (ignored by step_size='constant',
        may then be None). Both sides use the previous alpha and z. ``update_alpha`` / ``update_z`` let a
        caller that reweights the two sides at different intervals move only one of them. A Gram with
        NaN/inf leaves the weights untouched and records why in ``history``. Returns copies of
        (alpha, z) as float64.
        """
        index = self._num_updates
        k, n = self.num_domains, self.num_tasks
        g = to_matrix(gram)
        if g.shape != (k + n, k + n):
            raise ValueError(
                f"gram has shape {g.shape}, expected ({k + n}, {k + n}) = (num_domains + num_tasks) squared "
                f"with the {k} domain gradients first, then the {n} task gradients"
            )
        losses = as_float_vector(task_losses, "task_losses")
        if losses.shape[0] != n:
            raise ValueError(f"task_losses has {losses.shape[0]} entries, expected num_tasks = {n}")
        lr_value = self._check_lr(lr)
        eta_alpha, eta_z = self._etas(lr_value, None, update_alpha, update_z)  # what a skip records

        nonfinite = ~np.isfinite(g)
        if nonfinite.any():
            where = [tuple(map(int, ij)) for ij in np.argwhere(nonfinite)[:5]]
            reason = f"gram has {int(nonfinite.sum())} non-finite entries (first at {where})"
            bad_losses = np.flatnonzero(~np.isfinite(losses))
            if bad_losses.size:
                reason += f"; task_losses non-finite at {bad_losses.tolist()}"
            return self._skip(index, step, lr_value, losses, eta_alpha, eta_z, reason)
        bad = np.flatnonzero(~np.isfinite(losses) | (losses <= 0))
        if bad.size:
            raise ValueError(
                f"task_losses must be finite and > 0 (they normalise the task gradients); bad entries at "
                f"{bad.tolist()}: {losses[bad].tolist()}"
            )
        g = check_and_symmetrise(g)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught by the step, as a skip
            g = self._condition(g)
            gram_ema = noise.ema(self._gram_ema, g, self._options["gram_ema"]) if "gram_ema" in self._options else None
            g = g if gram_ema is None else gram_ema
            # the trust region sizes the step from the exponents themselves (the other rules ignore them)
            scores = self._scores(g, losses, index) if self._options.get("step_size") == "trust_region" else None
        eta_alpha, eta_z = self._etas(lr_value, scores, update_alpha, update_z)
        moved, loss_ema = self._step(g, losses, eta_alpha, eta_z, index, update_alpha, update_z)
        return self._commit(index, step, lr_value, losses, moved, eta_alpha, eta_z, loss_ema, gram_ema)

    def _apply_scores(self, index: int, step: int | None, lr_value: float | None, losses: np.ndarray,
                      a: np.ndarray, b: np.ndarray, update_alpha: bool, update_z: bool,
                      loss_ema: np.ndarray | None, gram_ema: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """One step along given exponents a (tasks) and b (domains): the in-step update (FromScores)."""
        eta_alpha, eta_z = self._etas(lr_value, (a, b), update_alpha, update_z)
        moved = mirror_step(self._log_alpha, self._log_z, a, b, eta_alpha, eta_z,
                            **self._step_options(update_alpha, update_z))
        return self._commit(index, step, lr_value, losses, moved, eta_alpha, eta_z, loss_ema, gram_ema)

    def _etas(self, lr_value: float | None, scores: tuple[np.ndarray, np.ndarray] | None, update_alpha: bool,
              update_z: bool) -> tuple[float, float]:
        """The step rule's (eta_alpha, eta_z) for this update, 0 for a side not updated; the trust region's
        from the scores (a, b) when they are finite (else 0: nothing to size)."""
        finite = scores is not None and all(np.all(np.isfinite(v)) for v in scores)
        eta_alpha, eta_z = self.step_sizes(lr_value, *scores) if finite and scores is not None \
            else self.step_sizes(lr_value)
        return (eta_alpha if update_alpha else 0.0), (eta_z if update_z else 0.0)

    def _commit(self, index: int, step: int | None, lr_value: float | None, losses: np.ndarray, moved: WeightStep,
                eta_alpha: float, eta_z: float, loss_ema: np.ndarray | None,
                gram_ema: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Keep the step's weights (or record why there was none), the EMAs and the trust region's peak lr."""
        if moved.skipped is not None:
            return self._skip(index, step, lr_value, losses, eta_alpha, eta_z, moved.skipped, a=moved.a, b=moved.b)
        self._log_alpha, self._log_z = moved.log_alpha, moved.log_z
        self._alpha, self._z = probs_from_log(moved.log_alpha), probs_from_log(moved.log_z)
        if lr_value is not None:
            self._lr_peak = max(self._lr_peak or 0.0, lr_value)
        self._loss_ema = loss_ema
        self._gram_ema = gram_ema
        self._record(index, step, lr_value, losses, moved.a, moved.b, eta_alpha, eta_z, None)
        self._num_updates += 1
        return self._alpha.copy(), self._z.copy()

    def _check_lr(self, lr: Any) -> float | None:
        constant = self._options.get("step_size") != "lr_over_mu" or not (self.moves_alpha or self.moves_z)
        if lr is None:
            if constant:
                return None
            raise ValueError("lr is required with step_size='lr_over_mu' (eta = lr / mu)")
        value = real(lr, "lr")
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"lr must be a finite number >= 0 (the optimizer's current learning rate), got {value!r}"
            )
        return value

    def _condition(self, g: np.ndarray) -> np.ndarray:
        """Option clip_norm (D G D), then option alignment='cosine' (unit-length gradients)."""
        return condition_gram(g, self._options.get("clip_norm"), self._options.get("alignment", "inner"))

    def preview(self, gram: Any, task_losses: Any) -> tuple[np.ndarray, np.ndarray]:
        """(a, b) that this Gram would give with the current weights; changes nothing (no EMA either).

        The controller's probe-size rule compares the domain scores b of two half-probes (grape.probe_size).
        """
        g = check_and_symmetrise(to_matrix(gram))
        with np.errstate(over="ignore", invalid="ignore"):
            g = self._condition(g)
        return self._scores(g, as_float_vector(task_losses, "task_losses"), self._num_updates)

    # -- what a method implements (with its pure functions) -------------------------------------------
    def _scores(self, g: np.ndarray, losses: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(a, b) of the conditioned Gram ``g`` with the current weights. Default: the raw alignments
        a = A^T alpha, b = A z (logged by the methods whose weights never move)."""
        k = self.num_domains
        return raw_scores(g[:k, k:], self._alpha, self._z)

    def _step(self, g: np.ndarray, losses: np.ndarray, eta_alpha: float, eta_z: float, index: int,
              update_alpha: bool, update_z: bool) -> tuple[WeightStep, np.ndarray | None]:
        """(the step, the loss EMA after it) from the conditioned Gram. Default: scores only, no move."""
        a, b = self._scores(g, losses, index)
        return WeightStep(self._log_alpha, self._log_z, a, b), self._loss_ema

    def _step_options(self, update_alpha: bool, update_z: bool) -> dict[str, Any]:
        """The keyword arguments of :func:`~grape_stream.grape.reweighting.step.mirror_step` for this update."""
        o = self._options
        return {"move_alpha": self.moves_alpha and update_alpha, "move_z": self.moves_z and update_z,
                "alpha_ema": o.get("alpha_ema", 0.0), "alpha_floor": o.get("alpha_floor", 0.0),
                "z_smoothing": o.get("z_smoothing", 0.0)}

    def _skip(
        self, index: int, step: int | None, lr: float | None, losses: np.ndarray, eta_alpha: float,
        eta_z: float, reason: str, a: np.ndarray | None = None, b: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        self._record(index, step, lr, losses, a, b, eta_alpha, eta_z, reason)
        self._num_updates += 1
        self._num_skipped += 1
        return self._alpha.copy(), self._z.copy()

    def _record(
        self, index: int, step: int | None, lr: float | None, losses: np.ndarray, a: np.ndarray | None,
        b: np.ndarray | None, eta_alpha: float, eta_z: float, skipped: str | None,
    ) -> None:
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            self._history_dropped += 1
        self._history.append(
            {
                "update": index,
                "step": None if step is None else int(step),
                "lr": lr,
                "alpha": self._alpha.tolist(),
                "z": self._z.tolist(),
                "task_losses": json_floats(losses),
                "a": json_floats(a),
                "b": json_floats(b),
                "eta_alpha": float(eta_alpha),
                "eta_z": float(eta_z),
                "skipped": skipped,
            }
        )

    # -- serialisation -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit; plain JSON types only (``json.dumps`` works).

        Floats are Python floats, whose repr round-trips exactly through JSON. The PCGrad task order is
        keyed by (seed, update index), so ``num_updates`` is its whole generator state.
        """
        return {
            "format": STATE_FORMAT,
            "method": self.method,
            "num_domains": self.num_domains,
            "num_tasks": self.num_tasks,
            "options": self.options,
            "alpha": self._alpha.tolist(),
            "z": self._z.tolist(),
            "log_alpha": log_weights_to_json(self._log_alpha),
            "log_z": log_weights_to_json(self._log_z),
            "loss_ema": None if self._loss_ema is None else self._loss_ema.tolist(),
            "num_updates": self._num_updates,
            "num_skipped": self._num_skipped,
            "rng": {
                "kind": "numpy PCG64(SeedSequence([seed, update_index]))",
                "seed": self._options.get("seed"),
                "next_update_index": self._num_updates,
            },
            "history": [dict(r) for r in self._history],
            "history_dropped": self._history_dropped,
            **({"gram_ema": None if self._gram_ema is None else self._gram_ema.tolist()}
               if "gram_ema" in self._options else {}),
            **({"lr_peak": self._lr_peak} if self._options.get("step_size") == "trust_region" else {}),
            **({} if (method_state := self._method_state()) is None else {"method_state": method_state}),
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore a state_dict() (also after a JSON round trip).

        Method, num_domains and num_tasks must match. With ``strict`` (default) the options must match
        too (``history_limit`` aside: it changes what is remembered, not the weights), because a resumed
        run with a different mu is a different experiment; ``strict=False`` keeps this object's options
        and restores only the state.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"state format {state.get('format')!r} is not {STATE_FORMAT!r}")
        for key, mine in (("method", self.method), ("num_domains", self.num_domains), ("num_tasks", self.num_tasks)):
            if state.get(key) != mine:
                raise ValueError(f"state_dict is for {key}={state.get(key)!r}, this reweighter has {key}={mine!r}")
        if strict:
            theirs = dict(state.get("options") or {})
            mine_opts = self.options
            diff = sorted(
                k for k in set(theirs) | set(mine_opts)
                if k not in BOOKKEEPING_OPTIONS and theirs.get(k) != mine_opts.get(k)
            )
            if diff:
                detail = ", ".join(f"{k}: saved {theirs.get(k)!r} vs now {mine_opts.get(k)!r}" for k in diff)
                raise ValueError(f"options differ from the saved state ({detail}); "
                                 "pass strict=False to keep the new ones")
        log_alpha = log_weights_from_json(state["log_alpha"], self.num_domains, "log_alpha")
        log_z = log_weights_from_json(state["log_z"], self.num_tasks, "log_z")
        alpha, z = probs_from_log(log_alpha), probs_from_log(log_z)
        for name, got, saved in (("alpha", alpha, state.get("alpha")), ("z", z, state.get("z"))):
            if saved is not None and got.tolist() != list(saved):
                raise ValueError(f"state_dict[{name!r}] does not match state_dict['log_{name}'] (edited by hand?)")
        ema = state.get("loss_ema")
        if ema is not None:
            ema = as_float_vector(ema, "loss_ema")
            if ema.shape[0] != self.num_tasks or not np.all(np.isfinite(ema) & (ema > 0)):
                raise ValueError("state_dict['loss_ema'] must hold num_tasks finite positive numbers")
        num_updates = int(state["num_updates"])
        if num_updates < 0:
            raise ValueError("state_dict['num_updates'] must be >= 0")
        history = [dict(r) for r in state.get("history", [])]
        self._log_alpha, self._log_z, self._alpha, self._z = log_alpha, log_z, alpha, z
        self._loss_ema = ema
        self._gram_ema = noise.gram_ema_from_state(state.get("gram_ema"), self.num_domains + self.num_tasks)
        self._num_updates = num_updates
        self._lr_peak = None if state.get("lr_peak") is None else float(state["lr_peak"])
        self._num_skipped = int(state.get("num_skipped", 0))
        self._history = deque(history, maxlen=self._options["history_limit"])
        self._history_dropped = int(state.get("history_dropped", 0)) + max(0, len(history) - len(self._history))
        self._load_method_state(state.get("method_state"))

