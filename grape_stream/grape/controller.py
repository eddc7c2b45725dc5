"""GrapeController: when to update the mixture, and probe -> Gram -> reweight -> mixer, for any loop.

The loop-independent half of GRAPE. A training loop calls ``controller.maybe_update(model, step, lr)``
after every optimizer step; every ``alpha_every`` / ``z_every`` steps the controller (1)-(2) runs the
probe stage (grape.probe_stage: one probe batch per domain and per target task, a pure function of
``(seed, step, rank)``, and the (K+N) x (K+N) Gram matrix of the groups' mean-loss gradients from one
fused forward/backward that never touches ``.grad``), (3) feeds it, the task losses and the current
learning rate to the reweighter (grape.reweighting) and (4) hands the new domain weights to the mixer
(grape.mixer_port: ``mixer.set_weights``). Steps (1)-(3) are the run's signal source (grape.signal: one
protocol; the probe is one source, the training steps' alignments or Gram and the training losses others), which
the controller holds as ``signal`` and calls without asking which it is.

Its settings are one :class:`~grape_stream.config.AlgorithmConfig` (``GrapeController(mixer, tasks,
config)``, or keyword overrides of its fields and of the reweighter's options; grape.algorithm_config
holds the rules). Across ranks the weights are identical by construction *and* by check: each rank probes
its own (rank-disjoint) samples, Gram and losses are averaged with an all-reduce (every rank feeds
bit-identical inputs to the deterministic reweighter), and rank 0's alpha / z are broadcast (a mismatch,
which would reveal non-determinism, is logged once). Each update returns a record (kept in ``history``,
written by :meth:`write_trajectory`, flattened for loggers by :meth:`metrics`). Method ``"schedule"``
replays a recorded trajectory (grape.replay). Nothing here imports Composer; docs/design.md places this
module.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, ContextManager, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from grape_stream.config import AlgorithmConfig
from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.algorithm_config import (
    algorithm_config,
    check_algorithm,
    controller_methods,
    filter_reweighter_options,
    reweighter_options,
    signal_source,
)
from grape_stream.grape.checkpoint import STATE_FORMAT, check_state_format, from_plain, history_tail, to_plain
from grape_stream.grape.collectives import agree_with_rank_zero
from grape_stream.grape.instep_gram import StepGramMode
from grape_stream.grape.instep_mode import InstepMode
from grape_stream.grape.loss_mode import LossMode
from grape_stream.grape.metrics import update_metrics
from grape_stream.grape.mixer_port import MixerPort, check_mixer, push_weights
from grape_stream.grape.probe_signal import ProbeSignal, QuietSignal
from grape_stream.grape.probe_stage import PerSampleLoss, ProbeStage
from grape_stream.grape.probes import module_device, unwrap_for_probe
from grape_stream.grape.replay import REPLAY_METHOD, ScheduleReplay
from grape_stream.grape.reweighting import Reweighter, build_reweighter, method_options
from grape_stream.grape.signal import SignalParts, SignalSource, UpdateCall
from grape_stream.grape.tasks import TaskStream, task_names
from grape_stream.grape.trajectory import floats, jsonable, load_trajectory, write_trajectory
from grape_stream.models import per_sample_lm_loss
from grape_stream.world import collective_rank_size

__all__ = ["REPLAY_METHOD", "STATE_FORMAT", "GrapeController", "controller_methods", "filter_reweighter_options",
           "load_trajectory", "unwrap_for_probe"]

log = logging.getLogger(__name__)

class GrapeController:
    """Drives the mixture: every ``alpha_every`` / ``z_every`` optimizer steps, probe -> Gram -> weights.

    Args:
        mixer: the :class:`~grape_stream.mixing.mixer.WeightedStreamingMixer` feeding training (any
            :class:`~grape_stream.grape.mixer_port.MixerPort`).
        tasks: the target tasks (probe split = validation).
        config: GRAPE's settings (:class:`~grape_stream.config.AlgorithmConfig`, or a mapping of its fields;
            default: the paper's). docs/recipes.md ("algorithm") documents each field.
        per_sample_loss: ``f(model, batch) -> Tensor[B]``; the default is the LM loss of
            :mod:`grape_stream.models` (honours ``loss_mask``).
        **overrides: AlgorithmConfig fields (``method="doge"``, ``alpha_every=50``, ...) and reweighter
            options (``clip_norm=1.0``, ``z_smoothing``, ``alpha0``, ...; grape.reweighting), over ``config``.
            ``mu_alpha`` / ``mu_z`` reach only the methods that take them; a misspelt name is one error
            naming the closest valid one.
    """

    def __init__(self, mixer: MixerPort, tasks: Sequence[TaskStream],
                 config: AlgorithmConfig | Mapping[str, Any] | None = None, *,
                 per_sample_loss: PerSampleLoss | None = None, **overrides: Any) -> None:
        self.config = algorithm_config(config, overrides, where="GrapeController")
        check_algorithm(self.config)
        self.mixer = mixer
        self.tasks = list(tasks)
        self.task_names = task_names(self.tasks)
        self.domain_names = check_mixer(mixer)
        self.method = str(self.config.method)
        #: what this method's reweighter is built with (the meta line of the trajectory records it)
        self.reweighter_options = reweighter_options(self.config)
        self.per_sample_loss = per_sample_loss if per_sample_loss is not None else per_sample_lm_loss
        self.probe = ProbeStage(self.config, mixer, self.tasks, self.per_sample_loss)

        #: update records of this run (after a resume: the checkpoint's newest ones, then this process's)
        self.history: list[dict[str, Any]] = []
        #: how many older records are not in `history` (they are in the trajectory file on disk)
        self.history_dropped = 0
        self.num_updates = 0
        self._started = False
        self._resumed = False
        self._mismatch_warned = False
        self._consumed: int | None = None
        self._last_from_batch: int | None = None

        self.replay: ScheduleReplay | None = None
        self.reweighter: Reweighter | None = None
        self.schedule_path: str | None = None
        if self.method == REPLAY_METHOD:
            assert self.config.schedule_path is not None, "check_algorithm requires it"
            self.replay = ScheduleReplay(self.config.schedule_path, self.domain_names, self.config.schedule_stretch)
            self.schedule_path = self.replay.path
        else:
            self.reweighter = self._build_reweighter()
        kind = signal_source(self.config)
        if kind.probes_tasks and not self.task_names:
            raise ConfigError(f"method {self.method!r} needs at least one target task")
        #: where each update's numbers come from (grape.signal): the probe, the training steps' alignments or
        #: per-domain Gram, the training losses, or nothing (the weights never move, or a replay sets them)
        self.signal: SignalSource = self._build_signal(kind)

    def _build_signal(self, kind: Signal) -> SignalSource:
        """The one source of ``kind``, built from the explicit parts it reads (no reference to this controller)."""
        if self.reweighter is None or kind in (Signal.none, Signal.replay):
            return QuietSignal(kind)
        parts = SignalParts(config=self.config, reweighter=self.reweighter, reweighter_options=self.reweighter_options,
                            domain_names=tuple(self.domain_names), task_names=tuple(self.task_names),
                            per_sample_loss=self.per_sample_loss, probe=self.probe)
        sources: dict[Signal, Callable[[SignalParts], SignalSource]] = {
            Signal.probe: ProbeSignal, Signal.step_alignments: InstepMode, Signal.step_gram: StepGramMode,
            Signal.training_losses: LossMode}
        return sources[kind](parts)

    def _build_reweighter(self) -> Reweighter:
        opts = dict(self.reweighter_options)
        if "history_limit" in method_options(self.method):
            # The controller's records carry what it needs of the reweighter's (a, b, skipped): one is enough.
            opts.setdefault("history_limit", 1)
        # uniform / static need no tasks, but a reweighter always has a task side: give it one placeholder.
        return build_reweighter(self.method, num_domains=len(self.domain_names),
                                num_tasks=max(len(self.task_names), 1), **opts)

    # ------------------------------------------------------------------------------------------------
    @property
    def alpha(self) -> np.ndarray:
        if self.reweighter is not None:
            return np.asarray(self.reweighter.alpha, dtype=np.float64)
        assert self.replay is not None
        return np.asarray(self.replay.current()["alpha"], dtype=np.float64)

    @property
    def z(self) -> np.ndarray | None:
        if self.reweighter is not None:
            z = getattr(self.reweighter, "z", None)
            return None if z is None or not self.task_names else np.asarray(z, dtype=np.float64)
        assert self.replay is not None
        rec = self.replay.current()
        return None if rec.get("z") is None else np.asarray(rec["z"], dtype=np.float64)

    def meta(self) -> dict[str, Any]:
        """The trajectory's first line: what the records belong to."""
        return {
            "type": "meta",
            "method": self.method,
            "domains": self.domain_names,
            "tasks": self.task_names,
            "alpha_every": self.config.alpha_every,
            "z_every": self.config.z_every,
            "probe_domain_batch": self.config.probe_domain_batch,
            "probe_task_batch": self.config.probe_task_batch,
            "seed": self.config.seed,
            "options": {k: jsonable(v) for k, v in self.reweighter_options.items()},
            **self.probe.meta(),
            **self.signal.meta(),
        }

    def metrics(self, record: Mapping[str, Any] | None = None, *, alignment: bool = True) -> dict[str, float]:
        """The flat ``{"grape/alpha/<domain>": ..., ...}`` dict of an update record (default: the last),
        for any logger; ``alignment=False`` leaves out the K x N alignment entries."""
        if record is None:
            record = self.history[-1] if self.history else {}
        return update_metrics(record, self.domain_names, self.task_names, alignment=alignment)

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
        if self.replay is not None:
            if not self.replay.starts_at_zero:  # the trajectory starts later: keep the mixer's weights until then
                initial = np.asarray(self.mixer.weights, dtype=np.float64)
            else:
                self.replay.index = 0
        if not np.array_equal(np.asarray(self.mixer.weights, dtype=np.float64), initial):
            self._apply_weights(initial, 0)
        rec = {"type": "update", "step": 0, "initial": True, "alpha": floats(initial),
               "z": None if self.z is None else floats(self.z)}
        self.history.append(rec)

    def due(self, step: int) -> tuple[bool, bool]:
        """(alpha due, z due) after ``step`` optimizer steps."""
        if step <= 0:
            return False, False
        return step % self.config.alpha_every == 0, step % self.config.z_every == 0

    def acts_at(self, step: int) -> bool:
        """Whether :meth:`maybe_update` does anything after ``step`` (an update is due, a replay runs, or a
        watched step's sums are to be folded in):
        a loop may skip the call (and what it costs to prepare) otherwise."""
        return self.replay is not None or any(self.due(step)) or self.signal.pending

    def observe(self, model: nn.Module, step: int, batch: Any, domains: torch.Tensor | None = None, *,
                optimizer: Any = None, autocast: Callable[[], ContextManager[Any]] | None = None) -> ContextManager:
        """A signal that watches the training steps (``signal.kind.watches_steps``: ``alignments: steps``, R&B, the
        loss-driven methods): wrap the forward + backward of each (micro-)batch of optimizer step ``step`` (1-based:
        the step being trained) in it (grape.signal); a no-op otherwise and on steps not observed."""
        return self.signal.observe(model, step, batch, domains, optimizer=optimizer, autocast=autocast)

    # ------------------------------------------------------------------------------------------------
    def maybe_update(
        self,
        model: nn.Module,
        step: int,
        lr: float,
        *,
        autocast: Callable[[], ContextManager[Any]] | None = None,
        consumed_batches: int | None = None,
        optimizer: Any = None,
    ) -> dict[str, Any] | None:
        """Call after optimizer step ``step`` (1-based: the number of steps taken). Returns the record of the
        update when one ran, else None.

        ``lr`` is the learning rate the optimizer will use next (the schedule's current value): the
        paper's step size is ``lr / mu``. ``autocast`` optionally wraps the probe's forward (the training
        precision context). ``consumed_batches``: how many batches the loop has taken from the mixer's
        loader, when it knows (Composer does); it makes the switch batch deterministic even with a plain
        DataLoader with workers. With ``mixer.dataloader()`` the mixer counts them itself. ``optimizer``: the
        training optimizer, read (never changed) by ``geometry="adam"``.
        """
        self._consumed = consumed_batches
        self.signal.after_step()
        if not self._started:
            self.start()
        if self.replay is not None:
            return self._replay(step)
        a_due, z_due = self.due(step)
        if not (a_due or z_due):
            return None
        t0 = time.perf_counter()
        seconds: dict[str, float] = {}
        rank, world = collective_rank_size()
        device = module_device(model)
        rec: dict[str, Any] = {"type": "update", "step": int(step), "lr": float(lr), "method": self.method}
        self.signal.update(UpdateCall(model=model, step=int(step), lr=float(lr), update_alpha=a_due, update_z=z_due,
                                      optimizer=optimizer, autocast=autocast), rec, seconds)
        alpha, z = self.alpha, self.z
        if world > 1:
            t = time.perf_counter()
            agreed, diff = agree_with_rank_zero(np.concatenate([alpha, z if z is not None else np.zeros(0)]), device)
            if diff and not self._mismatch_warned:  # would reveal non-determinism across ranks
                self._mismatch_warned = True
                log.warning("rank %d computed weights that differ from rank 0's by %.3g; using rank 0's", rank, diff)
            alpha, z = agreed[: len(alpha)], (agreed[len(alpha):] if z is not None else None)
            seconds["sync_weights"] = time.perf_counter() - t
        self._apply_weights(alpha, step)
        if self._last_from_batch is not None:
            rec["from_batch"] = self._last_from_batch
        rec["alpha"] = floats(alpha)
        rec["z"] = None if z is None else floats(z)
        rec["updated"] = {"alpha": bool(a_due), "z": bool(z_due)}
        seconds["total"] = time.perf_counter() - t0
        rec["seconds"] = seconds
        self.num_updates += 1
        self.history.append(rec)
        # DEBUG: the integrations' progress line (integrations/progress.py) reports each update once
        log.debug("GRAPE update at step %d (lr %.3g) took %.3fs: alpha=%s", step, lr, seconds["total"],
                 np.round(alpha, 4).tolist())
        return rec

    # ------------------------------------------------------------------------------------------------
    def probe_batches(self, step: int, device: torch.device | str | None = None, *,
                      tasks_only: bool = False) -> list[dict[str, torch.Tensor]]:
        """The K domain (unless ``tasks_only``) + N task probe batches this rank uses at ``step`` (a pure function
        of the seed, the step and, in sharded mode, the rank)."""
        rank, world = collective_rank_size()
        return self.probe.groups(step, rank, world, torch.device(device if device is not None else "cpu"),
                                 tasks_only=tasks_only)

    def _replay(self, step: int) -> dict[str, Any] | None:
        assert self.replay is not None
        src = self.replay.advance(step)
        if src is None:
            return None
        self._apply_weights(np.asarray(src["alpha"], dtype=np.float64), step)
        rec = ScheduleReplay.update_record(step, src)
        self.num_updates += 1
        self.history.append(rec)
        return rec

    def _apply_weights(self, alpha: np.ndarray, step: int) -> None:
        self._last_from_batch = push_weights(self.mixer, alpha, self._consumed)

    # ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain Python types and tensors only (loads with ``torch.load(weights_only=True)``).

        ``history`` holds the newest records only (grape.checkpoint.CHECKPOINT_HISTORY); the whole run is
        in the trajectory JSONL.
        """
        tail, dropped = history_tail(self.history, self.history_dropped)
        return {
            "format": STATE_FORMAT,
            "method": self.method,
            "domains": list(self.domain_names),
            "tasks": list(self.task_names),
            "reweighter": None if self.reweighter is None else to_plain(self.reweighter.state_dict()),
            "schedule_index": -1 if self.replay is None else int(self.replay.index),
            "num_updates": int(self.num_updates),
            "history": json.loads(json.dumps(tail)),
            "history_dropped": dropped,
            **({} if self.probe.sizer is None else {"probe_size": self.probe.state_dict()}),
            **self._signal_state(),
        }

    def _signal_state(self) -> dict[str, Any]:
        """The signal source's state under its entry (``instep``, ``training_losses``: the names these entries have
        always had, so a checkpoint written before grape.signal existed loads), or nothing."""
        key = self.signal.state_key
        state = None if key is None else self.signal.state_dict()
        return {} if key is None or state is None else {key: state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint (this format or the older int 1). The mixer's weights are restored by the
        mixer's own state (the data position and the weights that composed each batch belong together),
        so nothing is pushed here."""
        check_state_format(state, method=self.method, domains=self.domain_names, tasks=self.task_names)
        if self.reweighter is not None:
            self.reweighter.load_state_dict(from_plain(state["reweighter"]))
        if self.replay is not None:
            self.replay.index = int(state.get("schedule_index", -1))
        self.num_updates = int(state.get("num_updates", 0))
        self.history = list(state.get("history", []))
        self.history_dropped = int(state.get("history_dropped", 0))
        self.probe.load_state_dict(state.get("probe_size"))
        key = self.signal.state_key
        if key is not None and state.get(key) is not None:
            self.signal.load_state_dict(state[key])
        self._resumed = True

    def write_trajectory(self, path: str | os.PathLike[str]) -> str:
        """Write meta + every update record as JSONL (atomically: a reader never sees half a file).

        After a resume from a checkpoint that held only the newest records, the older records already in
        the file at `path` are kept in front of them.
        """
        return write_trajectory(path, self.meta(), self.history, keep_earlier=self.history_dropped > 0)
