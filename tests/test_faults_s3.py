"""Storage faults for real: a fault-injecting proxy (tests/fault_proxy.py) between the mixer and moto_server.

What must hold: random errors, resets and latency change no sample; an outage shorter than the retry
deadline is ridden out with the same batches as a fault-free run (with and without workers); an outage
longer than the deadline ends in bounded time with one error naming the domain, the shard, the endpoint
and the last cause. Nothing hangs (pytest-timeout is the backstop, far above the deadlines used).
"""

from __future__ import annotations

import time

import pytest

from _mds_fixtures import batch_identities, write_domains
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from test_mixer_s3 import upload

B = 8
SIZES = [240, 200]
SEQ = 64
N_BATCHES = 40


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("faultsrc"), SIZES, seq_len=SEQ, samples_per_shard=8)


def _reference(data: list[str]) -> list[list[tuple[int, int]]]:
    with WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(data)],
                                weights=[0.6, 0.4], batch_size=B, seed=5) as m:
        return [batch_identities(b) for _, b in zip(range(N_BATCHES), m.dataloader())]


def _remote_mixer(remotes: list[str], tmp_path, **kwargs) -> WeightedStreamingMixer:
    doms = [DomainStream(f"d{k}", remote=r, local=str(tmp_path / f"cache{k}")) for k, r in enumerate(remotes)]
    return WeightedStreamingMixer(doms, weights=[0.6, 0.4], batch_size=B, seed=5, **kwargs)


def _read(m: WeightedStreamingMixer, workers: int, during: callable | None = None) -> list:
    got = []
    # One batch a worker message: the workers stay close enough behind the reader to run into the outage.
    for i, b in enumerate(m.dataloader(num_workers=workers, batches_per_message=1)):
        got.append(batch_identities(b))
        if during is not None:
            during(i)
        if len(got) == N_BATCHES:
            break
    return got


@pytest.mark.timeout(300)
def test_random_errors_resets_and_latency_change_no_sample(fault_proxy, s3_bucket, data, tmp_path):
    remotes = [upload(fault_proxy.url, s3_bucket, d, f"rnd/d{k}") for k, d in enumerate(data)]
    fault_proxy.set_faults(error_rate=0.25, reset_rate=0.1, latency=0.01)
    with _remote_mixer(remotes, tmp_path, retry_deadline=60) as m:
        got = _read(m, workers=0)
    assert got == _reference(data)
    assert fault_proxy.stats.errors > 0 and fault_proxy.stats.resets > 0  # the faults really happened


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_outage_shorter_than_the_deadline_is_ridden_out(fault_proxy, s3_bucket, data, tmp_path, workers):
    remotes = [upload(fault_proxy.url, s3_bucket, d, f"out{workers}/d{k}") for k, d in enumerate(data)]

    def outage_at_batch(i: int) -> None:
        if i == 3:
            fault_proxy.outage(8.0)

    with _remote_mixer(remotes, tmp_path, retry_deadline=60, download_retry=1) as m:
        t0 = time.monotonic()
        got = _read(m, workers, during=outage_at_batch)
    assert got == _reference(data)
    assert time.monotonic() - t0 >= 6  # it did wait the outage out rather than read around it


@pytest.mark.timeout(120)
def test_an_outage_past_the_deadline_fails_fast_with_one_clear_error(fault_proxy, s3_bucket, data, tmp_path):
    remotes = [upload(fault_proxy.url, s3_bucket, d, f"dead/d{k}") for k, d in enumerate(data)]
    with _remote_mixer(remotes, tmp_path, retry_deadline=4, download_retry=1) as m:
        fault_proxy.outage(3600)
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            _read(m, workers=0)
        elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 30, f"took {elapsed:.0f} s to give up with a 4 s deadline"
    assert "domain 'd" in msg and "shard." in msg and fault_proxy.url in msg, msg
    assert "gave up after" in msg and ("Connect" in msg or "connect" in msg), msg
    assert len(msg.splitlines()) == 1


def test_outage_window_refuses_then_recovers(fault_proxy, s3_bucket):
    """The proxy itself: an outage refuses connections, and service resumes when it ends."""
    import boto3
    import botocore.config

    c = boto3.client("s3", endpoint_url=fault_proxy.url,
                     config=botocore.config.Config(retries={"max_attempts": 1, "mode": "standard"}))
    c.put_object(Bucket=s3_bucket, Key="k", Body=b"x" * 100_000)
    fault_proxy.outage(1.0)
    with pytest.raises(Exception, match="Could not connect|Connection was closed"):  # new / kept-alive
        c.get_object(Bucket=s3_bucket, Key="k")
    time.sleep(1.2)
    assert c.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"x" * 100_000
    fault_proxy.set_faults(error_rate=1.0)
    with pytest.raises(Exception, match="SlowDown"):
        c.get_object(Bucket=s3_bucket, Key="k")


@pytest.mark.timeout(120)
def test_refused_credentials_are_not_reported_as_a_missing_index(fault_proxy, s3_bucket, data, tmp_path):
    remotes = [upload(fault_proxy.url, s3_bucket, d, f"forbid/d{k}") for k, d in enumerate(data)]
    fault_proxy.forbidden = True
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        _remote_mixer(remotes, tmp_path, retry_deadline=60)
    msg = str(info.value)
    assert "HTTP 403" in msg and "InvalidAccessKeyId" in msg and "AWS_ACCESS_KEY_ID" in msg, msg
    assert "not found" not in msg
    assert time.monotonic() - t0 < 30  # a refusal is not retried until the deadline
