"""The futures a runner returns keep concurrent.futures' contract, whichever way the runner ends
them: `wait()` and `as_completed()` see them done, each done-callback runs once, and `result()` and
`exception()` say how it ended. A user's own tooling around a runner relies on those functions.

A future ended by `cancel()` alone is done for its own `result()` but not for `wait()` or
`as_completed()`: they count it only once `set_running_or_notify_cancel()` has told its waiters,
so they waited out their whole timeout for it, or for ever without one. The timeouts below only
guard against a hang; every assertion is on what the futures and `wait()` say."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import CancelledError, Future, as_completed, wait
from pathlib import Path

import pytest

from runners import InlineRunner, ProcessRunner, RunnerFailedError, ThreadRunner, WorkerCrashedError
from zephon._runner import Stage

RUNNERS = [InlineRunner, ThreadRunner, ProcessRunner]
GUARD_S = 30  # a hang guard only: the futures under test are all done before it


def counting_callbacks(futures: list[Future]) -> Counter:
    """How many times each future's done-callback has run, by position."""
    calls: Counter = Counter()
    lock = threading.Lock()

    def count(index: int, _future: Future) -> None:
        with lock:
            calls[index] += 1

    for index, future in enumerate(futures):
        future.add_done_callback(lambda future, index=index: count(index, future))
    return calls


def assert_done_for_wait_and_as_completed(futures: list[Future]) -> None:
    done, not_done = wait(futures, timeout=GUARD_S)
    assert not_done == set(), f"{len(not_done)} of {len(futures)} futures not done for wait()"
    assert done == set(futures)
    completed = []
    try:
        for future in as_completed(futures, timeout=GUARD_S):
            completed.append(future)
    except TimeoutError:
        pass
    assert set(completed) == set(futures), "as_completed() did not yield every future"


def assert_cancelled(future: Future) -> None:
    assert future.cancelled() and future.done()
    with pytest.raises(CancelledError):
        future.result(0)
    with pytest.raises(CancelledError):
        future.exception(0)


@pytest.mark.parametrize("make", RUNNERS, ids=lambda c: c.name)
def test_a_future_submitted_after_close_is_done_for_wait_and_as_completed(make):
    runner = make()
    runner.start([Stage("identity", lambda x: x)])
    runner.close()
    late = [runner.submit(0, i) for i in range(3)]
    calls = counting_callbacks(late)
    assert_done_for_wait_and_as_completed(late)
    for future in late:
        assert_cancelled(future)
    assert calls == Counter({0: 1, 1: 1, 2: 1})
