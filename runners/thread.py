"""A thread pool per stage, sharing items and results with the caller.

On free-threaded CPython the stages run truly in parallel; with the GIL only code that releases it
(NumPy kernels, image codecs, tokenizers) overlaps, which is why `auto` prefers processes there.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (registers its exit hook first, so ours runs before it)
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Self

from zephon._runner import Stage

from ._lifecycle import cancelled_future, check_owner, check_startable, stage_at, validate_stages

__all__ = ["ThreadRunner"]

_pool_thread = threading.local()
_started: weakref.WeakSet[ThreadRunner] = weakref.WeakSet()  # runners an exit hook stops


def _stop_at_exit() -> None:
    """Cancel the queued work of every runner still open when the interpreter exits.

    `concurrent.futures` joins its pool threads at exit, and a pool thread drains its queue first:
    a loader left unclosed ran every prefetched chunk before the process could end (seconds, or
    minutes of a slow map). Threading's exit hooks run in reverse order of registration, before
    non-daemon threads are joined, and this one is registered after `concurrent.futures`' own, so it
    runs first; running items finish, as in `close()`. Held by a weak set: a runner dropped unclosed
    still frees itself as garbage."""
    for runner in list(_started):
        runner._cancel_queued()


threading._register_atexit(_stop_at_exit)


class ThreadRunner:
    """One `ThreadPoolExecutor` of `parallelism` threads per stage, named after the stage.

    Items and results are passed by reference: nothing is copied or pickled, so a stage function
    must not mutate its input if an earlier stage or the caller still reads it. Done-callbacks run on
    the pool thread that finished the item; submitting the next stage from one is safe because every
    stage has its own pool.

    `close()` cancels work that has not started and waits for running items (threads cannot be
    interrupted); from the moment it begins, `submit` returns cancelled futures, so a callback chain
    still running ends quietly. A close interrupted while it waits is finished by the next one.

    Thread-safety: `submit` may be called from any thread, including done-callbacks; `start` and
    `close` belong to the owner (`close` may also be called from a done-callback). `close` is
    idempotent.
    """

    name = "thread"

    def __init__(self) -> None:
        self.reason = "requested explicitly"
        self._stages: tuple[Stage, ...] | None = None
        self._pools: list[ThreadPoolExecutor] = []
        self._closed = False
        # What marks this runner's pool threads. Not the runner itself: a pool thread holds its
        # initializer for life, so a bound method would keep the runner, hence its pools, alive
        # from their own threads, and a runner never closed would keep its idle threads forever
        # instead of their exiting once the runner is garbage.
        self._mark = object()

    def start(self, stages: Sequence[Stage]) -> None:
        check_startable(self._stages is not None, self._closed)
        self._stages = validate_stages(stages)
        self._pid = os.getpid()
        self._pools = [
            ThreadPoolExecutor(
                max_workers=stage.parallelism,
                thread_name_prefix=f"zephon-{stage.name}",
                initializer=_mark_pool_thread,
                initargs=(self._mark,),
            )
            for stage in self._stages
        ]
        _started.add(self)

    def submit(self, stage_index: int, item: Any) -> Future:
        stage = stage_at(self._stages, stage_index)
        check_owner(self._pid)
        if self._closed:
            return cancelled_future()
        try:
            return self._pools[stage_index].submit(stage.fn, item)
        except RuntimeError as error:
            if self._closed:  # the pool shut down between the check and the submit
                return cancelled_future()
            # The runner is open (a thread could not start: a container's thread limit): the item
            # fails with the cause, where a cancelled future would reach the loader as a bare
            # CancelledError.
            failed: Future = Future()
            failed.set_exception(error)
            return failed

    def close(self) -> None:
        self._closed = True
        _started.discard(self)
        if self._stages is not None and os.getpid() != self._pid:
            # A forked child's copy (a child leaving the parent's `with` block): its pools' threads
            # are the parent's and did not survive the fork, and a pool's lock a parent thread
            # held at the fork (submitting the next stage) stays held here for good.
            return
        # Every pool's queued work is cancelled before any is waited for, and a pool is waited for
        # on every call (joining finished threads is cheap): a close cut short by Ctrl-C while it
        # waits for running items has stopped every pool already, and the next close() waits for
        # the rest. A pool thread cannot join itself; when a done-callback closes the runner the
        # threads are left to finish on their own (they exit once their queues are drained).
        self._cancel_queued()
        if getattr(_pool_thread, "mark", None) is not self._mark:
            for pool in self._pools:
                pool.shutdown(wait=True)

    def _cancel_queued(self) -> None:
        """Mark closed and cancel every pool's queued work, waiting for nothing."""
        self._closed = True
        if self._stages is None or os.getpid() != self._pid:
            return
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _mark_pool_thread(mark: object) -> None:
    _pool_thread.mark = mark
