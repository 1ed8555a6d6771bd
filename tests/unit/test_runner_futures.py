"""The futures a runner returns keep concurrent.futures' contract, whichever way the runner ends
them: `wait()` and `as_completed()` see them done, each done-callback runs once, and `result()` and
`exception()` say how it ended, and a done-callback may submit again or close the runner (the
loader chains its stages that way). A user's own tooling around a runner relies on those functions.

A future ended by `cancel()` alone is done for its own `result()` but not for `wait()` or
`as_completed()`: they count it only once `set_running_or_notify_cancel()` has told its waiters,
so they waited out their whole timeout for it, or for ever without one. The timeouts below only
guard against a hang; every assertion is on what the futures and `wait()` say."""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import CancelledError, Future, as_completed, wait
from pathlib import Path

import numpy as np
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


def held_until(release: threading.Event, started: threading.Event):
    """A stage function that signals it runs, then waits for `release` (at most the guard)."""

    def held(x):
        started.set()
        release.wait(GUARD_S)
        return x

    return held


def test_items_still_queued_when_a_thread_runner_closes_are_done_for_wait_and_as_completed():
    """close() cancels the items no thread has taken; one of them its caller had cancelled first."""
    release, started = threading.Event(), threading.Event()
    runner = ThreadRunner()
    runner.start([Stage("held", held_until(release, started), 1)])
    running = runner.submit(0, 0)
    assert started.wait(GUARD_S)
    queued = [runner.submit(0, i) for i in range(1, 4)]
    assert queued[0].cancel()
    calls = counting_callbacks([running, *queued])
    closer = threading.Thread(target=runner.close)  # it waits for the running item
    closer.start()
    try:
        assert_done_for_wait_and_as_completed(queued)
    finally:
        release.set()
        closer.join(GUARD_S)
    assert not closer.is_alive()
    for future in queued:
        assert_cancelled(future)
    assert running.result(0) == 0
    assert_done_for_wait_and_as_completed([running, *queued])
    assert calls == Counter({0: 1, 1: 1, 2: 1, 3: 1})


def test_a_queued_item_its_caller_cancelled_is_done_for_wait_once_a_thread_runner_fails_its_queue():
    """Past task_timeout_s the runner fails its queued items; one its caller had cancelled stays
    cancelled, and its waiters are told. The caller cancels it after the stuck item has started:
    a timeout of 5 s, not 0.2, leaves this thread that long to, however loaded the machine (a
    cancel() after the runner had failed the queue returned False on a correct runner)."""
    release, started = threading.Event(), threading.Event()
    runner = ThreadRunner(task_timeout_s=5.0)
    runner.start([Stage("stuck", held_until(release, started), 1)])
    stuck = runner.submit(0, 0)
    assert started.wait(GUARD_S)
    cancelled, failed = runner.submit(0, 1), runner.submit(0, 2)
    assert cancelled.cancel()
    calls = counting_callbacks([stuck, cancelled, failed])
    try:
        assert_done_for_wait_and_as_completed([stuck, cancelled, failed])
        assert isinstance(stuck.exception(0), WorkerCrashedError)
        assert_cancelled(cancelled)
        assert isinstance(failed.exception(0), RunnerFailedError)
    finally:
        release.set()
        runner.close()
    assert calls == Counter({0: 1, 1: 1, 2: 1})


def test_a_later_stage_refuses_an_item_submitted_as_a_thread_runner_fails_an_earlier_stage_past_task_timeout_s():
    """Past task_timeout_s the watch fails stage 0's queued item, whose done-callback submits to
    stage 1, as the loader's chain does. Stage 1 was marked failed only after stage 0's queue was
    drained, so that item reached stage 1's idle thread and ran on a runner already failed (on
    3.14t a stage-0 item finishing on its own thread did the same). The callback holds the watch
    until stage 1 has run the item or refused it, which makes the order the same on every build."""
    release, started, ran = threading.Event(), threading.Event(), threading.Event()

    def next_stage(x):
        ran.set()
        return x

    runner = ThreadRunner(task_timeout_s=0.2)
    runner.start([Stage("first", held_until(release, started), 1), Stage("next", next_stage, 1)])
    submitted: list[Future] = []
    returned = threading.Event()

    def submit_next(_future: Future) -> None:
        try:
            submitted.append(runner.submit(1, "next"))
            if not submitted[0].done():
                ran.wait(GUARD_S)  # stage 1's idle thread takes the item unless the watch drains it
        finally:
            returned.set()

    try:
        stuck = runner.submit(0, "held")
        assert started.wait(GUARD_S)
        queued = runner.submit(0, "queued")
        queued.add_done_callback(submit_next)
        assert returned.wait(GUARD_S), "the done-callback never returned"
        timed_out = stuck.exception(GUARD_S)
        assert isinstance(timed_out, WorkerCrashedError)
        assert isinstance(queued.exception(0), RunnerFailedError)
        refused = submitted[0].exception(GUARD_S)
        assert not ran.is_set(), "stage 1 ran an item submitted after the runner had failed"
        assert isinstance(refused, RunnerFailedError) and refused.__cause__ is timed_out, refused
    finally:
        release.set()
        runner.close()


