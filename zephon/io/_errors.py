"""The error a shard raises when it cannot be opened or read, even after retries."""

from __future__ import annotations

from .._errors import ZephonError

__all__ = ["ShardUnavailableError"]


class ShardUnavailableError(ZephonError):
    """A shard could not be read after every retry: it vanished, or the storage kept failing.

    The message names the shard URL and the last underlying error, so that a training log points at
    the file to check without a debugger.
    """

    def __init__(self, url: str, attempts: int, cause: str) -> None:
        self.url = url
        self.attempts = attempts
        self.cause = cause
        super().__init__(f"shard {url} unavailable after {attempts} attempt(s): {cause}")

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (type(self), (self.url, self.attempts, self.cause))
