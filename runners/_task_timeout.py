"""The thread runner's `task_timeout_s`: a daemon thread that fails an item running too long.

A thread cannot be interrupted, so a stage function that never returns (a hung network read, a
deadlock in a C library) would keep whoever waits for its item waiting for ever. This thread wakes
when the earliest running item is due and hands every item past its time to the runner, which
fails it naming where its thread is stuck. It holds the runner weakly: a runner dropped unclosed
is still collected, and that, like `close()`, wakes it to exit.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .thread import ThreadRunner

__all__ = ["TaskTimeoutWatch"]


class TaskTimeoutWatch:
    """One daemon thread, `zephon-task-timeout`, watching one runner's items.

    Thread-safety: `stop` may be called from any thread and takes no lock (the runner's exit hook
    calls it); `join` from any thread but the watch's own.
    """

    def __init__(self, runner: ThreadRunner, task_timeout_s: float) -> None:
        self._wake: SimpleQueue = SimpleQueue()
        self.thread = threading.Thread(
            target=_watch, args=(weakref.ref(runner), task_timeout_s, self._wake.get), name="zephon-task-timeout",
            daemon=True,
        )
        self.thread.start()
        weakref.finalize(runner, self._wake.put, None).atexit = False

    def stop(self) -> None:
        """Tell the watch to exit now, waiting for nothing."""
        self._wake.put(None)

    def join(self, deadline: float) -> None:
        """Wait for the watch to exit until `deadline` (`time.monotonic()`)."""
        self.thread.join(min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX))


def _watch(runner_ref: weakref.ref, task_timeout_s: float, sleep_until_woken: Callable[..., None]) -> None:
    """Fail the items running past `task_timeout_s` and sleep until the next one is due, until woken
    (the runner closes or is collected)."""
    while (next_due := _fail_overdue(runner_ref, task_timeout_s)) is not None:
        try:
            sleep_until_woken(timeout=min(max(0.0, next_due - time.monotonic()), threading.TIMEOUT_MAX))
        except Empty:
            continue
        return


def _fail_overdue(runner_ref: weakref.ref, task_timeout_s: float) -> float | None:
    """Hand every item running past `task_timeout_s` to the runner to fail; when the next running
    item is due (a whole timeout from now if none runs: an item taken meanwhile is due no sooner),
    or None once the runner is gone. A function of its own, so that nothing of the runner (a pool,
    an item's future) is held while the watch sleeps."""
    runner = runner_ref()
    if runner is None:
        return None
    now = time.monotonic()
    next_due = now + task_timeout_s
    for pool in runner._pools:
        for thread, future, since in pool.running():
            if future.done():  # failed already; its thread is still stuck
                continue
            if since + task_timeout_s <= now:
                runner._time_out(pool, thread, future)
            else:
                next_due = min(next_due, since + task_timeout_s)
    return next_due
