"""Checks and small pieces every runner shares, so that all of them fail the same way."""

from __future__ import annotations

import logging
import numbers
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager

from zephon._errors import ConfigurationError, check_finite
from zephon._runner import Stage

from ._errors import RunnerReusedError

__all__ = [
    "cancel_and_notify", "cancelled_future", "check_close_timeout", "check_owner", "check_startable",
    "check_task_timeout", "end_in_close", "end_on_runner_thread", "exit_hook", "set_unless_ended", "stage_at",
    "validate_stages",
]

# Whether the main thread runs a runner's exit hook now: a plain flag, set and reset by that thread
# alone (an exit hook takes no lock).
_in_exit_hook = False


def validate_stages(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """The stages as an immutable tuple, refusing a layout no runner can serve."""
    checked = tuple(stages)
    for index, stage in enumerate(checked):
        if not isinstance(stage, Stage):
            raise ConfigurationError(f"stage {index} is a {type(stage).__name__}, not a Stage")
        if not callable(stage.fn):
            raise ConfigurationError(f"stage {stage.name!r}: fn is not callable")
        if isinstance(stage.parallelism, bool) or not isinstance(stage.parallelism, int) or stage.parallelism < 1:
            raise ConfigurationError(
                f"stage {stage.name!r}: parallelism must be a positive int, got {stage.parallelism!r}"
            )
    return checked


def check_task_timeout(task_timeout_s: float | None) -> float | None:
    """`task_timeout_s` as given, refused unless None (no timeout) or a positive number (inf is
    taken: no timeout either). Types are checked too: True or "30" was taken for a number."""
    if task_timeout_s is not None and not (
        isinstance(task_timeout_s, numbers.Real) and not isinstance(task_timeout_s, bool) and task_timeout_s > 0
    ):
        raise ConfigurationError(f"task_timeout_s must be a positive number or None, got {task_timeout_s!r}")
    return task_timeout_s


def check_close_timeout(close_timeout_s: float) -> float:
    """`close_timeout_s` as given, refused unless a finite number >= 0. Checked when the runner is
    made, not at close(): a bad one (None for "wait forever") failed close() after it had begun,
    leaving the threads or workers running and the buffer directory behind."""
    if check_finite(close_timeout_s, "close_timeout_s") < 0:
        raise ConfigurationError(f"close_timeout_s must be >= 0, got {close_timeout_s!r}")
    return close_timeout_s


def check_startable(runner: object, started: bool, closed: bool) -> None:
    """`start` runs once per runner. A second call is most often a second loader given the same
    instance through a pipeline's options (a resume in the same process, another iteration of the
    pipeline), which never called `start` itself: the message says what to do, naming the runner."""
    if started or closed:
        kind = type(runner).__name__
        raise RunnerReusedError(
            f"this {kind} was started or closed already (start() may be called once, before close()): a runner "
            "instance serves one loader; pass a runner name or factory instead, so that each loader makes its own: "
            f"runner={runner.name!r}, or for runner options functools.partial({kind}, ...)"
        )


def check_owner(started_in: int) -> None:
    """Refuse work in a process forked from the one that started the runner: a thread pool's
    threads did not survive the fork (the item would wait forever), and a process runner's
    workers answer the parent's reader thread (which would take the child's replies for its own)."""
    if os.getpid() != started_in:
        raise RuntimeError(
            f"this runner was started in process {started_in}; a process forked from it must start its own"
        )


def stage_at(stages: tuple[Stage, ...] | None, index: int) -> Stage:
    """The stage `submit` names; misuse is a programming error, so it raises instead of failing a future."""
    if stages is None:
        raise RuntimeError("submit() called before start()")
    if not 0 <= index < len(stages):
        raise IndexError(f"stage index {index} out of range for {len(stages)} stage(s)")
    return stages[index]


def cancelled_future() -> Future:
    """What `submit` returns once the runner is closing.

    A chain of done-callbacks may still be submitting the next stage while the owner closes the
    runner; a cancelled future lets that chain end quietly instead of raising inside a callback.
    """
    future: Future = Future()
    cancel_and_notify(future)
    return future


def cancel_and_notify(future: Future) -> None:
    """End `future` cancelled as a concurrent.futures executor does, unless it has finished.

    `cancel()` alone runs the done-callbacks and makes `result()` raise, but `wait()` and
    `as_completed()` count a cancelled future as done only once `set_running_or_notify_cancel()`
    has told their waiters: without it they waited out their timeout for it, or for ever. That
    call raises when made twice, so only the one party that owns the future's start may make it
    (the thread that took its item from a queue, the one that claimed it from a runner's
    unfinished set). A future its caller has cancelled already runs no callback again here.

    The waiters are told even when a done-callback that `cancel()` runs raises (a Ctrl-C landing
    in one as close() cancels: concurrent.futures lets a BaseException through). The future has
    left the queue or the held set already, so no later close() reaches it again: `wait()` waited
    for it for ever. It is cancelled by then (callbacks run after the state is set).
    """
    try:
        cancelled = future.cancel()
    except BaseException:
        future.set_running_or_notify_cancel()
        raise
    if cancelled:
        future.set_running_or_notify_cancel()


def set_unless_ended(setter: Callable[[object], None], value: object) -> None:
    """`setter(value)` (a running future's `set_result` or `set_exception`), unless the future has
    ended already: failed past `task_timeout_s` or at close while its item ran, or its item
    returned just as the runner failed it. `value` is then dropped."""
    try:
        setter(value)
    except InvalidStateError:
        pass


def end_on_runner_thread(
    log: logging.Logger | logging.LoggerAdapter, end: Callable[..., object], *args: object
) -> None:
    """`end(*args)`, a call that ends a future and so runs its done-callbacks (`set_result`,
    `set_exception`, `cancel_and_notify`), made on a thread the runner owns, which must go on.

    `concurrent.futures` catches only `Exception` from a done-callback; a `SystemExit`,
    `GeneratorExit` or a user's own `BaseException` went through to this thread and ended it: a
    stage thread's queue was never served again, the `task_timeout_s` watch failed nothing more,
    the process runner's reader read no later reply. It is logged on `log` instead, naming the
    thread; the future is ended by then (callbacks run after its state is set), but its callbacks
    after the one that raised do not run. An `Exception` from `end` itself (`InvalidStateError`)
    is the caller's. No lock is taken here: callbacks run on the caller's terms."""
    try:
        end(*args)
    except Exception:
        raise
    except BaseException as error:
        log.error(
            "a done-callback raised %s on thread %s, which goes on; the future's later done-callbacks were not run",
            type(error).__name__, threading.current_thread().name, exc_info=error,
        )


def end_in_close(
    log: logging.Logger | logging.LoggerAdapter, end: Callable[..., object], *args: object
) -> None:
    """`end(*args)`, a call that ends a future from `close()` (cancelling queued or held work,
    failing an item left running), where a done-callback may raise a BaseException.

    On the main thread outside an exit hook it goes through and cuts the close short: a Ctrl-C
    there is the user's, and the next `close()` finishes the rest. Anywhere else no one calls
    `close()` again (the closer thread closing a dropped loader's runner, a runner's own thread,
    an exit hook): it is logged and the close goes on (`end_on_runner_thread`). Raised there, it
    left the rest of a thread runner's queue uncancelled and its idle threads waiting until exit,
    a process runner's other held futures unended and its /dev/shm directory in place, and in
    the thread runners' exit hook every runner after that one unstopped."""
    if threading.current_thread() is threading.main_thread() and not _in_exit_hook:
        end(*args)
    else:
        end_on_runner_thread(log, end, *args)


@contextmanager
def exit_hook() -> Iterator[None]:
    """Mark the main thread as running a runner's exit hook (`end_in_close`), taking no lock."""
    global _in_exit_hook
    _in_exit_hook = True
    try:
        yield
    finally:
        _in_exit_hook = False
