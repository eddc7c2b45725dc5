"""The Reweighter base class: everything the methods share.

Every method (docs/reweighting.md: uniform, static, DoGE, DoGE-PCGrad and the three GRAPE progress
metrics) needs only inner products between the K domain gradients g_k and the N task gradients h_n, so a
reweighter takes the (K+N)x(K+N) Gram matrix of those gradients (domains first) and never sees a model.
That keeps the package pure numpy (torch tensors are accepted and copied to float64), testable against
explicit vectors, and cheap: O((K+N)^2) memory for every method, PCGrad included.

A method is a subclass that states its facts as class attributes and implements :meth:`_alignments`
(the per-task vector ``a`` and per-domain vector ``b`` in the exponents); this class does the checks,
clipping, step sizes, log-space steps, floors and smoothing, the history and (de)serialisation.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, ClassVar, Mapping

import numpy as np

from grape_stream.grape.reweighting import noise, step_rule
from grape_stream.grape.reweighting.from_scores import FromScores
from grape_stream.grape.reweighting.gram_input import (
    GRAM_ASYMMETRY_RTOL,
    check_and_symmetrise,
    clip_gram,
    to_matrix,
)
from grape_stream.grape.reweighting.options import (
    positive_int,
    real,
    resolve_history_limit,
    resolve_step_options,
)
from grape_stream.grape.reweighting.registry import all_options
from grape_stream.grape.reweighting.state import (
    STATE_FORMAT,
    json_floats,
    log_weights_from_json,
    log_weights_to_json,
)
from grape_stream.simplex import (
    apply_floor,
    as_float_vector,
    exp_gradient_step,
    log_normalize,
    mix_uniform,
    probs_from_log,
    uniform,
)

__all__ = ["BOOKKEEPING_OPTIONS", "GRAM_ASYMMETRY_RTOL", "Reweighter"]

#: Options that change what is remembered, not the weights: a strict load does not compare them (the
#: controller keeps its own update records and asks its reweighter for the last one only).
BOOKKEEPING_OPTIONS = ("history_limit",)


class Reweighter(FromScores):
    """Domain weights alpha (K) and task weights z (N), moved by one Gram matrix per update.

    Subclasses set which options they take and implement :meth:`_alignments`, which returns the
    per-task alignment ``a`` (N) and per-domain alignment ``b`` (K) that the exponents use. This base
    class does everything shared: input checks, gradient clipping through the Gram diagonal, step
    sizes, the log-space steps, floors and smoothing, the history, and (de)serialisation.
    """

    method: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: Options this method accepts (besides num_domains / num_tasks).
    options_accepted: ClassVar[tuple[str, ...]] = ("history_limit",)
    moves_alpha: ClassVar[bool] = False
    moves_z: ClassVar[bool] = False
    #: Whether an update needs the probe Gram (False: the weights never move, so no probe is run).
    needs_probe: ClassVar[bool] = True

    def __init__(self, num_domains: int, num_tasks: int, **options: Any) -> None:
        self.num_domains = positive_int(num_domains, "num_domains")
        self.num_tasks = positive_int(num_tasks, "num_tasks")
        unknown = sorted(set(options) - set(self.options_accepted))
        if unknown:
            everything = all_options()
            kind = "does not apply to" if all(u in everything for u in unknown) else "is not an option of"
            raise TypeError(
                f"option(s) {', '.join(map(repr, unknown))} {kind} method {self.method!r}; "
                f"options of {self.method!r}: {', '.join(self.options_accepted)}"
            )
        self._options = self._resolve_options(dict(options))
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

    # -- options -------------------------------------------------------------------------------------
    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        """Validate and fill defaults; the result is JSON-serialisable and goes into state_dict()."""
        return {"history_limit": resolve_history_limit(opts.pop("history_limit", None))}

    def _resolve_step_options(self, opts: dict[str, Any], sides: tuple[str, ...]) -> dict[str, Any]:
        out = resolve_step_options(opts, sides, self.num_domains)
        out.update(noise.resolve_noise_options(opts))  # only non-default ones: old checkpoints keep loading
        return out

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
        eta_alpha, eta_z = self.step_sizes(lr_value)  # provisional under the trust region (needs a, b)

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
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught below, as a skip
            g = self._normalise(g)
            gram_ema = noise.ema(self._gram_ema, g, self._options["gram_ema"]) if "gram_ema" in self._options else None
            g = g if gram_ema is None else gram_ema
            alignment = g[:k, k:]
            task_gram = g[k:, k:]
            a, b, new_ema = self._alignments(alignment, task_gram, losses, index)
        return self._apply_scores(index, step, lr_value, losses, a, b, eta_alpha, eta_z, update_alpha, update_z,
                                  new_ema, gram_ema)

    def _apply_scores(self, index: int, step: int | None, lr_value: float | None, losses: np.ndarray, a: np.ndarray,
                      b: np.ndarray, eta_alpha: float, eta_z: float, update_alpha: bool, update_z: bool,
                      new_ema: np.ndarray | None, gram_ema: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The multiplicative steps from the exponents' vectors a (tasks) and b (domains), then commit and record."""
        if self._options.get("step_size") == "trust_region" and np.all(np.isfinite(a)) and np.all(np.isfinite(b)):
            eta_alpha, eta_z = self.step_sizes(lr_value, a, b)
        eta_alpha, eta_z = (eta_alpha if update_alpha else 0.0), (eta_z if update_z else 0.0)
        try:
            log_z = exp_gradient_step(self._log_z, -a, eta_z) if (self.moves_z and update_z) else self._log_z
            moves = self.moves_alpha and update_alpha
            log_alpha = exp_gradient_step(self._log_alpha, b, eta_alpha) if moves else self._log_alpha
        except FloatingPointError:
            return self._skip(
                index, step, lr_value, losses, eta_alpha, eta_z,
                f"exponent overflow: eta_alpha*b or eta_z*a is not finite (eta_alpha={eta_alpha!r}, "
                f"eta_z={eta_z!r}, max|a|={float(np.max(np.abs(a)))!r}, max|b|={float(np.max(np.abs(b)))!r})",
                a=a, b=b,
            )
        self._commit(log_alpha, log_z, update_alpha, update_z)
        if lr_value is not None:
            self._lr_peak = max(self._lr_peak or 0.0, lr_value)
        self._loss_ema = new_ema
        self._gram_ema = gram_ema
        self._record(index, step, lr_value, losses, a, b, eta_alpha, eta_z, None)
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

    def _normalise(self, g: np.ndarray) -> np.ndarray:
        """Option clip_norm (D G D), then option alignment='cosine' (unit-length gradients)."""
        g = clip_gram(g, self._options.get("clip_norm"))
        return noise.cosine_gram(g) if self._options.get("alignment") == "cosine" else g

    def preview(self, gram: Any, task_losses: Any) -> tuple[np.ndarray, np.ndarray]:
        """(a, b) that this Gram would give with the current weights; changes nothing (no EMA either).

        The controller's probe-size rule compares the domain scores b of two half-probes (grape.probe_size).
        """
        k = self.num_domains
        g = check_and_symmetrise(to_matrix(gram))
        with np.errstate(over="ignore", invalid="ignore"):
            g = self._normalise(g)
            a, b, _ = self._alignments(g[:k, k:], g[k:, k:], as_float_vector(task_losses, "task_losses"),
                                       self._num_updates)
        return a, b

    def _alignments(
        self, alignment: np.ndarray, task_gram: np.ndarray, losses: np.ndarray, index: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(a, b, new loss EMA). Default: raw alignments, a = A^T alpha, b = A z (logged, never applied)."""
        return alignment.T @ self._alpha, alignment @ self._z, self._loss_ema

    def _commit(self, log_alpha: np.ndarray, log_z: np.ndarray, update_alpha: bool, update_z: bool) -> None:
        if self.moves_alpha and update_alpha:
            if "alpha_ema" in self._options:  # Dynamic Gradient Alignment's damping of the step
                log_alpha = log_normalize(noise.mix_log_weights(self._log_alpha, log_alpha, self._options["alpha_ema"]))
            floor = self._options.get("alpha_floor", 0.0)
            if floor > 0.0:
                alpha = apply_floor(probs_from_log(log_alpha), floor)
                log_alpha = log_normalize(np.log(alpha))
            self._log_alpha = log_alpha
            self._alpha = probs_from_log(log_alpha)
        if self.moves_z and update_z:
            share = self._options.get("z_smoothing", 0.0)
            if share > 0.0:
                log_z = log_normalize(np.log(mix_uniform(probs_from_log(log_z), share)))
            self._log_z = log_z
            self._z = probs_from_log(log_z)

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

