"""The errors a runner fails items with when it cannot compute them: crashing or hung workers, or a
runner that can run no more (the process runner's machinery broken, a thread stuck for good)."""

from __future__ import annotations

from zephon._errors import ConfigurationError, ZephonError

__all__ = ["RunnerFailedError", "RunnerReusedError", "WorkerCrashedError"]


class WorkerCrashedError(ZephonError):
    """Every attempt at one item ended with its worker process dying or timing out, or the thread
    running it (thread runner) outlived `task_timeout_s`, or `close_timeout_s` at close (one
    attempt: a thread cannot be stopped).

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


class RunnerReusedError(ConfigurationError, RuntimeError):
    """A runner instance was started a second time: most often a second loader given the same
    instance through a pipeline's options, or one runner reused after its loader closed.

    A setup mistake, so a ConfigurationError, which is what a training script catches for those;
    a RuntimeError too, which it was before, so that callers catching that still do.
    """


class RunnerFailedError(ZephonError):
    """A runner can run no more items: the process runner's reader thread stopped on an unexpected
    error (a bug, or a fault it has no remedy for), so no reply can be received any more; or a
    thread runner's thread outlived `task_timeout_s`, and a thread cannot be stopped.

    Every item the runner held, wherever it was (queued, sent, or its reply being handled; a thread
    runner's queued ones), and every item submitted afterwards fails with this error, the original
    one as its `__cause__`: the loader raises it instead of waiting forever for a reply that can no
    longer arrive.
    """

    def __init__(
        self, detail: str = "its reader thread stopped on an unexpected error", runner: str = "process"
    ) -> None:
        self.detail = detail
        self.runner = runner
        super().__init__(f"the {runner} runner failed: {detail}; it can run no more items (see the cause)")

    def __reduce__(self):  # rebuilt from its detail, not its message, which would be wrapped again
        return (type(self), (self.detail, self.runner))
