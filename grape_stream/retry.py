"""Bounded retries for remote storage: exponential backoff with jitter under an overall deadline.

Object stores blip: a throttled request, a connection reset, a load balancer restarting, a minute of
outage. A training job must ride those out without changing a single sample, and must *never* wait
forever: after the deadline it fails with one error naming what it was doing and the last cause.

One policy object is threaded through every remote read and write (shard downloads, index downloads,
converter uploads), so `retry_deadline` in a recipe or on a `DomainStream` means the same everywhere.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import socket
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

from grape_stream.config import RETRY_DEADLINE_S
from grape_stream.errors import StorageError, redact_url

__all__ = ["RetryPolicy", "RetryError", "CredentialsError", "DEFAULT_RETRY", "DEADLINE_ENV", "call_with_retry",
           "classify", "credentials_message", "default_policy", "error_codes", "is_credential_error", "is_transient",
           "note_throttled", "storage_call", "endpoint_note"]

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


#: Error codes (botocore's "An error occurred (<code>)", or the response's Error.Code) by what they mean.
CREDENTIAL_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException",
    "InvalidToken", "TokenRefreshRequired", "InvalidClientTokenId", "UnrecognizedClientException",
    "AllAccessDisabled", "AccountProblem", "RequestTimeTooSkewed", "403",
})
MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                            "TooManyRequestsException", "RequestLimitExceeded", "RequestThrottled", "429"})
#: botocore's exceptions for credentials it cannot find or load (matched by name: no botocore import here).
_CREDENTIAL_CLASSES = frozenset({
    "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError",
    "UnauthorizedSSOTokenError", "SSOTokenLoadError", "ProfileNotFound",
})
_CODE_IN_TEXT = re.compile(r"An error occurred \(([A-Za-z0-9.]+)\)")
_MISSING_TEXT = ("NoSuchKey", "NoSuchBucket", "(404)", "not found")


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and what it wraps (``raise ... from``, or raised while handling), outermost first."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 8:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def error_codes(exc: BaseException) -> tuple[set[str], set[int]]:
    """The object-store error codes and HTTP statuses an error (or what it wraps) carries.

    A botocore ``ClientError`` keeps the response even when streaming rewrites its text (streaming 0.13
    turns S3 403 and 404 alike into "Object ... not found"), so the response is read first; wrappers such
    as boto3's ``S3UploadFailedError`` keep only the text, which names the code.
    """
    codes: set[str] = set()
    statuses: set[int] = set()
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code:
                codes.add(str(code))
            if isinstance(status, int):
                statuses.add(status)
        codes.update(_CODE_IN_TEXT.findall(str(e)))
    return codes, statuses


def classify(exc: BaseException) -> str:
    """What a storage error means for retrying: ``"credentials"`` (missing, refused, expired or not
    permitted: re-reading the credentials may help, waiting does not), ``"missing"`` (no such object or
    bucket), ``"throttled"`` (503 SlowDown, 429: retry, more slowly), ``"transient"`` (network, 5xx,
    timeouts: retry) or ``"permanent"`` (an error already explained to the user, a local file problem, a
    programming error)."""
    chain = _chain(exc)
    if any(type(e).__name__ in _CREDENTIAL_CLASSES for e in chain) or "Unable to locate credentials" in str(exc):
        return "credentials"
    codes, statuses = error_codes(exc)
    if codes & CREDENTIAL_CODES or 403 in statuses:
        return "credentials"
    if codes & MISSING_CODES or 404 in statuses:
        return "missing"
    if codes & THROTTLE_CODES or 429 in statuses or (503 in statuses and not codes - {"503", "SlowDown"}):
        return "throttled"
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, (PermissionError, StorageError, ValueError, TypeError, KeyError, IndexError, AttributeError)):
        return "permanent"
    text = f"{type(exc).__name__}: {exc}"
    if any(marker in text for marker in _MISSING_TEXT):
        return "missing"
    return "transient"


def is_transient(exc: BaseException) -> bool:
    """Whether a storage error may go away by itself (network, throttling, 5xx) and is worth retrying.

    Not: a missing object, missing or refused credentials (streaming 0.13 raises S3 403 and 404 both as
    "Object ... not found"; the response tells them apart), an error already explained to the user, or a
    programming error.
    """
    return classify(exc) in ("transient", "throttled")


def is_credential_error(exc: BaseException) -> bool:
    return classify(exc) == "credentials"


class CredentialsError(StorageError, PermissionError):
    """The object store refused the credentials, or there were none: one line saying what to set."""


def credentials_message(what: str, url: str, exc: BaseException) -> str:
    """One line: what failed, the code, and what to set (AWS variables for s3://)."""
    codes, statuses = error_codes(exc)
    missing = any(type(e).__name__ in _CREDENTIAL_CLASSES for e in _chain(exc))
    code = next(iter(sorted(codes - {"403"})), None) or ("HTTP 403" if 403 in statuses or "403" in codes else None)
    if url.startswith("s3://"):
        fix = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / a credentials file)"
               if missing else
               "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials) "
               "or AWS_PROFILE for this endpoint, and the bucket's permissions")
    else:
        fix = "check the credentials configured for this store"
    why = (f"no credentials found ({type(exc).__name__})" if missing
           else f"access refused ({code})" if code else "access refused")
    endpoint = endpoint_note(url) if os.environ.get("S3_ENDPOINT_URL", "") not in what else ""
    return f"{what}: {why}{endpoint}; {fix}"


