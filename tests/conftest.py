"""Shared fixtures (a real S3-compatible HTTP server, moto_server, on 127.0.0.1) and the test split.

The code under test reaches the S3 server only through boto3 / streaming with an endpoint URL, exactly
as it would reach MinIO, R2 or AWS S3.

Tests are split in two by marker, so a developer can run the fast half while editing
(`make test-fast`, i.e. `pytest -m "not integration"`): a test is `integration` when it starts processes
or servers or trains (S3 server, torch.distributed, SIGKILL, Spark, Composer Trainer runs), decided here
from its fixtures and module rather than by hand in each file. `make test` runs both.
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
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    from grape_stream.testing import FaultProxy

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


#: Test modules whose tests start processes, servers, Spark or training runs.
INTEGRATION_MODULES = frozenset({
    "test_alignment_distributed",
    "test_composer",
    "test_composer_foundry",
    "test_composer_multiprocess",
    "test_convert_resume",
    "test_convert_s3",
    "test_convert_spark",
    "test_demo",
    "test_demo_corpus",
    "test_fsdp_loss_methods",
    "test_hf_docs",
    "test_hf_trainer",
    "test_index_docs",
    "test_lightning",
    "test_lightning_docs",
    "test_mixer_dist",
    "test_mixer_elastic_dist",
    "test_mixer_s3",
    "test_mixer_shm",
    "test_mixer_workers",
    "test_plain_loop",
    "test_recipe_cli",
    "test_run_ux",
    "test_packaging",
    "test_s3_fixture",
})
_INTEGRATION_FIXTURES = frozenset({"s3_server", "s3_bucket", "fault_proxy"})
#: Single tests in otherwise fast modules that train, kill or start processes.
INTEGRATION_TESTS = frozenset({
    "test_sigkill_during_a_save_then_autoresume_continues_the_same_trajectory",
    "test_subprocess_stderr_is_exactly_one_line",
    "test_same_output_for_one_and_two_workers",
    "test_fsdp_is_refused_with_a_clear_message",
    "test_lightning_fsdp2_doremi_resumes_after_sigkill_onto_the_same_trajectory",
    "test_a_sigkilled_dataloader_run_leaves_a_folder_that_is_then_swept",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        name = getattr(item, "originalname", item.name)
        if (module in INTEGRATION_MODULES or name in INTEGRATION_TESTS
                or _INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.integration)
        else:
            item.add_marker(pytest.mark.unit)


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
        except Exception as exc:
            if proc.poll() is not None:
                raise RuntimeError("moto_server exited during start-up") from exc
            if time.time() > deadline:
                proc.kill()
                raise RuntimeError("moto_server did not start within 60 s") from exc
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


@pytest.fixture
def fault_proxy(s3_server: str) -> Iterator["FaultProxy"]:
    """A fault-injecting proxy in front of the session's S3 server; S3_ENDPOINT_URL points at it meanwhile.

    Faults are off at the start: a test uploads its data first, then turns them on.
    """
    from grape_stream.testing import FaultProxy

    proxy = FaultProxy(s3_server, seed=0).start()
    os.environ["S3_ENDPOINT_URL"] = proxy.url
    try:
        yield proxy
    finally:
        os.environ["S3_ENDPOINT_URL"] = s3_server
        proxy.stop()
