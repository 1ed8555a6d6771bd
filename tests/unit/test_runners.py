"""Behaviour every runner shares: same results, futures that carry results or exceptions, chaining
through done-callbacks, and a close() that is idempotent and ends later submissions quietly."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from concurrent.futures import CancelledError, Future
from functools import partial

import numpy as np
import pytest

from runners import InlineRunner, ProcessRunner, RunnerFailedError, ThreadRunner, WorkerCrashedError
from zephon._errors import ConfigurationError
from zephon._runner import Runner, Stage

RUNNERS = [InlineRunner, ThreadRunner, ProcessRunner]


def numpy_heavy(seed: int) -> dict:
    """Deterministic array work that avoids BLAS, whose threading may change float summation order."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, size=(192, 256, 3), dtype=np.uint8)
    signal = rng.standard_normal(50_000)
    return {
        "seed": seed,
        "image": image[::-1].copy(),
        "histogram": np.bincount(image.ravel(), minlength=256),
        "spectrum": np.abs(np.fft.rfft(signal)),
        "sorted": np.sort(signal),
    }


def run_stage(runner: Runner, fn, items, parallelism: int = 2, timeout: float = 20.0) -> list:
    runner.start([Stage("work", fn, parallelism)])
    futures = [runner.submit(0, item) for item in items]
    return [future.result(timeout) for future in futures]


def assert_same_outputs(left: list[dict], right: list[dict]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize("make", [ThreadRunner, ProcessRunner], ids=lambda c: c.name)
def test_every_runner_returns_what_the_inline_runner_returns_for_numpy_work(make):
    with InlineRunner() as reference:
        expected = run_stage(reference, numpy_heavy, range(12))
    with make() as runner:
        assert_same_outputs(run_stage(runner, numpy_heavy, range(12), parallelism=3), expected)


@pytest.mark.parametrize("make", [ThreadRunner, ProcessRunner], ids=lambda c: c.name)
def test_results_are_right_even_when_futures_resolve_out_of_order(make, tmp_path):
    gate = tmp_path / "gate"  # a file, so that it works across processes too
    completed: list[int] = []
    lock = threading.Lock()

    def square(i: int) -> int:
        deadline = time.monotonic() + 10
        while i == 0 and not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        return i * i

    def record(i: int, _future: Future) -> None:
        with lock:
            completed.append(i)

    with make() as runner:
        runner.start([Stage("square", square, 2)])
        futures = [runner.submit(0, i) for i in range(2)]
        for i, future in enumerate(futures):
            future.add_done_callback(partial(record, i))
        assert futures[1].result(10) == 1
        assert not futures[0].done()
        # Submitted while item 0 still runs (a process worker may queue one behind it).
        futures += [runner.submit(0, i) for i in range(2, 4)]
        for i, future in enumerate(futures[2:], start=2):
            future.add_done_callback(partial(record, i))
        gate.touch()
        assert [future.result(10) for future in futures] == [0, 1, 4, 9]
    assert completed[0] == 1 and sorted(completed) == [0, 1, 2, 3]


@pytest.mark.parametrize("make", RUNNERS, ids=lambda c: c.name)
def test_an_exception_from_the_stage_function_reaches_the_future_with_its_message(make):
    def picky(x: int) -> int:
        if x == 3:
            raise ValueError(f"item {x} is not welcome")
        return x

    with make() as runner:
        runner.start([Stage("picky", picky)])
        futures = [runner.submit(0, x) for x in range(5)]
        assert futures[3].exception(10).args == ("item 3 is not welcome",)
        assert isinstance(futures[3].exception(), ValueError)
        assert [futures[i].result(10) for i in (0, 1, 2, 4)] == [0, 1, 2, 4]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit], ids=lambda c: c.__name__)