def storage_call(
    fn: Callable[[], T],
    *,
    what: str,
    url: str,
    policy: RetryPolicy | None = None,
    refresh: Callable[[], None] | None = None,
    on_failure: Callable[[BaseException, int], None] | None = None,
    retryable: Callable[[BaseException], bool] | None = None,
    throttled_as: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """One object-store operation under the retry policy, with the rules every storage call shares.

    Network errors and 5xx are retried with backoff until the deadline (`RetryError`, one line). Throttling
    (503 SlowDown) is retried too, and said once per job and prefix (:func:`note_throttled`): the prefix is
    `throttled_as` when given (a domain's remote, for a read of one object under it such as its index.json, so
    that the index and the shards of one throttled domain are one line, not two), else `url`. Credentials
    are never retried as if the network blinked: a credential error calls `refresh` (build a new client,
    which reads the credentials again: they may have rotated) and tries once more; a second credential
    error in a row is final (`CredentialsError`, one line naming what to set). A missing object is raised
    as it is. `retryable` may allow more errors (e.g. a shard another process is still downloading).
    """
    policy = policy or default_policy()
    refreshed = [False]

    def decide(exc: BaseException) -> bool:
        kind = classify(exc)
        if kind == "credentials":
            if refreshed[0]:
                return False
            refreshed[0] = True
            if refresh is not None:
                refresh()
            return True
        refreshed[0] = False
        if kind == "throttled":
            note_throttled(throttled_as or url, exc)
        return kind in ("transient", "throttled") or (retryable is not None and retryable(exc))

    try:
        return call_with_retry(fn, policy=policy, what=what, retryable=decide, on_failure=on_failure, sleep=sleep,
                               clock=clock)
    except (KeyboardInterrupt, SystemExit, StorageError):
        raise
    except BaseException as exc:
        if classify(exc) == "credentials":
            raise CredentialsError(credentials_message(what, url, exc)) from exc
        raise


_THROTTLED: set[str] = set()
_THROTTLE_NAMES: list[Any] = []  # sockets that hold this process's "said once" names (see note_throttled)
log = logging.getLogger("grape_stream.storage")


def _first_in_job(key: str) -> bool:
    """True the first time any process of this job (process group: a launcher, its ranks, their DataLoader
    workers) asks about `key`. Linux: the first to bind an abstract-namespace socket named after the key
    wins; the name lives as long as that process and leaves no file behind. Elsewhere: once per process."""
    if key in _THROTTLED:
        return False
    _THROTTLED.add(key)
    if not sys.platform.startswith("linux"):
        return True
    digest = hashlib.sha1(f"{os.getpgid(0)}\0{key}".encode()).hexdigest()[:24]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0grape_stream.said.{digest}")
    except OSError:
        s.close()
        return False
    _THROTTLE_NAMES.append(s)
    return True


def note_throttled(url: str, exc: BaseException) -> None:
    """Say once per job and prefix that the store is throttling: the run goes on, slower, losing nothing."""
    url = url.rstrip("/")  # "s3://b/d0/" and "s3://b/d0" are one prefix
    if _first_in_job(f"throttled {url}"):
        codes, _ = error_codes(exc)
        code = next(iter(sorted(codes & THROTTLE_CODES)), None) or "503 SlowDown"
        log.warning("%s%s is throttling requests (%s): retrying them with backoff, so reads and writes slow down "
                    "but nothing is lost (said once)", redact_url(url), endpoint_note(url), code)


def endpoint_note(url: str) -> str:
    """`` (endpoint http://...)`` for an s3:// URL read through S3_ENDPOINT_URL, so errors name the server."""
    endpoint = os.environ.get("S3_ENDPOINT_URL")
    return f" (endpoint {endpoint})" if url.startswith("s3://") and endpoint else ""
