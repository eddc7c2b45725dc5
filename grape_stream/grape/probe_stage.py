"""The probe, one stage with one entry point: :meth:`ProbeStage.run`.

At an update the controller hands the model to the stage, which (1) unwraps it once (grape.probes: the
module whose parameters are differentiated), (2) sizes the probe (fixed, or chosen from the previous
probe's measured noise, grape.probe_size), (3) gathers the K domain and N task groups (a pure function of
``(seed, step, rank)``), (4) forms their Gram matrix in one fused forward/backward (grape.gram), in the
optimizer's geometry when asked (grape.geometry), leaving the model's mode and the RNG as found, and
(5) records what it did in the update record. Everything the stage needs comes from its
:class:`~grape_stream.config.AlgorithmConfig`; nothing is passed through as ``**kwargs``.

With the paper's settings (SGD geometry, fixed probe size) the options beyond the paper do nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, ContextManager, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from grape_stream.config import AlgorithmConfig
from grape_stream.grape.geometry import adam_preconditioner
from grape_stream.grape.gram.group_gram import fused_gram
from grape_stream.grape.gram.sharding import common_length, is_sharded
from grape_stream.grape.mixer_port import MixerPort
from grape_stream.grape.probe_size import ProbeSizer, combine_halves, relative_standard_error, split_halves
from grape_stream.grape.probes import draw_probe_groups, module_device, pad_groups, unwrap_for_probe
from grape_stream.grape.reweighting import Reweighter
from grape_stream.grape.tasks import TaskStream
from grape_stream.grape.trajectory import floats

__all__ = ["PerSampleLoss", "ProbeStage"]

log = logging.getLogger(__name__)

PerSampleLoss = Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]
Autocast = Callable[[], ContextManager[Any]]


class ProbeStage:
    """Probe -> Gram for one controller: its probe sizes (and their state), geometry and Gram settings."""

    def __init__(self, config: AlgorithmConfig, mixer: MixerPort, tasks: Sequence[TaskStream],
                 per_sample_loss: PerSampleLoss) -> None:
        self.config = config
        self.mixer = mixer
        self.tasks = list(tasks)
        self.num_domains = len(mixer.domain_names)
        self.per_sample_loss = per_sample_loss
        c = config
        self.sizer = None if c.probe_rse is None else ProbeSizer(c.probe_rse, c.probe_domain_batch, c.probe_task_batch,
                                                               tuple(c.probe_batch_bounds))
        self._said: str | None = None  # the geometry last logged

    # -- sizes and groups ----------------------------------------------------------------------------
    def sizes(self) -> tuple[int, int]:
        """The per-group probe batch sizes (domain, task) of the next probe."""
        if self.sizer is None:
            return self.config.probe_domain_batch, self.config.probe_task_batch
        return self.sizer.domain_batch, self.sizer.task_batch

    def groups(self, step: int, rank: int, world: int, device: torch.device, *,
               tasks_only: bool = False) -> list[dict[str, torch.Tensor]]:
        """The K domain (unless ``tasks_only``) + N task probe batches this rank uses at ``step``, padded and on
        ``device``."""
        domain_batch, task_batch = self.sizes()
        return draw_probe_groups(
            self.mixer, 0 if tasks_only else self.num_domains, self.tasks, step, seed=self.config.seed,
            domain_batch=domain_batch, task_batch=task_batch, rank=rank, world=world,
            sharded=self.config.probe_mode == "sharded", device=device,
        )

    # -- the entry point -----------------------------------------------------------------------------
    def run(self, model: nn.Module, step: int, *, rank: int, world: int, reweighter: Reweighter,
            autocast: Autocast | None, optimizer: Any, rec: dict[str, Any],
            seconds: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
        """(Gram, losses) of this rank's probe at ``step`` (averaged over the ranks when sharded), float64;
        the record ``rec`` gets the probe's losses, alignments and options, ``seconds`` its timings.

        ``reweighter`` previews the half-probes of the size rule; ``optimizer`` is read (never changed) by
        ``geometry="adam"``.
        """
        probe_model = unwrap_for_probe(model, sharded_ok=True)  # FSDP: probed unit by unit (grape/gram/sharding.py)
        t = time.perf_counter()
        groups = self.groups(step, rank, world, module_device(probe_model))
        if world > 1 and is_sharded(probe_model):  # every rank's forwards gather the units: one batch shape
            groups = pad_groups(groups, common_length(groups, module_device(probe_model)))
        seconds["probe_data"] = time.perf_counter() - t
        t = time.perf_counter()
        pre = self._precondition(probe_model, optimizer, rec)
        if self.sizer is None:
            gram, losses = self._gram(probe_model, groups, pre, autocast)
        else:
            gram, losses = self._sized_gram(probe_model, groups, pre, autocast, reweighter, rec)
        seconds["gram"] = time.perf_counter() - t
        k = self.num_domains
        rec["domain_loss"] = floats(losses[:k])
        rec["task_loss"] = floats(losses[k:])
        rec["alignment"] = [floats(row) for row in gram[:k, k:]]
        rec["gram_diag"] = floats(np.diag(gram))
        return gram, losses

    def _precondition(self, model: nn.Module, optimizer: Any, rec: dict[str, Any]) -> Any:
        """AdamW's second-moment weights under ``geometry="adam"`` (None: the paper's SGD inner products)."""
        if self.config.geometry != "adam":
            return None
        pre, used = adam_preconditioner(optimizer, model)
        rec["geometry"] = used
        if used != self._said:
            self._said = used
            log.info("GRAPE alignment geometry: %s", used)
        return pre

    def _sized_gram(self, model: nn.Module, groups: list[dict[str, torch.Tensor]], pre: Any,
                    autocast: Autocast | None, reweighter: Reweighter,
                    rec: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """The Gram of the half-groups in one pass, combined exactly; the next probe size from their noise."""
        assert self.sizer is not None
        half_gram, half_losses = self._gram(model, split_halves(groups), pre, autocast)
        gram, losses = combine_halves(half_gram, half_losses)
        k = self.num_domains
        _, b = reweighter.preview(gram, losses[k:])
        _, b1 = reweighter.preview(half_gram[0::2, 0::2], half_losses[0::2][k:])
        _, b2 = reweighter.preview(half_gram[1::2, 1::2], half_losses[1::2][k:])
        rse, noise, signal = relative_standard_error(np.asarray(b), np.asarray(b1), np.asarray(b2))
        rec["probe_batch"] = [self.sizer.domain_batch, self.sizer.task_batch]
        rec["probe_rse"] = rse if np.isfinite(rse) else None  # None: no signal above the noise
        rec["probe_noise_var"], rec["probe_signal_var"] = noise, signal
        rec["next_probe_batch"] = list(self.sizer.next_sizes(rse))
        return gram, losses

    def _gram(self, model: nn.Module, groups: list[dict[str, torch.Tensor]], precondition: Any,
              autocast: Autocast | None) -> tuple[np.ndarray, np.ndarray]:
        """(Gram, losses) of the groups as float64 numpy, leaving the model's mode and the RNG as found.

        The probe must not advance the training RNG (dropout masks, etc.): a run with GRAPE and one resumed
        from a checkpoint must see the same random numbers as their uninterrupted twins. A non-finite result
        is an error: updating the mixture from a diverged model would hide the divergence.
        """
        c = self.config
        was_training = model.training
        model.train(c.probe_train_mode)
        cuda = torch.cuda.is_available() and module_device(model).type == "cuda"
        devices = [torch.cuda.current_device()] if cuda else []
        try:
            with torch.random.fork_rng(devices=devices), (autocast() if autocast is not None
                                                           else contextlib.nullcontext()):
                gram_t, losses_t, _info = fused_gram(
                    model, self.per_sample_loss, groups, reduce="mean" if c.probe_mode == "sharded" else None,
                    settings=c.gram_options, precondition=precondition)
        finally:
            model.train(was_training)
        gram = np.asarray(torch.as_tensor(gram_t).detach().double().cpu().numpy(), dtype=np.float64)
        losses = np.asarray(torch.as_tensor(losses_t).detach().double().cpu().numpy(), dtype=np.float64).ravel()
        n = len(groups)
        if gram.shape != (n, n) or losses.shape != (n,):
            raise RuntimeError(f"the fused Gram returned shapes {gram.shape} and {losses.shape}, expected "
                               f"{(n, n)} and {(n,)}")
        if not (np.all(np.isfinite(gram)) and np.all(np.isfinite(losses))):
            raise FloatingPointError(
                "the probe's Gram matrix or losses are not finite (the model diverged, or the probe data holds "
                "token ids outside the vocabulary); refusing to update the mixture"
            )
        return gram, losses

    # -- what the trajectory and the checkpoint hold -------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """What a trajectory's meta line records (only the non-default options)."""
        out: dict[str, Any] = {}
        if self.config.geometry != "sgd":
            out["geometry"] = str(self.config.geometry)  # a plain word (records go into states)
        if self.sizer is not None:
            out.update(probe_rse=self.sizer.target, probe_batch_bounds=list(self.sizer.bounds))
        return out

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.sizer is None else self.sizer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if self.sizer is not None and state is not None:
            self.sizer.load_state_dict(state)
