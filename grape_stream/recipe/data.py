"""The recipe's data: the converter's manifest, the model sizes it implies, the domain and task streams,
the mixer and its training DataLoader. Nothing here knows which trainer consumes them.

Each function takes the typed recipe (:class:`~grape_stream.config.RecipeConfig`) or its plain form; the
mixer gets ``data.mixer`` (a :class:`~grape_stream.config.MixerConfig`) as it is.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any, Mapping

from torch.utils.data import DataLoader

from grape_stream.config import RecipeConfig
from grape_stream.errors import ConfigError, DataError, StorageError
from grape_stream.grape.tasks import TaskStream
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from grape_stream.recipe.schema import as_recipe
from grape_stream.retry import classify
from grape_stream.streaming_compat.local_index import fetch_remote_file

__all__ = ["build_mixer", "check_local_data", "join_location", "manifest_at", "manifest_vocab_size", "read_manifest",
           "recipe_streams",
           "resolved_sizes", "train_dataloader"]

log = logging.getLogger(__name__)

Recipe = RecipeConfig | Mapping[str, Any]


def join_location(base: str | None, *parts: str | None) -> str | None:
    """``base/part/...`` for a directory or a URL (``s3://``, ...); None when there is no base."""
    if base is None:
        return None
    out = base.rstrip("/")
    for p in parts:
        if p:
            out = f"{out}/{p}" if "://" in out else os.path.join(out, p)
    return out


def read_manifest(cfg: Recipe) -> dict[str, Any] | None:
    """The converter's manifest.json at data.local (or data.remote), or None when there is none. Only
    ``data.remote`` / ``data.local`` are read (a mapping holding just those will do)."""
    if isinstance(cfg, RecipeConfig):
        remote, local = cfg.data.remote, cfg.data.local
    else:
        remote, local = cfg["data"].get("remote"), cfg["data"].get("local")
    return manifest_at(remote, local)


def manifest_at(remote: str | None, local: str | None) -> dict[str, Any] | None:
    """The manifest.json of the conversion at ``remote`` (downloaded), else ``local``; None when there is none."""
    if remote is None:
        if local is None:
            return None
        path = os.path.join(local, "manifest.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    url = str(join_location(remote, "manifest.json"))
    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(tmp, "manifest.json")
        try:  # an outage is ridden out and refused credentials are one line, under the retry policy
            fetch_remote_file(url, dest, what=f"cannot read {url}")
        except StorageError:
            raise
        except Exception as exc:
            if classify(exc) != "missing":
                raise
            log.info("no manifest at %s: %s", remote, exc)  # allowed when sizes are given explicitly
            return None
        with open(dest, encoding="utf-8") as f:
            return json.load(f)


def manifest_vocab_size(manifest: Mapping[str, Any] | None) -> int | None:
    """The vocabulary the data was tokenized with: the converter writes it under ``tokenizer.vocab_size``
    (older or hand-written manifests: top-level ``vocab_size``)."""
    if not manifest:
        return None
    tok = manifest.get("tokenizer")
    value = tok.get("vocab_size") if isinstance(tok, Mapping) else None
    value = value if value is not None else manifest.get("vocab_size")
    return int(value) if value else None


def resolved_sizes(cfg: Recipe, manifest: Mapping[str, Any] | None) -> tuple[int, int]:
    """(vocab_size, seq_len) of the model: the recipe's, else the manifest's.

    Checked against the data's manifest before any model is built: a ``model.vocab_size`` *smaller* than
    the vocabulary the data was tokenized with is a :class:`ConfigError` naming both numbers (token ids
    would fall outside the embedding: an ``IndexError`` deep inside the first forward pass otherwise). A
    *larger* one is allowed: a padded vocabulary (e.g. 50304 for GPT-2's 50257, a multiple of 64 for
    faster matmuls) only leaves some embedding rows unused. Likewise a model ``seq_len`` shorter than the
    data's samples is an error, a longer one is allowed."""
    cfg = as_recipe(cfg)
    data_vocab = manifest_vocab_size(manifest)
    vocab = cfg.model.vocab_size or data_vocab
    seq = cfg.model.seq_len or cfg.data.seq_len or (manifest or {}).get("seq_len")
    if not vocab:
        raise ConfigError("recipe key 'model.vocab_size' is not set and no data manifest gives it; "
                          "set model.vocab_size")
    if not seq:
        raise ConfigError("recipe keys 'model.seq_len' / 'data.seq_len' are not set and no data manifest gives them; "
                          "set data.seq_len")
    where = _manifest_where(cfg)
    if data_vocab and data_vocab > int(vocab):
        raise ConfigError(
            f"recipe key 'model.vocab_size' is {vocab} but the data{where} was tokenized with vocab_size={data_vocab}: "
            f"token ids would fall outside the embedding; set model.vocab_size={data_vocab} (or larger, padded), "
            "or leave it unset to take the data's"
        )
    if manifest and manifest.get("seq_len") and int(manifest["seq_len"]) > int(seq):
        raise ConfigError(f"the data{where} has seq_len={manifest['seq_len']} but the model's seq_len "
                          f"(model.seq_len / data.seq_len) is {seq}; raise it to {manifest['seq_len']}")
    return int(vocab), int(seq)


def _manifest_where(cfg: RecipeConfig) -> str:
    base = cfg.data.remote or cfg.data.local
    return f" ({join_location(base, 'manifest.json')})" if base else ""


def _datasets_under(root: str, split: str | None) -> list[str]:
    """Names of the converted datasets directly under ``root`` (``<name>[/<split>]/index.json``)."""
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root)
                  if os.path.isfile(os.path.join(root, n, split or "", "index.json")))


