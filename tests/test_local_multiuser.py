"""Files in shared folders are opened exclusively and never through a planted symlink, and an owner record
that cannot be written does not stop the mixer (issue 29 item 7)."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest

from grape_stream.atomic import atomic_open, atomic_write_json, atomic_write_text
from grape_stream.streaming_compat.shm import _owner_path, record_owner


def test_a_symlink_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "record.json"
    os.symlink(victim, f"{target}.tmp.{os.getpid()}")  # the predictable name, planted before the write
    atomic_write_json(target, {"a": 1})
    assert victim.read_text() == "keep me"
    assert json.loads(target.read_text()) == {"a": 1} and not target.is_symlink()
    assert not os.path.lexists(f"{target}.tmp.{os.getpid()}")
    atomic_write_text(target, "again")  # and a normal rewrite still works
    assert target.read_text() == "again"
    with pytest.raises(ValueError, match="mode must be"):
        with atomic_open(target, "a"):
            pass


def test_an_owner_record_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path, caplog):
    created = SimpleNamespace(created_shms=[object()])
    dataset = SimpleNamespace(_shm_prefix_int=7, _locals_shm=created)  # streaming's two attributes it reads
    os.mkdir(_owner_path(7, str(tmp_path)))  # the record's name taken by something it cannot replace
    with caplog.at_level(logging.WARNING, logger="grape_stream.streaming_compat.shm"):
        record_owner(dataset, shm_dir=str(tmp_path))
    assert "cannot record the owner of shared-memory prefix 000007" in caplog.text
    os.rmdir(_owner_path(7, str(tmp_path)))
    record_owner(dataset, shm_dir=str(tmp_path))
    assert json.loads(open(_owner_path(7, str(tmp_path))).read())["pid"] == os.getpid()
    assert _owner_path(7, str(tmp_path)).endswith(f"grape_stream_owner.000007.{os.geteuid()}")
