"""A loader starts one runner, whichever of its threads asks for it first: the trainer's first
iteration, or a monitor reading `runner_info` at that moment.

The moment both ask is made certain with a runner factory that holds the first start until the
second thread has either made a runner of its own (what went wrong) or waits for the first (what
must happen); the loader's start lock is swapped for one that says when a thread waits for it.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from runners import ThreadRunner
from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline

GUARD_S = 30  # a hang guard only: the events below are set long before


class SaysWhenWaitedFor:
    """A lock (`lock`, a plain one unless given) that sets `waited_for` when a thread finds it held
    and has to wait."""

    def __init__(self, waited_for: threading.Event, lock=None) -> None:
        self._lock = threading.Lock() if lock is None else lock
        self._waited_for = waited_for

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._waited_for.set()
            self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


def _held_first_start(made: list[ThreadRunner], first_starting: threading.Event, go_on: threading.Event):
    """A runner factory whose first call waits, once it has said so, until `go_on`; a later call
    sets `go_on` itself (a second runner is being made)."""

    def make_runner() -> ThreadRunner:
        runner = ThreadRunner()
        made.append(runner)
        if len(made) == 1:
            first_starting.set()
            go_on.wait(GUARD_S)
        else:
            go_on.set()
        return runner

    return make_runner


def test_runner_info_read_on_another_thread_as_the_first_iteration_starts_the_runner_starts_no_second_one(tmp_path):
    """Both threads saw no runner and each started one; the loader kept one, and the other's
    threads (a process runner's workers and /dev/shm directory) stayed until exit, never closed."""
    made: list[ThreadRunner] = []
    first_starting, go_on = threading.Event(), threading.Event()
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=_held_first_start(made, first_starting, go_on))
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
    loader._starting = SaysWhenWaitedFor(go_on)
    taken = []
    trainer = threading.Thread(target=lambda: taken.append(next(iter(loader))))
    try:
        trainer.start()
        assert first_starting.wait(GUARD_S)
        info = loader.runner_info
        trainer.join(GUARD_S)
        assert len(made) == 1, "a second runner was started"
        assert len(taken) == 1, "the trainer took its batch"
        assert info == {"name": "thread", "reason": "requested explicitly"}
        assert loader._runner is made[0]
    finally:
        go_on.set()
        trainer.join(GUARD_S)
        loader.close()
        for runner in made:
            runner.close()
    assert all(not thread.is_alive() for runner in made for pool in runner._pools for thread in pool.threads)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_child_forked_while_a_parent_thread_starts_the_runner_starts_its_own(tmp_path):
    """The parent thread holds the loader's start lock while its runner starts; a fork then (a
    torch DataLoader forking its workers as a monitor reads `runner_info`) copies the lock held.
    The child, which starts a runner of its own, must not wait for it."""
    made: list[ThreadRunner] = []
    first_starting, go_on = threading.Event(), threading.Event()
    dataset = jsonl_dataset(tmp_path / "data")
    unheld = text_pipeline(dataset, runner="thread")
    with unheld.shard(0, 1, global_batch_size=global_batch(unheld)) as reference_loader:
        reference = next(iter(reference_loader)).digest()
    pipeline = text_pipeline(dataset, runner=_held_first_start(made, first_starting, go_on))
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
    monitor = threading.Thread(target=lambda: loader.runner_info)
    try:
        monitor.start()
        assert first_starting.wait(GUARD_S)
        out = tmp_path / "child"
        child = os.fork()
        if child == 0:
            code = 1
            try:
                signal.alarm(15)  # a child stuck on the copied lock dies instead of hanging the test
                out.write_text(next(iter(loader)).digest())
                loader.close()
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(child, 0)[1] == 0, "the child started its own runner (it hung on the copied lock until its alarm)"
        assert out.read_text() == reference
    finally:
        go_on.set()
        monitor.join(GUARD_S)
        loader.close()