def _check_local(kind: str, name: str, local: str, split: str | None, base: str | None, base_key: str,
                 split_key: str = "data.split") -> None:
    """`split_key` names where `split` came from (``data.split``, ``data.task_probe_split`` (or the entry's
    own ``split``), ``data.task_test_split`` (or its ``test_split``)), so the error blames the right key."""
    index = os.path.join(local, split or "", "index.json")
    if os.path.isfile(index):
        return
    if base is not None and not os.path.isdir(base) and os.path.abspath(local).startswith(os.path.abspath(base)):
        raise DataError(f"data directory {base} (recipe key {base_key!r}) does not exist; convert the data first "
                        f"(grape-stream convert SOURCE -i ... -o {base}) or fix {base_key}")
    if not os.path.isdir(local):
        there = _datasets_under(os.path.dirname(local.rstrip("/")) or ".", split)
        raise DataError(f"{kind} {name!r} (recipe key 'data.{kind}s') not found: no directory {local}; "
                        f"{kind}s there: {there or 'none'}")
    if split and os.path.isfile(os.path.join(local, "index.json")):
        raise DataError(f"{kind} {name!r}: no split {split!r} at {local} (the data has no splits); "
                        f"set {split_key}=null")
    subs = sorted(d for d in os.listdir(local) if os.path.isfile(os.path.join(local, d, "index.json")))
    has = f"; splits there: {subs}" if subs else ""
    raise DataError(f"{kind} {name!r}: no MDS index at {index}{has} (recipe key {split_key!r})")


def check_local_data(cfg: Recipe, domains: list[dict[str, Any]], tasks: list[TaskStream]) -> None:
    """Before any model is built: every local-only domain and task (no remote) has its MDS index; else one
    :class:`DataError` naming the path and listing what the directory does hold."""
    data = as_recipe(cfg).data

    def split_key(section: str, name: str, entry_key: str, default_key: str) -> str:
        """The entry's own key when the recipe's entry sets it, else the section-wide default's."""
        own = next((e for e in getattr(data, section) if isinstance(e, Mapping) and str(e["name"]) == name), {})
        return f"data.{section}[name={name}].{entry_key}" if entry_key in own else default_key

    for d in domains:
        if d["remote"] is None and d["local"] is not None:
            _check_local("domain", d["name"], d["local"], d["split"], data.local, "data.local",
                         split_key("domains", d["name"], "split", "data.split"))
    t_base = data.task_local if data.task_local is not None else data.local
    t_key = "data.task_local" if data.task_local is not None else "data.local"
    for t in tasks:
        if t.remote is None and t.local is not None:
            keys = {t.test_split: split_key("tasks", t.name, "test_split", "data.task_test_split"),
                    t.split: split_key("tasks", t.name, "split", "data.task_probe_split")}
            for split in dict.fromkeys(s for s in (t.split, t.test_split) if s is not None):
                _check_local("task", t.name, t.local, split, t_base, t_key, keys[split])


def recipe_streams(cfg: Recipe) -> tuple[list[dict[str, Any]], list[TaskStream]]:
    """(domains as {name, remote, local, split}, tasks as TaskStream): each entry's own locations, else
    the section's bases joined with its name."""
    data = as_recipe(cfg).data
    domains = []
    for e in data.domains:
        e = {"name": e} if isinstance(e, str) else dict(e)
        name = str(e["name"])
        remote = e.get("remote", join_location(data.remote, name))
        local = e.get("local", join_location(data.local, name))
        domains.append({"name": name, "remote": remote, "local": local, "split": e.get("split", data.split)})
    t_remote = data.task_remote if data.task_remote is not None else data.remote
    t_local = data.task_local if data.task_local is not None else data.local
    tasks = []
    for e in data.tasks:
        e = {"name": e} if isinstance(e, str) else dict(e)
        name = str(e["name"])
        if e.get("remote", t_remote) is None and e.get("local", t_local) is None:
            raise ConfigError(f"task {name!r}: set data.task_local / data.local or data.task_remote / data.remote "
                              "(or the task's own local/remote)")
        tasks.append(TaskStream(
            name=name,
            remote=e.get("remote", join_location(t_remote, name)),
            local=e.get("local", join_location(t_local, name)),
            split=e.get("split", data.task_probe_split),
            test_split=e.get("test_split", data.task_test_split),
        ))
    return domains, tasks


def build_mixer(cfg: Recipe, domains: list[dict[str, Any]], batch_size: int, seed: int) -> WeightedStreamingMixer:
    """The mixer over the recipe's domains, with ``data.mixer`` (a MixerConfig) as its settings."""
    streams = []
    for d in domains:
        if d["local"] is None and d["remote"] is None:
            raise ConfigError(f"domain {d['name']!r}: set data.local or data.remote (or the domain's own local/remote)")
        streams.append(DomainStream(d["name"], remote=d["remote"], local=d["local"], split=d["split"]))
    return WeightedStreamingMixer(streams, batch_size=batch_size, seed=seed, config=as_recipe(cfg).data.mixer)


def train_dataloader(cfg: Recipe, mixer: Any, per_rank: int) -> Any:
    """The mixer's own loader (``mixer.dataloader``) when it has one, else a DataLoader over it."""
    data = as_recipe(cfg).data
    make = getattr(mixer, "dataloader", None)
    if callable(make):
        return make(num_workers=data.num_workers, batches_per_message=data.batches_per_message)
    kwargs: dict[str, Any] = {"batch_size": per_rank, "num_workers": data.num_workers}
    collate = getattr(mixer, "collate_fn", None)
    if collate is not None:
        kwargs["collate_fn"] = collate
    return DataLoader(mixer, **kwargs)
