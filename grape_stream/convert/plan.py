"""What a conversion will do, decided before any work: checked options, plan.json, the units, OUT's state.

The plan is every setting that changes the output. It is stored in OUT/.grape_convert/plan.json by the
first run; a re-run with the same plan resumes (skipping units with a done-marker), one with a
different plan is refused unless --overwrite, so a resumed output never mixes two settings.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping, Sequence

from grape_stream.atomic import atomic_write_json
from grape_stream.config import ConvertConfig, field_names
from grape_stream.convert.errors import ConvertStateError
from grape_stream.convert.inputs import check_domain_name
from grape_stream.convert.layout import CONVERTER_VERSION, STATE_DIR
from grape_stream.convert.packing import EOS_MODES, REMAINDER_MODES
from grape_stream.convert.tokenization import GPT2_EOS_ID, GPT2_VOCAB_SIZE, load_tokenizer, token_dtype
from grape_stream.errors import UnknownOptionError, did_you_mean, redact_url

__all__ = [
    "convert_config",
    "parse_split",
    "check_run_options",
    "check_shard_options",
    "size_bytes",
    "tokenizer_facts",
    "build_plan",
    "prepare_out",
    "split_units",
    "load_markers",
    "Units",
]

Units = list[tuple[str, list[tuple[str, str]]]]  # (unit id, [(absolute path, path relative to the input root)])


def convert_config(source: str | ConvertConfig, inputs: str | Sequence[str] | None, out: str | None,
                   options: Mapping[str, Any]) -> ConvertConfig:
    """The ConvertConfig of a ``convert(...)`` call: the given config (or the fields as arguments) with the
    keyword ``options`` applied, a reader's option (``domain_field``) into ``config.reader``; a name that is
    neither is one UnknownOptionError naming it and the closest."""
    from grape_stream.convert.readers import reader_options

    if isinstance(source, ConvertConfig):
        fields: dict[str, Any] = {f: getattr(source, f) for f in field_names(ConvertConfig)}
        fields.update({k: v for k, v in (("inputs", inputs), ("out", out)) if v is not None})
    else:
        fields = {"source": source, "inputs": inputs, "out": out}
    known = reader_options()
    reader = dict(fields.get("reader") or {})
    for name, value in options.items():
        if name in known:
            reader[name] = value
        elif name in field_names(ConvertConfig) and name != "reader":
            fields[name] = value
        else:
            raise UnknownOptionError(f"convert() got an unexpected keyword argument {name!r}"
                                     f"{did_you_mean(name, [*field_names(ConvertConfig), *known])}")
    if fields["inputs"] is None or fields["out"] is None:
        raise TypeError("convert() needs a source, inputs and out (or a ConvertConfig)")
    fields["inputs"] = [fields["inputs"]] if isinstance(fields["inputs"], str) else list(fields["inputs"])
    fields["reader"] = reader
    return ConvertConfig(**fields)


def parse_split(spec: str | dict[str, float] | None, holdout: float | None = None) -> dict[str, float] | None:
    """`"train=0.8,probe=0.1,test=0.1"` -> ordered fractions summing to 1; `holdout=f` -> train/val."""
    if holdout is not None:
        if spec is not None:
            raise ValueError("--holdout and --split are exclusive (--holdout F is --split train=1-F,val=F)")
        if not 0.0 < holdout < 1.0:
            raise ValueError(f"--holdout must be a fraction in (0, 1), got {holdout}")
        return {"train": 1.0 - holdout, "val": holdout}
    if spec is None:
        return None
    if isinstance(spec, str):
        out: dict[str, float] = {}
        for part in spec.split(","):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"--split expects name=fraction[,name=fraction...], got {spec!r}")
            try:
                out[key] = float(value)
            except ValueError:
                raise ValueError(f"--split: {value!r} is not a number (in {spec!r})") from None
    else:
        out = {str(k): float(v) for k, v in spec.items()}
    for name, frac in out.items():
        why = check_domain_name(name)
        if why:
            raise ValueError(f"--split name: {why.replace('domain', 'split')}")
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"--split fraction for {name!r} must be in (0, 1], got {frac}")
    if abs(sum(out.values()) - 1.0) > 1e-6:
        raise ValueError(f"--split fractions must sum to 1, got {sum(out.values())} in {out}")
    return out


def check_run_options(config: ConvertConfig) -> None:
    """The checks that need nothing but the settings (run first: they fail fastest)."""
    c = config
    if c.workers < 1:
        raise ValueError(f"workers must be >= 1, got {c.workers}")
    if c.files_per_unit < 1:
        raise ValueError(f"files_per_unit must be >= 1, got {c.files_per_unit}")
    if c.eos not in EOS_MODES:
        raise ValueError(f"eos must be one of {EOS_MODES}, got {c.eos!r}")
    if c.remainder not in REMAINDER_MODES:
        raise ValueError(f"remainder must be one of {REMAINDER_MODES}, got {c.remainder!r}")
    if c.seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {c.seq_len}")
    domain = c.reader.get("domain")
    if domain is not None and check_domain_name(domain):
        raise ValueError(f"--domain: {check_domain_name(domain)}")


def check_shard_options(compression: str | None, hashes: Sequence[str]) -> None:
    """Compression and hash names as streaming's MDSWriter knows them."""
    from streaming.base.compression import is_compression  # imports torch
    from streaming.base.hashing import is_hash

    if compression and not is_compression(compression):
        raise ValueError(f"unknown compression {compression!r} (e.g. zstd, zstd:7, gz, br, snappy, or none)")
    for h in hashes:
        if not is_hash(h):
            raise ValueError(f"unknown hash {h!r} (e.g. sha1, md5, xxh64)")


