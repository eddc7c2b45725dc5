"""GrapeController: probe -> Gram matrix -> reweighter -> mixer, for any training loop.

The controller is the loop-independent half of GRAPE. A training loop calls
``controller.maybe_update(model, step, lr)`` once after every optimizer step; every ``alpha_every`` /
``z_every`` steps the controller

1. draws one probe batch per domain (``mixer.probe``) and per target task (``TaskStream.probe``), each a
   pure function of ``(seed, step, ...)`` so a resumed run draws the same probes;
2. computes the (K+N) x (K+N) Gram matrix of the groups' mean-loss gradients with one fused
   forward/backward (``grape_stream.grape.gram.group_gram.group_gram``), which never touches ``.grad`` and keeps
   memory bounded by the largest layer;
3. feeds the Gram matrix, the task losses and the optimizer's current learning rate to the reweighter
   (``grape_stream.grape.reweighting``), and
4. hands the new domain weights to the mixer (``mixer.set_weights``), which applies them to batches
   composed from then on.

Across ranks the weights are identical by construction *and* by check: each rank probes its own
(rank-disjoint) samples, the Gram matrix and losses are averaged with an all-reduce (so every rank
feeds bit-identical inputs to the deterministic reweighter), and rank 0's alpha / z are then broadcast
and used by every rank's mixer (a mismatch, which would reveal non-determinism, is logged once).

Method ``"schedule"`` replays a recorded trajectory (the JSONL written by the trajectory callback or
:meth:`GrapeController.write_trajectory`) without computing any alignment: weights found by a small
proxy can steer a large run at no cost.

Nothing here imports Composer.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import json
import logging
import os
import time
from typing import Any, Callable, ContextManager, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from grape_stream.grape.tasks import TaskStream, task_names

__all__ = ["GrapeController", "filter_reweighter_options", "load_trajectory", "unwrap_for_probe", "controller_methods", "REPLAY_METHOD", "STATE_FORMAT"]

log = logging.getLogger(__name__)

#: Methods whose weights never depend on gradients: no probe is drawn, no Gram is computed.
#: Besides the reweighting methods, the controller replays a recorded trajectory.
REPLAY_METHOD = "schedule"


def controller_methods() -> list[str]:
    """Every `method` a GrapeController (and so a recipe) accepts: the reweighter registry plus replay."""
    from grape_stream.grape.reweighting import available_methods

    return [*available_methods(), REPLAY_METHOD]
#: Version of the controller's state_dict layout (bumped on incompatible change).
STATE_FORMAT = 1


# ---------------------------------------------------------------------------------------------------
# model unwrapping: DDP is supported, FSDP is refused with a clear message
# ---------------------------------------------------------------------------------------------------
def unwrap_for_probe(model: nn.Module) -> nn.Module:
    """The module whose parameters the probe differentiates.

    DDP is unwrapped by type (``.module`` exists on many non-DDP wrappers, e.g. Composer's classifier):
    differentiating the inner module with ``torch.autograd.grad`` runs no DDP hook, so no collective is
    issued and every rank's ``.grad`` stays bit-identical. FSDP shards parameters (DTensor / flat
    params): a per-rank gradient of a shard is not the gradient the Gram matrix needs, so it is refused
    rather than silently computing a wrong answer.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model = model.module
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        fsdp_types: tuple[type, ...] = (FullyShardedDataParallel,)
    except Exception:  # pragma: no cover - torch without distributed
        fsdp_types = ()
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        DTensor = None  # type: ignore[assignment]
    for m in model.modules():
        if fsdp_types and isinstance(m, fsdp_types):
            raise NotImplementedError(
                "GRAPE probes do not support FSDP yet: parameters are sharded, so a per-rank gradient is not "
                "the full gradient the alignment Gram matrix needs. Use DDP (Composer: no parallelism_config / "
                "fsdp_config) or a plain single-device loop."
            )
    if DTensor is not None:
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                raise NotImplementedError(
                    f"GRAPE probes do not support FSDP2/DTensor-sharded parameters yet (parameter {name!r} is a "
                    "DTensor): the per-rank gradient of a shard is not the full gradient the alignment Gram matrix "
                    "needs. Use DDP or a single-device loop."
                )
    return model


