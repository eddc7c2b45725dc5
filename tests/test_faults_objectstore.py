"""What a big cluster's object store does, through the fault proxy: throttling, rotating credentials, and the
reads outside the mixer's shard reader (target tasks, the recipe's manifest).

* ``503 SlowDown`` sustained on one domain's prefix: the run slows down, every batch is the same as without
  it, and it is said once (one warning line for the job, DataLoader workers included).
* Credentials rotated mid-run (a ``credential_process`` whose key changes, and the proxy accepting only the
  new key from that moment): the next requests use the new key, batches are unchanged, and credentials
  are looked up about once per process, not per shard, per domain or per failed request.
* A remote task's splits and the recipe's remote manifest.json ride out an outage / 500s like shards do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _grape_data import write_task
from _mds_fixtures import batch_identities, write_domains
from grape_stream.grape.tasks import TaskStream
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from grape_stream.testing.credentials import RotatingCredentials
from test_mixer_s3 import upload

HERE = Path(__file__).resolve().parent
B, N_BATCHES = 8, 40

_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from _mds_fixtures import batch_identities
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
cfg = json.loads(sys.argv[1])
doms = [DomainStream(f"d{{k}}", remote=r, local=c) for k, (r, c) in enumerate(zip(cfg["remotes"], cfg["caches"]))]
got = []
with WeightedStreamingMixer(doms, weights=[0.6, 0.4], batch_size={b}, seed=5, retry_deadline=120,
                            download_retry=1) as m:
    for batch in m.dataloader(num_workers=cfg["workers"], batches_per_message=1):
        got.append(batch_identities(batch))
        if len(got) == {n}:
            break
print(json.dumps(got))
""".format(tests=str(HERE), b=B, n=N_BATCHES)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("osrc"), [240, 200], seq_len=64, samples_per_shard=8)


@pytest.fixture(scope="module")
def reference(data):
    with WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(data)],
                                weights=[0.6, 0.4], batch_size=B, seed=5) as m:
        return [[list(x) for x in batch_identities(b)] for _, b in zip(range(N_BATCHES), m.dataloader())]


def _run(remotes: list[str], tmp_path, workers: int, env: dict | None = None) -> subprocess.Popen:
    cfg = {"remotes": remotes, "caches": [str(tmp_path / f"cache{k}") for k in range(len(remotes))],
           "workers": workers}
    full = dict(os.environ, PYTHONPATH=str(HERE.parent))
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.Popen([sys.executable, "-c", _RUN, json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full)


@pytest.mark.timeout(300)
def test_sustained_slowdown_on_one_domain_loses_nothing_and_is_said_once(fault_proxy, s3_bucket, data, reference,
                                                                          tmp_path):
    remotes = [upload(fault_proxy.url, s3_bucket, d, f"slow/d{k}") for k, d in enumerate(data)]
    # the domain's index.json is throttled too, always (its first 6 GETs: more than botocore's own 3 attempts, so
    # our retry sees it), then the whole prefix all run long: index, main process and 2 DataLoader workers: 1 line
    index = fault_proxy.fail(rf"^/{s3_bucket}/slow/d0/index\.json", method="GET", action="503", times=6)
    rule = fault_proxy.slow_down(f"{s3_bucket}/slow/d0", rate=0.4)  # S3 throttling one prefix (~65 SlowDowns a run)
    proc = _run(remotes, tmp_path, workers=2)
    out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out) == reference  # slower, but not one sample lost, repeated or moved
    said = [line for line in err.splitlines() if "is throttling requests" in line]
    assert len(said) == 1, err[-3000:]
    assert f"s3://{s3_bucket}/slow/d0" in said[0] and "SlowDown" in said[0] and "nothing is lost" in said[0]
    assert index.hits == 6 and rule.hits > 20  # the throttling really happened, the index's and the shards'


@pytest.mark.timeout(300)
def test_rotated_credentials_are_used_by_the_next_request_without_per_shard_lookups(fault_proxy, s3_bucket, data,
                                                                                    reference, tmp_path):
    remotes = [upload(fault_proxy.url, s3_bucket, d, f"rot/d{k}") for k, d in enumerate(data)]
    creds = RotatingCredentials(tmp_path / "creds", key="KEY-ONE")
    fault_proxy.accept_keys({"KEY-ONE"})
    fault_proxy.set_faults(error_rate=0.1, error_status=500)  # failed requests must not mean new lookups either
    stop = threading.Event()

    def rotate_mid_run() -> None:
        while not stop.is_set() and fault_proxy.stats.keys["KEY-ONE"] < 60:
            time.sleep(0.01)
        fault_proxy.accept_keys({"KEY-ONE", "KEY-TWO"})  # a provider's rotation: the new key works first,
        creds.rotate("KEY-TWO")  # then lookups hand it out,
        fault_proxy.accept_keys({"KEY-TWO"})  # then the old one is refused

    t = threading.Thread(target=rotate_mid_run)
    t.start()
    try:
        proc = _run(remotes, tmp_path, workers=2, env=creds.env())
        out, err = proc.communicate(timeout=280)
    finally:
        stop.set()
        t.join()
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out) == reference
    assert fault_proxy.stats.refused_keys >= 1 and fault_proxy.stats.keys["KEY-TWO"] > 20  # the next requests
    lookups = creds.lookups()
    pids = {pid for pid, _ in lookups}
    assert len(pids) <= 3  # the main process and 2 DataLoader workers
    # per process: the start-up check and the shared session, then one more after the rotation; not one per
    # shard (55), per domain's client or per failed request (fault_proxy.stats.errors)
    assert len(lookups) <= 2 * len(pids) + 2, (lookups, fault_proxy.stats.errors)
    assert fault_proxy.stats.errors > 10


@pytest.mark.timeout(200)
def test_a_remote_tasks_splits_ride_out_an_outage(fault_proxy, s3_bucket, tmp_path):
    write_task(str(tmp_path / "src"), "t0", (3, 7), n_val=64, n_test=32)
    remote = upload(fault_proxy.url, s3_bucket, str(tmp_path / "src" / "t0"), "tasks/t0")
    local = TaskStream("t0", local=str(tmp_path / "src" / "t0"))
    want = local.probe(16, key=(3,))
    task = TaskStream("t0", remote=remote, local=str(tmp_path / "cache"), download_timeout=5)
    fault_proxy.outage_after(3, 8.0)  # the index is read, then the store goes away for 8 s
    try:
        t0 = time.monotonic()
        got = task.probe(16, key=(3,))
        evaluated = sum(len(b["tokens"]) for b in task.eval_dataloader(8))
    finally:
        task.close()
        local.close()
    assert fault_proxy.stats.refused_windows == 1 and time.monotonic() - t0 >= 6
    assert all((got[k] == want[k]).all() for k in want) and evaluated == 32


@pytest.mark.timeout(200)
def test_the_recipes_remote_manifest_is_read_through_500s(fault_proxy, s3_bucket, tmp_path):
    from grape_stream.recipe import read_manifest

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "manifest.json").write_text(json.dumps({"tokenizer": {"vocab_size": 257}}))
    remote = upload(fault_proxy.url, s3_bucket, str(tmp_path / "m"), "manifested")
    rule = fault_proxy.fail(r"/manifest\.json", method="GET", action="500", times=8)
    assert read_manifest({"data": {"remote": remote, "local": None}}) == {"tokenizer": {"vocab_size": 257}}
    assert rule.hits == 8
    assert read_manifest({"data": {"remote": f"s3://{s3_bucket}/nothing-here", "local": None}}) is None
