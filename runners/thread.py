"""Daemon threads per stage, sharing items and results with the caller.

On free-threaded CPython the stages run truly in parallel; with the GIL only code that releases it
(NumPy kernels, image codecs, tokenizers) overlaps, which is why `auto` prefers processes there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Self

from zephon._job_log import RankLog
from zephon._runner import Stage

from ._errors import RunnerFailedError, WorkerCrashedError
from ._lifecycle import (
    cancelled_future,
    check_close_timeout,
    check_owner,
    check_startable,
    check_task_timeout,
    end_in_close,
    end_on_runner_thread,
    exit_hook,
    set_unless_ended,
    stage_at,
    validate_stages,
)
from ._stage_threads import StageThreads, stuck_in
from ._task_timeout import TaskTimeoutWatch

__all__ = ["ThreadRunner"]

_log = RankLog(logging.getLogger(__name__))  # its lines are this rank's own events
# The runners the exit hook stops, as weak references (a runner dropped unclosed still frees itself
# as garbage, and its reference's callback removes it). The hook reads a copy made in one C call:
# it iterated a WeakSet in Python (to 3.13), which a runner closed on another thread meanwhile (the
# closer thread's close) changed under it, failing the hook with "Set changed size during
# iteration" and leaving every other runner unstopped at exit.
_started: dict[weakref.ref[ThreadRunner], None] = {}


def _remember(runner: ThreadRunner) -> None:
    _started[weakref.ref(runner, _forget_collected)] = None


def _forget(runner: ThreadRunner) -> None:
    _started.pop(weakref.ref(runner), None)  # a live reference equals the one stored


def _forget_collected(reference: weakref.ref) -> None:
    _started.pop(reference, None)


def _open_runners() -> list[ThreadRunner]:
    return [runner for reference in _started.copy() if (runner := reference()) is not None]


def _stop_at_exit() -> None:
    """Stop every runner still open when the interpreter exits, as `close()` would, and wait for
    the running items of one whose close another thread (the closer thread) has not finished.

    Their threads are daemon threads, which exit does not wait for: without this hook, items
    running then would be cut off wherever interpreter finalization found them, and queued ones
    would never be cancelled. Threading's exit hooks run before non-daemon threads are joined,
    while logging still works. A done-callback raising a BaseException as the hook cancels or
    fails a future is logged and the hook goes on (`exit_hook`): nothing closes these runners later."""
    with exit_hook():
        runners = _open_runners()
        for runner in runners:
            runner._stop_threads()
        began = time.monotonic()
        for runner in runners:
            runner._wait_for_running(began + runner._close_timeout_s, "interpreter exit began")


threading._register_atexit(_stop_at_exit)


class ThreadRunner:
    """`parallelism` daemon threads per stage, named after the stage (`_stage_threads`).

    Items and results are passed by reference: nothing is copied or pickled, so a stage function
    must not mutate its input if an earlier stage or the caller still reads it. Done-callbacks run on
    the thread that finished the item; submitting the next stage from one is safe because every
    stage has its own threads.

    - `task_timeout_s` (default None: no timeout): an item running longer fails with
      `WorkerCrashedError` naming its stage and the call its thread is stuck in. The thread cannot
      be stopped, so the runner can run nothing more: queued and later items fail with
      `RunnerFailedError` (the timeout as its cause), and `close()` leaves the thread behind, as
      below. A watching thread (`_task_timeout`) runs only when this is set.
    - `close_timeout_s`: how long `close()` (or interpreter exit, for a runner never closed) waits
      for the items already running. Threads cannot be interrupted: one still running then (a
      stage function that never returns: a hung network read, a deadlock in a C library) is left
      behind with a warning naming its stage and the call it is in, and its item fails with
      `WorkerCrashedError` saying the same (a late result is dropped); it is a daemon thread, so
      it does not hold up interpreter exit.

    `close()` cancels work that has not started and waits for running items, as above; from the
    moment it begins, `submit` returns cancelled futures, so a callback chain still running ends
    quietly. A close interrupted while it waits is finished by the next one.

    Thread-safety: `submit` may be called from any thread, including done-callbacks; `start`
    belongs to the owner. `close` may be called from any thread, also while another close runs
    (the owner's and the closer thread's, or a watchdog's: each waits, and each thread left
    behind is reported once), and from a done-callback, which does not wait for the running
    items. `close` is idempotent.
    """

    name = "thread"

    def __init__(self, *, task_timeout_s: float | None = None, close_timeout_s: float = 5.0) -> None:
        task_timeout_s = check_task_timeout(task_timeout_s)
        close_timeout_s = check_close_timeout(close_timeout_s)
        self.reason = "requested explicitly"
        self._task_timeout_s = task_timeout_s
        self._close_timeout_s = close_timeout_s
        self._watch: TaskTimeoutWatch | None = None
        self._timed_out: WorkerCrashedError | None = None  # the first item failed past task_timeout_s
        self._stages: tuple[Stage, ...] | None = None
        self._pools: list[StageThreads] = []
        self._closed = False
        self._waited = False  # a close (or the exit hook) waited for the running items to the end
        # Each thread left behind, with the wait that reported it: two may wait at once (the
        # owner's close and the closer thread's, the exit hook during the closer's close), and
        # `setdefault` lets one claim each thread without a lock (the exit hook waits too).
        self._reported: dict[threading.Thread, object] = {}

    def start(self, stages: Sequence[Stage]) -> None:
        check_startable(self, self._stages is not None, self._closed)
        self._stages = validate_stages(stages)
        self._pid = os.getpid()
        try:
            for stage in self._stages:
                self._pools.append(StageThreads(stage))
            if self._task_timeout_s is not None:
                self._watch = TaskTimeoutWatch(self, self._task_timeout_s)
        except BaseException:  # a thread that cannot start: the error is start()'s, no thread is left
            self._stop_threads()
            raise
        _remember(self)

    def submit(self, stage_index: int, item: Any) -> Future:
        stage_at(self._stages, stage_index)
        check_owner(self._pid)
        if self._closed:
            return cancelled_future()
        return self._pools[stage_index].submit(item)

    def close(self) -> None:
        self._closed = True
        if self._stages is not None and os.getpid() != self._pid:
            # A forked child's copy (a child leaving the parent's `with` block): its threads are
            # the parent's and did not survive the fork.
            _forget(self)
            return
        # Every stage's queued work is cancelled before any is waited for, and the waiting is done
        # again by the next call until one finishes it: a close cut short by Ctrl-C while it waits
        # for running items has stopped every stage already, and the next close() waits for the
        # rest. A thread cannot join itself; when a done-callback closes the runner the threads
        # are left to finish on their own (they exit once their items are done).
        self._stop_threads()
        on_watch = self._watch is not None and threading.current_thread() is self._watch.thread
        if not on_watch and not any(pool.runs_current_thread() for pool in self._pools):
            self._wait_for_running(time.monotonic() + self._close_timeout_s, "close() began")
            # Only now: interpreter exit during a close on another thread (the closer thread's, for
            # a dropped loader) waits for the running items too, instead of cutting them off.
            _forget(self)

    def _stop_threads(self) -> None:
        """Mark closed, cancel every stage's queued work and tell its threads to exit, waiting for
        nothing and taking no lock (the exit hook calls it)."""
        self._closed = True
        if self._stages is None or os.getpid() != self._pid:
            return
        for pool in self._pools:
            pool.stop()
        if self._watch is not None:
            self._watch.stop()

    def _wait_for_running(self, deadline: float, since: str) -> None:
        """Wait for the running items until `deadline`, then leave the threads still running
        behind, each reported once with its stage and where it is, and fail their items: nothing
        else would ever end those futures if the call never returns (`wait()` on one waited for
        ever), and one that returns late has its result dropped, as past `task_timeout_s`."""
        if self._waited or self._stages is None or os.getpid() != self._pid:
            return
        if self._watch is not None:
            self._watch.join(deadline)
        claim = object()
        for pool in self._pools:
            left = pool.wait(deadline)
            items = {thread: future for thread, future, _ in pool.running()}
            for thread in left:
                if self._reported.setdefault(thread, claim) is not claim:
                    continue  # another wait reported it and failed its item
                where = stuck_in(thread)
                _log.warning(
                    "stage %r: thread %s still runs an item %.1f s after %s (close_timeout_s); it is left "
                    "running, as a daemon thread that does not hold up interpreter exit (a thread cannot be "
                    "interrupted). It is in:\n%s",
                    pool.stage.name, thread.name, self._close_timeout_s, since, where,
                )
                if (future := items.get(thread)) is not None:
                    cause = (
                        f"thread {thread.name} still ran it after {since} and close_timeout_s={self._close_timeout_s}, "
                        f"and was left running (a thread cannot be interrupted). It is in:\n{where}"
                    )
                    error = WorkerCrashedError(pool.stage.name, 1, cause)
                    end_in_close(_log, set_unless_ended, future.set_exception, error)
        self._waited = True

    def _time_out(self, pool: StageThreads, thread: threading.Thread, future: Future) -> None:
        """Fail `future`, which `thread` has run for `task_timeout_s`, naming where the thread is;
        from the first, fail every queued and later item too. Called by the watch.

        Every stage refuses new items, and its threads start no queued one, before any future is
        failed, so whoever a failure wakes (the loader, a done-callback submitting the next stage)
        finds a runner that runs nothing more, on whichever stage: a stage still accepting items
        as an earlier stage's queue was failed ran the item a failed item's callback submitted to
        it, and its threads the items queued there before. An item that returns in the
        instant before its own failure still fails the runner: it did run that long."""
        cause = (
            f"thread {thread.name} exceeded task_timeout_s={self._task_timeout_s} and was left running (a thread "
            f"cannot be interrupted). It is in:\n{stuck_in(thread)}"
        )
        error = WorkerCrashedError(pool.stage.name, 1, cause)
        if self._timed_out is None:
            self._timed_out = error
            detail = (
                f"stage {pool.stage.name!r}: its thread {thread.name} exceeded task_timeout_s={self._task_timeout_s}"
            )

            def failure() -> RunnerFailedError:
                failed = RunnerFailedError(detail, runner="thread")
                failed.__cause__ = error
                return failed

            for each in self._pools:
                each.refuse(failure)
            for each in self._pools:
                each.fail_queued()
        # The watch goes on past a done-callback raising a BaseException.
        end_on_runner_thread(_log, set_unless_ended, future.set_exception, error)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
