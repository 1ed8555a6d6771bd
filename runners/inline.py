"""The reference runner: every stage runs in the thread that submits to it."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Self

from zephon._runner import Stage

from ._lifecycle import cancelled_future, check_startable, stage_at, validate_stages

__all__ = ["InlineRunner"]


class InlineRunner:
    """Runs `fn(item)` inside `submit` and returns an already-completed future.

    The simplest possible executor, for debugging (breakpoints and tracebacks stay in the caller)
    and as the reference the other runners must match. `parallelism` is accepted and ignored.
    An `Exception` from `fn` is set on the future, never raised, so callers handle failures the same
    way for every runner; `KeyboardInterrupt` and `SystemExit` propagate out of `submit` (a real
    Ctrl-C lands here, in the user's own thread, and must stop it at once). The other runners set
    them on the future, so every runner hands them to the caller as themselves (README.md).

    Thread-safety: `submit` may be called from any number of threads at once (each runs its own
    item); `start` and `close` belong to the owner. `close` is idempotent.
    """

    name = "inline"

    def __init__(self) -> None:
        self.reason = "requested explicitly"
        self._stages: tuple[Stage, ...] | None = None
        self._closed = False

    def start(self, stages: Sequence[Stage]) -> None:
        check_startable(self, self._stages is not None, self._closed)
        self._stages = validate_stages(stages)

    def submit(self, stage_index: int, item: Any) -> Future:
        stage = stage_at(self._stages, stage_index)
        if self._closed:
            return cancelled_future()
        future: Future = Future()
        try:
            result = stage.fn(item)
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        return future

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
