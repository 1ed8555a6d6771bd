"""Retrying storage calls: object stores fail transiently, and one flaky read must not end a run."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .. import _fork
from .._errors import ConfigurationError, check_finite
from .._job_log import RankLog
from ._compression import CorruptStreamError
from ._errors import ShardUnavailableError
from ._http_status import TRANSIENT_STATUS
from ._retry_after import retry_after_s
from ._version import changed_after_planning, expired_while_open

__all__ = ["MAX_RETRY_DELAY_S", "RetryPolicy", "is_transient"]

log = RankLog(logging.getLogger("zephon"))


class _RetryLog:
    """Which retried reads are logged: the 1st, 2nd, 4th, 8th, … of this process, each naming the
    count. Every retry costs the run a wait, so the first ones must show; but a store that fails
    one read in ten over a multi-day job would write a line per chunk. Counted per process, the
    lines are bounded by the logarithm of the retries and the count in the last one says how many.

    Thread-safe: the count is taken under a lock (held for the increment only), which a forked
    child (a process-runner worker) replaces, as a fork may copy it held by another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        _fork.renew_in_child(self, _RetryLog._new_lock)

    def _new_lock(self) -> None:
        self._lock = threading.Lock()

    def count(self) -> int | None:
        """Count one retried read; its number if it is to be logged, else None."""
        with self._lock:
            self._count += 1
            count = self._count
        return count if count & (count - 1) == 0 else None


_retry_log = _RetryLog()

T = TypeVar("T")

# Errors that the clients under fsspec backends raise as their own types, not as OSError, by
# (module, class, the attribute holding its HTTP status): a transport failure (no status, None) is
# transient; an error carrying a status is where that status says "try again" (`TRANSIENT_STATUS`).
# huggingface_hub's HfFileSystem (hf://) raises its HTTP status errors as OSError, but once its own
# backoff gives up, a timeout, reset or broken connection surfaces as the TransportError of httpx
# (httpx2 in huggingface_hub 2). fsspec's HTTPFileSystem (http(s)://) lets aiohttp's errors through
# as they are: a lost connection, a body cut short, and the ClientResponseError it raises for every
# status but 404 (a FileNotFoundError). s3fs lets botocore's through once its own few quick tries
# are spent: an endpoint out of reach or a connection refused (ConnectionError), a connection closed
# or a read timed out mid-response (HTTPClientError), a body shorter than its Content-Length
# (IncompleteReadError); none is an OSError, so a dropped connection to S3 ended the run with
# botocore's error, never retried. gcsfs raises its HttpError for every status but 403, 404, 412
# and 502 (OSErrors) once its own tries are spent. An error of one of these modules means it is
# imported, so they are looked up in sys.modules, never imported.
_CLIENT_ERRORS = (
    ("httpx", "TransportError", None),
    ("httpx2", "TransportError", None),
    ("aiohttp", "ClientConnectionError", None),
    ("aiohttp", "ClientPayloadError", None),
    ("aiohttp", "ClientResponseError", "status"),
    ("botocore.exceptions", "ConnectionError", None),
    ("botocore.exceptions", "HTTPClientError", None),
    ("botocore.exceptions", "IncompleteReadError", None),
    ("gcsfs.retry", "HttpError", "code"),
)