def test_a_stage_thread_starts_no_queued_item_once_a_thread_runner_has_failed_past_task_timeout_s():
    """An item queued before the runner failed, taken by its stage's thread while the watch was
    still failing an earlier stage's queue, ran on a runner already failed; it now fails with
    the same RunnerFailedError. Stage 0's queued item's done-callback, run on the watch once every
    stage refuses new items, frees stage 1's thread and holds the watch until that thread has
    ended the item queued behind, which makes the order the same on every build. The stuck item
    times out at 5 s, not 0.2: this thread must put stage 1's held item on its thread before that,
    however loaded the machine (one refused as the runner had failed never started, and the test
    waited for it in vain)."""
    release, started = threading.Event(), threading.Event()
    release_next, next_started, ran = threading.Event(), threading.Event(), threading.Event()
    held_next = held_until(release_next, next_started)

    def next_stage(x):
        if x == "held":
            return held_next(x)
        ran.set()
        return x

    runner = ThreadRunner(task_timeout_s=5.0)
    runner.start([Stage("first", held_until(release, started), 1), Stage("next", next_stage, 1)])
    returned = threading.Event()
    try:
        stuck = runner.submit(0, "held")
        assert started.wait(GUARD_S)
        runner.submit(1, "held")
        assert next_started.wait(GUARD_S)
        behind = runner.submit(1, "queued before the failure")
        behind_done = threading.Event()
        behind.add_done_callback(lambda _future: behind_done.set())

        def free_the_next_stage(_future: Future) -> None:
            try:
                release_next.set()
                behind_done.wait(GUARD_S)
            finally:
                returned.set()

        runner.submit(0, "queued").add_done_callback(free_the_next_stage)
        assert returned.wait(GUARD_S), "the done-callback never returned"
        timed_out = stuck.exception(GUARD_S)
        failed = behind.exception(GUARD_S)
        assert not ran.is_set(), "stage 1 started an item after the runner had failed"
        assert isinstance(failed, RunnerFailedError) and failed.__cause__ is timed_out, failed
    finally:
        release.set()
        release_next.set()
        runner.close()


def opens_with(gate: Path):
    """A stage function that returns its item once `gate` exists (a file: workers are processes)."""

    def gated(x):
        deadline = time.monotonic() + GUARD_S
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        return x

    return gated


def test_items_in_flight_when_a_process_runner_closes_are_done_for_wait_and_as_completed(tmp_path):
    """Two items in the worker (running, and waiting in its pipe), two queued in the parent."""
    runner = ProcessRunner()
    runner.start([Stage("held", opens_with(tmp_path / "never"), 1)])
    in_flight = [runner.submit(0, i) for i in range(4)]
    calls = counting_callbacks(in_flight)
    runner.close()
    assert_done_for_wait_and_as_completed(in_flight)
    for future in in_flight:
        assert_cancelled(future)
    assert calls == Counter({0: 1, 1: 1, 2: 1, 3: 1})


def test_items_their_caller_cancelled_on_a_process_runner_are_done_for_wait_once_the_runner_reaches_them(tmp_path):
    """Cancelled while a worker held them (running, in its pipe) or queued in the parent: told to
    waiters when their reply comes or the queue reaches them, as an executor's worker would."""
    gate = tmp_path / "gate"
    with ProcessRunner() as runner:
        runner.start([Stage("held", opens_with(gate), 1)])
        cancelled = [runner.submit(0, i) for i in range(3)]
        kept = runner.submit(0, 3)
        assert all(future.cancel() for future in cancelled)
        calls = counting_callbacks([*cancelled, kept])
        gate.touch()
        assert_done_for_wait_and_as_completed([*cancelled, kept])
        for future in cancelled:
            assert_cancelled(future)
        assert kept.result(0) == 3
    assert calls == Counter({0: 1, 1: 1, 2: 1, 3: 1})