def size_bytes(size: int | str) -> int:
    """`"64mb"` -> bytes, as streaming reads a shard size limit."""
    from streaming.base.util import bytes_to_int

    return int(bytes_to_int(size))


def tokenizer_facts(reader: Any, source: str, tokenizer: str, eos_id: int | None) -> tuple[str, int, int]:
    """(name, vocab size, EOS id) of the tokenizer; pre-tokenized sources must say GPT-2."""
    if reader.pretokenized:
        if tokenizer != "gpt2":
            raise ValueError(f"{source} is already tokenized with GPT-2; --tokenizer must be gpt2, got {tokenizer!r}")
        eos_final = GPT2_EOS_ID if eos_id is None else int(eos_id)
        if eos_final != GPT2_EOS_ID:
            raise ValueError(f"{source} uses GPT-2 ids; its EOS id is {GPT2_EOS_ID}")
        return "gpt2", GPT2_VOCAB_SIZE, eos_final
    tok = load_tokenizer(tokenizer, eos_id)
    return tok.name, tok.vocab_size, tok.eos_id


def build_plan(config: ConvertConfig, *, reader: Any, tok: tuple[str, int, int], per_example: bool,
               split_fracs: dict[str, float] | None, split_by: str | None, root: str, files: list[str],
               rels: list[str], remote: str | None) -> dict[str, Any]:
    """plan.json: every setting of ``config`` that changes the output, with what was derived from it (the
    reader, the tokenizer's facts, the splits) and the inputs with their sizes."""
    c = config
    tok_name, vocab_size, eos_final = tok
    dtype = token_dtype(vocab_size)
    columns = {"tokens": f"ndarray:{dtype.name}"}
    if per_example or c.remainder == "pad":
        columns["loss_mask"] = "ndarray:uint8"
    return {
        "converter_version": CONVERTER_VERSION,
        "source": c.source,
        "reader": reader.describe(),
        "tokenizer": tok_name,
        "vocab_size": int(vocab_size),
        "eos_id": int(eos_final),
        "dtype": dtype.name,
        "columns": columns,
        "seq_len": int(c.seq_len),
        "eos": c.eos,
        "remainder": c.remainder,
        "per_example": bool(per_example),
        "split": split_fracs,
        "split_seed": int(c.split_seed),
        "split_by": split_by,
        "compression": c.compression or None,
        "shard_size": size_bytes(c.shard_size),
        "hashes": sorted(c.hashes),
        "files_per_unit": int(c.files_per_unit),
        "input_root": root,
        "inputs": [[rel, os.path.getsize(f)] for f, rel in zip(files, rels)],
        "remote": redact_url(remote) if remote else remote,  # plan.json: no password from the URL
    }


def prepare_out(local_root: str, state: str, plan: dict[str, Any], overwrite: bool) -> None:
    """Claim `local_root` for this plan: empty or new, the same plan (resume), or cleared under overwrite."""
    plan_path = os.path.join(state, "plan.json")
    if os.path.isdir(local_root) and os.listdir(local_root):
        if not os.path.exists(plan_path):
            raise ConvertStateError(
                f"{local_root} is not empty and holds no grape-stream conversion ({STATE_DIR}/plan.json); "
                "choose an empty or new directory"
            )
        with open(plan_path) as f:
            old = json.load(f)
        new = json.loads(json.dumps(plan))
        if old != new and not overwrite:
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise ConvertStateError(
                f"{local_root} holds a conversion with different settings ({', '.join(diff)}); "
                "pass overwrite=True / --overwrite to start over, or choose another output"
            )
        if overwrite:
            for name in os.listdir(local_root):
                p = os.path.join(local_root, name)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    os.makedirs(os.path.join(state, "units"), exist_ok=True)
    if not os.path.exists(plan_path):
        atomic_write_json(plan_path, plan)


def split_units(files: list[str], rels: list[str], per_unit: int) -> Units:
    """Consecutive runs of `per_unit` files (in sorted order), named part-00000, part-00001, ..."""
    pairs = list(zip(files, rels))
    return [(f"part-{i // per_unit:05d}", pairs[i:i + per_unit]) for i in range(0, len(pairs), per_unit)]


def load_markers(state: str, unit_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The done-markers of the units a previous run finished."""
    done = {}
    for u in unit_ids:
        p = os.path.join(state, "units", f"{u}.json")
        if os.path.exists(p):
            with open(p) as f:
                done[u] = json.load(f)
    return done