@pytest.mark.parametrize("make", RUNNERS, ids=lambda c: c.name)
def test_keyboard_interrupt_or_system_exit_from_the_stage_function_reaches_the_caller_as_itself_once(
    make, stop, tmp_path
):
    """Not an item failure and not a crash: the caller gets the very exception (inline raises it
    from submit, in the caller's own thread; the others from the future), nothing re-runs the item,
    and the stage goes on serving."""
    attempts = tmp_path / "attempts"  # a file, so that attempts in worker processes count too

    def stops_at_three(x: int) -> int:
        if x == 3:
            with open(attempts, "a") as log:
                log.write("attempt\n")
            raise stop(f"stop at item {x}")
        return x

    with make() as runner:
        runner.start([Stage("stops", stops_at_three, 1)])
        with pytest.raises(stop, match="stop at item 3"):
            runner.submit(0, 3).result(10)
        assert [runner.submit(0, x).result(10) for x in (4, 5)] == [4, 5]
        stats = runner.stats() if isinstance(runner, ProcessRunner) else None
    assert attempts.read_text().count("attempt") == 1
    if stats is not None:
        assert (stats.retries, stats.workers_replaced) == (0, 0)


@pytest.mark.parametrize("make", RUNNERS, ids=lambda c: c.name)
def test_a_done_callback_can_submit_the_next_stage(make):
    n = 40
    results: dict[int, int] = {}
    finished = threading.Event()
    lock = threading.Lock()

    with make() as runner:

        def second_done(i: int, future: Future) -> None:
            with lock:
                results[i] = future.result()
                if len(results) == n:
                    finished.set()

        def first_done(i: int, future: Future) -> None:
            runner.submit(1, future.result()).add_done_callback(partial(second_done, i))

        runner.start([Stage("add", lambda x: x + 1, 2), Stage("double", lambda x: x * 2, 2)])
        for i in range(n):
            runner.submit(0, i).add_done_callback(partial(first_done, i))
        assert finished.wait(20)
    assert results == {i: (i + 1) * 2 for i in range(n)}


@pytest.mark.parametrize("make", RUNNERS, ids=lambda c: c.name)
def test_close_is_idempotent_and_later_submissions_are_cancelled(make):
    runner = make()
    runner.start([Stage("identity", lambda x: x)])
    assert runner.submit(0, 1).result(10) == 1
    runner.close()
    runner.close()
    late = runner.submit(0, 2)
    assert late.cancelled()
    with pytest.raises(CancelledError):
        late.result(0)


@pytest.mark.parametrize("make", RUNNERS, ids=lambda c: c.name)
def test_close_from_a_done_callback_does_not_deadlock(make):
    closed = threading.Event()
    with make() as runner:
        runner.start([Stage("slow", lambda x: time.sleep(0.1) or x, 2)])

        def close_runner(_future: Future) -> None:
            runner.close()
            closed.set()

        runner.submit(0, 1).add_done_callback(close_runner)
        assert closed.wait(10)
        assert runner.submit(0, 2).cancelled()


@pytest.mark.parametrize("make", RUNNERS, ids=lambda c: c.name)
def test_the_context_manager_closes_the_runner(make):
    with make() as runner:
        runner.start([Stage("identity", lambda x: x)])
    assert runner.submit(0, 1).cancelled()


@pytest.mark.parametrize("make", RUNNERS, ids=lambda c: c.name)
def test_every_runner_builds_without_arguments_and_explains_itself(make):
    runner = make()
    assert isinstance(runner, Runner)
    assert runner.name == {InlineRunner: "inline", ThreadRunner: "thread", ProcessRunner: "process"}[make]
    assert runner.reason == "requested explicitly"
    runner.close()


@pytest.mark.parametrize("make", RUNNERS, ids=lambda c: c.name)
def test_misuse_fails_loudly_instead_of_hanging(make):
    with make() as runner:
        with pytest.raises(RuntimeError, match="before start"):
            runner.submit(0, 1)
        with pytest.raises(ConfigurationError, match="parallelism"):
            runner.start([Stage("zero", lambda x: x, 0)])
    with make() as runner:
        runner.start([Stage("one", lambda x: x)])
        with pytest.raises(IndexError):
            runner.submit(1, 1)
        with pytest.raises(RuntimeError, match="once"):
            runner.start([Stage("again", lambda x: x)])