def test_a_process_runner_closed_from_a_done_callback_ends_every_other_item_done_for_wait(tmp_path):
    """The close runs on the reader thread, between the resolutions it was handing out."""
    with ProcessRunner() as runner:
        runner.start([Stage("quick", lambda x: x, 1), Stage("held", opens_with(tmp_path / "never"), 2)])
        held = [runner.submit(1, i) for i in range(5)]
        first = runner.submit(0, "close")
        calls = counting_callbacks([first, *held])  # first's counts before its close begins
        first.add_done_callback(lambda _future: runner.close())
        assert_done_for_wait_and_as_completed([first, *held])
        assert first.result(0) == "close"
        for future in held:
            assert_cancelled(future)
    assert calls == Counter({index: 1 for index in range(6)})


def dies_on_one_hangs_on_two(x: int) -> int:
    if x == 1:
        os._exit(3)
    if x == 2:
        time.sleep(GUARD_S * 2)
    if x == 3:
        raise ValueError("three")
    return x


def test_every_way_a_process_runner_ends_a_future_is_done_for_wait_and_runs_its_callback_once():
    """A result, the function's exception, a worker that always dies, one that always hangs.

    Items 0 and 3 run under the same `task_timeout_s` as the hanging one: 5 s, so that only a
    machine that held one of them up that long on both of its attempts could fail it (at 0.5 s a
    stall of a second or two did); the hanging item waits it out twice."""
    with ProcessRunner(task_timeout_s=5.0, max_retries=1) as runner:
        runner.start([Stage("mixed", dies_on_one_hangs_on_two, 2)])
        futures = [runner.submit(0, i) for i in range(4)]
        calls = counting_callbacks(futures)
        assert_done_for_wait_and_as_completed(futures)
        assert futures[0].result(0) == 0 and futures[0].exception(0) is None
        for crashed in futures[1:3]:
            assert isinstance(crashed.exception(0), WorkerCrashedError)
            with pytest.raises(WorkerCrashedError):
                crashed.result(0)
        assert futures[3].exception(0).args == ("three",)
    assert calls == Counter({0: 1, 1: 1, 2: 1, 3: 1})


def test_an_item_a_thread_runner_leaves_running_at_close_fails_naming_close_timeout_s_and_is_done_for_wait():
    """A thread cannot be stopped: close() leaves one still running after close_timeout_s behind.
    Its future stayed running for good, so wait() without a timeout never returned for it; it
    fails instead, naming the stage and where the thread is, and a late result is dropped."""
    release, started = threading.Event(), threading.Event()
    runner = ThreadRunner(close_timeout_s=0.1)
    runner.start([Stage("stuck", held_until(release, started), 1)])
    stuck = runner.submit(0, 0)
    assert started.wait(GUARD_S)
    thread = runner._pools[0].threads[0]
    calls = counting_callbacks([stuck])
    try:
        runner.close()
        assert stuck.done(), "close() left it pending"
        assert_done_for_wait_and_as_completed([stuck])
    finally:
        release.set()
    error = stuck.exception(0)
    assert isinstance(error, WorkerCrashedError), error
    assert "stage 'stuck'" in str(error) and "close_timeout_s=0.1" in str(error), error
    assert "thread zephon-stuck_0" in str(error) and "in held" in str(error), error
    thread.join(GUARD_S)
    assert not thread.is_alive()
    assert stuck.exception(0) is error, "the late result does not replace the failure"
    assert calls == Counter({0: 1})


@pytest.mark.parametrize("make", [ThreadRunner, ProcessRunner], ids=lambda c: c.name)
def test_items_submitted_from_many_threads_while_the_runner_closes_all_end_done_for_wait(make):
    """Submissions racing close(): each future ends once (a result or cancelled), none pending."""
    runner = make()
    runner.start([Stage("identity", lambda x: x, 2)])
    submitted: list[list[Future]] = [[] for _ in range(4)]
    go = threading.Barrier(len(submitted) + 1)

    def submit_until_closed(mine: list[Future]) -> None:
        go.wait(GUARD_S)
        for i in range(1_000_000):  # a guard: close() ends it long before
            mine.append(runner.submit(0, i))
            if mine[-1].cancelled():
                return

    submitters = [threading.Thread(target=submit_until_closed, args=(mine,)) for mine in submitted]
    for thread in submitters:
        thread.start()
    go.wait(GUARD_S)
    runner.close()
    for thread in submitters:
        thread.join(GUARD_S)
    assert all(mine[-1].cancelled() for mine in submitted)
    futures = [future for mine in submitted for future in mine]
    calls = counting_callbacks(futures)
    assert_done_for_wait_and_as_completed(futures)
    assert calls == Counter({index: 1 for index in range(len(futures))})
    assert all(future.cancelled() or future.result(0) == i for mine in submitted for i, future in enumerate(mine))