# ---------------------------------------------------------------------------------------------------
# distributed helpers (no-ops in a single process)
# ---------------------------------------------------------------------------------------------------
def _dist_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _collective_device(fallback: torch.device) -> torch.device:
    backend = torch.distributed.get_backend()
    if backend == "nccl":
        return fallback if fallback.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_from_zero(x: np.ndarray, device: torch.device) -> np.ndarray:
    t = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float64)).to(_collective_device(device))
    torch.distributed.broadcast(t, src=0)
    return t.cpu().numpy()


# ---------------------------------------------------------------------------------------------------
# state sanitising: checkpoints must load with torch.load(weights_only=True)
# ---------------------------------------------------------------------------------------------------
def _to_plain(obj: Any) -> Any:
    """numpy arrays -> tagged tensors, numpy scalars -> Python numbers, recursively."""
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.array(obj, copy=True))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Mapping):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_to_plain(v) for v in obj)
    if isinstance(obj, list):
        return [_to_plain(v) for v in obj]
    return obj


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        if set(obj.keys()) == {"__ndarray__"}:
            return obj["__ndarray__"].cpu().numpy().copy()
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_from_plain(v) for v in obj)
    if isinstance(obj, list):
        return [_from_plain(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------------
# trajectories
# ---------------------------------------------------------------------------------------------------
def load_trajectory(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read a trajectory JSONL: (meta, update records sorted by step). Errors name the line."""
    meta: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            kind = rec.get("type", "update")
            if kind == "meta":
                meta = rec
            elif kind == "update":
                if "step" not in rec or "alpha" not in rec:
                    raise ValueError(f"{path}:{lineno}: an update record needs 'step' and 'alpha'")
                records.append(rec)
    if not records:
        raise ValueError(f"{path}: no update records")
    records.sort(key=lambda r: r["step"])
    return meta, records


def _collate_domain_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Domain probe samples (dicts with ``tokens``) -> ``{"tokens": int64 (B, T), "loss_mask": ones}``
    (the mask makes the domain groups' keys match the task groups' for the fused probe)."""
    if not samples:
        raise ValueError("the mixer returned an empty probe")
    toks = []
    for s in samples:
        t = s["tokens"]
        toks.append(t.to(torch.int64) if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t).astype(np.int64)))
    tokens = torch.stack(toks)
    return {"tokens": tokens, "loss_mask": torch.ones_like(tokens, dtype=torch.uint8)}


def _pad_groups(groups: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Give every probe group the same sequence length (the fused probe concatenates them).

    Shorter groups are right-padded with token 0 and loss_mask 0: in a causal model, tokens after a
    position never change its prediction, so the padded loss equals the unpadded one exactly.
    """
    T = max(g["tokens"].shape[1] for g in groups)
    out = []
    for g in groups:
        t = g["tokens"].shape[1]
        if t == T:
            out.append(g)
            continue
        pad = T - t
        out.append({
            "tokens": torch.nn.functional.pad(g["tokens"], (0, pad), value=0),
            "loss_mask": torch.nn.functional.pad(g["loss_mask"].to(torch.uint8), (0, pad), value=0),
        })
    return out


class GrapeController:
    """Drives the mixture: every ``alpha_every`` / ``z_every`` optimizer steps, probe -> Gram -> weights.

    Args:
        mixer: the :class:`~grape_stream.mixing.mixer.WeightedStreamingMixer` feeding training (anything with
            ``domain_names`` or ``domains``, ``probe(k, n, key)`` and ``set_weights(alpha)``).
        tasks: the target tasks (probe split = validation).
        method: a reweighter name (``uniform``, ``static``, ``doge``, ``doge_pcgrad``, ``grape``,
            ``grape_gap``, ``grape_ema``) or ``schedule`` (replay ``schedule_path``).
        alpha_every, z_every: update periods in optimizer steps (paper: 100 and 100).
        probe_domain_batch, probe_task_batch: samples per domain / per task in one probe (per rank).
        per_sample_loss: ``f(model, batch) -> Tensor[B]``; the default is the LM loss of
            :mod:`grape_stream.models` (honours ``loss_mask``).
        seed: seeds the probes; independent of the training stream's seed and position.
        probe_mode: ``"sharded"`` (each rank probes different samples, Gram averaged over ranks: R times
            the probe for the cost of one) or ``"replicated"`` (all ranks probe the same samples).
        probe_train_mode: run the probe with the model in train mode (dropout on). Default False: the
            alignment of the deterministic network, which is what the next steps move along.
        schedule_path, schedule_stretch: for ``method="schedule"``, the trajectory JSONL and a factor
            on its steps (a proxy trajectory of 10k steps drives a 50k-step run with stretch 5).
        **reweighter_options: passed to ``build_reweighter`` (``mu_alpha``, ``mu_z``, ``step_size``,
            ``clip_norm``, ``z_smoothing``, initial weights, ...).
    """

    def __init__(
        self,
        mixer: Any,
        tasks: Sequence[TaskStream],
        method: str = "grape",
        alpha_every: int = 100,
        z_every: int = 100,
        probe_domain_batch: int = 8,
        probe_task_batch: int = 8,
        per_sample_loss: Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
        seed: int = 0,
        *,
        probe_mode: str = "sharded",
        probe_train_mode: bool = False,
        schedule_path: str | os.PathLike[str] | None = None,
        schedule_stretch: float = 1.0,
        gram_options: Mapping[str, Any] | None = None,
        **reweighter_options: Any,
    ) -> None:
        for name, val in (("alpha_every", alpha_every), ("z_every", z_every),
                          ("probe_domain_batch", probe_domain_batch), ("probe_task_batch", probe_task_batch)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        if probe_mode not in ("sharded", "replicated"):
            raise ValueError(f"probe_mode must be 'sharded' or 'replicated', got {probe_mode!r}")
        if schedule_stretch <= 0:
            raise ValueError(f"schedule_stretch must be > 0, got {schedule_stretch}")
        self.mixer = mixer
        self.tasks = list(tasks)
        self.task_names = task_names(self.tasks)
        self.domain_names = _mixer_domain_names(mixer)
        self.method = str(method)
        self.alpha_every = alpha_every
        self.z_every = z_every
        self.probe_domain_batch = probe_domain_batch
        self.probe_task_batch = probe_task_batch
        if per_sample_loss is None:
            from grape_stream.models import per_sample_lm_loss

            per_sample_loss = per_sample_lm_loss
        self.per_sample_loss = per_sample_loss
        self.seed = int(seed)
        self.probe_mode = probe_mode
        self.probe_train_mode = probe_train_mode
        self.gram_options = dict(gram_options or {})
        self.reweighter_options = dict(reweighter_options)

        self.history: list[dict[str, Any]] = []
        self.num_updates = 0
        self._started = False
        self._resumed = False
        self._mismatch_warned = False
        self._set_weights_params = _signature_params(getattr(mixer, "set_weights"))
        self._consumed: int | None = None
        self._last_from_batch: int | None = None

        K, N = len(self.domain_names), len(self.task_names)
        self._schedule: list[dict[str, Any]] = []
        self._schedule_steps: list[float] = []
        self._schedule_index = -1
        if self.method == "schedule":
            if schedule_path is None:
                raise ValueError("method='schedule' needs schedule_path (a trajectory JSONL)")
            if self.reweighter_options:
                raise TypeError(f"method 'schedule' takes no reweighter options, got {sorted(self.reweighter_options)}")
            meta, records = load_trajectory(schedule_path)
            if meta.get("domains") and list(meta["domains"]) != self.domain_names:
                raise ValueError(
                    f"schedule {schedule_path} was recorded for domains {meta['domains']}, "
                    f"but the mixer has {self.domain_names}"
                )
            for rec in records:
                if len(rec["alpha"]) != K:
                    raise ValueError(f"schedule {schedule_path}: step {rec['step']} has {len(rec['alpha'])} weights, expected {K}")
            self._schedule = records
            self._schedule_steps = [float(r["step"]) * schedule_stretch for r in records]
            self.schedule_path = os.fspath(schedule_path)
            self.reweighter = None
        else:
            from grape_stream.grape.reweighting import build_reweighter

            # uniform / static need no tasks, but a reweighter always has a task side: give it one placeholder.
            self.reweighter = build_reweighter(self.method, num_domains=K, num_tasks=max(N, 1), **self.reweighter_options)
            self.schedule_path = None
        self.needs_probe = self.reweighter is not None and self.reweighter.needs_probe
        if self.needs_probe and N == 0:
            raise ValueError(f"method {self.method!r} needs at least one target task")
        self._update_params = _signature_params(self.reweighter.update) if self.reweighter is not None else set()
        if self.needs_probe and alpha_every != z_every and not {"update_alpha", "update_z"} <= self._update_params:
            raise ValueError(
                f"alpha_every={alpha_every} differs from z_every={z_every}, but the {self.method!r} reweighter "
                "updates alpha and z together; use equal periods"
            )

    # ------------------------------------------------------------------------------------------------
    @property
    def alpha(self) -> np.ndarray:
        if self.reweighter is not None:
            return np.asarray(self.reweighter.alpha, dtype=np.float64)
        rec = self._schedule[max(self._schedule_index, 0)]
        return np.asarray(rec["alpha"], dtype=np.float64)

    @property
    def z(self) -> np.ndarray | None:
        if self.reweighter is not None:
            z = getattr(self.reweighter, "z", None)
            return None if z is None or not self.task_names else np.asarray(z, dtype=np.float64)
        rec = self._schedule[max(self._schedule_index, 0)]
        return None if rec.get("z") is None else np.asarray(rec["z"], dtype=np.float64)

    def meta(self) -> dict[str, Any]:
        return {
            "type": "meta",
            "method": self.method,
            "domains": self.domain_names,
            "tasks": self.task_names,
            "alpha_every": self.alpha_every,
            "z_every": self.z_every,
            "probe_domain_batch": self.probe_domain_batch,
            "probe_task_batch": self.probe_task_batch,
            "seed": self.seed,
            "options": {k: _jsonable(v) for k, v in self.reweighter_options.items()},
        }

    def start(self) -> None:
        """Push the initial weights to the mixer (once, and never after a resume).

        Called by :meth:`maybe_update` on its first call; call it yourself before the first batch is drawn
        if the initial weights must apply to batch 0 (the Composer adapter does, at FIT_START).
        """
        if self._started:
            return
        self._started = True
        if self._resumed:
            return
        initial = self.alpha
        if self.method == "schedule":
            if self._schedule_steps[0] > 0:  # the trajectory starts later: keep the mixer's weights until then
                initial = np.asarray(getattr(self.mixer, "weights"), dtype=np.float64)
            else:
                self._schedule_index = 0
        if not np.array_equal(np.asarray(getattr(self.mixer, "weights", []), dtype=np.float64), initial):
            self._apply_weights(initial, 0)
        rec = {"type": "update", "step": 0, "initial": True, "alpha": _floats(initial),
               "z": None if self.z is None else _floats(self.z)}
        self.history.append(rec)

    def due(self, step: int) -> tuple[bool, bool]:
        """(alpha due, z due) after ``step`` optimizer steps."""
        if step <= 0:
            return False, False
        return step % self.alpha_every == 0, step % self.z_every == 0

    # ------------------------------------------------------------------------------------------------
    def maybe_update(
        self,
        model: nn.Module,
        step: int,
        lr: float,
        *,
        autocast: Callable[[], ContextManager[Any]] | None = None,
        consumed_batches: int | None = None,
    ) -> dict[str, Any] | None:
        """Call after optimizer step ``step`` (1-based: the number of steps taken). Returns the record of the
        update when one ran, else None.

        ``lr`` is the learning rate the optimizer will use next (the schedule's current value): the
        paper's step size is ``lr / mu``. ``autocast`` optionally wraps the probe's forward (the training
        precision context). ``consumed_batches``: how many batches the loop has taken from the mixer's
        loader, when it knows (Composer does); it makes the switch batch deterministic even with a plain
        DataLoader with workers. With ``mixer.dataloader()`` the mixer counts them itself.
        """
        self._consumed = consumed_batches
        if not self._started:
            self.start()
        if self.method == "schedule":
            return self._replay(step)
        a_due, z_due = self.due(step)
        if not (a_due or z_due):
            return None
        t0 = time.perf_counter()
        seconds: dict[str, float] = {}
        rank, world = _dist_world()
        device = _module_device(model)
        K, N = len(self.domain_names), len(self.task_names)
        rec: dict[str, Any] = {"type": "update", "step": int(step), "lr": float(lr), "method": self.method}

        if self.needs_probe:
            probe_model = unwrap_for_probe(model)
            t = time.perf_counter()
            groups = self._probe_batches(step, rank, world, device)
            seconds["probe_data"] = time.perf_counter() - t
            t = time.perf_counter()
            # Sharded: every rank probed different samples; group_gram averages Gram and losses over the
            # ranks (one all-reduce), so every rank feeds identical numbers to the reweighter.
            gram, losses = self._gram(probe_model, groups, autocast, reduce="mean" if self.probe_mode == "sharded" else None)
            seconds["gram"] = time.perf_counter() - t
            t = time.perf_counter()
            self._reweight(gram, losses[K:], lr, step, a_due, z_due)
            seconds["reweight"] = time.perf_counter() - t
            rec["domain_loss"] = _floats(losses[:K])
            rec["task_loss"] = _floats(losses[K:])
            rec["alignment"] = [_floats(row) for row in gram[:K, K:]]
            rec["gram_diag"] = _floats(np.diag(gram))
            last = self.reweighter.history[-1] if self.reweighter.history else {}
            if last.get("b") is not None:
                rec["domain_alignment"] = last["b"]
            if last.get("a") is not None:
                rec["task_alignment"] = last["a"]
            if last.get("skipped"):
                rec["skipped"] = last["skipped"]
                log.warning("GRAPE update at step %d skipped: %s", step, last["skipped"])

        alpha, z = self.alpha, self.z
        if world > 1:
            t = time.perf_counter()
            mine = np.concatenate([alpha, z if z is not None else np.zeros(0)])
            agreed = _broadcast_from_zero(mine, device)
            if not np.array_equal(agreed, mine) and not self._mismatch_warned:
                self._mismatch_warned = True
                log.warning("rank %d computed weights that differ from rank 0's by %.3g; using rank 0's",
                            rank, float(np.max(np.abs(agreed - mine))))
            alpha = agreed[:K]
            z = agreed[K:] if z is not None else None
            seconds["sync_weights"] = time.perf_counter() - t
        self._apply_weights(alpha, step)
        if self._last_from_batch is not None:
            rec["from_batch"] = self._last_from_batch
        rec["alpha"] = _floats(alpha)
        rec["z"] = None if z is None else _floats(z)
        rec["updated"] = {"alpha": bool(a_due), "z": bool(z_due)}
        seconds["total"] = time.perf_counter() - t0
        rec["seconds"] = seconds
        self.num_updates += 1
        self.history.append(rec)
        log.info("GRAPE update at step %d (lr %.3g) took %.3fs: alpha=%s", step, lr, seconds["total"],
                 np.round(alpha, 4).tolist())
        return rec

    # ------------------------------------------------------------------------------------------------
    def probe_batches(self, step: int, device: torch.device | str | None = None) -> list[dict[str, torch.Tensor]]:
        """The K domain + N task probe batches this rank uses at ``step`` (a pure function of the seed,
        the step and, in sharded mode, the rank)."""
        rank, world = _dist_world()
        return self._probe_batches(step, rank, world, torch.device(device) if device is not None else torch.device("cpu"))

    def _probe_batches(self, step: int, rank: int, world: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
        sharded = world > 1 and self.probe_mode == "sharded"
        prank = rank if sharded else 0
        groups: list[dict[str, torch.Tensor]] = []
        for k in range(len(self.domain_names)):
            if sharded:
                samples = self.mixer.probe(k, self.probe_domain_batch, (self.seed, step), rank=rank, world_size=world)
            else:
                samples = self.mixer.probe(k, self.probe_domain_batch, (self.seed, step))
            groups.append(_collate_domain_samples(samples))
        for n, task in enumerate(self.tasks):
            groups.append(
                task.probe(self.probe_task_batch, key=(step, n), seed=self.seed, rank=prank,
                           world_size=world if sharded else 1, disjoint=sharded)
            )
        groups = _pad_groups(groups)
        return [{k: v.to(device, non_blocking=True) for k, v in g.items()} for g in groups]

    def _gram(self, model: nn.Module, groups: list[dict[str, torch.Tensor]],
              autocast: Callable[[], ContextManager[Any]] | None, reduce: str | None) -> tuple[np.ndarray, np.ndarray]:
        from grape_stream.grape.gram.group_gram import group_gram

        was_training = model.training
        model.train(self.probe_train_mode)
        # The probe must not advance the training RNG (dropout masks, etc.): a run with GRAPE and one
        # resumed from a checkpoint must see the same random numbers as their uninterrupted twins.
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and _module_device(model).type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), (autocast() if autocast is not None else contextlib.nullcontext()):
                opts = {"reduce": reduce, **self.gram_options}
                gram, losses = group_gram(model, self.per_sample_loss, groups, **opts)
        finally:
            model.train(was_training)
        gram = np.asarray(torch.as_tensor(gram).detach().double().cpu().numpy(), dtype=np.float64)
        losses = np.asarray(torch.as_tensor(losses).detach().double().cpu().numpy(), dtype=np.float64).ravel()
        G = len(groups)
        if gram.shape != (G, G) or losses.shape != (G,):
            raise RuntimeError(f"group_gram returned shapes {gram.shape} and {losses.shape}, expected {(G, G)} and {(G,)}")
        if not (np.all(np.isfinite(gram)) and np.all(np.isfinite(losses))):
            raise FloatingPointError(
                "the probe's Gram matrix or losses are not finite (the model diverged, or the probe data holds "
                "token ids outside the vocabulary); refusing to update the mixture"
            )
        return gram, losses

    def _reweight(self, gram: np.ndarray, task_losses: np.ndarray, lr: float, step: int,
                  a_due: bool, z_due: bool) -> None:
        assert self.reweighter is not None
        kwargs: dict[str, Any] = {}
        if "step" in self._update_params:
            kwargs["step"] = step
        if {"update_alpha", "update_z"} <= self._update_params:
            kwargs.update(update_alpha=a_due, update_z=z_due)
        self.reweighter.update(gram, task_losses, float(lr), **kwargs)

    def _replay(self, step: int) -> dict[str, Any] | None:
        idx = bisect.bisect_right(self._schedule_steps, float(step)) - 1
        if idx < 0 or idx == self._schedule_index:
            return None
        self._schedule_index = idx
        src = self._schedule[idx]
        alpha = np.asarray(src["alpha"], dtype=np.float64)
        self._apply_weights(alpha, step)
        rec = {"type": "update", "step": int(step), "method": "schedule", "source_step": src["step"],
               "alpha": _floats(alpha), "z": src.get("z"), "seconds": {"total": 0.0}}
        self.num_updates += 1
        self.history.append(rec)
        return rec

    def _apply_weights(self, alpha: np.ndarray, step: int) -> None:
        # "As soon as possible": the mixer applies the weights from the first batch no DataLoader worker can
        # have composed yet (batches consumed + the loader's prefetch depth), a deterministic batch when
        # the loader is mixer.dataloader() or the caller says how many batches were consumed.
        kwargs: dict[str, Any] = {}
        if self._consumed is not None and "consumed" in self._set_weights_params:
            kwargs["consumed"] = int(self._consumed)
        version_at = self.mixer.set_weights(np.asarray(alpha, dtype=np.float64), **kwargs)
        self._last_from_batch = int(version_at) if isinstance(version_at, (int, np.integer)) else None

    # ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain Python types and tensors only (loads with ``torch.load(weights_only=True)``)."""
        return {
            "format": STATE_FORMAT,
            "method": self.method,
            "domains": list(self.domain_names),
            "tasks": list(self.task_names),
            "reweighter": None if self.reweighter is None else _to_plain(self.reweighter.state_dict()),
            "schedule_index": int(self._schedule_index),
            "num_updates": int(self.num_updates),
            "history": json.loads(json.dumps(self.history)),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint. The mixer's weights are restored by the mixer's own state (the data
        position and the weights that composed each batch belong together), so nothing is pushed here."""
        fmt = state.get("format")
        if fmt != STATE_FORMAT:
            raise ValueError(f"controller state format {fmt!r} is not supported (expected {STATE_FORMAT})")
        for key, mine in (("method", self.method), ("domains", self.domain_names), ("tasks", self.task_names)):
            if state.get(key) != mine:
                raise ValueError(
                    f"checkpoint was written with {key}={state.get(key)!r} but this run has {key}={mine!r}; "
                    "resume with the same recipe"
                )
        if self.reweighter is not None:
            self.reweighter.load_state_dict(_from_plain(state["reweighter"]))
        self._schedule_index = int(state.get("schedule_index", -1))
        self.num_updates = int(state.get("num_updates", 0))
        self.history = list(state.get("history", []))
        self._resumed = True

    # ------------------------------------------------------------------------------------------------
    def write_trajectory(self, path: str | os.PathLike[str]) -> str:
        """Write meta + every update record as JSONL (atomically: a reader never sees half a file)."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(self.meta()) + "\n")
            for rec in self.history:
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, path)
        return path


# ---------------------------------------------------------------------------------------------------
def _mixer_domain_names(mixer: Any) -> list[str]:
    names = getattr(mixer, "domain_names", None)
    if names is None:
        domains = getattr(mixer, "domains", None)
        if domains is None:
            raise TypeError(f"{type(mixer).__name__} has neither `domain_names` nor `domains`; is it a WeightedStreamingMixer?")
        names = [getattr(d, "name", d) for d in domains]
    names = [str(n) for n in names]
    if not names:
        raise ValueError("the mixer has no domains")
    return names


def _module_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _signature_params(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _floats(x: Iterable[Any]) -> list[float]:
    return [float(v) for v in np.asarray(x, dtype=np.float64).ravel()]


def _jsonable(v: Any) -> Any:
    try:
        json.dumps(v)
        return v
    except TypeError:
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, (list, tuple)):
            return [_jsonable(x) for x in v]
        return repr(v)


def filter_reweighter_options(
    method: str, options: Mapping[str, Any], *, strict: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split options into (kept, dropped) for ``method``.

    An option no reweighter knows is always an error that names it. With ``strict=False`` an option that
    belongs to *another* method (``mu_z`` under ``method=doge``) is dropped instead of failing, so a recipe
    written for GRAPE runs unchanged with ``algorithm.method=uniform``. ``schedule`` takes none.
    """
    from grape_stream.grape.reweighting import REWEIGHTERS, method_options

    everything = {o for cls in REWEIGHTERS.values() for o in cls.options_accepted}
    unknown = sorted(set(options) - everything)
    if unknown:
        raise TypeError(
            f"unknown reweighting option(s) {', '.join(map(repr, unknown))}; known options: {', '.join(sorted(everything))}"
        )
    accepted = set() if method == "schedule" else set(method_options(method))
    kept = {k: v for k, v in options.items() if k in accepted}
    dropped = {k: v for k, v in options.items() if k not in accepted}
    if dropped and strict:
        raise TypeError(
            f"option(s) {', '.join(map(repr, sorted(dropped)))} do not apply to method {method!r}; "
            f"its options: {', '.join(sorted(accepted)) or 'none'}"
        )
    return kept, dropped