def test_inline_runner_completes_the_future_before_submit_returns():
    with InlineRunner() as runner:
        runner.start([Stage("boom", lambda x: 1 / x)])
        ok, failed = runner.submit(0, 2), runner.submit(0, 0)
        assert ok.done() and ok.result() == 0.5
        assert failed.done() and isinstance(failed.exception(), ZeroDivisionError)


def test_thread_runner_shares_items_and_names_threads_after_the_stage():
    item = {"payload": np.zeros(10)}
    with ThreadRunner() as runner:
        runner.start([Stage("tokenize", lambda x: (x, threading.current_thread().name), 2)])
        returned, thread_name = runner.submit(0, item).result(10)
    assert returned is item
    assert "tokenize" in thread_name


def test_thread_runner_joins_its_threads_on_close():
    before = set(threading.enumerate())
    with ThreadRunner() as runner:
        runner.start([Stage("a", lambda x: x, 3), Stage("b", lambda x: x, 2)])
        assert [runner.submit(i % 2, i).result(10) for i in range(10)] == list(range(10))
    assert set(threading.enumerate()) == before


def test_a_thread_runner_close_interrupted_while_it_waits_is_finished_by_the_next_close():
    """Close shut the pools down one by one, each waiting for its running item: Ctrl-C during the
    first wait left the other pools' queued items to run, and a second close returned at once."""
    before = set(threading.enumerate())
    release, started = threading.Event(), threading.Semaphore(0)

    def held(x):
        started.release()
        return release.wait(60) and x

    runner = ThreadRunner()
    runner.start([Stage("a", held, 1), Stage("b", held, 1)])
    running = [runner.submit(0, 0), runner.submit(1, 1)]
    for _ in running:  # each pool's one thread is inside its item before anything else is queued
        assert started.acquire(timeout=60)
    queued = [runner.submit(0, 2), runner.submit(1, 3)]
    first = runner._pools[0]

    def interrupted_wait(deadline):  # Ctrl-C while it waits for the running item
        del first.wait
        raise KeyboardInterrupt

    first.wait = interrupted_wait
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.close()
        assert all(future.cancelled() for future in queued)
    finally:
        release.set()
    runner.close()
    assert [future.result() for future in running] == [0, 1]
    assert set(threading.enumerate()) == before


def test_a_thread_runner_close_leaves_an_item_that_never_returns_behind_after_close_timeout_s_naming_where_it_is(
        caplog):
    """close() waited for running items without a timeout: a stage function that never returns (a
    hung read, a deadlock in a C library) made it, and interpreter exit, wait for ever. It now
    waits `close_timeout_s`, then leaves that thread behind, a daemon thread that exit does not
    wait for, and says which stage and which call; a later close neither waits nor warns again.
    The item fails (test_runner_futures.py), and its result, should the call return, is dropped."""
    release, started = threading.Event(), threading.Event()

    def blocked_forever(x):
        started.set()
        return release.wait() and x

    runner = ThreadRunner(close_timeout_s=0.2)
    runner.start([Stage("stuck", blocked_forever, 1), Stage("fine", lambda x: x, 2)])
    stuck = runner.submit(0, 1)
    assert started.wait(60) and runner.submit(1, 2).result(10) == 2
    threads = [thread for pool in runner._pools for thread in pool.threads]
    try:
        with caplog.at_level(logging.WARNING, logger="runners.thread"):
            runner.close()
            runner.close()
        assert isinstance(stuck.exception(0), WorkerCrashedError)
        warned = [record.getMessage() for record in caplog.records]
        assert len(warned) == 1, warned
        assert "stage 'stuck': thread zephon-stuck_" in warned[0] and "in blocked_forever" in warned[0]
        for idle in threads[1:]:  # told to exit; close gave them close_timeout_s, a loaded machine may take longer
            idle.join(60)
        assert [thread.is_alive() for thread in threads] == [True, False, False], "only the stuck thread is left"
        assert threads[0].daemon, "a thread left behind must not hold up interpreter exit"
    finally:
        release.set()
    threads[0].join(60)
    assert not threads[0].is_alive(), "the thread left behind exits once its call returns"
    assert isinstance(stuck.exception(0), WorkerCrashedError), "its late result is dropped"