def interrupted_once():
    """A done-callback that raises KeyboardInterrupt the first time it runs: a Ctrl-C landing in
    one of the callbacks close() runs as it cancels (concurrent.futures lets it through)."""
    raised = []

    def callback(_future: Future) -> None:
        if not raised:
            raised.append(True)
            raise KeyboardInterrupt

    return callback


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [ThreadRunner, ProcessRunner], ids=lambda c: c.name)
def test_a_future_whose_done_callback_interrupts_close_as_it_cancels_is_still_done_for_wait(make, tmp_path):
    """close() cancelled the future (its callbacks ran) and was interrupted before telling its
    waiters; the next close() did not reach it again (it was no longer queued, or no longer held),
    so wait() waited out its timeout for it, and for ever without one."""
    release, started = threading.Event(), threading.Event()
    runner = make(close_timeout_s=0.1)
    if make is ThreadRunner:
        runner.start([Stage("held", held_until(release, started), 1)])
        in_flight = [runner.submit(0, 0)]
        assert started.wait(GUARD_S)
    else:
        runner.start([Stage("held", opens_with(tmp_path / "never"), 1)])
        in_flight = []
    queued = [runner.submit(0, i) for i in range(1, 5)]
    interrupt = interrupted_once()  # in whichever future close() cancels first
    for future in queued:
        future.add_done_callback(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.close()
        runner.close()  # finishes the interrupted close
        done, not_done = wait(queued, timeout=5)  # a hang guard: all are done at once
        assert not_done == set(), f"{len(not_done)} cancelled futures never told to wait()"
        for future in queued:
            assert_cancelled(future)
    finally:
        release.set()
        runner.close()


def chains_on(
    runner, future: Future, *, stage: int = 1, closes: bool = False
) -> tuple[list[Future], threading.Event]:
    """Give `future` a done-callback doing what the loader's chain does: submit to another stage
    (`stage`), and with `closes` close the runner too. It hands back what it submitted, and sets
    the event once it has returned: a callback run under a lock that submit or close takes waits
    on its own thread for ever, and the event is never set."""
    submitted: list[Future] = []
    returned = threading.Event()

    def submit_next(_future: Future) -> None:
        try:
            submitted.append(runner.submit(stage, "next"))
            if closes:
                runner.close()
        finally:
            returned.set()

    future.add_done_callback(submit_next)
    return submitted, returned


class Injected(Exception):
    """A fault injected into the process runner's reader thread."""


def first_stage(gate: Path):
    """Stage 0 of the tests below: "crash" kills its worker, "raise" raises, anything else is
    returned once `gate` exists."""
    opened = opens_with(gate)

    def first(x):
        if x == "crash":
            os._exit(3)
        if x == "raise":
            raise ValueError(x)
        return opened(x)

    return first


@pytest.mark.timeout(120)  # bounds a close() after a callback hung holding the runner's lock
@pytest.mark.parametrize("way", ["result", "raise", "crash", "reader fails", "close"])
def test_whichever_way_a_process_runner_ends_a_future_its_done_callback_may_submit_and_close(way, tmp_path, monkeypatch):
    """The loader submits each next stage from a done-callback, on whichever thread ended the
    future: the reader thread (a reply, a worker given up on, the reader's own failure) or the
    closing thread. None of them may end a future while holding the runner's lock (`submit` and
    `close` take it): the callback would wait for it for ever, on the very thread holding it."""
    gate = tmp_path / "gate"
    runner = ProcessRunner(max_retries=0)
    try:
        runner.start([Stage("first", first_stage(gate), 1), Stage("next", lambda x: x, 1)])
        if way == "reader fails":

            def decode_fails(*_args):
                raise Injected("decode")

            monkeypatch.setattr(runner, "_decode_reply", decode_fails)
        future = runner.submit(0, way)
        submitted, returned = chains_on(runner, future, closes=way == "close")
        if way == "close":
            closer = threading.Thread(target=runner.close)
            closer.start()
            closer.join(GUARD_S)
        else:
            gate.touch()
        assert returned.wait(GUARD_S), "the done-callback never returned from submit or close"
        if way == "reader fails":
            assert isinstance(future.exception(0), RunnerFailedError)
            assert isinstance(submitted[0].exception(GUARD_S), RunnerFailedError)
        elif way == "close":
            assert not closer.is_alive()
            assert_cancelled(future)
            assert_cancelled(submitted[0])
        else:
            expected = {"result": type(None), "raise": ValueError, "crash": WorkerCrashedError}[way]
            assert isinstance(future.exception(0), expected)
            assert submitted[0].result(GUARD_S) == "next"
    finally:
        gate.touch()
        runner.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("way", ["raise", "task_timeout_s", "close"])
def test_whichever_way_a_thread_runner_ends_a_future_its_done_callback_may_submit_and_close(way):
    """As for the process runner: a stage thread (the item's error), the `task_timeout_s` watch
    (a queued item failed as the runner can run no more) or the closing thread (a queued item
    cancelled) ends the future, and its callback submits and closes from there."""
    release, started = threading.Event(), threading.Event()
    runner = ThreadRunner(task_timeout_s=0.2 if way == "task_timeout_s" else None)
    held = held_until(release, started)

    def first(x):
        if x == "raise":
            raise ValueError(x)
        return held(x)

    try:
        runner.start([Stage("first", first, 1), Stage("next", lambda x: x, 1)])
        if way == "raise":
            future = runner.submit(0, "raise")
        else:
            runner.submit(0, "held")
            assert started.wait(GUARD_S)
            future = runner.submit(0, "queued")  # waits behind the held item on the stage's one thread
            future.add_done_callback(lambda _future: release.set())  # before a close in the next one waits
        submitted, returned = chains_on(runner, future, closes=way == "close")
        if way == "close":
            closer = threading.Thread(target=runner.close)
            closer.start()
            closer.join(GUARD_S)
        assert returned.wait(GUARD_S), "the done-callback never returned from submit or close"
        if way == "raise":
            assert isinstance(future.exception(0), ValueError)
            assert submitted[0].result(GUARD_S) == "next"
        elif way == "task_timeout_s":
            assert isinstance(future.exception(0), RunnerFailedError)
            assert isinstance(submitted[0].exception(GUARD_S), RunnerFailedError)
        else:
            assert not closer.is_alive()
            assert_cancelled(future)
            assert_cancelled(submitted[0])
    finally:
        release.set()
        runner.close()


def _line_of(function, text: str) -> int:
    """The number of the first line of `function` holding `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_an_array_item_whose_submit_meets_a_close_ending_is_cancelled_not_raised(tmp_path):
    """A submit that finds the runner closing once it has written its item's array into the request
    arena gives the arena's block back. It looked whether the runner still had the arena, then used
    it; a close ending between the two (on another thread) dropped it, and submit raised
    AttributeError ('NoneType' object has no attribute 'give_back') instead of returning a cancelled
    future. The interleaving is forced by trace functions: close starts once the item is encoded and
    is held before its first step; the submit, once it has looked, lets it run to its end."""
    runner = ProcessRunner(shm_root=str(tmp_path))
    runner.start([Stage("sum", lambda a: int(a.sum()), 1)])
    at_lock = _line_of(ProcessRunner.submit, "with self._lock:")
    give_back = _line_of(ProcessRunner._discard, ".give_back(")
    close_held, looked = threading.Event(), threading.Event()

    def hold_close(frame, event, _arg):
        if event == "call" and frame.f_code is ProcessRunner._finish_close.__code__:
            close_held.set()
            looked.wait(GUARD_S)
        return None

    def close_held_until_looked() -> None:
        sys.settrace(hold_close)
        runner.close()

    closing = threading.Thread(target=close_held_until_looked, daemon=True)

    def steer(frame, event, _arg):
        if frame.f_code not in (ProcessRunner.submit.__code__, ProcessRunner._discard.__code__):
            return None

        def at_line(frame, event, _arg):
            at = event == "line" and frame.f_lineno
            if at == at_lock and frame.f_code is ProcessRunner.submit.__code__ and closing.ident is None:
                closing.start()
                assert close_held.wait(GUARD_S)
            elif at == give_back and frame.f_code is ProcessRunner._discard.__code__:
                looked.set()
                closing.join(GUARD_S)
            return at_line

        return at_line

    outcome: list = []

    def submit() -> None:
        sys.settrace(steer)
        try:
            outcome.append(runner.submit(0, np.ones(1 << 16, dtype=np.uint8)))
        except BaseException as exc:
            outcome.append(exc)

    submitting = threading.Thread(target=submit, daemon=True)
    submitting.start()
    submitting.join(GUARD_S)
    closing.join(GUARD_S)
    assert looked.is_set() and not closing.is_alive(), "the interleaving under test must have happened"
    [future] = outcome
    assert isinstance(future, Future) and future.cancelled(), future
