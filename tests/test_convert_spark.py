"""Spark path (grape_stream.convert.spark): a real local Spark session writes the same layout.

pyspark is pinned in requirements/dev.txt (Java 17+ must be on the machine), so this runs in CI.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from convert_data import make_docs, read_mds  # noqa: E402


@pytest.fixture(scope="module")
def spark():
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    s = (SparkSession.builder.master("local[2]").appName("grape-stream-test")
         .config("spark.ui.enabled", "false").config("spark.driver.memory", "1g").getOrCreate())
    yield s
    s.stop()


def test_spark_writes_per_domain_mds_that_decodes_to_the_documents(spark, tmp_path):
    from grape_stream.convert.spark import convert_dataframe
    from grape_stream.convert.tokenization import load_tokenizer

    docs = make_docs(200, 12)
    rows = [(t, "fr" if i % 2 else "de") for i, t in enumerate(docs)] + [(None, "fr"), ("  ", "de")]
    df = spark.createDataFrame(rows, ["text", "lang"]).repartition(2)
    manifest = convert_dataframe(df, str(tmp_path / "out"), tokenizer="bytes", seq_len=64, domain_column="lang")
    assert sorted(manifest["domains"]) == ["de", "fr"]
    assert manifest["domains"]["fr"]["skipped_rows"] == 1 and manifest["domains"]["fr"]["documents"] == 100
    tok = load_tokenizer("bytes")
    for lang, parity in (("de", 0), ("fr", 1)):
        samples = read_mds(tmp_path / "out" / lang)
        assert len(samples) == manifest["domains"][lang]["samples"] > 0
        stream = np.concatenate([s["tokens"] for s in samples])
        cuts = np.flatnonzero(stream == 256)
        decoded = [tok.decode(stream[a + 1:b]) for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]
        source = [t for i, t in enumerate(docs) if i % 2 == parity]
        # Packing restarts per Spark task/batch and drops its remainder, so the piece that spans a
        # boundary between two tasks' rows is not a source document; every other piece is.
        strays = [d for d in decoded if d not in source]
        assert len(strays) <= 2 and len(decoded) - len(strays) > 0.8 * len(source)
