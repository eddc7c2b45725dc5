"""YAML recipe -> model, mixer, tasks, algorithm, evaluators, Trainer: what ``grape-stream train`` runs.

A recipe is a nested mapping with a fixed schema (:data:`SCHEMA`): every key it may hold has a default
here, an unknown key is an error that names it (with the closest valid key), and ``key=value``
overrides on the command line address keys by their dotted path (``algorithm.method=uniform``,
``trainer.max_duration=200ba``, ``data.remote=s3://bucket/slimpajama``); values are parsed as YAML.

Paper-scale recipes must be checkable on a laptop: :func:`build` with ``dry_run=True`` constructs the
model on the meta device and every other object that needs no data, so a recipe is validated in a
second without a GPU and without its data.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import yaml

__all__ = [
    "SCHEMA",
    "Built",
    "apply_overrides",
    "build",
    "build_model",
    "bundled_recipes",
    "load_recipe",
    "main",
    "resolve_recipe_path",
]

log = logging.getLogger(__name__)


class _Free(dict):
    """Marks a mapping whose keys are free-form (passed through to a library as keyword arguments)."""


class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED = _Required()


class _RecipeLoader(yaml.SafeLoader):
    """YAML 1.1 (PyYAML) reads ``1e-4`` as a *string* (it wants ``1.0e-4``); recipes are full of learning
    rates and mu's written that way, so floats in exponent notation resolve as floats here."""


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    __import__("re").compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        __import__("re").X,
    ),
    list("-+0123456789."),
)


def _yaml_load(text: Any) -> Any:
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass

#: Every key a recipe may hold, with its default. docs/recipes.md documents each one.
SCHEMA: dict[str, Any] = {
    "run_name": None,  # default: the recipe file's stem
    "seed": 17,
    "output_dir": "runs/{run_name}",
    "model": {
        "kind": "gpt",  # gpt (grape_stream.models.GPT) | hf (a transformers config, built without download)
        "vocab_size": None,  # None: from the data manifest (data.local/manifest.json or data.remote)
        "seq_len": None,  # None: data.seq_len
        "n_layer": 2,
        "n_head": 8,
        "d_model": 256,
        "d_ff": 512,
        "dropout": 0.0,
        "tie_embeddings": True,
        "hf_config": None,  # kind=hf: a model type ("gpt2", "llama") or a local directory with config.json
        "hf_overrides": _Free(),  # kind=hf: config fields (n_layer, hidden_size, ...)
    },
    "data": {
        "remote": None,  # base URL of the converted domains: <remote>/<domain> (s3://... uses S3_ENDPOINT_URL)
        "local": None,  # base directory: the data itself when remote is None, else the download cache
        "split": "train",  # domain split directory (None: <domain>/index.json)
        "seq_len": None,  # None: from the manifest
        "domains": REQUIRED,  # names, or mappings {name, remote, local, split}
        "tasks": [],  # names, or mappings {name, remote, local, split, test_split}
        "task_remote": None,  # base URL of the converted tasks (default: data.remote)
        "task_local": None,  # base directory of the tasks (default: data.local)
        "task_probe_split": "validation",  # what GRAPE probes (the paper: each task's validation set)
        "task_test_split": "test",  # what evaluation reads (never the probe split)
        "num_workers": 0,  # DataLoader workers for training
        "mixer": _Free(),  # extra WeightedStreamingMixer / StreamingDataset keyword arguments
        "eval_batch_size": 16,
        "eval_num_workers": 0,
    },
    "algorithm": {
        "method": "grape",  # grape | grape_gap | grape_ema | doge | doge_pcgrad | uniform | static | schedule
        "alpha_every": 100,
        "z_every": 100,
        "probe_domain_batch": 8,
        "probe_task_batch": 8,
        "mu_alpha": 1e-4,
        "mu_z": 1.5e-5,
        "seed": 0,
        "probe_mode": "sharded",  # sharded | replicated (only matters with several ranks)
        "schedule_path": None,  # method=schedule: a trajectory JSONL to replay
        "schedule_stretch": 1.0,
        "options": _Free(),  # other reweighter options: clip_norm, z_smoothing, step_size, eta_*, alpha0, weights...
        "trajectory": True,  # write <output_dir>/grape_trajectory.jsonl (+ .png at fit end)
        "plots": True,
    },
    "optimizer": {
        "name": "adamw",
        "lr": 1.5e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    },
    "scheduler": {
        "name": "cosine",  # cosine | linear | constant | wsd
        "t_warmup": "0.01dur",
        "alpha_f": 0.1,  # final lr / peak lr
        "decay_fraction": 0.2,  # wsd: the share of training spent decaying
    },
    "trainer": {
        "max_duration": "1000ba",
        "global_train_batch_size": 64,
        "device_train_microbatch_size": None,  # None: the whole per-rank batch; or an int; or "auto"
        "eval_interval": "500ba",
        "eval_subset_num_batches": -1,
        "device": "auto",  # auto | cpu | gpu | mps
        "precision": None,  # None: amp_bf16 on gpu, fp32 elsewhere
        "grad_clip_norm": 1.0,  # None: no clipping
        "save_folder": None,
        "save_interval": "1000ba",
        "save_num_checkpoints_to_keep": -1,
        "save_overwrite": False,
        "autoresume": False,
        "load_path": None,
        "log_interval": "10ba",
        "log_to_console": True,
        "progress_bar": False,
        "metrics_jsonl": True,  # write every logged metric to <output_dir>/metrics.jsonl
        "loggers": _Free(),  # {file: {...}, tensorboard: {...}, wandb: {...}, mlflow: {...}}
    },
}

