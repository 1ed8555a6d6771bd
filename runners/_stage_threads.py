"""The threads of one `ThreadRunner` stage: daemon threads serving one queue of items.

Daemon threads, because a stage function may never return (a hung network read, a deadlock in a
C library) and a thread cannot be interrupted: interpreter exit joins every non-daemon thread
without a timeout, a `ThreadPoolExecutor`'s among them, so one such thread kept the training job
from ever ending. The runner bounds how long it waits for running items instead, and reports the
threads it leaves behind (`stuck_in` says where each one is). Each thread notes the item it runs
and since when (`running`), so that the runner can fail one running past `task_timeout_s`.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from queue import Empty, SimpleQueue
from typing import Any

from zephon._job_log import RankLog
from zephon._runner import Stage

from ._lifecycle import cancel_and_notify, end_in_close, end_on_runner_thread, set_unless_ended

__all__ = ["StageThreads", "stuck_in"]

_log = RankLog(logging.getLogger("runners.thread"))  # the runner's: a user configures one logger for it

_STOP = None  # what tells a thread to exit once it takes it from the queue


class StageThreads:
    """`parallelism` daemon threads named `zephon-<stage>_N`, all started here, serving one queue.

    The threads hold the queue, the stage function, their slots in `_taken` and `_failure`, never
    this object: one its runner dropped unclosed is collected, and its finalizer tells its idle
    threads to exit.

    Thread-safety: `submit` may be called from any thread; `stop` too, and it takes no lock of its
    own (the runner's exit hook calls it); `wait` from any thread but these; `running`, `refuse`
    and `fail_queued` from any thread.
    """

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.threads: list[threading.Thread] = []
        self._queue: SimpleQueue = SimpleQueue()
        self._stopped = False
        # What every item fails with once `refuse` has begun, in a one-slot list the threads share:
        # one takes no new item from then on (it holds the list, never this object).
        self._failure: list[Callable[[], BaseException] | None] = [None]
        # Thread n's item and when it took it (time.monotonic()), None while it waits for one: a
        # list whose slots are each written by one thread only, read by the runner's watch.
        self._taken: list[tuple[Future, float] | None] = [None] * stage.parallelism
        try:
            for n in range(stage.parallelism):
                thread = threading.Thread(
                    target=_serve, args=(self._queue, stage.fn, self._taken, n, self._failure),
                    name=f"zephon-{stage.name}_{n}", daemon=True,
                )
                thread.start()
                self.threads.append(thread)
        except BaseException:  # a thread that cannot start (a container's thread limit)
            self.stop()
            raise
        weakref.finalize(self, _tell_to_exit, self._queue, len(self.threads)).atexit = False

    def submit(self, item: Any) -> Future:
        """A future of `stage.fn(item)`; a cancelled one once `stop` has begun, a failed one once
        `refuse` has."""
        future: Future = Future()
        if (failure := self._failure[0]) is not None:  # not queued: it would wait behind a stuck thread
            future.set_exception(failure())
            return future
        self._queue.put((future, item))
        if self._stopped:
            # `stop` may have drained the queue before this item reached it, and its threads may
            # have exited: drained again, so it is cancelled instead of waiting for ever (a thread
            # that took it runs it).
            _tell_to_exit(self._queue, self._end_queued(cancel_and_notify))
        elif self._failure[0] is not None:
            # `fail_queued` may have drained the queue before this item reached it: drained again, so
            # it fails instead of waiting behind a stuck thread (a thread that took it fails it).
            _tell_to_exit(self._queue, self._end_queued(lambda future: _fail_taken(future, self._failure[0])))
        return future

    def stop(self) -> None:
        """Cancel the items no thread has taken and tell every thread to exit after its item."""
        self._stopped = True
        self._end_queued(lambda future: end_in_close(_log, cancel_and_notify, future))
        _tell_to_exit(self._queue, len(self.threads))

    def refuse(self, failure: Callable[[], BaseException]) -> None:
        """Fail every item submitted from now on, with a fresh `failure()` each (a note the loader
        adds to one must not reach the others): the runner can run no more. Ends no future, so it
        runs no done-callback: the runner refuses on every stage before it fails any queued item,
        whose callback may submit to another stage (`fail_queued`)."""
        self._failure[0] = failure

    def fail_queued(self) -> None:
        """Fail the items no thread has taken, once `refuse` has begun. The threads are left as
        they are; `stop` ends them. Called on the runner's `task_timeout_s` watch, which a
        done-callback raising a BaseException must not end midway through the queue: the rest of
        it never failed, and the stop messages taken were lost."""
        _tell_to_exit(
            self._queue,
            self._end_queued(lambda future: end_on_runner_thread(_log, _fail_taken, future, self._failure[0])),
        )

    def _end_queued(self, end: Callable[[Future], None]) -> int:
        """Take every queued item and `end` its future; how many stop messages were taken with
        them. Whoever takes an item from the queue, a thread or this, is the one to start or end
        its future, so no item a thread runs is touched and no future is ended twice."""
        stops = 0
        while True:
            try:
                work = self._queue.get_nowait()
            except Empty:
                return stops
            if work is _STOP:
                stops += 1
            else:
                end(work[0])

    def running(self) -> list[tuple[threading.Thread, Future, float]]:
        """The items the threads run now: (thread, its item's future, when it took it)."""
        return [(thread, *taken) for thread, taken in zip(self.threads, list(self._taken)) if taken is not None]

    def wait(self, deadline: float) -> list[threading.Thread]:
        """Join the threads until `deadline` (`time.monotonic()`); the threads still running
        something then: an item, or a finished item's done-callbacks. One that is only yet to
        exit (it waits for, or has just taken, its stop message) is not: with a short
        `close_timeout_s` every idle thread was reported as left behind running an item."""
        for thread in self.threads:
            thread.join(min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX))
        busy = {thread for thread, *_ in self.running()}  # in a stage function written in C too
        return [thread for thread in self.threads if thread.is_alive() and (thread in busy or _runs_something(thread))]

    def runs_current_thread(self) -> bool:
        return threading.current_thread() in self.threads


def stuck_in(thread: threading.Thread) -> str:
    """Where `thread` is now, innermost call last: the stage function's frames down to the call
    it waits in, so that a report of a thread that does not finish names the function at fault."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(it has just finished)"
    below_serve = itertools.takewhile(lambda call: call[0].f_code is not _serve.__code__, traceback.walk_stack(frame))
    return "".join(traceback.StackSummary.extract(reversed(list(below_serve))).format()).rstrip()


def _runs_something(thread: threading.Thread) -> bool:
    """Whether `thread` is in a call made from `_serve` (the stage function, a done-callback),
    rather than in `_serve` itself (waiting on the queue) or outside it (starting or exiting)."""
    frame = sys._current_frames().get(thread.ident)
    below = 0
    while frame is not None:
        if frame.f_code is _serve.__code__:
            return below > 0
        below += 1
        frame = frame.f_back
    return False


def _serve(queue: SimpleQueue, fn, taken: list, slot: int, failure: list) -> None:
    """Run items until told to stop, noting in `taken[slot]` the one running and since when.
    Whatever `fn` raises, `SystemExit` and `KeyboardInterrupt` included, is the item's: it is set on
    the future, and the thread goes on serving; so it does past a done-callback raising one (logged,
    `end_on_runner_thread`). An item the runner failed meanwhile (it ran past
    `task_timeout_s`) keeps that failure: what `fn` gave it late is dropped. Once the runner has
    failed (`failure[0]`), an item taken fails with it instead of running: the watch may still be
    failing another stage's queue, and this one's until it reaches it."""
    while (work := queue.get()) is not _STOP:
        future, item = work
        del work  # nothing of a finished item is kept while the thread waits for the next
        if failure[0] is not None:
            end_on_runner_thread(_log, _fail_taken, future, failure[0])
        elif future.set_running_or_notify_cancel():
            taken[slot] = (future, time.monotonic())
            try:
                result = fn(item)
            except BaseException as error:
                taken[slot] = None
                _settle(future.set_exception, error)
                del error
            else:
                taken[slot] = None
                _settle(future.set_result, result)
                del result
        del future, item


def _fail_taken(future: Future, failure: Callable[[], BaseException]) -> None:
    """Fail a future taken from the queue with a fresh `failure()`; one its caller cancelled stays
    cancelled, its waiters told (`set_running_or_notify_cancel`, as a thread taking it would have)."""
    if future.set_running_or_notify_cancel():
        future.set_exception(failure())


def _settle(setter, value) -> None:
    """Resolve a running future unless it is resolved already (`set_unless_ended`), on the stage
    thread, which goes on past a done-callback raising a BaseException."""
    end_on_runner_thread(_log, set_unless_ended, setter, value)


def _tell_to_exit(queue: SimpleQueue, threads: int) -> None:
    for _ in range(threads):
        queue.put(_STOP)
