"""Reweighters: turn one Gram matrix of probe gradients into new domain weights alpha and task weights z.

Every method of GRAPE-SPEC.md (uniform, static, DoGE, DoGE-PCGrad and the three GRAPE progress metrics)
needs only inner products between the K domain gradients g_k and the N task gradients h_n, so a
reweighter takes the (K+N)x(K+N) Gram matrix of those gradients (domains first) and never sees a model.
That keeps this module pure numpy (torch tensors are accepted and copied to float64), testable against
explicit vectors, and cheap: O((K+N)^2) memory for every method, PCGrad included.

    r = build_reweighter("grape", num_domains=K, num_tasks=N)
    alpha, z = r.update(gram, task_losses, lr)

See docs/reweighting.md for the equations as implemented and when to use each option.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from grape_stream.simplex import (
    apply_floor,
    as_float_vector,
    check_simplex,
    exp_gradient_step,
    log_normalize,
    mix_uniform,
    probs_from_log,
    uniform,
)

__all__ = [
    "REWEIGHTERS",
    "Reweighter",
    "UniformReweighter",
    "StaticReweighter",
    "DogeReweighter",
    "DogePCGradReweighter",
    "GrapeReweighter",
    "GrapeGapReweighter",
    "GrapeEmaReweighter",
    "available_methods",
    "build_reweighter",
    "method_options",
    "pcgrad_coefficients",
    "pcgrad_task_orders",
    "reweighter_from_state_dict",
]

STATE_FORMAT = "grape_stream.reweighter/1"

#: Largest tolerated |G - G^T| relative to max|G|. A Gram computed in float32 by summing per-layer
#: products in different orders is asymmetric at the 1e-7 level; anything near 1e-4 is a wrong matrix.
GRAM_ASYMMETRY_RTOL = 1e-4

PAPER_MU_ALPHA = 1e-4
PAPER_MU_Z = 1.5e-5


# ----------------------------------------------------------------------------------------------------
# PCGrad in coefficient space
# ----------------------------------------------------------------------------------------------------
def pcgrad_task_orders(seed: int, update_index: int, num_tasks: int) -> list[list[int]]:
    """The random order in which task i is projected against the other tasks, for every i.

    Drawn from a generator keyed by (seed, update_index) alone, so an update replays exactly after a
    resume without storing any generator state. Row i is a permutation of {0..N-1} minus {i}.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(update_index)])))
    orders = []
    for i in range(num_tasks):
        others = np.array([j for j in range(num_tasks) if j != i], dtype=np.int64)
        orders.append(rng.permutation(others).tolist())
    return orders


def pcgrad_coefficients(task_gram: np.ndarray, orders: Sequence[Sequence[int]]) -> np.ndarray:
    """PCGrad (Yu et al. 2020) on the task gradients h_n, from their Gram matrix S alone.

    Returns C (N x N) with projected task gradient i equal to sum_m C[i, m] h_m. Following the PCGrad
    algorithm, task i's running projection is compared with each *original* h_j (j != i, in
    ``orders[i]``) and, if the inner product is negative, the component along h_j is removed:
    c <- c - (<c, h_j> / ||h_j||^2) e_j, where <c, h_j> = c @ S[:, j]. A zero gradient (S[j, j] == 0)
    conflicts with nothing.
    """
    s = np.asarray(task_gram, dtype=np.float64)
    n = s.shape[0]
    coeffs = np.eye(n, dtype=np.float64)
    for i in range(n):
        c = coeffs[i]
        for j in orders[i]:
            dot = float(c @ s[:, j])
            if dot < 0.0 and s[j, j] > 0.0:
                c[j] -= dot / s[j, j]
    return coeffs


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------
def _json_floats(values: np.ndarray | None) -> list[float | None] | None:
    """A JSON-safe list: floats round-trip exactly through json (repr is shortest-exact); NaN/inf -> None."""
    if values is None:
        return None
    return [float(v) if math.isfinite(v) else None for v in np.asarray(values, dtype=np.float64).tolist()]


def _log_weights_to_json(log_w: np.ndarray) -> list[float | None]:
    # -inf (an exact zero weight) is the only non-finite value a log-weight may hold; JSON has no -inf.
    return [None if v == -math.inf else float(v) for v in log_w.tolist()]


