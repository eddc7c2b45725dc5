"""Bounded retries for remote storage: exponential backoff with jitter under an overall deadline.

Object stores blip: a throttled request, a connection reset, a load balancer restarting, a minute of
outage. A training job must ride those out without changing a single sample, and must *never* wait
forever: after the deadline it fails with one error naming what it was doing and the last cause.

One policy object is threaded through every remote read and write (shard downloads, index downloads,
converter uploads), so `retry_deadline` in a recipe or on a `DomainStream` means the same everywhere.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, replace
from typing import Callable, TypeVar

from grape_stream.config import RETRY_DEADLINE_S
from grape_stream.errors import StorageError

__all__ = ["RetryPolicy", "RetryError", "DEFAULT_RETRY", "DEADLINE_ENV", "call_with_retry", "default_policy",
           "is_transient", "endpoint_note"]

T = TypeVar("T")


class RetryError(StorageError):
    """An operation kept failing until the policy's deadline or attempt limit; `last` is the final cause."""

    def __init__(self, message: str, last: BaseException | None, attempts: int, elapsed: float) -> None:
        super().__init__(message)
        self.last = last
        self.attempts = attempts
        self.elapsed = elapsed


@dataclass(frozen=True)
class RetryPolicy:
    """When to try again. Defaults ride out a 60 s outage with margin (deadline 180 s).

    Attributes:
        deadline: seconds from the first attempt after which no new attempt starts.
        max_attempts: upper bound on attempts whatever the deadline (0 = only the deadline bounds).
        initial_backoff: sleep after the first failure; doubles each time up to `max_backoff`.
        max_backoff: cap of one sleep, so recovery is noticed within this many seconds.
        jitter: each sleep is multiplied by a uniform factor in [1 - jitter, 1 + jitter], so ranks and
            workers that failed together do not retry in lock-step against a recovering server.
    """

    deadline: float = RETRY_DEADLINE_S
    max_attempts: int = 0
    initial_backoff: float = 0.5
    max_backoff: float = 8.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if not self.deadline > 0:
            raise ValueError(f"retry deadline must be > 0 seconds, got {self.deadline!r}")
        if self.max_attempts < 0:
            raise ValueError(f"max_attempts must be >= 0, got {self.max_attempts!r}")
        if not (0 < self.initial_backoff <= self.max_backoff):
            raise ValueError("need 0 < initial_backoff <= max_backoff")
        if not (0.0 <= self.jitter < 1.0):
            raise ValueError(f"jitter must lie in [0, 1), got {self.jitter!r}")

    def with_deadline(self, deadline: float | None) -> "RetryPolicy":
        return self if deadline is None else replace(self, deadline=float(deadline))

    def backoff(self, failures: int, rng: random.Random | None = None) -> float:
        """Sleep before attempt `failures + 1` (failures >= 1)."""
        base = min(self.max_backoff, self.initial_backoff * 2.0 ** (failures - 1))
        r = (rng or random).uniform(1.0 - self.jitter, 1.0 + self.jitter)
        return base * r


DEFAULT_RETRY = RetryPolicy()
DEADLINE_ENV = "GRAPE_STREAM_RETRY_DEADLINE"


def default_policy() -> RetryPolicy:
    """The default policy, with its deadline taken from ``GRAPE_STREAM_RETRY_DEADLINE`` (seconds) when set:
    how an operator shortens or lengthens every remote retry of a converter or job without code."""
    raw = os.environ.get(DEADLINE_ENV, "").strip()
    if not raw:
        return DEFAULT_RETRY
    try:
        return DEFAULT_RETRY.with_deadline(float(raw))
    except ValueError:
        raise ValueError(f"{DEADLINE_ENV}={raw!r} is not a number of seconds") from None


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy = DEFAULT_RETRY,
    what: str,
    retryable: Callable[[BaseException], bool] = lambda exc: True,
    on_failure: Callable[[BaseException, int], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Call `fn` until it returns, a non-retryable error is raised, or the policy gives up.

    `on_failure(exc, attempt)` runs after each failed attempt (to reset state a failed attempt left
    behind, e.g. a shard stuck in PREPARING). Giving up raises RetryError whose message names `what`,
    the attempts, the seconds spent and the last cause in one line.
    """
    start = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except BaseException as exc:  # noqa: BLE001 - classified just below
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) or not retryable(exc):
                raise
            if on_failure is not None:
                on_failure(exc, attempt)
            elapsed = clock() - start
            pause = policy.backoff(attempt)
            out_of_attempts = policy.max_attempts and attempt >= policy.max_attempts
            if out_of_attempts or elapsed + pause > policy.deadline:
                cause = f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__
                raise RetryError(
                    f"{what}: gave up after {attempt} attempt(s) in {elapsed:.0f} s "
                    f"(retry deadline {policy.deadline:g} s); last error: {cause}",
                    exc, attempt, elapsed,
                ) from exc
            sleep(pause)


#: What an object store says when retrying cannot help: the object or bucket is missing, or the
#: credentials are refused (botocore: "An error occurred (NoSuchKey) ...", "(403)", "(404)").
_PERMANENT_MARKERS = ("NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                      "(403)", "(404)", "not found")


def is_transient(exc: BaseException) -> bool:
    """Whether a storage error may go away by itself (network, throttling, 5xx) and is worth retrying.

    Not: a missing or forbidden object (streaming 0.13 raises S3 403 and 404 both as FileNotFoundError
    "Object ... not found"), an error already explained to the user, or a programming error.
    """
    if isinstance(exc, (FileNotFoundError, PermissionError, StorageError)):
        return False
    if isinstance(exc, (ValueError, TypeError, KeyError, IndexError, AttributeError)):
        return False
    text = f"{type(exc).__name__}: {exc}"
    return not any(marker in text for marker in _PERMANENT_MARKERS)


def endpoint_note(url: str) -> str:
    """`` (endpoint http://...)`` for an s3:// URL read through S3_ENDPOINT_URL, so errors name the server."""
    endpoint = os.environ.get("S3_ENDPOINT_URL")
    return f" (endpoint {endpoint})" if url.startswith("s3://") and endpoint else ""
