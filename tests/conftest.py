"""Shared fixtures: a real S3-compatible HTTP server (moto_server) on 127.0.0.1.

The code under test reaches it only through boto3 / streaming with an endpoint URL, exactly as it would
reach MinIO, R2 or AWS S3.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import pytest

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_server_cmd(port: int) -> list[str]:
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe:
        return [exe, "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Start moto_server for the session; yield its endpoint URL with S3_ENDPOINT_URL / AWS_* set."""
    port = _free_port()
    proc = subprocess.Popen(_moto_server_cmd(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=1)
            break
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError("moto_server exited during start-up")
            if time.time() > deadline:
                proc.kill()
                raise RuntimeError("moto_server did not start within 60 s")
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in (*_S3_ENV, "S3_ENDPOINT_URL")}
    os.environ.update(_S3_ENV)
    os.environ["S3_ENDPOINT_URL"] = endpoint
    try:
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh, empty bucket on the session's S3 server."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name
