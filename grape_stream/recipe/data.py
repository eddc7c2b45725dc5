"""The recipe's data: the converter's manifest, the model sizes it implies, the domain and task streams,
the mixer and its training DataLoader. Nothing here knows which trainer consumes them.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any, Mapping

from streaming.base.storage.download import CloudDownloader
from torch.utils.data import DataLoader

from grape_stream.grape.tasks import TaskStream
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

__all__ = ["build_mixer", "join_location", "read_manifest", "recipe_streams", "resolved_sizes", "train_dataloader"]

log = logging.getLogger(__name__)


def join_location(base: str | None, *parts: str | None) -> str | None:
    """``base/part/...`` for a directory or a URL (``s3://``, ...); None when there is no base."""
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
    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(tmp, "manifest.json")
        try:
            CloudDownloader.direct_download(join_location(data["remote"], "manifest.json"), dest, 60)
        except Exception as exc:  # no manifest is allowed when sizes are given explicitly
            log.info("no manifest at %s: %s", data["remote"], exc)
            return None
        with open(dest, encoding="utf-8") as f:
            return json.load(f)


def resolved_sizes(cfg: Mapping[str, Any], manifest: Mapping[str, Any] | None) -> tuple[int, int]:
    """(vocab_size, seq_len) of the model: the recipe's, else the manifest's; a model smaller than the
    data it reads is an error (token ids would fall outside the embedding)."""
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


def recipe_streams(cfg: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[TaskStream]]:
    """(domains as {name, remote, local, split}, tasks as TaskStream): each entry's own locations, else
    the section's bases joined with its name."""
    data = cfg["data"]
    domains = []
    for e in data["domains"]:
        e = {"name": e} if isinstance(e, str) else dict(e)
        name = str(e["name"])
        remote = e.get("remote", join_location(data["remote"], name))
        local = e.get("local", join_location(data["local"], name))
        domains.append({"name": name, "remote": remote, "local": local, "split": e.get("split", data["split"])})
    t_remote = data["task_remote"] if data["task_remote"] is not None else data["remote"]
    t_local = data["task_local"] if data["task_local"] is not None else data["local"]
    tasks = []
    for e in data["tasks"]:
        e = {"name": e} if isinstance(e, str) else dict(e)
        name = str(e["name"])
        tasks.append(TaskStream(
            name=name,
            remote=e.get("remote", join_location(t_remote, name)),
            local=e.get("local", join_location(t_local, name)),
            split=e.get("split", data["task_probe_split"]),
            test_split=e.get("test_split", data["task_test_split"]),
        ))
    return domains, tasks


def build_mixer(cfg: Mapping[str, Any], domains: list[dict[str, Any]], batch_size: int,
                seed: int) -> WeightedStreamingMixer:
    """The mixer over the recipe's domains (``data.mixer`` passed through as keyword arguments)."""
    streams = []
    for d in domains:
        if d["local"] is None and d["remote"] is None:
            raise ValueError(f"domain {d['name']!r}: set data.local or data.remote (or the domain's own local/remote)")
        streams.append(DomainStream(d["name"], remote=d["remote"], local=d["local"], split=d["split"]))
    return WeightedStreamingMixer(domains=streams, batch_size=batch_size, seed=seed, **cfg["data"]["mixer"])


def train_dataloader(cfg: Mapping[str, Any], mixer: Any, per_rank: int) -> Any:
    """The mixer's own loader (``mixer.dataloader``) when it has one, else a DataLoader over it."""
    make = getattr(mixer, "dataloader", None)
    workers = int(cfg["data"]["num_workers"])
    if callable(make):
        return make(num_workers=workers)
    kwargs: dict[str, Any] = {"batch_size": per_rank, "num_workers": workers}
    collate = getattr(mixer, "collate_fn", None)
    if collate is not None:
        kwargs["collate_fn"] = collate
    return DataLoader(mixer, **kwargs)
