"""The same conversion on Apache Spark, for corpora that outgrow one machine (optional: needs pyspark).

    from pyspark.sql import SparkSession
    from grape_stream.convert.spark import convert_dataframe

    spark = SparkSession.builder.getOrCreate()
    df = spark.read.json("s3a://raw/slimpajama/train/*/*.jsonl.zst")   # or spark.read.parquet(...)
    df = df.withColumn("domain", df.meta.redpajama_set_name)
    convert_dataframe(df, "s3://bucket/slimpajama-mds", tokenizer="gpt2", seq_len=1024, domain_column="domain")

Each (domain, split) is written with streaming's `dataframe_to_mds` (one MDS partition per Spark task,
merged with `merge_index`), so the output layout, sample schema and manifest are those of
`grape_stream.convert.pipeline`: `OUT/<domain>[/<split>]/index.json`, `tokens` packed to seq_len with EOS
between documents. Differences from the single-machine converter, by design of Spark:
- packing restarts at every Arrow batch of a task (`spark.sql.execution.arrow.maxRecordsPerBatch`,
  10,000 rows by default): the remainder of each batch is dropped (or padded with remainder="pad");
- partition directory names are Spark task-attempt ids, so two runs are equal in content per domain
  but not byte-identical, and a failed job is re-run as a whole (Spark retries failed tasks itself);
- bad-input accounting is left to Spark's readers (e.g. `mode=PERMISSIVE` + `_corrupt_record`):
  rows whose text is null or empty are skipped and counted in the manifest as `skipped_rows`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import numpy as np

from grape_stream.atomic import atomic_write_json
from grape_stream.config import ConvertConfig, field_default
from grape_stream.convert.inputs import check_domain_name
from grape_stream.convert.layout import CONVERTER_VERSION, MANIFEST_FORMAT
from grape_stream.convert.packing import SequencePacker
from grape_stream.convert.remote import is_remote, upload
from grape_stream.convert.tokenization import load_tokenizer, token_dtype

__all__ = ["convert_dataframe"]


def _pack_batch(pdf: Any, *, text_column: str, tokenizer: str, eos_id: int | None, seq_len: int, eos: str,
                remainder: str, dtype: str) -> Iterator[dict[str, np.ndarray]]:
    """Runs on the executors: tokenize one Arrow batch (a pandas DataFrame) and yield packed rows."""
    tok = load_tokenizer(tokenizer, eos_id)
    texts = [t for t in pdf[text_column].tolist() if isinstance(t, str) and t.strip()]
    packer = SequencePacker(seq_len, tok.eos_id, np.dtype(dtype), eos=eos, remainder=remainder)
    rows, mask = packer.add(tok.encode_batch(texts)) if texts else (np.zeros((0, seq_len), dtype), None)
    last, lmask = packer.finish()
    for block, m in ((rows, mask), (last, lmask)):
        for i in range(block.shape[0]):
            yield {"tokens": block[i], **({"loss_mask": m[i]} if m is not None else {})}


def convert_dataframe(
    df: Any,
    out: str,
    *,
    tokenizer: str = field_default(ConvertConfig, "tokenizer"),
    eos_id: int | None = None,
    seq_len: int = field_default(ConvertConfig, "seq_len"),
    text_column: str = "text",
    domain_column: str | None = None,
    domain: str | None = None,
    split_column: str | None = None,
    eos: str = field_default(ConvertConfig, "eos"),
    remainder: str = field_default(ConvertConfig, "remainder"),
    compression: str | None = field_default(ConvertConfig, "compression"),
    shard_size: int | str = field_default(ConvertConfig, "shard_size"),
    local: str | None = None,
) -> dict[str, Any]:
    """Write one MDS dataset per (domain, split) of a Spark DataFrame; returns (and writes) the manifest.
    The shared settings default to ``grape_stream.config.ConvertConfig``'s (``convert``'s).

    out: a local/shared directory, or a remote URL (s3://...) with `local` as the staging directory.
    """
    from pyspark.sql import functions as F

    if (domain is None) == (domain_column is None):
        raise ValueError("give exactly one of domain (fixed) or domain_column (per row)")
    tok = load_tokenizer(tokenizer, eos_id)
    dtype = token_dtype(tok.vocab_size)
    columns = {"tokens": f"ndarray:{dtype.name}"}
    if remainder == "pad":
        columns["loss_mask"] = "ndarray:uint8"

    keys = [F.lit(domain).alias("_domain") if domain else F.col(str(domain_column)).cast("string").alias("_domain")]
    keys.append(F.col(split_column).cast("string").alias("_split") if split_column
                else F.lit(None).cast("string").alias("_split"))
    data = df.select(*keys, F.col(text_column).alias(text_column))
    pairs = sorted((r["_domain"], r["_split"]) for r in data.select("_domain", "_split").distinct().collect())
    for dom, sp in pairs:
        for name in (dom, sp):
            if name is not None and check_domain_name(name):
                raise ValueError(f"cannot use {name!r} as a directory name: {check_domain_name(name)}")

    remote = out.rstrip("/") if is_remote(out) else None
    local_root = os.path.abspath(local or (out if not remote else os.path.join(os.getcwd(), ".grape_spark_staging")))
    mds_kwargs = {"columns": columns, "compression": compression, "size_limit": shard_size}
    udf_kwargs = {"text_column": text_column, "tokenizer": tokenizer, "eos_id": eos_id, "seq_len": seq_len,
                  "eos": eos, "remainder": remainder, "dtype": dtype.name}
    domains: dict[str, Any] = {}
    for dom, sp in pairs:
        if dom is None:
            continue
        entry = _write_one(data, dom, sp, local_root, remote, text_column, mds_kwargs, udf_kwargs)
        if remainder == "drop":
            entry["tokens"] = entry["samples"] * seq_len
        if sp is None:
            domains[dom] = entry
        else:
            agg = domains.setdefault(dom, {"path": dom, "documents": 0, "samples": 0, "splits": {}})
            agg["splits"][sp] = entry
            agg["documents"] += entry["documents"]
            agg["samples"] += entry["samples"]
    manifest = {
        "format": MANIFEST_FORMAT, "converter": "spark", "converter_version": CONVERTER_VERSION,
        "kind": "domain", "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
        "seq_len": seq_len, "dtype": dtype.name, "columns": columns, "eos": eos, "remainder": remainder,
        "compression": compression, "domains": domains,
    }
    atomic_write_json(os.path.join(local_root, "manifest.json"), manifest)
    if remote:
        upload(local_root, remote, ["manifest.json"])
    return manifest


def _write_one(data: Any, dom: str, sp: str | None, local_root: str, remote: str | None, text_column: str,
               mds_kwargs: dict[str, Any], udf_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Write one (domain, split) with streaming's dataframe_to_mds; its manifest entry (without tokens)."""
    from pyspark.sql import functions as F
    from streaming.base.converters import dataframe_to_mds

    rel = f"{dom}/{sp}" if sp else dom
    cond = F.col("_domain") == dom
    cond = cond & (F.col("_split") == sp) if sp is not None else cond & F.col("_split").isNull()
    sub = data.filter(cond).select(text_column)
    target: Any = os.path.join(local_root, rel)
    if remote:
        target = (target, f"{remote}/{rel}")
    dataframe_to_mds(sub, merge_index=True, mds_kwargs={"out": target, **mds_kwargs},
                     udf_iterable=_pack_batch, udf_kwargs=udf_kwargs)
    with open(os.path.join(local_root, rel, "index.json")) as f:
        samples = sum(s["samples"] for s in json.load(f)["shards"])
    n_docs = sub.filter(F.col(text_column).isNotNull() & (F.trim(F.col(text_column)) != "")).count()
    return {"path": rel, "documents": n_docs, "samples": samples, "skipped_rows": sub.count() - n_docs}