MAX_RETRY_DELAY_S = 60.0
"""The longest the doubling wait between attempts grows to (a first wait asked longer is kept):
unbounded, retries=20 waited three days before its last attempt, and past ~1,000 the wait
overflowed a float."""


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `attempts` tries with exponential backoff (`base_delay`, then doubled each time, up
    to `MAX_RETRY_DELAY_S`). A 429 or 503 whose server sent `Retry-After` waits at least what it
    asked, up to `MAX_RETRY_DELAY_S` (`_retry_after`): the doubling alone came back sooner, and a
    rate limit counts those early attempts too.

    Retried: `OSError`, which is what fsspec backends raise for network, permission and
    missing-file failures (fsspec's own timeout, FSTimeoutError, is one on Python >= 3.11, as are
    requests' errors and huggingface_hub's HTTP errors), and the transport errors HTTP clients
    raise as their own types (`is_transient`). A compressed stream whose bytes do not decode is
    not transient: it is reported at once as ShardUnavailableError, and so is an s3fs file that
    refuses to read on because it changed after planning (`_version.expired_while_open`). Anything else (a parse error,
    a bug) surfaces as it is. A failed attempt that is retried is logged as a warning (logger
    `zephon`) naming the file, the attempt, the error and a Retry-After it honoured (or asked
    beyond the cap): the 1st, 2nd, 4th, … of the process (`_RetryLog`).
    """

    attempts: int = 3
    base_delay: float = 0.5

    def __post_init__(self) -> None:
        # A bool is an int to Python: retries=True meant one attempt, no retry at all.
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool) or self.attempts < 1:
            raise ConfigurationError(
                f"retries={self.attempts!r} must be an int >= 1: the attempts in all, the first one included (1: no retry)"
            )
        if check_finite(self.base_delay, "retry_delay") < 0:
            raise ConfigurationError(f"retry_delay={self.base_delay!r} must be >= 0")

    def call(self, url: str, operation: Callable[[], T]) -> T:
        """Run `operation`; after the last failed attempt raise ShardUnavailableError naming `url`.

        `operation` must be safe to repeat from scratch: readers build their result in locals, so a
        retried read never sees half of a previous attempt.
        """
        for attempt in range(self.attempts):
            try:
                return operation()
            except CorruptStreamError as error:  # reading the same bytes again cannot help
                raise ShardUnavailableError(url, attempt + 1, str(error)) from error
            except Exception as error:
                if expired_while_open(error):  # another attempt would open the other version
                    raise changed_after_planning(url, f"it changed after planning ({error})") from error
                if not is_transient(error):
                    raise
                last = error
                if attempt + 1 < self.attempts:
                    # Said even when the next attempt mends it: the wait slows the run (up to a
                    # minute), and a store that keeps failing must show in the job's log.
                    delay, why = self._wait(attempt, error)
                    if (count := _retry_log.count()) is not None:
                        log.warning(
                            "reading %s failed on attempt %d of %d (%s: %s); retrying in %.3g s%s "
                            "(retried read %d of this process; logged at 1, 2, 4, 8, …)",
                            url, attempt + 1, self.attempts, type(error).__name__, error, delay, why, count,
                        )
                    time.sleep(delay)
        raise ShardUnavailableError(url, self.attempts, f"{type(last).__name__}: {last}") from last

    def _wait(self, attempt: int, error: Exception) -> tuple[float, str]:
        """The wait after failed attempt `attempt` (from 0) with `error`, and what the warning
        adds about it: the backoff's, or a Retry-After's where that is longer, up to the cap."""
        delay = self._delay(attempt)
        asked = retry_after_s(error)
        if asked is None:
            return delay, ""
        if asked > MAX_RETRY_DELAY_S:
            return max(delay, MAX_RETRY_DELAY_S), (
                f", the most a wait lasts, though its server asked for {asked:.6g} s (Retry-After)"
            )
        return max(delay, asked), f" (its server asked for {asked:.6g} s: Retry-After)"

    def _delay(self, attempt: int) -> float:
        """The wait after failed attempt `attempt` (from 0); the exponent is bounded first, so
        that a large attempt count cannot overflow."""
        doubled = self.base_delay * 2.0 ** min(attempt, 64)
        return max(self.base_delay, min(doubled, MAX_RETRY_DELAY_S))


def is_transient(error: Exception) -> bool:
    """Whether reading again may succeed where `error` failed (see `_CLIENT_ERRORS`)."""
    if isinstance(error, OSError):
        return True
    for module_name, class_name, status in _CLIENT_ERRORS:
        kind = getattr(sys.modules.get(module_name), class_name, None)
        if kind is not None and isinstance(error, kind):
            return status is None or getattr(error, status, None) in TRANSIENT_STATUS
    return False