_ENTRY_KEYS = {
    "domains": {"name", "remote", "local", "split"},
    "tasks": {"name", "remote", "local", "split", "test_split"},
}


# ---------------------------------------------------------------------------------------------------
# loading, validation, overrides
# ---------------------------------------------------------------------------------------------------
def _dotted(schema: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in schema.items():
        path = f"{prefix}{k}"
        out.append(path)
        if isinstance(v, dict) and not isinstance(v, _Free):
            out.extend(_dotted(v, path + "."))
    return out


def _unknown_key(path: str, where: str) -> KeyError:
    valid = _dotted(SCHEMA)
    close = difflib.get_close_matches(path, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return KeyError(f"unknown recipe key {path!r}{where}{hint}")


def _merge(schema: Mapping[str, Any], given: Mapping[str, Any], prefix: str, where: str) -> dict[str, Any]:
    if not isinstance(given, Mapping):
        raise TypeError(f"recipe key {prefix.rstrip('.') or '<root>'!r}{where} must be a mapping, got {type(given).__name__}")
    out: dict[str, Any] = {}
    for key in given:
        if key not in schema:
            raise _unknown_key(f"{prefix}{key}", where)
    for key, default in schema.items():
        path = f"{prefix}{key}"
        if isinstance(default, _Free):
            value = given.get(key) or {}
            if not isinstance(value, Mapping):
                raise TypeError(f"recipe key {path!r}{where} must be a mapping, got {type(value).__name__}")
            out[key] = dict(value)
        elif isinstance(default, dict):
            out[key] = _merge(default, given.get(key) or {}, path + ".", where)
        elif key in given:
            out[key] = copy.deepcopy(given[key])
        else:
            out[key] = copy.deepcopy(default)
    return out


def bundled_recipes() -> dict[str, str]:
    """name -> path of the recipes shipped in ``grape_stream.recipes``."""
    import importlib.resources

    root = importlib.resources.files("grape_stream.recipes")
    return {p.name[:-5]: str(p) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_recipe_path(name_or_path: str) -> str:
    if os.path.exists(name_or_path):
        return name_or_path
    bundled = bundled_recipes()
    key = name_or_path[:-5] if name_or_path.endswith(".yaml") else name_or_path
    key = os.path.basename(key)
    if key in bundled:
        return bundled[key]
    raise FileNotFoundError(f"no recipe {name_or_path!r}: not a file, and not one of the bundled recipes {sorted(bundled)}")


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ValueError(f"override {item!r} is not key=value (e.g. algorithm.method=uniform)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"override {item!r} has an empty key")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"override {item!r}: the value is not valid YAML ({exc})") from None
    return key, value


def apply_overrides(cfg: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set dotted keys in a *validated* recipe. Unknown keys are errors that name the key; keys inside
    free-form mappings (``algorithm.options.clip_norm``, ``model.hf_overrides.n_layer``) are accepted."""
    cfg = copy.deepcopy(cfg)
    for item in overrides:
        key, value = _parse_override(item)
        parts = key.split(".")
        node: Any = cfg
        schema: Any = SCHEMA
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(schema, _Free):
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})
                    schema = _Free()
                continue
            if not isinstance(schema, dict) or part not in schema:
                raise _unknown_key(key, " (command-line override)")
            if last:
                sub = schema[part]
                if isinstance(sub, dict) and not isinstance(sub, _Free):
                    node[part] = _merge(sub, value or {}, ".".join(parts) + ".", " (command-line override)")
                else:
                    node[part] = value
            else:
                schema = schema[part]
                node = node[part]
    return cfg


def load_recipe(source: str | os.PathLike[str] | Mapping[str, Any], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read (path, bundled name or mapping), validate against :data:`SCHEMA`, fill defaults, apply overrides."""
    if isinstance(source, Mapping):
        given, where, stem = dict(source), "", None
    else:
        path = resolve_recipe_path(os.fspath(source))
        with open(path, encoding="utf-8") as f:
            try:
                given = _yaml_load(f) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"{path}: not valid YAML: {exc}") from None
        where, stem = f" in {path}", os.path.splitext(os.path.basename(path))[0]
    cfg = _merge(SCHEMA, given, "", where)
    cfg = apply_overrides(cfg, overrides)
    if cfg["run_name"] is None:
        cfg["run_name"] = stem or "grape-run"
    _validate(cfg)
    return cfg


def _validate(cfg: dict[str, Any]) -> None:
    data = cfg["data"]
    if isinstance(data["domains"], _Required) or not data["domains"]:
        raise ValueError("recipe key 'data.domains' is required: the list of domain names (or {name, local, remote})")
    for group in ("domains", "tasks"):
        entries = data[group]
        if not isinstance(entries, list):
            raise TypeError(f"recipe key 'data.{group}' must be a list, got {type(entries).__name__}")
        names = []
        for i, e in enumerate(entries):
            if isinstance(e, str):
                names.append(e)
            elif isinstance(e, Mapping):
                bad = sorted(set(e) - _ENTRY_KEYS[group])
                if bad:
                    raise KeyError(f"unknown recipe key 'data.{group}[{i}].{bad[0]}'; an entry takes {sorted(_ENTRY_KEYS[group])}")
                if not e.get("name"):
                    raise ValueError(f"recipe key 'data.{group}[{i}]' needs a 'name'")
                names.append(str(e["name"]))
            else:
                raise TypeError(f"recipe key 'data.{group}[{i}]' must be a name or a mapping, got {type(e).__name__}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"recipe key 'data.{group}' repeats {dup}")
    alg = cfg["algorithm"]
    from grape_stream.grape.controller import controller_methods

    choices = controller_methods()
    if alg["method"] not in choices:
        raise ValueError(f"recipe key 'algorithm.method' is {alg['method']!r}; choose one of {', '.join(choices)}")
    if alg["method"] not in ("uniform", "static", "schedule") and not data["tasks"]:
        raise ValueError(f"algorithm.method={alg['method']} needs target tasks: set 'data.tasks'")
    if cfg["model"]["kind"] not in ("gpt", "hf"):
        raise ValueError(f"recipe key 'model.kind' is {cfg['model']['kind']!r}; choose 'gpt' or 'hf'")
    if cfg["model"]["kind"] == "hf" and not cfg["model"]["hf_config"]:
        raise ValueError("model.kind=hf needs 'model.hf_config' (a model type such as gpt2 or llama, or a local config dir)")
    if cfg["optimizer"]["name"].lower() != "adamw":
        raise ValueError(f"recipe key 'optimizer.name' is {cfg['optimizer']['name']!r}; supported: adamw")
    if cfg["scheduler"]["name"] not in ("cosine", "linear", "constant", "wsd"):
        raise ValueError(f"recipe key 'scheduler.name' is {cfg['scheduler']['name']!r}; choose cosine, linear, constant or wsd")
    if cfg["data"]["task_probe_split"] == cfg["data"]["task_test_split"]:
        raise ValueError("data.task_probe_split and data.task_test_split must differ: never evaluate on the probe split")
    gbs = cfg["trainer"]["global_train_batch_size"]
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise ValueError(f"trainer.global_train_batch_size must be a positive integer, got {gbs!r}")


# ---------------------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------------------
def _join(base: str | None, *parts: str | None) -> str | None:
    if base is None:
        return None
    out = base.rstrip("/")
    for p in parts:
        if p:
            out = f"{out}/{p}" if "://" in out else os.path.join(out, p)
    return out


def read_manifest(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The converter's manifest.json at data.local (or data.remote), or None when there is none."""
    data = cfg["data"]
    if data["remote"] is None:
        if data["local"] is None:
            return None
        path = os.path.join(data["local"], "manifest.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    import tempfile

    from streaming.base.storage.download import CloudDownloader

    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(tmp, "manifest.json")
        try:
            CloudDownloader.direct_download(_join(data["remote"], "manifest.json"), dest, 60)
        except Exception as exc:  # no manifest is allowed when sizes are given explicitly
            log.info("no manifest at %s: %s", data["remote"], exc)
            return None
        with open(dest, encoding="utf-8") as f:
            return json.load(f)


def _resolved_sizes(cfg: Mapping[str, Any], manifest: Mapping[str, Any] | None) -> tuple[int, int]:
    model, data = cfg["model"], cfg["data"]
    vocab = model["vocab_size"] or (manifest or {}).get("vocab_size")
    seq = model["seq_len"] or data["seq_len"] or (manifest or {}).get("seq_len")
    if not vocab:
        raise ValueError("model.vocab_size is not set and no data manifest gives it; set model.vocab_size")
    if not seq:
        raise ValueError("model.seq_len / data.seq_len are not set and no data manifest gives them; set data.seq_len")
    if manifest:
        if manifest.get("vocab_size") and int(manifest["vocab_size"]) > int(vocab):
            raise ValueError(
                f"the data was tokenized with vocab_size={manifest['vocab_size']} but model.vocab_size={vocab}: "
                "token ids would fall outside the embedding"
            )
        if manifest.get("seq_len") and int(manifest["seq_len"]) > int(seq):
            raise ValueError(f"the data has seq_len={manifest['seq_len']} but the model's seq_len is {seq}")
    return int(vocab), int(seq)


def build_model(cfg: Mapping[str, Any], *, vocab_size: int, seq_len: int, device: Any = None) -> Any:
    """The recipe's decoder as ``module(tokens) -> logits`` (GPT, or a transformers model built from a
    config without any download). ``device="meta"`` builds it without allocating memory."""
    import torch
    from torch import nn

    m = cfg["model"]
    ctx = torch.device(device) if device is not None else torch.device("cpu")
    if m["kind"] == "gpt":
        from grape_stream.models import GPT, GPTConfig

        gcfg = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=m["n_layer"], n_head=m["n_head"],
                         d_model=m["d_model"], d_ff=m["d_ff"], dropout=m["dropout"], tie_embeddings=m["tie_embeddings"])
        with ctx:
            return GPT(gcfg)
    from transformers import AutoConfig, AutoModelForCausalLM

    src = m["hf_config"]
    overrides = dict(m["hf_overrides"])
    if os.path.isdir(src):
        config = AutoConfig.from_pretrained(src, local_files_only=True, **overrides)
    else:
        config = AutoConfig.for_model(src, **overrides)
    if "vocab_size" not in overrides:
        config.vocab_size = vocab_size
    for attr in ("n_positions", "max_position_embeddings"):
        if hasattr(config, attr) and attr not in overrides:
            setattr(config, attr, seq_len)

    class _HFTokensToLogits(nn.Module):
        """Adapts a transformers causal LM to ``tokens -> logits`` (what per_sample_lm_loss expects)."""

        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=tokens, use_cache=False).logits

    with ctx:
        return _HFTokensToLogits(AutoModelForCausalLM.from_config(config))


def _streams(cfg: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
    from grape_stream.grape.tasks import TaskStream

    data = cfg["data"]
    domains = []
    for e in data["domains"]:
        e = {"name": e} if isinstance(e, str) else dict(e)
        name = str(e["name"])
        remote = e.get("remote", _join(data["remote"], name))
        local = e.get("local", _join(data["local"], name))
        domains.append({"name": name, "remote": remote, "local": local, "split": e.get("split", data["split"])})
    t_remote = data["task_remote"] if data["task_remote"] is not None else data["remote"]
    t_local = data["task_local"] if data["task_local"] is not None else data["local"]
    tasks = []
    for e in data["tasks"]:
        e = {"name": e} if isinstance(e, str) else dict(e)
        name = str(e["name"])
        tasks.append(TaskStream(
            name=name,
            remote=e.get("remote", _join(t_remote, name)),
            local=e.get("local", _join(t_local, name)),
            split=e.get("split", data["task_probe_split"]),
            test_split=e.get("test_split", data["task_test_split"]),
        ))
    return domains, tasks


def build_mixer(cfg: Mapping[str, Any], domains: list[dict[str, Any]], batch_size: int, seed: int) -> Any:
    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    streams = []
    for d in domains:
        if d["local"] is None and d["remote"] is None:
            raise ValueError(f"domain {d['name']!r}: set data.local or data.remote (or the domain's own local/remote)")
        streams.append(DomainStream(d["name"], remote=d["remote"], local=d["local"], split=d["split"]))
    return WeightedStreamingMixer(domains=streams, batch_size=batch_size, seed=seed, **cfg["data"]["mixer"])


def build_scheduler(cfg: Mapping[str, Any]) -> Any:
    from composer.optim import (
        ConstantWithWarmupScheduler,
        CosineAnnealingWithWarmupScheduler,
        LinearWithWarmupScheduler,
    )

    s = cfg["scheduler"]
    if s["name"] == "cosine":
        return CosineAnnealingWithWarmupScheduler(t_warmup=s["t_warmup"], alpha_f=s["alpha_f"])
    if s["name"] == "linear":
        return LinearWithWarmupScheduler(t_warmup=s["t_warmup"], alpha_f=s["alpha_f"])
    if s["name"] == "constant":
        return ConstantWithWarmupScheduler(t_warmup=s["t_warmup"])
    return WarmupStableDecayScheduler(t_warmup=s["t_warmup"], decay_fraction=s["decay_fraction"], alpha_f=s["alpha_f"])


class WarmupStableDecayScheduler:
    """WSD (MiniCPM; the paper's 0.7B runs): linear warmup, constant, then linear decay to ``alpha_f`` over
    the last ``decay_fraction`` of training. A Composer scheduler: ``(state, ssr) -> lr multiplier``."""

    def __init__(self, t_warmup: str = "0.01dur", decay_fraction: float = 0.2, alpha_f: float = 0.1) -> None:
        if not 0.0 <= decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must lie in [0, 1], got {decay_fraction}")
        self.t_warmup = t_warmup
        self.decay_fraction = decay_fraction
        self.alpha_f = alpha_f

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        from composer.optim.scheduler import _convert_time

        assert state.max_duration is not None
        warm = _convert_time(self.t_warmup, state)
        now = state.timestamp.get(warm.unit).value
        if warm.value > 0 and now < warm.value:
            return now / warm.value
        frac = state.get_elapsed_duration()
        frac = 0.0 if frac is None else float(frac.value) / ssr
        start = 1.0 - self.decay_fraction
        if frac <= start or self.decay_fraction == 0:
            return 1.0
        p = min(1.0, (frac - start) / self.decay_fraction)
        return 1.0 - p * (1.0 - self.alpha_f)


@dataclass
class Built:
    """Everything a recipe builds; ``trainer`` is None in a dry run."""

    cfg: dict[str, Any]
    model: Any
    algorithm: Any
    tasks: list[Any]
    domains: list[dict[str, Any]]
    optimizer: Any
    scheduler: Any
    per_rank_batch_size: int
    mixer: Any = None
    train_dataloader: Any = None
    evaluators: list[Any] = field(default_factory=list)
    callbacks: list[Any] = field(default_factory=list)
    loggers: list[Any] = field(default_factory=list)
    trainer: Any = None

    def close(self) -> None:
        """Close the trainer, then release the streaming resources of the mixer and the tasks."""
        if self.trainer is not None:
            self.trainer.close()
        if self.mixer is not None:
            self.mixer.close()
        for t in self.tasks:
            t.close()

    def describe(self) -> dict[str, Any]:
        n_params = sum(p.numel() for p in self.model.parameters())
        return {
            "run_name": self.cfg["run_name"],
            "model": f"{self.cfg['model']['kind']} ({n_params / 1e6:.1f}M parameters)",
            "domains": [d["name"] for d in self.domains],
            "tasks": [t.name for t in self.tasks],
            "method": self.cfg["algorithm"]["method"],
            "max_duration": self.cfg["trainer"]["max_duration"],
            "global_batch": self.cfg["trainer"]["global_train_batch_size"],
            "per_rank_batch": self.per_rank_batch_size,
            "lr": self.cfg["optimizer"]["lr"],
            "scheduler": self.cfg["scheduler"]["name"],
        }


def _device_name(cfg: Mapping[str, Any]) -> str:
    import torch

    dev = cfg["trainer"]["device"]
    if dev == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if dev not in ("cpu", "gpu", "mps"):
        raise ValueError(f"trainer.device must be auto, cpu, gpu or mps, got {dev!r}")
    return dev


def build_algorithm(cfg: Mapping[str, Any], tasks: list[Any]) -> Any:
    from grape_stream.integrations.composer.algorithm import GrapeAlgorithm
    from grape_stream.grape.controller import filter_reweighter_options

    a = cfg["algorithm"]
    method = a["method"]
    options = dict(a["options"])
    if options.get("step_size") == "constant":
        mus = {}
    else:
        mus = {k: a[k] for k in ("mu_alpha", "mu_z") if a[k] is not None}
    kept, dropped = filter_reweighter_options(method, {**mus, **options}, strict=False)
    if dropped:
        log.info("algorithm.method=%s ignores options that belong to other methods: %s", method, sorted(dropped))
    controller_opts: dict[str, Any] = {"probe_mode": a["probe_mode"]}
    if method == "schedule":
        if not a["schedule_path"]:
            raise ValueError("algorithm.method=schedule needs algorithm.schedule_path (a trajectory JSONL)")
        controller_opts.update(schedule_path=a["schedule_path"], schedule_stretch=a["schedule_stretch"])
    return GrapeAlgorithm(
        method=method,
        tasks=tasks,
        alpha_every=a["alpha_every"],
        z_every=a["z_every"],
        probe_domain_batch=a["probe_domain_batch"],
        probe_task_batch=a["probe_task_batch"],
        mu_alpha=kept.pop("mu_alpha", None),
        mu_z=kept.pop("mu_z", None),
        seed=a["seed"],
        **controller_opts,
        **kept,
    )


def _loggers(cfg: Mapping[str, Any], output_dir: str) -> list[Any]:
    from composer import loggers as L

    classes = {
        "file": L.FileLogger,
        "tensorboard": L.TensorboardLogger,
        "wandb": L.WandBLogger,
        "mlflow": L.MLFlowLogger,
        "inmemory": L.InMemoryLogger,
    }
    out = []
    for name, kwargs in cfg["trainer"]["loggers"].items():
        if name not in classes:
            raise ValueError(f"unknown logger 'trainer.loggers.{name}'; choose from {sorted(classes)}")
        out.append(classes[name](**dict(kwargs or {})))
    if cfg["trainer"]["metrics_jsonl"]:
        from grape_stream.integrations.composer.algorithm import JSONLMetricsLogger

        out.append(JSONLMetricsLogger(os.path.join(output_dir, "metrics.jsonl")))
    return out


def build(cfg: Mapping[str, Any], *, dry_run: bool = False, extra_callbacks: Sequence[Any] = (),
          extra_loggers: Sequence[Any] = ()) -> Built:
    """Build a recipe. ``dry_run``: the model on the meta device and no data opened, no Trainer."""
    import torch
    from composer.utils import reproducibility

    cfg = copy.deepcopy(dict(cfg))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gbs = cfg["trainer"]["global_train_batch_size"]
    if gbs % world:
        raise ValueError(f"trainer.global_train_batch_size={gbs} is not divisible by the {world} ranks")
    per_rank = gbs // world
    output_dir = cfg["output_dir"].format(run_name=cfg["run_name"])

    manifest = None if dry_run else read_manifest(cfg)
    vocab, seq = _resolved_sizes(cfg, manifest)
    if not dry_run:
        # Trainer(seed=) seeds only after the model exists: seed first so initial weights are reproducible.
        reproducibility.seed_all(cfg["seed"])
    module = build_model(cfg, vocab_size=vocab, seq_len=seq, device="meta" if dry_run else None)
    from grape_stream.integrations.composer.algorithm import ComposerGPT, GrapeTrajectoryCallback, TaskEvalSummary

    model = ComposerGPT(module)
    domains, tasks = _streams(cfg)
    algorithm = build_algorithm(cfg, tasks)
    o = cfg["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(o["lr"]), betas=tuple(o["betas"]), eps=float(o["eps"]),
                                  weight_decay=float(o["weight_decay"]))
    scheduler = build_scheduler(cfg)
    built = Built(cfg=cfg, model=model, algorithm=algorithm, tasks=tasks, domains=domains, optimizer=optimizer,
                  scheduler=scheduler, per_rank_batch_size=per_rank)
    if dry_run:
        return built

    device = _device_name(cfg)
    if world > 1:
        from composer.utils import dist

        dist.initialize_dist(device)
    mixer = build_mixer(cfg, domains, per_rank, cfg["seed"])
    train_dl = _train_dataloader(cfg, mixer, per_rank)
    from composer.core import Evaluator

    evaluators = []
    if tasks and cfg["data"]["task_test_split"]:
        for t in tasks:
            evaluators.append(Evaluator(
                label=t.name,
                dataloader=t.eval_dataloader(cfg["data"]["eval_batch_size"], num_workers=cfg["data"]["eval_num_workers"]),
                metric_names=["LanguageCrossEntropy", "LanguagePerplexity"],
            ))
    callbacks: list[Any] = []
    if cfg["algorithm"]["trajectory"]:
        callbacks.append(GrapeTrajectoryCallback(folder=output_dir, plots=cfg["algorithm"]["plots"]))
    if evaluators:
        callbacks.append(TaskEvalSummary([t.name for t in tasks]))
    callbacks.extend(extra_callbacks)
    loggers = _loggers(cfg, output_dir) + list(extra_loggers)
    algorithms: list[Any] = [algorithm]
    if cfg["trainer"]["grad_clip_norm"] is not None:
        from composer.algorithms import GradientClipping

        algorithms.append(GradientClipping(clipping_type="norm", clipping_threshold=float(cfg["trainer"]["grad_clip_norm"])))
    t = cfg["trainer"]
    precision = t["precision"] or ("amp_bf16" if device == "gpu" else "fp32")
    from composer import Trainer

    trainer = Trainer(
        run_name=cfg["run_name"],
        model=model,
        train_dataloader=train_dl,
        eval_dataloader=evaluators or None,
        eval_interval=t["eval_interval"],
        eval_subset_num_batches=t["eval_subset_num_batches"],
        max_duration=t["max_duration"],
        optimizers=optimizer,
        schedulers=scheduler,
        algorithms=algorithms,
        callbacks=callbacks,
        loggers=loggers,
        device=device,
        precision=precision,
        device_train_microbatch_size=t["device_train_microbatch_size"] or per_rank,
        seed=cfg["seed"],
        save_folder=t["save_folder"],
        save_interval=t["save_interval"],
        save_num_checkpoints_to_keep=t["save_num_checkpoints_to_keep"],
        save_overwrite=t["save_overwrite"],
        autoresume=t["autoresume"],
        load_path=t["load_path"],
        console_log_interval=t["log_interval"],
        log_to_console=t["log_to_console"],
        progress_bar=t["progress_bar"],
        python_log_level=None,
    )
    built.mixer, built.train_dataloader, built.evaluators = mixer, train_dl, evaluators
    built.callbacks, built.loggers, built.trainer = callbacks, loggers, trainer
    return built


def _train_dataloader(cfg: Mapping[str, Any], mixer: Any, per_rank: int) -> Any:
    from torch.utils.data import DataLoader

    make = getattr(mixer, "dataloader", None)
    workers = int(cfg["data"]["num_workers"])
    if callable(make):
        return make(num_workers=workers)
    kwargs: dict[str, Any] = {"batch_size": per_rank, "num_workers": workers}
    collate = getattr(mixer, "collate_fn", None)
    if collate is not None:
        kwargs["collate_fn"] = collate
    return DataLoader(mixer, **kwargs)


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grape-stream train",
        description="Train from a YAML recipe (Composer). Overrides: dotted key=value, e.g. algorithm.method=uniform.",
    )
    parser.add_argument("recipe", help="a recipe YAML path, or the name of a bundled recipe (e.g. demo-cpu)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (values are YAML)")
    parser.add_argument("--dry-run", action="store_true", help="validate and build (model on meta device), do not train")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe as YAML")
    # intermixed: `grape-stream train RECIPE --dry-run key=value` works as well as options first
    args = parser.parse_intermixed_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_recipe(args.recipe, args.overrides)
    except (KeyError, ValueError, TypeError, FileNotFoundError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"grape-stream train: {msg}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(cfg, sort_keys=False))
    try:
        built = build(cfg, dry_run=args.dry_run)
    except (KeyError, ValueError, TypeError, FileNotFoundError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"grape-stream train: {msg}", file=sys.stderr)
        return 2
    summary = built.describe()
    print(json.dumps(summary, indent=2))
    if args.dry_run:
        return 0
    try:
        built.trainer.fit()
    finally:
        built.close()
    return 0
