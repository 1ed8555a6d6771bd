"""Closes the runners of loaders dropped without `close()`, on a daemon thread of its own.

A loader's finalizer runs on whichever thread's garbage collection finds the loader: a process
runner's own reader thread while it holds the runner's lock, or a stage thread of another loader's
runner while it holds something the dropped runner's running items wait for. Closing the runner
there waited for ever (the process runner's close takes that lock; the thread runner's waits for
its running items). So a finalizer only hands the close over (`close_later`: a
`queue.SimpleQueue.put`, which takes no lock and is documented safe from `__del__` and finalizers)
and one daemon thread per process (`THREAD_NAME`), does the closing.

The thread is started by ordinary code (`start`, where a loader starts its runner), never by a
finalizer, and again in a forked child, which gets a fresh queue: the parent's queued closes are
the parent's. A runner still queued when the interpreter exits is held by the queue, so it is
still open, and its own exit hook closes it (both runners close every runner still open at exit);
`close()` is idempotent, so the closer reaching it later does nothing more.

Thread-safety: `close_later` from any thread, finalizers included; `start` from ordinary code only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from queue import SimpleQueue

from . import _fork
from ._job_log import RankLog

__all__ = ["THREAD_NAME", "close_later", "start"]

log = RankLog(logging.getLogger("zephon"))

THREAD_NAME = "zephon-runner-closer"

_queue: SimpleQueue[Callable[[], None]] = SimpleQueue()
_thread: threading.Thread | None = None
_starting = threading.Lock()  # taken by `start` only, so never by a finalizer


def start() -> None:
    """Make sure this process's closer thread runs; call before handing a close to `close_later`."""
    global _thread
    with _starting:
        if _thread is None:
            thread = threading.Thread(target=_close_each, args=(_queue,), name=THREAD_NAME, daemon=True)
            thread.start()
            _thread = thread


def close_later(close: Callable[[], None]) -> None:
    """Have the closer thread call `close()`: all a finalizer may do, wherever it runs."""
    _queue.put(close)


def _close_each(queue: SimpleQueue[Callable[[], None]]) -> None:
    """Call each close handed over, one at a time, for as long as the process lives. A close that
    fails is logged and the next one still runs, whatever it raised: a SystemExit (or another
    BaseException) ending this thread would leave every later dropped loader's runner open, with
    `start` taking the dead thread for a running one."""
    while True:
        close = queue.get()
        try:
            close()
        except BaseException:
            log.exception("zephon: closing the runner of a loader dropped without close() failed")
        del close  # the runner is not held while the thread waits for the next one


def _forget_the_parents_closer() -> None:
    """In a forked child: the parent's closer thread did not survive the fork, and the closes
    queued there are the parent's runners (a child must not stop them)."""
    global _queue, _thread, _starting
    _queue, _thread, _starting = SimpleQueue(), None, threading.Lock()


_fork.call_in_child(_forget_the_parents_closer)
