"""GRAPE's settings: the recipe's ``algorithm`` section, and what every GRAPE entry point takes.

:class:`AlgorithmConfig` travels as it is from the recipe to where each value takes effect: the Composer
algorithm, the HF / Lightning callbacks and a plain loop's controller all take it (or keyword overrides of
its fields), through ``GrapeLoop`` to ``GrapeController`` (docs/design.md, "How a setting travels").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from grape_stream.config.choices import Alignments, Geometry, ProbeMode
from grape_stream.config.fields import free

__all__ = ["GRAM_CHUNK_ELEMENTS", "PAPER_MU_ALPHA", "PAPER_MU_Z", "PROBE_BATCH_BOUNDS", "AlgorithmConfig",
           "GramConfig", "GrapeConfig"]

#: The paper's regularisation strengths (Table "model_archs": eta = lr / mu = 1.5 and 10 at lr 1.5e-4):
#: eta_alpha = lr / mu_alpha, eta_z = lr / mu_z. Every other default of mu_alpha / mu_z refers to these.
PAPER_MU_ALPHA = 1e-4
PAPER_MU_Z = 1.5e-5

#: Per-group gradient elements the fused Gram materialises at once per layer (64 MiB in fp32).
GRAM_CHUNK_ELEMENTS = 1 << 24

#: The smallest and largest per-group probe batch (per rank) the probe-size rule (``probe_rse``) may choose.
PROBE_BATCH_BOUNDS = (4, 64)


@dataclass
class GramConfig:
    """How the fused Gram runs (``group_gram``'s keyword arguments; ``algorithm.gram_options``)."""

    micro_batch_size: Optional[int] = None  # the probe in chunks of this many samples (None: one fused pass)
    chunk_elements: int = GRAM_CHUNK_ELEMENTS  # per-group gradient elements materialised at once per layer
    ghost: bool = True  # allow the token-pair ("ghost") form of matmul layers when it is cheaper


@dataclass
class AlgorithmConfig:
    """GRAPE's settings (the recipe's ``algorithm`` section; docs/recipes.md documents each key)."""

    method: str = "grape"  # a reweighting method (grape_stream.grape.reweighting.REWEIGHTERS) or schedule
    alpha_every: int = 100  # optimizer steps between alpha updates
    z_every: int = 100  # ... and between z updates
    probe_domain_batch: int = 8  # samples per domain in one probe (per rank)
    probe_task_batch: int = 8  # samples per target task in one probe (per rank)
    # the paper's step (eta = lr / mu) with options.step_size=lr_over_mu (None: the paper's mu); the default step
    # rule, options.step_size=trust_region, sizes each update by a KL divergence instead (kl_alpha, kl_z);
    # giving mu without options.step_size selects lr_over_mu (grape_stream.grape.reweighting.step_rule)
    mu_alpha: Optional[float] = None
    mu_z: Optional[float] = None
    seed: int = 0  # seeds the probes (independent of the training stream's seed)
    probe_mode: ProbeMode = ProbeMode.sharded  # only matters with several ranks
    probe_train_mode: bool = False  # probe with dropout on (default: the deterministic network)
    schedule_path: Optional[str] = None  # method=schedule: a trajectory JSONL to replay
    schedule_stretch: float = 1.0  # method=schedule: a factor on the replayed steps
    # the reweighter's options (their names and checks: each method's options dataclass; docs/reweighting.md):
    # clip_norm, z_smoothing, step_size, eta_*, alpha0, weights, alignment, gram_ema, alpha_ema, ...
    options: dict[str, Any] = free()
    # beyond the paper (docs/reweighting.md; defaults = the paper): alignment in AdamW's geometry, and the probe
    # size chosen from the measured probe noise (target relative standard error; None: fixed size)
    geometry: Geometry = Geometry.sgd
    probe_rse: Optional[float] = None
    probe_batch_bounds: list[int] = field(default_factory=lambda: list(PROBE_BATCH_BOUNDS))
    gram_options: GramConfig = field(default_factory=GramConfig)
    # in-step alignments (docs/alignment.md): "steps" takes the domain side from alignment_steps training steps
    # per update (their own backwards, evenly spaced) instead of K domain probes per update; "probe" is the paper's
    alignments: Alignments = Alignments.probe
    alignment_steps: int = 4
    # True: write grape_trajectory.jsonl in the run's folder (+ .png at the end); False: none; or a file path
    trajectory: Any = True
    plots: bool = True
    summary: bool = True  # print the end-of-run summary table (and write grape_summary.txt, log it as an artifact)
    log_alignment: bool = True  # log the K x N alignment metrics with every update


#: The name the issue uses for the GRAPE section.
GrapeConfig = AlgorithmConfig
