"""The default remote cache (and the registration lock) live in this user's own temp folder (issue 29
items 3, 7): another user's folder, one that others may write, or a symlink in its place is refused in one
line."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from grape_stream.errors import ConfigError
from grape_stream.streaming_compat.local_index import UnsafeCacheError, default_local_for


@pytest.fixture
def tmpdir_root(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"grape_stream-{os.getuid()}"


def test_the_default_cache_is_private_and_per_remote(tmpdir_root):
    a = default_local_for("s3://b/web", "train")
    assert os.path.dirname(a) == str(tmpdir_root / "cache")
    assert stat.S_IMODE(os.stat(tmpdir_root).st_mode) == 0o700
    assert a == default_local_for("s3://b/web", "train") != default_local_for("s3://b/code", "train")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_folder_of_another_user_is_refused(tmpdir_root):
    tmpdir_root.mkdir(mode=0o700)
    os.chown(tmpdir_root, 12345, 12345)
    with pytest.raises(UnsafeCacheError, match=r"owned by uid 12345, not by you.*pass local=") as info:
        default_local_for("s3://b/web")
    assert "\n" not in str(info.value) and isinstance(info.value, ConfigError)


def test_a_folder_others_may_write_or_a_symlink_is_refused(tmpdir_root, tmp_path):
    tmpdir_root.mkdir()
    tmpdir_root.chmod(0o777)
    with pytest.raises(UnsafeCacheError, match=r"writable by other users \(mode 777\)"):
        default_local_for("s3://b/web")
    tmpdir_root.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    tmpdir_root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeCacheError, match="not a directory"):
        default_local_for("s3://b/web")
