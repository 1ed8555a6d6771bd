"""Retrying storage calls: object stores fail transiently, and one flaky read must not end a run."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .._errors import ConfigurationError, check_finite
from ._compression import CorruptStreamError
from ._errors import ShardUnavailableError

__all__ = ["RetryPolicy"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `attempts` tries with exponential backoff (`base_delay`, then doubled each time).

    Only `OSError` is retried: that is what fsspec backends raise for network, permission and
    missing-file failures. A compressed stream whose bytes do not decode is not transient either:
    it is reported at once as ShardUnavailableError. Anything else (a parse error, a bug) surfaces
    as it is.
    """

    attempts: int = 3
    base_delay: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
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
            except OSError as error:
                last = error
                if attempt + 1 < self.attempts:
                    time.sleep(self.base_delay * 2**attempt)
        raise ShardUnavailableError(url, self.attempts, f"{type(last).__name__}: {last}") from last
