"""Typed defaults: every default of a recipe, of GRAPE and of the mixer is stated here, once.

Recipes (:mod:`grape_stream.recipe` loads them as omegaconf structured configs of :class:`RecipeConfig`),
:class:`GrapeAlgorithm`'s constructor and the docs all read these dataclasses, so a default changes in one
place. They are plain dataclasses of the types omegaconf's structured configs accept (``Optional[...]``,
``Any``, ``list``/``dict`` fields built with ``default_factory``, nested dataclasses, and :data:`MISSING`
as omegaconf spells a required value); no Union other than Optional.

Two field markers carry the recipe's rules (read by :func:`is_free` / :func:`is_required`):

* ``free=True``: a mapping whose keys are not checked (passed through to a library as keyword arguments);
* a default of :data:`MISSING`: the key is required.

Level 0: imports nothing from grape_stream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = [
    "MISSING",
    "PAPER_MU_ALPHA",
    "PAPER_MU_Z",
    "RETRY_DEADLINE_S",
    "AlgorithmConfig",
    "DataConfig",
    "GrapeConfig",
    "MixerConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RecipeConfig",
    "SchedulerConfig",
    "TrainerConfig",
    "is_free",
    "is_required",
]

#: A required value (omegaconf's literal for one, so the dataclasses keep their meaning there).
MISSING: Any = "???"

#: The paper's regularisation strengths (Table "model_archs": eta = lr / mu = 1.5 and 10 at lr 1.5e-4):
#: eta_alpha = lr / mu_alpha, eta_z = lr / mu_z. Every other default of mu_alpha / mu_z refers to these.
PAPER_MU_ALPHA = 1e-4
PAPER_MU_Z = 1.5e-5


#: How long a failing remote read or write is retried before it fails with one error: rides out a 60 s
#: outage of the object store with margin (grape_stream.retry.RetryPolicy's default).
RETRY_DEADLINE_S = 180.0


def _free() -> Any:
    """A free-form mapping field (keys not checked against a schema)."""
    return field(default_factory=dict, metadata={"free": True})


def is_free(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("free"))


def is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is MISSING


@dataclass
class ModelConfig:
    kind: str = "gpt"  # gpt (grape_stream.models.GPT) | hf (a transformers config, built without download)
    vocab_size: Optional[int] = None  # None: from the data manifest (data.local/manifest.json or data.remote)
    seq_len: Optional[int] = None  # None: data.seq_len
    n_layer: int = 2
    n_head: int = 8
    d_model: int = 256
    d_ff: int = 512
    dropout: float = 0.0
    tie_embeddings: bool = True
    hf_config: Optional[str] = None  # kind=hf: a model type ("gpt2", "llama") or a local directory with config.json
    hf_overrides: dict[str, Any] = _free()  # kind=hf: config fields (n_layer, hidden_size, ...)


@dataclass
class DataConfig:
    remote: Optional[str] = None  # base URL of the converted domains: <remote>/<domain> (s3://... uses S3_ENDPOINT_URL)
    local: Optional[str] = None  # base directory: the data itself when remote is None, else the download cache
    split: Optional[str] = "train"  # domain split directory (None: <domain>/index.json)
    seq_len: Optional[int] = None  # None: from the manifest
    domains: list[Any] = MISSING  # names, or mappings {name, remote, local, split}
    tasks: list[Any] = field(default_factory=list)  # names, or mappings {name, remote, local, split, test_split}
    task_remote: Optional[str] = None  # base URL of the converted tasks (default: data.remote)
    task_local: Optional[str] = None  # base directory of the tasks (default: data.local)
    task_probe_split: str = "validation"  # what GRAPE probes (the paper: each task's validation set)
    task_test_split: str = "test"  # what evaluation reads (never the probe split)
    num_workers: int = 0  # DataLoader workers for training
    batches_per_message: Optional[int] = None  # batches a worker sends at once (None: 512 // batch size, capped)
    mixer: dict[str, Any] = _free()  # extra WeightedStreamingMixer / StreamingDataset keyword arguments
    eval_batch_size: int = 16
    eval_num_workers: int = 0


@dataclass
class AlgorithmConfig:
    """GRAPE's settings (the recipe's ``algorithm`` section; GrapeAlgorithm's constructor defaults)."""

    method: str = "grape"  # a reweighting method (grape_stream.grape.reweighting.REWEIGHTERS) or schedule
    alpha_every: int = 100
    z_every: int = 100
    probe_domain_batch: int = 8
    probe_task_batch: int = 8
    mu_alpha: Optional[float] = PAPER_MU_ALPHA
    mu_z: Optional[float] = PAPER_MU_Z
    seed: int = 0
    probe_mode: str = "sharded"  # sharded | replicated (only matters with several ranks)
    schedule_path: Optional[str] = None  # method=schedule: a trajectory JSONL to replay
    schedule_stretch: float = 1.0
    # other reweighter options: clip_norm, z_smoothing, step_size, eta_*, alpha0, weights, and beyond the paper
    # alignment (inner | cosine), gram_ema, alpha_ema (docs/reweighting.md)
    options: dict[str, Any] = _free()
    # beyond the paper (docs/reweighting.md; defaults = the paper): alignment in AdamW's geometry, and the probe
    # size chosen from the measured probe noise (target relative standard error; None: fixed size)
    geometry: str = "sgd"  # sgd | adam
    probe_rse: Optional[float] = None
    probe_batch_bounds: list[int] = field(default_factory=lambda: [4, 64])
    trajectory: bool = True  # write <output_dir>/grape_trajectory.jsonl (+ .png at fit end)
    plots: bool = True
    summary: bool = True  # print the end-of-run summary table (and write grape_summary.txt, log it as an artifact)