@pytest.mark.timeout(60)
def test_a_thread_runner_close_reports_only_threads_running_something_not_idle_ones_yet_to_exit(caplog):
    """With close_timeout_s=0 (or any timeout a busy machine outlasts) the idle threads, told to
    exit an instant before, had mostly not exited yet: each was reported as still running an item
    ("It is in: (it has just finished)" or nothing), a warning per thread at every close, so the
    threads really stuck were lost among them. Those still are reported, in a stage function
    written in Python or in C (a held lock's `acquire`: no Python frame of its own)."""
    release, started = threading.Event(), threading.Event()

    def blocked(x):
        started.set()
        return release.wait() and x

    locks, runners = [], []
    try:
        with caplog.at_level(logging.WARNING, logger="runners.thread"):
            for _ in range(10):
                held = threading.Lock()
                held.acquire()
                locks.append(held)
                runner = ThreadRunner(close_timeout_s=0)
                runner.start([Stage("stuck", blocked, 1), Stage("in_c", held.acquire, 1), Stage("idle", lambda x: x, 4)])
                runners.append(runner)
                started.clear()
                stuck, in_c = runner.submit(0, 1), runner.submit(1, 1)
                assert started.wait(30) and runner.submit(2, 2).result(30) == 2
                while not runner._pools[1].running():
                    time.sleep(0.001)
                runner.close()
                assert isinstance(stuck.exception(0), WorkerCrashedError)
                assert isinstance(in_c.exception(0), WorkerCrashedError)
        warned = sorted(record.getMessage().partition(" still runs")[0] for record in caplog.records)
        assert warned == ["stage 'in_c': thread zephon-in_c_0"] * 10 + ["stage 'stuck': thread zephon-stuck_0"] * 10, warned
    finally:
        release.set()
        for held in locks:
            held.release()
    for runner in runners:
        for pool in runner._pools:
            for thread in pool.threads:
                thread.join(30)


@pytest.mark.timeout(60)
def test_a_thread_left_behind_is_reported_once_when_two_closes_wait_for_it_at_once(caplog, monkeypatch):
    """Each close (and the exit hook) that waited for the running items reported every thread
    still running, so two waiting at once (the owner's close and the closer thread's, or the exit
    hook during the closer's close) each warned about the same stuck thread."""
    release, started = threading.Event(), threading.Event()

    def blocked(x):
        started.set()
        return release.wait() and x

    runner = ThreadRunner(close_timeout_s=0.2)
    runner.start([Stage("stuck", blocked, 1)])
    stuck = runner.submit(0, 1)
    assert started.wait(60)
    both_waiting = threading.Barrier(2, timeout=30)
    wait = type(runner._pools[0]).wait

    def wait_once_both_close(pool, deadline):  # neither close has reported before the other waits
        both_waiting.wait()
        return wait(pool, deadline)

    monkeypatch.setattr(type(runner._pools[0]), "wait", wait_once_both_close)
    try:
        with caplog.at_level(logging.WARNING, logger="runners.thread"):
            other = threading.Thread(target=runner.close)
            other.start()
            runner.close()
            other.join(30)
        warned = [record.getMessage() for record in caplog.records]
        assert len(warned) == 1 and "thread zephon-stuck_0" in warned[0], warned
    finally:
        release.set()
    with pytest.raises(WorkerCrashedError, match="close_timeout_s"):  # failed once, by the wait that reported it
        stuck.result(10)