def _log_weights_from_json(values: Sequence[float | None], size: int, name: str) -> np.ndarray:
    if not isinstance(values, (list, tuple)) or len(values) != size:
        raise ValueError(f"state_dict[{name!r}] must be a list of {size} numbers")
    out = np.array([-math.inf if v is None else float(v) for v in values], dtype=np.float64)
    if np.any(np.isnan(out)) or np.any(out == math.inf):
        raise ValueError(f"state_dict[{name!r}] holds NaN or +inf")
    return out


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _to_matrix(gram: Any) -> np.ndarray:
    if hasattr(gram, "detach"):  # torch.Tensor, any device / dtype
        gram = gram.detach().cpu().double().numpy()
    try:
        return np.array(gram, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"gram must be a square matrix of numbers, got {type(gram).__name__}: {exc}") from None


# ----------------------------------------------------------------------------------------------------
# base class
# ----------------------------------------------------------------------------------------------------
class Reweighter:
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
        self.num_domains = _positive_int(num_domains, "num_domains")
        self.num_tasks = _positive_int(num_tasks, "num_tasks")
        unknown = sorted(set(options) - set(self.options_accepted))
        if unknown:
            everything = sorted({o for cls in REWEIGHTERS.values() for o in cls.options_accepted})
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

    # -- options -------------------------------------------------------------------------------------
    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        """Validate and fill defaults; the result is JSON-serialisable and goes into state_dict()."""
        out: dict[str, Any] = {}
        limit = opts.pop("history_limit", None)
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0:
                raise ValueError(f"history_limit must be None (keep all) or an integer >= 0, got {limit!r}")
            limit = int(limit)
        out["history_limit"] = limit
        return out

    def _resolve_step_options(self, opts: dict[str, Any], sides: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        step_size = opts.pop("step_size", "lr_over_mu")
        if step_size not in ("lr_over_mu", "constant"):
            raise ValueError(f"step_size must be 'lr_over_mu' (paper) or 'constant' (authors' code), got {step_size!r}")
        out["step_size"] = step_size
        defaults = {"alpha": PAPER_MU_ALPHA, "z": PAPER_MU_Z}
        for side in sides:
            mu, eta = opts.pop(f"mu_{side}", None), opts.pop(f"eta_{side}", None)
            if step_size == "lr_over_mu":
                if eta is not None:
                    raise ValueError(
                        f"eta_{side} is only used with step_size='constant'; with 'lr_over_mu' the step is "
                        f"lr / mu_{side}"
                    )
                mu = defaults[side] if mu is None else _real(mu, f"mu_{side}")
                if not (math.isfinite(mu) and mu > 0):
                    raise ValueError(f"mu_{side} must be a finite number > 0, got {mu!r}")
                out[f"mu_{side}"], out[f"eta_{side}"] = mu, None
            else:
                if mu is not None:
                    raise ValueError(f"mu_{side} is not used with step_size='constant'; give eta_{side} instead")
                if eta is None:
                    raise ValueError(
                        f"step_size='constant' needs eta_{side} (the paper's peak value is lr/mu: "
                        f"eta_alpha=1.5, eta_z=10; the authors' ClimbLab configs use eta_alpha=1.5, eta_z=5.0)"
                    )
                eta = _real(eta, f"eta_{side}")
                if not (math.isfinite(eta) and eta >= 0):
                    raise ValueError(f"eta_{side} must be a finite number >= 0, got {eta!r}")
                out[f"mu_{side}"], out[f"eta_{side}"] = None, eta
        clip = opts.pop("clip_norm", None)
        if clip is not None:
            clip = _real(clip, "clip_norm")
            if not (math.isfinite(clip) and clip > 0):
                raise ValueError(f"clip_norm must be None (no clipping) or a finite number > 0, got {clip!r}")
        out["clip_norm"] = clip
        alpha0 = opts.pop("alpha0", None)
        out["alpha0"] = None if alpha0 is None else check_simplex(alpha0, "alpha0", self.num_domains).tolist()
        floor = _real(opts.pop("alpha_floor", 0.0), "alpha_floor")
        if not (0.0 <= floor <= 1.0 / self.num_domains):
            raise ValueError(
                f"alpha_floor must lie in [0, 1/num_domains] = [0, {1.0 / self.num_domains!r}], got {floor!r}"
            )
        out["alpha_floor"] = floor
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
    def step_sizes(self, lr: float | None) -> tuple[float, float]:
        """(eta_alpha, eta_z) for this learning rate; 0 for a side the method never moves."""
        o = self._options
        etas = []
        for side, moves in (("alpha", self.moves_alpha), ("z", self.moves_z)):
            if not moves:
                etas.append(0.0)
            elif o["step_size"] == "constant":
                etas.append(float(o[f"eta_{side}"]))
            else:
                etas.append(float(lr) / o[f"mu_{side}"])
        return etas[0], etas[1]

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
        g = _to_matrix(gram)
        if g.shape != (k + n, k + n):
            raise ValueError(
                f"gram has shape {g.shape}, expected ({k + n}, {k + n}) = (num_domains + num_tasks) squared "
                f"with the {k} domain gradients first, then the {n} task gradients"
            )
        losses = as_float_vector(task_losses, "task_losses")
        if losses.shape[0] != n:
            raise ValueError(f"task_losses has {losses.shape[0]} entries, expected num_tasks = {n}")
        lr_value = self._check_lr(lr)
        eta_alpha, eta_z = self.step_sizes(lr_value)
        eta_alpha = eta_alpha if update_alpha else 0.0
        eta_z = eta_z if update_z else 0.0

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
        g = self._check_and_symmetrise(g)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught below, as a skip
            g = self._clip(g)
            alignment = g[:k, k:]
            task_gram = g[k:, k:]
            a, b, new_ema = self._alignments(alignment, task_gram, losses, index)
        try:
            log_z = exp_gradient_step(self._log_z, -a, eta_z) if (self.moves_z and update_z) else self._log_z
            log_alpha = (
                exp_gradient_step(self._log_alpha, b, eta_alpha)
                if (self.moves_alpha and update_alpha)
                else self._log_alpha
            )
        except FloatingPointError:
            return self._skip(
                index, step, lr_value, losses, eta_alpha, eta_z,
                f"exponent overflow: eta_alpha*b or eta_z*a is not finite (eta_alpha={eta_alpha!r}, "
                f"eta_z={eta_z!r}, max|a|={float(np.max(np.abs(a)))!r}, max|b|={float(np.max(np.abs(b)))!r})",
                a=a, b=b,
            )
        self._commit(log_alpha, log_z, update_alpha, update_z)
        self._loss_ema = new_ema
        self._record(index, step, lr_value, losses, a, b, eta_alpha, eta_z, None)
        self._num_updates += 1
        return self._alpha.copy(), self._z.copy()

    def _check_lr(self, lr: Any) -> float | None:
        constant = self._options.get("step_size") == "constant" or not (self.moves_alpha or self.moves_z)
        if lr is None:
            if constant:
                return None
            raise ValueError("lr is required with step_size='lr_over_mu' (eta = lr / mu)")
        value = _real(lr, "lr")
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"lr must be a finite number >= 0 (the optimizer's current learning rate), got {value!r}"
            )
        return value

    def _check_and_symmetrise(self, g: np.ndarray) -> np.ndarray:
        scale = float(np.max(np.abs(g)))
        asym = float(np.max(np.abs(g - g.T)))
        if asym > GRAM_ASYMMETRY_RTOL * scale:
            i, j = np.unravel_index(int(np.argmax(np.abs(g - g.T))), g.shape)
            raise ValueError(
                f"gram is not symmetric: |G[{i},{j}] - G[{j},{i}]| = {asym!r} exceeds "
                f"{GRAM_ASYMMETRY_RTOL:g} * max|G| = {GRAM_ASYMMETRY_RTOL * scale!r}; pass the Gram matrix "
                f"of inner products <v_i, v_j> of the K domain then N task gradients"
            )
        g = 0.5 * g + 0.5 * g.T  # (g + g.T) / 2 could overflow near the float64 limit
        diag = np.diag(g)
        neg = np.flatnonzero(diag < -GRAM_ASYMMETRY_RTOL * scale)
        if neg.size:
            raise ValueError(
                f"gram has negative diagonal entries at {neg.tolist()} ({diag[neg].tolist()}); a diagonal "
                f"entry is a squared gradient norm"
            )
        return g

    def _clip(self, g: np.ndarray) -> np.ndarray:
        """Per-group gradient clipping g_i <- g_i * min(1, c/||g_i||), expressed on the Gram: D G D."""
        c = self._options.get("clip_norm")
        if c is None:
            return g
        norms = np.sqrt(np.maximum(np.diag(g), 0.0))
        scale = np.ones_like(norms)
        big = norms > c
        scale[big] = c / norms[big]
        return g * scale[:, None] * scale[None, :]

    def _alignments(
        self, alignment: np.ndarray, task_gram: np.ndarray, losses: np.ndarray, index: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(a, b, new loss EMA). Default: raw alignments, a = A^T alpha, b = A z (logged, never applied)."""
        return alignment.T @ self._alpha, alignment @ self._z, self._loss_ema

    def _commit(self, log_alpha: np.ndarray, log_z: np.ndarray, update_alpha: bool, update_z: bool) -> None:
        if self.moves_alpha and update_alpha:
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
                "task_losses": _json_floats(losses),
                "a": _json_floats(a),
                "b": _json_floats(b),
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
            "log_alpha": _log_weights_to_json(self._log_alpha),
            "log_z": _log_weights_to_json(self._log_z),
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
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore a state_dict() (also after a JSON round trip).

        Method, num_domains and num_tasks must match. With ``strict`` (default) the options must match
        too, because a resumed run with a different mu is a different experiment; ``strict=False`` keeps
        this object's options (e.g. a new history_limit) and restores only the state.
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
            diff = sorted(k for k in set(theirs) | set(mine_opts) if theirs.get(k) != mine_opts.get(k))
            if diff:
                detail = ", ".join(f"{k}: saved {theirs.get(k)!r} vs now {mine_opts.get(k)!r}" for k in diff)
                raise ValueError(f"options differ from the saved state ({detail}); pass strict=False to keep the new ones")
        log_alpha = _log_weights_from_json(state["log_alpha"], self.num_domains, "log_alpha")
        log_z = _log_weights_from_json(state["log_z"], self.num_tasks, "log_z")
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
        self._num_updates = num_updates
        self._num_skipped = int(state.get("num_skipped", 0))
        self._history = deque(history, maxlen=self._options["history_limit"])
        self._history_dropped = int(state.get("history_dropped", 0)) + max(0, len(history) - len(self._history))


# ----------------------------------------------------------------------------------------------------
# methods
# ----------------------------------------------------------------------------------------------------
class UniformReweighter(Reweighter):
    method = "uniform"
    description = "alpha fixed at 1/K (baseline); alignments are still logged"
    needs_probe = False


class StaticReweighter(Reweighter):
    method = "static"
    description = "alpha fixed at given weights, e.g. a published mixture (weights=...)"
    options_accepted = ("weights", "history_limit")
    needs_probe = False

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        weights = opts.pop("weights", None)
        if weights is None:
            raise ValueError(f"method 'static' needs weights=[...] ({self.num_domains} domain weights summing to 1)")
        out = super()._resolve_options(opts)
        out["weights"] = check_simplex(weights, "weights", self.num_domains).tolist()
        out["alpha0"] = out["weights"]
        return out

    @property
    def options(self) -> dict[str, Any]:
        opts = super().options
        opts.pop("alpha0", None)
        return opts


class DogeReweighter(Reweighter):
    method = "doge"
    description = "DoGE: z fixed uniform, alpha_k *= exp(eta_alpha * mean_n <g_k, h_n>) (raw alignment)"
    options_accepted = (
        "mu_alpha", "step_size", "eta_alpha", "clip_norm", "alpha0", "alpha_floor", "history_limit",
    )
    moves_alpha = True

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        out = self._resolve_step_options(opts, ("alpha",))
        out.update(Reweighter._resolve_options(self, opts))
        return out

    def _alignments(self, alignment, task_gram, losses, index):
        return alignment.T @ self._alpha, alignment.mean(axis=1), self._loss_ema


class DogePCGradReweighter(DogeReweighter):
    method = "doge_pcgrad"
    description = "DoGE against the PCGrad-combined task gradient (mean of projected h_n), seeded order"
    options_accepted = DogeReweighter.options_accepted + ("seed",)

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        seed = opts.pop("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        out = super()._resolve_options(opts)
        out["seed"] = int(seed)
        return out

    def _alignments(self, alignment, task_gram, losses, index):
        orders = pcgrad_task_orders(self._options["seed"], index, self.num_tasks)
        coeffs = pcgrad_coefficients(task_gram, orders)
        combined = coeffs.mean(axis=0)  # g_PCGrad = (1/N) sum_i h~_i = sum_m combined_m h_m
        return alignment.T @ self._alpha, alignment @ combined, self._loss_ema


class GrapeReweighter(Reweighter):
    method = "grape"
    description = "GRAPE with rate-of-improvement (RoI): both sides use grad log l_n = h_n / l_n"
    options_accepted = (
        "mu_alpha", "mu_z", "step_size", "eta_alpha", "eta_z", "clip_norm", "z_smoothing",
        "alpha0", "z0", "alpha_floor", "history_limit",
    )
    moves_alpha = True
    moves_z = True

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        out = self._resolve_step_options(opts, ("alpha", "z"))
        z0 = opts.pop("z0", None)
        out["z0"] = None if z0 is None else check_simplex(z0, "z0", self.num_tasks).tolist()
        share = _real(opts.pop("z_smoothing", 0.0), "z_smoothing")
        if not (0.0 <= share <= 1.0):
            raise ValueError(f"z_smoothing must lie in [0, 1] (authors' code: 0.001), got {share!r}")
        out["z_smoothing"] = share
        out.update(Reweighter._resolve_options(self, opts))
        return out

    def _task_side_divisor(self, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return losses, self._loss_ema

    def _domain_side_divisor(self, losses: np.ndarray) -> np.ndarray:
        return losses

    def _alignments(self, alignment, task_gram, losses, index):
        task_div, new_ema = self._task_side_divisor(losses)
        a = (alignment / task_div[None, :]).T @ self._alpha  # a_n = sum_k alpha_k A_z[k, n]
        b = (alignment / self._domain_side_divisor(losses)[None, :]) @ self._z  # b_k = sum_n z_n A_alpha[k, n]
        return a, b, new_ema


class GrapeGapReweighter(GrapeReweighter):
    method = "grape_gap"
    description = "GRAPE with gap-of-improvement (GOI): raw alignments on both sides"

    def _task_side_divisor(self, losses):
        return np.ones_like(losses), self._loss_ema

    def _domain_side_divisor(self, losses):
        return np.ones_like(losses)


class GrapeEmaReweighter(GrapeReweighter):
    method = "grape_ema"
    description = "GRAPE with EMA rate-of-improvement: task side divides by an EMA of the losses (beta=0.7)"
    options_accepted = GrapeReweighter.options_accepted + ("ema_beta",)

    def _resolve_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        beta = _real(opts.pop("ema_beta", 0.7), "ema_beta")
        if not (0.0 <= beta < 1.0):
            raise ValueError(f"ema_beta must lie in [0, 1), got {beta!r}")
        out = super()._resolve_options(opts)
        out["ema_beta"] = beta
        return out

    def _task_side_divisor(self, losses):
        # Paper: l_ema^t = beta * l_ema^{t-1} + (1 - beta) * l_n(theta_t), used at the same step t, i.e.
        # updated before use. It starts at the first observed losses (so the first update equals GRAPE).
        beta = self._options["ema_beta"]
        ema = losses.copy() if self._loss_ema is None else beta * self._loss_ema + (1.0 - beta) * losses
        return ema, ema


REWEIGHTERS: dict[str, type[Reweighter]] = {
    cls.method: cls
    for cls in (
        UniformReweighter, StaticReweighter, DogeReweighter, DogePCGradReweighter,
        GrapeReweighter, GrapeGapReweighter, GrapeEmaReweighter,
    )
}


def available_methods() -> list[str]:
    """Method names accepted by build_reweighter, in the order of GRAPE-SPEC.md."""
    return list(REWEIGHTERS)


def method_needs_probe(name: str) -> bool:
    """Whether `name`'s updates read the probe Gram (uniform and static never do)."""
    return REWEIGHTERS[_canonical(name)].needs_probe


def _canonical(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"method name must be a string, got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_")
    if key not in REWEIGHTERS:
        raise ValueError(f"unknown reweighting method {name!r}; available: {', '.join(REWEIGHTERS)}")
    return key


def method_options(name: str) -> tuple[str, ...]:
    """The options a method accepts, so a recipe can pass only those (others raise TypeError)."""
    return REWEIGHTERS[_canonical(name)].options_accepted


def build_reweighter(name: str, num_domains: int, num_tasks: int, **options: Any) -> Reweighter:
    """Create a reweighter by name ('grape', 'doge', ...; '-' and '_' are interchangeable).

    Defaults reproduce the paper's equations: eta = lr / mu with mu_alpha=1e-4, mu_z=1.5e-5, no
    clipping, no smoothing, no floor. Unknown or inapplicable options raise TypeError listing the valid ones.
    """
    return REWEIGHTERS[_canonical(name)](num_domains, num_tasks, **options)


def reweighter_from_state_dict(state: Mapping[str, Any]) -> Reweighter:
    """Rebuild a reweighter (method, sizes, options) from a state_dict() and load its state."""
    opts = {k: v for k, v in dict(state.get("options") or {}).items() if v is not None}
    method = _canonical(str(state.get("method")))
    cls = REWEIGHTERS[method]
    r = cls(state["num_domains"], state["num_tasks"], **{k: v for k, v in opts.items() if k in cls.options_accepted})
    r.load_state_dict(state)
    return r
