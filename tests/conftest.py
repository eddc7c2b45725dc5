"""Shared fixtures (a real S3-compatible HTTP server, moto_server, on 127.0.0.1) and the test split.

The code under test reaches the S3 server only through boto3 / streaming with an endpoint URL, exactly
as it would reach MinIO, R2 or AWS S3.

Tests are split in two by marker, so a developer can run the fast half while editing
(`make test-fast`, i.e. `pytest -m "not integration"`): a test is `integration` when it starts processes
or servers or trains (S3 server, torch.distributed, SIGKILL, Spark, Composer Trainer runs), decided here
from its fixtures and module rather than by hand in each file. `make test` runs both.

`make test` runs the suite on two parallel pytest-xdist workers (each test module whole on one worker, so its
module-scoped fixtures are built once; `make test XDIST=` runs it in one process). Every test must stay
correct beside any other test running at the same moment in another process (and beside other jobs on the
machine), so:

* Files: only under `tmp_path` / `tmp_path_factory` (one base folder per worker) or `tempfile.mkdtemp()`; never
  a fixed path, never inside the repository (a CLI run with `cwd=REPO` gets `--out` under `tmp_path`).
* Ports: the `free_port` fixture (`_parallel.free_port()` in helpers and spawned processes; no two workers are
  handed the same port); never a fixed port or `29500 + pid`. `mp.spawn` tests rendezvous through a file in
  `tmp_path` (`init_method=f"file://{tmp_path}/rendezvous"`), which needs no port at all.
* Shared memory: streaming picks each dataset's `/dev/shm` prefix (the first free number, under
  grape_stream's registration lock), so never assume a prefix; a test that checks what is left in `/dev/shm`
  or the temp folder looks only at its own prefixes (`mixer.shm_prefixes`) or inodes, never at the whole
  folder: other workers' segments come and go meanwhile.
* Environment: `monkeypatch.setenv` (or restore in `finally`): workers are separate processes, but the tests
  of one worker share one.
* S3: `s3_server` is one moto_server per worker; `s3_bucket` gives each test its own bucket.
* Threads: each worker, and what it spawns, runs torch with one thread (`OMP_NUM_THREADS=1`): the workers
  are the parallelism.
* Cost: a set-up several tests share is a module-scoped fixture; a module that takes minutes goes in
  `SLOW_MODULES` (they start first, so no long module is left for the end while the other worker idles). A
  training script run as a subprocess goes through `_warm.run` (a fork of a server that imported torch,
  streaming, Composer, Transformers and Lightning once per worker: the imports were most of such a run's CPU);
  `_warm.run(..., ranks=n)` starts n ranks as torchrun would. The DDP tests that check real torchrun, `composer -n`
  and the runs that must start cold stay plain subprocesses.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

import _parallel

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
    "test_composer_fsdp",
    "test_composer_multiprocess",
    "test_convert_resume",
    "test_convert_s3",
    "test_convert_spark",
    "test_demo",
    "test_demo_corpus",
    "test_fsdp_loss_methods",
    "test_registration_ranks",
    "test_fsdp_resume",
    "test_hf_docs",
    "test_hf_trainer",
    "test_index_docs",
    "test_instep_composer",
    "test_instep_distributed",
    "test_lightning",
    "test_lightning_docs",
    "test_loss_composer",
    "test_loss_distributed",
    "test_loss_trainers",
    "test_mixer_dist",
    "test_mixer_elastic_dist",
    "test_mixer_s3",
    "test_mixer_shm",
    "test_mixer_workers",
    "test_packaging",
    "test_plain_loop",
    "test_recipe_cli",
    "test_rnb_composer",
    "test_run_ux",
    "test_s3_fixture",
    "test_warm_launch",
})
_INTEGRATION_FIXTURES = frozenset({"s3_server", "s3_bucket", "fault_proxy"})
#: Single tests in otherwise fast modules that train, kill or start processes.
INTEGRATION_TESTS = frozenset({
    "test_sigkill_during_a_save_then_autoresume_continues_the_same_trajectory",
    "test_subprocess_stderr_is_exactly_one_line",
    "test_same_output_for_one_and_two_workers",
    "test_the_controller_probes_an_fsdp2_model_as_it_is",
    "test_lightning_fsdp2_doremi_resumes_after_sigkill_onto_the_same_trajectory",
    "test_a_sigkilled_dataloader_run_leaves_a_folder_that_is_then_swept",
    "test_cli_train_runs_a_recipe_end_to_end",
    "test_two_ranks_give_the_gram_of_all_samples",
    "test_sigkill_then_autoresume_with_every_option_continues_the_same_trajectory",
    # a CLI or interpreter subprocess each (the import checks of a fresh interpreter, a conversion's log)
    "test_progress_in_a_log_is_plain_lines_and_on_a_terminal_bars",
    "test_dry_run_refuses_missing_local_data_at_once_without_composer",
    "test_light_imports",
    "test_convert_cli_help_imports_no_torch",
    "test_importing_the_integration_packages_loads_no_trainer",
    # DataLoader worker processes; RegMix's proxy training runs
    "test_save_at_8_resume_at_2_save_resume_at_8_with_workers_0_3_1",
    "test_regmix_cli_runs_real_proxies_and_writes_weights",
})


#: The modules that take longest (roughly slowest first: each spawns several training or server processes),
#: started first under xdist so that the short ones fill the end.
SLOW_MODULES: tuple[str, ...] = (
    "test_soak_short", "test_demo", "test_composer", "test_mixer_workers", "test_checkpoint_kill",
    "test_hf_trainer", "test_lightning", "test_convert_spark", "test_composer_multiprocess",
    "test_mixer_elastic_dist", "test_fsdp_resume", "test_run_ux", "test_composer_foundry",
)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # before torch is imported (collection): the worker and every process it starts
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")


def _module(item: pytest.Item) -> str:
    return item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = getattr(item, "originalname", item.name)
        if (_module(item) in INTEGRATION_MODULES or name in INTEGRATION_TESTS
                or _INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.integration)
        else:
            item.add_marker(pytest.mark.unit)
    # Longest modules first (a stable sort: each module's tests keep their order). xdist's loadfile hands out
    # modules in this order when run with --no-loadscope-reorder (the Makefile does).
    rank = {m: i for i, m in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))


@pytest.fixture(autouse=True, scope="module")
def _collect_cycles_after_module() -> Iterator[None]:
    """Mixers, datasets and loaders left in reference cycles by a module's tests hold open files and shared-memory
    mappings until the garbage collector runs: in one worker that ran a long stretch of modules the count reached
    the 20,000 open-file limit. Collect at every module's end."""
    yield
    gc.collect()


@pytest.fixture
def free_port() -> int:
    """A TCP port free now that no other xdist worker of this run is handed (`_parallel.free_port`)."""
    return _parallel.free_port()


def _moto_server_cmd(port: int) -> list[str]:
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe:
        return [exe, "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Start moto_server for the session; yield its endpoint URL with S3_ENDPOINT_URL / AWS_* set."""
    port = _parallel.free_port()
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