def test_a_thread_runner_fails_an_item_running_past_task_timeout_s_naming_its_stage_and_where_it_is_stuck(
        caplog, monkeypatch):
    """A stage function that never returns (a hung read, a deadlock in a C library) kept whoever
    waited for its item waiting for ever, silently. With `task_timeout_s` the item fails with
    WorkerCrashedError naming the stage, the thread and the call it is stuck in. A thread cannot be
    stopped, so the runner runs nothing more: queued and later items fail with RunnerFailedError,
    the timeout as its cause; close() leaves the thread behind with its warning, and the thread,
    once its call returns, drops its result and exits without an error of its own."""
    unhandled: list = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    release, started = threading.Event(), threading.Event()

    def blocked_until_released(x):
        started.set()
        return release.wait() and x

    runner = ThreadRunner(task_timeout_s=0.2, close_timeout_s=0.1)
    runner.start([Stage("stuck", blocked_until_released, 1), Stage("fine", lambda x: x, 1)])
    stuck = runner.submit(0, 1)
    assert started.wait(60)
    queued = runner.submit(0, 2)
    thread = runner._pools[0].threads[0]
    try:
        timed_out = stuck.exception(60)
        assert isinstance(timed_out, WorkerCrashedError), timed_out
        message = str(timed_out)
        assert "stage 'stuck'" in message and "task_timeout_s=0.2" in message, message
        assert "thread zephon-stuck_0" in message and "in blocked_until_released" in message, message
        for future in (queued, runner.submit(1, 3)):
            failed = future.exception(60)
            assert isinstance(failed, RunnerFailedError) and failed.__cause__ is timed_out, failed
            assert "thread runner" in str(failed) and "stage 'stuck'" in str(failed), failed
        with caplog.at_level(logging.WARNING, logger="runners.thread"):
            runner.close()
        warned = [record.getMessage() for record in caplog.records]
        assert len(warned) == 1 and "in blocked_until_released" in warned[0], warned
    finally:
        release.set()
    thread.join(60)
    assert not thread.is_alive() and unhandled == []
    assert stuck.exception() is timed_out, "the late result does not replace the timeout"


def test_a_thread_runner_times_no_item_out_by_default_or_past_an_infinite_task_timeout_s():
    """Off by default, like the process runner's: no thread watches the items, so a slow item
    takes as long as it takes; an infinite timeout is taken too (it overflowed no wait)."""
    for options in ({}, {"task_timeout_s": float("inf")}):
        release = threading.Event()
        before = set(threading.enumerate())
        runner = ThreadRunner(**options)
        runner.start([Stage("slow", lambda x: release.wait() and x, 1)])
        future = runner.submit(0, 7)
        watchers = set(threading.enumerate()) - before - set(runner._pools[0].threads)
        assert len(watchers) == (1 if options else 0), watchers
        release.set()
        assert future.result(60) == 7
        runner.close()
        assert set(threading.enumerate()) == before, "close stops the watching thread too"


@pytest.mark.parametrize("task_timeout_s", [0, -1.0, float("nan"), "30", True])
def test_a_thread_runner_task_timeout_that_is_not_a_positive_number_is_refused_at_construction(task_timeout_s):
    with pytest.raises(ConfigurationError, match="task_timeout_s must be a positive number or None"):
        ThreadRunner(task_timeout_s=task_timeout_s)


@pytest.mark.parametrize("close_timeout_s", [None, -1.0, float("nan")])
def test_a_thread_runner_close_timeout_that_close_could_not_wait_by_is_refused_at_construction(close_timeout_s):
    with pytest.raises(ConfigurationError, match="close_timeout_s"):
        ThreadRunner(close_timeout_s=close_timeout_s)