#: The name the issue uses for the GRAPE section.
GrapeConfig = AlgorithmConfig


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 1.5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class SchedulerConfig:
    name: str = "cosine"  # cosine | linear | constant | wsd
    t_warmup: str = "0.01dur"
    alpha_f: float = 0.1  # final lr / peak lr
    decay_fraction: float = 0.2  # wsd: the share of training spent decaying


@dataclass
class TrainerConfig:
    max_duration: str = "1000ba"
    global_train_batch_size: int = 64
    device_train_microbatch_size: Any = None  # None: the whole per-rank batch; or an int; or "auto"
    eval_interval: str = "500ba"
    eval_subset_num_batches: int = -1
    device: str = "auto"  # auto | cpu | gpu | mps
    precision: Optional[str] = None  # None: amp_bf16 on gpu, fp32 elsewhere
    grad_clip_norm: Optional[float] = 1.0  # None: no clipping
    save_folder: Optional[str] = None
    save_interval: str = "1000ba"
    save_num_checkpoints_to_keep: int = -1
    save_overwrite: bool = False
    autoresume: bool = False
    load_path: Optional[str] = None
    log_interval: str = "10ba"
    log_to_console: bool = True
    progress_bar: bool = False
    metrics_jsonl: bool = True  # write every logged metric to <output_dir>/metrics.jsonl
    loggers: dict[str, Any] = _free()  # {file: {...}, tensorboard: {...}, wandb: {...}, mlflow: {...}}


@dataclass
class RecipeConfig:
    """A whole recipe; docs/recipes.md documents each key."""

    run_name: Optional[str] = None  # default: the recipe file's stem
    seed: int = 17
    output_dir: str = "runs/{run_name}"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Composer callbacks by name -> keyword arguments (lr_monitor, speed_monitor, ..., or "module:Class")
    callbacks: dict[str, Any] = _free()
    # free values for ${variables.x} interpolation elsewhere in the recipe (llm-foundry's `variables:`)
    variables: dict[str, Any] = _free()
    # llm-foundry's key: the level of grape_stream's and Composer's messages (debug, info, warning, error);
    # `grape-stream train --log-level` wins over it (grape_stream.console)
    python_log_level: Optional[str] = None


@dataclass
class MixerConfig:
    """WeightedStreamingMixer's keyword defaults (the recipe passes ``data.mixer`` through as overrides).

    Not yet read by the mixer itself: grape_stream.mixing should take its defaults from here.
    """

    seed: int = 0
    shuffle: bool = True
    composition: str = "systematic"
    shuffle_block_size: int = 1 << 18
    lag: Optional[int] = None
    schedule_capacity: int = 1024
    overwrite_local: bool = False
    s3_dummy_credentials: bool = False
    prefetch: bool = True
    retry_deadline: float = RETRY_DEADLINE_S  # seconds a failing shard download is retried
