"""The error a runner raises when it gives up on an item because of crashing workers."""

from __future__ import annotations

from zephon._errors import ZephonError

__all__ = ["WorkerCrashedError"]


class WorkerCrashedError(ZephonError):
    """Every attempt at one item ended with its worker process dying or timing out.

    Distinct from an exception raised by the stage function, which is delivered as itself: this one
    means the item could not be computed at all, and names the stage and what happened to the
    worker on the last attempt so that a training log points at the right operator.
    """

    def __init__(self, stage: str, attempts: int, cause: str) -> None:
        self.stage = stage
        self.attempts = attempts
        self.cause = cause
        plural = "" if attempts == 1 else "s"
        super().__init__(
            f"stage {stage!r}: gave up on an item after {attempts} attempt{plural}; "
            f"on the last one its worker {cause}"
        )

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (type(self), (self.stage, self.attempts, self.cause))
