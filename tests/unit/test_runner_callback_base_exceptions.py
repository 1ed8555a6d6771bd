"""A done-callback that raises a BaseException on a thread a runner owns leaves that thread serving.

`concurrent.futures` catches only `Exception` from a done-callback (and logs it); a `SystemExit`,
`GeneratorExit` or a user's own `BaseException` subclass goes through `set_result`,
`set_exception` or `cancel` to whoever called it. On a runner's own thread that ended the thread:
a stage thread (its queue then never served, whoever waits for an item waiting for ever), the
`task_timeout_s` watch (the stuck item and the rest of the queue never failed), or the process
runner's reader (every later reply never read). The error is logged, naming it, not swallowed.
The timeouts below only guard against a hang; every assertion is on what futures and logs say."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from runners import ProcessRunner, RunnerFailedError, ThreadRunner, WorkerCrashedError
from zephon._runner import Stage

GUARD_S = 20  # a hang guard only


class UsersOwnBaseError(BaseException):
    """A user's BaseException subclass, raised by a done-callback."""


ERRORS = [SystemExit, UsersOwnBaseError]


def raising_callback(error_type: type[BaseException]):
    def callback(_future: Future) -> None:
        raise error_type("raised by a done-callback")

    return callback


def logged_naming(caplog, logger: str, error_type: type[BaseException]) -> list[str]:
    return [
        record.getMessage() for record in caplog.records
        if record.name == logger and error_type.__name__ in record.getMessage()
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("item_fails", [False, True], ids=["result", "exception"])
@pytest.mark.parametrize("error_type", ERRORS)
def test_a_thread_runner_stage_thread_serves_later_items_after_a_done_callback_raises_a_base_exception(
        error_type, item_fails, caplog):
    gate = threading.Event()

    def fn(x: int) -> int:
        gate.wait(GUARD_S)
        if item_fails and x == 0:
            raise ValueError("the item's own error")
        return x * 10

    runner = ThreadRunner(close_timeout_s=GUARD_S)
    with caplog.at_level(logging.ERROR, logger="runners.thread"):
        runner.start([Stage("only", fn, parallelism=1)])
        first = runner.submit(0, 0)
        first.add_done_callback(raising_callback(error_type))  # before it can finish: run on the stage thread
        gate.set()
        later = [runner.submit(0, x) for x in range(1, 5)]
        assert [future.result(timeout=GUARD_S) for future in later] == [10, 20, 30, 40]
        runner.close()
    assert first.done()
    assert logged_naming(caplog, "runners.thread", error_type), caplog.text
    assert all(not thread.is_alive() for thread in runner._pools[0].threads)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error_type", ERRORS)
def test_the_task_timeout_watch_fails_every_item_after_a_done_callback_raises_a_base_exception(error_type, caplog):
    release = threading.Event()

    def hang(x: int) -> int:
        release.wait(GUARD_S)
        return x

    runner = ThreadRunner(task_timeout_s=0.2, close_timeout_s=GUARD_S)
    with caplog.at_level(logging.ERROR, logger="runners.thread"):
        runner.start([Stage("stuck", hang, parallelism=2)])
        stuck = [runner.submit(0, x) for x in range(2)]
        queued = [runner.submit(0, x) for x in range(2, 5)]
        # Raised as the watch drains the queue, and as it fails a running item.
        queued[0].add_done_callback(raising_callback(error_type))
        stuck[0].add_done_callback(raising_callback(error_type))
        for future in stuck:
            assert isinstance(future.exception(timeout=GUARD_S), WorkerCrashedError)
        for future in queued:
            assert isinstance(future.exception(timeout=GUARD_S), RunnerFailedError)
        assert isinstance(runner.submit(0, 5).exception(timeout=GUARD_S), RunnerFailedError)
        release.set()
        runner.close()
    assert len(logged_naming(caplog, "runners.thread", error_type)) == 2, caplog.text
    assert all(not thread.is_alive() for thread in runner._pools[0].threads)
    assert not runner._watch.thread.is_alive()


def wait_for_file(path: str) -> str:
    """A stage function that returns once `path` exists, so the test adds its callback first."""
    while not os.path.exists(path):
        time.sleep(0.01)
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error_type", ERRORS)
def test_the_process_runner_reader_reads_later_replies_after_a_done_callback_raises_a_base_exception(
        error_type, tmp_path: Path, caplog):
    go = tmp_path / "go"
    runner = ProcessRunner(close_timeout_s=GUARD_S)
    with caplog.at_level(logging.ERROR, logger="runners.process"):
        runner.start([Stage("only", wait_for_file, parallelism=1)])
        try:
            first = runner.submit(0, str(go))
            first.add_done_callback(raising_callback(error_type))  # before its reply: run on the reader
            go.touch()
            assert first.result(timeout=GUARD_S) == str(go)
            later = [runner.submit(0, str(go)) for _ in range(4)]
            assert [future.result(timeout=GUARD_S) for future in later] == [str(go)] * 4
        finally:
            runner.close()
    assert logged_naming(caplog, "runners.process", error_type), caplog.text
    assert runner._reader is not None and not runner._reader.is_alive()
