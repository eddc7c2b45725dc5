"""Layout guarantees of grape_stream.mixing / streaming_compat: no cycle through the loader, one guarded
place for streaming's internals, the package re-exports. (Import levels of the whole package: test_layout.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import streaming

import grape_stream
from grape_stream import mixing
from grape_stream.mixing.loader import BatchSource, MixerDataLoader
from grape_stream.streaming_compat import shard_state

PKG = Path(grape_stream.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_loader_does_not_import_the_mixer():
    assert not any(m.startswith("grape_stream.mixing.mixer") for m in _imported_modules(PKG / "mixing" / "loader.py"))


def test_only_shard_state_touches_streamings_shard_bookkeeping():
    for path in (PKG / "mixing").glob("*.py"):
        text = path.read_text()
        for private in ("_shard_states", "_shard_access_times", "_shm_prefix_int", "_ShardState"):
            assert private not in text, (path.name, private)


def test_unsupported_streaming_version_is_one_clear_error(monkeypatch):
    shard_state.require_supported_streaming.cache_clear()
    monkeypatch.setattr(streaming, "__version__", "0.99.0")
    try:
        with pytest.raises(shard_state.UnsupportedStreamingVersion, match="0.99.0"):
            shard_state.require_supported_streaming()
    finally:
        shard_state.require_supported_streaming.cache_clear()
    monkeypatch.undo()
    assert shard_state.require_supported_streaming() == 3  # _ShardState.LOCAL of 0.12 and 0.13


@pytest.mark.parametrize("version,ok", [("0.12.0", True), ("0.12.3", True), ("0.13.0", True), ("0.11.0", False),
                                        ("0.14.0", False), ("1.0.0", False)])
def test_streaming_versions_the_guard_names(monkeypatch, version, ok):
    """0.12.x (llm-foundry 0.22) and 0.13.x pass; any other release fails with one line naming the pin."""
    shard_state.require_supported_streaming.cache_clear()
    monkeypatch.setattr(streaming, "__version__", version)
    try:
        if ok:
            assert shard_state.require_supported_streaming() == 3
        else:
            with pytest.raises(shard_state.UnsupportedStreamingVersion) as err:
                shard_state.require_supported_streaming()
            assert "\n" not in str(err.value) and version in str(err.value)
            assert shard_state.REQUIREMENT in str(err.value) and "0.12.x, 0.13.x" in str(err.value)
    finally:
        shard_state.require_supported_streaming.cache_clear()


def test_loader_refuses_an_object_without_the_loader_protocol():
    with pytest.raises(TypeError, match="needs a WeightedStreamingMixer"):
        MixerDataLoader(object())
    assert not isinstance(object(), BatchSource)


def test_public_names_are_reexported():
    assert mixing.WeightedStreamingMixer is grape_stream.WeightedStreamingMixer
    assert mixing.DomainStream is grape_stream.DomainStream
    for name in mixing.__all__:
        assert getattr(mixing, name) is not None
