"""The recipe: one typed object per section (model, data, algorithm, optimizer, scheduler, trainer).

Recipes (:mod:`grape_stream.recipe` loads them as omegaconf structured configs of :class:`RecipeConfig`)
become these objects, and each section travels to where its values take effect (docs/design.md, "How a
setting travels"); the docs read the same dataclasses, so a default changes in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from grape_stream.config.algorithm import AlgorithmConfig
from grape_stream.config.data import DataConfig
from grape_stream.config.fields import free

__all__ = ["DecoderShape", "ModelConfig", "OptimizerConfig", "RecipeConfig", "SchedulerConfig", "TrainerConfig"]


@dataclass
class DecoderShape:
    """The small GPT's architecture (grape_stream.models.GPTConfig and the recipe's ``model`` share it)."""

    n_layer: int = 2
    n_head: int = 8
    d_model: int = 256
    d_ff: int = 512
    dropout: float = 0.0
    tie_embeddings: bool = True


@dataclass
class ModelConfig(DecoderShape):
    """The recipe's ``model`` section: the decoder's architecture, its sizes and its kind."""

    kind: str = "gpt"  # gpt (grape_stream.models.GPT) | hf (a transformers config, built without download)
    vocab_size: Optional[int] = None  # None: from the data manifest (data.local/manifest.json or data.remote)
    seq_len: Optional[int] = None  # None: data.seq_len
    hf_config: Optional[str] = None  # kind=hf: a model type ("gpt2", "llama") or a local directory with config.json
    hf_overrides: dict[str, Any] = free()  # kind=hf: config fields (n_layer, hidden_size, ...)


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
    loggers: dict[str, Any] = free()  # {file: {...}, tensorboard: {...}, wandb: {...}, mlflow: {...}}


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
    callbacks: dict[str, Any] = free()
    # free values for ${variables.x} interpolation elsewhere in the recipe (llm-foundry's `variables:`)
    variables: dict[str, Any] = free()
    # llm-foundry's key: the level of grape_stream's and Composer's messages (debug, info, warning, error);
    # `grape-stream train --log-level` wins over it (grape_stream.console)
    python_log_level: Optional[str] = None
