"""The retry policy every remote read and write uses: backoff, jitter, the deadline, what is retried."""

from __future__ import annotations

import pytest

from grape_stream.errors import StorageError
from grape_stream.retry import RetryError, RetryPolicy, call_with_retry, default_policy, is_transient


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_transient_failures_are_retried_with_capped_exponential_backoff():
    clock, calls = FakeClock(), []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 7:
            raise ConnectionResetError("reset by peer")
        return "ok"

    policy = RetryPolicy(deadline=100, initial_backoff=0.5, max_backoff=4.0, jitter=0.0)
    assert call_with_retry(flaky, policy=policy, what="x", sleep=clock.sleep, clock=lambda: clock.now) == "ok"
    assert clock.sleeps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_the_deadline_ends_it_with_one_line_naming_what_and_the_cause():
    clock = FakeClock()

    def down() -> None:
        clock.now += 1.0  # each attempt takes a second
        raise ConnectionRefusedError("Could not connect to the endpoint URL")

    with pytest.raises(RetryError) as info:
        call_with_retry(down, policy=RetryPolicy(deadline=10, jitter=0.0), what="reading s3://b/k",
                        sleep=clock.sleep, clock=lambda: clock.now)
    msg = str(info.value)
    assert msg.startswith("reading s3://b/k: gave up after") and "Could not connect" in msg and "\n" not in msg
    assert clock.now <= 10 + 1 and isinstance(info.value, StorageError)  # never started past the deadline


def test_permanent_errors_are_not_retried_and_failure_hooks_run():
    seen = []
    with pytest.raises(FileNotFoundError):
        call_with_retry(lambda: (_ for _ in ()).throw(FileNotFoundError("Object s3://b/k not found.")),
                        what="x", retryable=is_transient, on_failure=lambda e, n: seen.append(n))
    assert seen == []  # not retryable: raised at once, before any hook
    assert not is_transient(RuntimeError("An error occurred (InvalidAccessKeyId) when calling GetObject"))
    assert not is_transient(RuntimeError("An error occurred (404) when calling the HeadObject operation"))
    assert is_transient(RuntimeError("An error occurred (SlowDown) when calling GetObject: reduce rate"))
    assert is_transient(ConnectionResetError("reset"))
    assert is_transient(RuntimeError("Read timeout on endpoint URL: s3://b/shard.00404.mds"))  # a 404 in a name


def test_the_environment_sets_the_default_deadline(monkeypatch):
    monkeypatch.setenv("GRAPE_STREAM_RETRY_DEADLINE", "7.5")
    assert default_policy().deadline == 7.5
    monkeypatch.setenv("GRAPE_STREAM_RETRY_DEADLINE", "soon")
    with pytest.raises(ValueError, match="GRAPE_STREAM_RETRY_DEADLINE"):
        default_policy()
