"""A done-callback that raises a BaseException on a thread a runner owns leaves that thread serving.

`concurrent.futures` catches only `Exception` from a done-callback (and logs it); a `SystemExit`,
`GeneratorExit` or a user's own `BaseException` subclass goes through `set_result`,
`set_exception` or `cancel` to whoever called it. On a runner's own thread that ended the thread:
a stage thread (its queue then never served, whoever waits for an item waiting for ever), the
`task_timeout_s` watch (the stuck item and the rest of the queue never failed), or the process
runner's reader (every later reply never read). The same error raised as `close()` cancels a
future cut that close short where no one closes the runner again (the closer thread, the exit
hooks): it now goes on to the end. The error is logged, naming it, not swallowed.
The timeouts below only guard against a hang; every assertion is on what futures and logs say."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, wait
from pathlib import Path

import pytest

from runners import ProcessRunner, RunnerFailedError, ThreadRunner, WorkerCrashedError
from zephon import _runner_closer
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

    # The callbacks below are added after the items are submitted: one added once the watch had
    # failed its item ran on this thread instead, and raised here. A timeout of 5 s, not 0.2,
    # leaves this thread that long for the five submits and two additions, however loaded the machine.
    runner = ThreadRunner(task_timeout_s=5.0, close_timeout_s=GUARD_S)
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


# -- a close no one will call again: on the closer thread, and in the exit hooks ------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error_type", ERRORS)
def test_a_thread_runner_closed_by_the_closer_thread_cancels_its_whole_queue_and_ends_its_threads_after_a_done_callback_raises(
        error_type, caplog):
    gate, first_taken = threading.Event(), threading.Event()

    def fn(x: int) -> int:
        first_taken.set()
        gate.wait(GUARD_S)
        return x

    runner = ThreadRunner(close_timeout_s=GUARD_S)
    with caplog.at_level(logging.ERROR):
        runner.start([Stage("only", fn, parallelism=1)])
        runner.submit(0, 0)
        # The stage's one thread holds item 0 before the others are queued: a thread still waiting
        # on the queue as the close drains it takes one of them and runs it, as it should.
        assert first_taken.wait(GUARD_S)
        queued = [runner.submit(0, x) for x in range(1, 6)]
        queued[0].add_done_callback(raising_callback(error_type))
        closed = threading.Event()
        _runner_closer.start()
        _runner_closer.close_later(runner.close)  # what a dropped loader's finalizer does
        _, not_ended = wait(queued, timeout=GUARD_S)
        gate.set()
        _runner_closer.close_later(closed.set)  # one close at a time: set once runner.close returned
        assert closed.wait(GUARD_S)
    assert not not_ended, "every queued future ends, cancelled"
    assert all(future.cancelled() for future in queued)
    for thread in runner._pools[0].threads:
        thread.join(GUARD_S)
        assert not thread.is_alive()
    assert error_type.__name__ in caplog.text, "the done-callback's error is logged"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error_type", ERRORS)
def test_a_process_runner_closed_by_the_closer_thread_ends_every_held_future_and_removes_its_directory_after_a_done_callback_raises(
        error_type, tmp_path: Path, caplog):
    never = tmp_path / "never"  # the items wait for it until close terminates their worker
    runner = ProcessRunner(close_timeout_s=1)
    with caplog.at_level(logging.ERROR):
        runner.start([Stage("only", wait_for_file, parallelism=1)])
        held = [runner.submit(0, str(never)) for _ in range(6)]
        held[2].add_done_callback(raising_callback(error_type))
        directory = runner.shm_directory
        closed = threading.Event()
        _runner_closer.start()
        _runner_closer.close_later(runner.close)
        _runner_closer.close_later(closed.set)
        assert closed.wait(GUARD_S)
        _, not_ended = wait(held, timeout=GUARD_S)
    assert not not_ended, "every held future ends, cancelled"
    assert directory is not None and not os.path.exists(directory), "the buffer directory is removed"
    assert runner.worker_pids() == [], "every worker is stopped and reaped"
    assert runner._at_exit is None, "the close finished: the exit hook has nothing left to do"
    assert error_type.__name__ in caplog.text, "the done-callback's error is logged"


_TWO_RUNNERS_OPEN_AT_EXIT = """
import atexit, faulthandler, os, sys, threading
from concurrent.futures import wait
from runners import ProcessRunner, ThreadRunner
from zephon._runner import Stage
from tests.unit.test_runner_callback_base_exceptions import wait_for_file

faulthandler.dump_traceback_later(90, exit=True)
kind, never = sys.argv[1], sys.argv[2]
gate = threading.Event()

def blocks(x):
    gate.wait(60)
    return x

def raise_system_exit(future):
    raise SystemExit("raised by a done-callback")

runners, queued = [], []

def report():  # registered before the runners start: runs after their exit hooks
    _, not_ended = wait(queued, timeout=0)
    gate.set()
    for runner in runners:
        if kind == "thread":
            for thread in runner._pools[0].threads:
                thread.join(30)
                print("thread-alive" if thread.is_alive() else "thread-ended")
        else:
            print("directory-left" if os.path.exists(runner._directory or "") else "directory-removed")
    print(f"not-ended-{len(not_ended)}")
    sys.stdout.flush()

atexit.register(report)
for _ in range(2):
    if kind == "thread":
        runner = ThreadRunner(close_timeout_s=0.5)
        runner.start([Stage("only", blocks, 1)])
        runner.submit(0, 0)
    else:
        runner = ProcessRunner(close_timeout_s=0.5)
        runner.start([Stage("only", wait_for_file, 1)])
        runner.submit(0, never)
    runners.append(runner)
    futures = [runner.submit(0, never) for _ in range(4)]
    futures[1].add_done_callback(raise_system_exit)
    queued.extend(futures)
"""


@pytest.mark.timeout(150)
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize("kind, closed", [("thread", "thread-ended"), ("process", "directory-removed")])
def test_runners_open_at_exit_are_all_closed_to_the_end_by_their_exit_hooks_after_a_done_callback_raises(
        kind, closed, tmp_path: Path):
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _TWO_RUNNERS_OPEN_AT_EXIT, kind, str(tmp_path / "never")], capture_output=True,
        text=True, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])},
    )
    assert done.stdout.split() == [closed, closed, "not-ended-0"], done.stdout + done.stderr
    assert "SystemExit" in done.stderr, "the done-callback's error is logged"