@pytest.mark.parametrize("options", [{}, {"task_timeout_s": 3600}], ids=["plain", "task_timeout_s"])
def test_a_thread_runner_never_closed_is_freed_with_its_threads_once_dropped(options):
    # A pool thread keeps its initializer for life; had it been a method of the runner, the
    # threads would keep the runner and its pools alive, and a loader dropped without close()
    # would leave its idle threads behind for good. The task-timeout watch holds the runner
    # weakly and is woken by its collection, not an hour later.
    before = set(threading.enumerate())
    runner = ThreadRunner(**options)
    runner.start([Stage("a", lambda x: x, 3), Stage("b", lambda x: x, 2)])
    assert [runner.submit(i % 2, i).result(10) for i in range(10)] == list(range(10))
    threads = set(threading.enumerate()) - before
    assert threads
    dropped = weakref.ref(runner)
    del runner
    gc.collect()
    assert dropped() is None
    for thread in threads:  # woken by the pools' collection; the timeout only guards the suite
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)


def test_a_thread_that_cannot_start_fails_start_with_that_error_and_leaves_no_thread_behind(monkeypatch):
    """A stage's threads start with the runner, so a thread that cannot start (a container's thread
    limit) fails `start()` with the cause, and the threads started before it exit."""
    before = set(threading.enumerate())
    start, started = threading.Thread.start, []

    def third_cannot_start(thread):
        if len(started) == 2:
            raise RuntimeError("can't start new thread")
        start(thread)
        started.append(thread)

    runner = ThreadRunner()
    monkeypatch.setattr(threading.Thread, "start", third_cannot_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        runner.start([Stage("a", lambda x: x, 2), Stage("b", lambda x: x, 2)])
    monkeypatch.undo()
    for thread in started:  # told to exit; the timeout only guards the suite
        thread.join(60)
    assert len(started) == 2 and set(threading.enumerate()) == before


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize("make", [ThreadRunner, ProcessRunner], ids=["thread", "process"])
def test_a_runner_used_in_a_forked_child_refuses_at_once_and_serves_its_parent_on(make):
    """A thread pool's threads did not survive the fork (the child's item would never run); a
    process runner's workers answer the parent's reader thread, which would have paired the child's
    reply with one of the parent's items or stopped on it."""
    import os

    with make() as runner:
        runner.start([Stage("double", lambda x: 2 * x)])
        assert runner.submit(0, 1).result(timeout=30) == 2
        child = os.fork()
        if child == 0:
            code = 1
            try:
                with pytest.raises(RuntimeError, match="forked from it must start its own"):
                    runner.submit(0, 100)
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(child, 0)[1] == 0
        assert [runner.submit(0, x).result(timeout=30) for x in (3, 4)] == [6, 8]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_thread_runner_closed_in_a_forked_child_returns_at_once_and_serves_its_parent_on():
    """A thread resolving a future holds its lock for an instant; a child forked then inherits it
    held, so a child closing its copy of the runner (leaving the parent's `with` block) must not
    cancel the queued futures it copied: it would wait for that lock forever. The threads and
    their items are the parent's anyway. The fork's instant is made certain here by holding a
    queued item's future lock in a parent thread while forking."""
    import os
    import signal

    release_item = threading.Event()
    with ThreadRunner() as runner:
        runner.start([Stage("double", lambda x: release_item.wait(30) and 2 * x)])
        running, queued = runner.submit(0, 1), runner.submit(0, 2)
        held, release = threading.Event(), threading.Event()

        def resolving() -> None:  # what a thread does inside Future.set_result
            with queued._condition:
                held.set()
                release.wait()

        holder = threading.Thread(target=resolving)
        holder.start()
        held.wait()
        child = os.fork()
        if child == 0:
            code = 1
            try:
                signal.alarm(15)  # a child stuck on the lock dies instead of hanging the test
                runner.close()
                code = 0
            finally:
                os._exit(code)
        release.set()
        holder.join()
        assert os.waitpid(child, 0)[1] == 0, "the child's close returned (it hung, killed by its alarm)"
        release_item.set()
        assert [running.result(timeout=30), queued.result(timeout=30)] == [2, 4]
        assert [runner.submit(0, x).result(timeout=30) for x in (3, 4)] == [6, 8]
