"""A process runner's close() returns within `close_timeout_s` and 2 s (and 1 s per GiB the largest
worker holds) whatever its workers do: one that does not die after SIGKILL (uninterruptible sleep on
a hung NFS read), one stopped part-way through a reply or before reading an item larger than its
pipe holds, a reader thread stuck in a done-callback. Each made close wait for ever, and interpreter
exit with it. A big worker still being torn down is waited for, not reported. Nor does the reader
thread, while the runner runs, wait without a bound for a worker it killed past `task_timeout_s`;
it reaps one it gave up on as soon as that one exits.

Linux offers no process that SIGKILL cannot end on demand (a stopped one dies too), so a worker
whose exit never comes is stood in for by its `multiprocessing` handle and the runner's watch of its
exit: the waitpid behind `exitcode` and `is_alive()`, and the watch's wait, report it running until
the test lets go, while the real process underneath is killed and left a zombie, as a process in
uninterruptible sleep would be once it woke."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import pytest

from runners import ProcessRunner, WorkerCrashedError, _process_close
from tests.unit.worker_replies import half_of_a_reply, worker_pipe
from zephon._runner import Stage

# Far beyond close_timeout_s and the margins close adds (a loaded CI machine included); a close
# still running then is one that waits for ever.
BOUND_S = 60.0
# task_timeout_s of the tests whose ordinary items must come back while the runner times items
# out (with max_retries=0, an ordinary item a loaded machine held up past it fails the test): long
# enough for any stall, and the hanging item waits it out once.
ITEMS_RUN_UNDER_S = 10.0


def close_within_bound(runner: ProcessRunner) -> None:
    closing = threading.Thread(target=runner.close, name="test-close", daemon=True)
    closing.start()
    closing.join(BOUND_S)
    assert not closing.is_alive(), "close() is still waiting"


class NeverExiting:
    """`never_exiting(runner, pid)`: that worker's exit is not seen by its parent until `release()`
    (at the end of the test at the latest); `never_exiting(runner, pid, seen_after_kill_s=...)`:
    nor by a wait that ends sooner than that after its parent killed it (as a worker whose memory
    takes that long to free). Which waits see it depends on the deadlines close asks for, not on
    how fast this machine runs."""

    def __init__(self) -> None:
        self.seen: dict[int, threading.Event] = {}

    def __call__(self, runner: ProcessRunner, pid: int, seen_after_kill_s: float | None = None) -> None:
        seen = self.seen[pid] = threading.Event()
        killed_at: list[float] = []
        [worker] = [w for w in runner._workers if w.process.pid == pid]
        popen = worker.process._popen
        real_poll, real_kill = popen.poll, popen.kill

        def poll(flag: int = os.WNOHANG) -> int | None:
            return real_poll(flag) if seen.is_set() else None

        def wait(timeout: float) -> None:
            if killed_at and seen_after_kill_s is not None and (
                time.monotonic() + timeout >= killed_at[0] + seen_after_kill_s
            ):
                seen.set()  # a wait long enough for the memory to be freed
            seen.wait(timeout)

        def kill() -> None:
            real_kill()
            killed_at.append(time.monotonic())

        popen.poll, popen.kill, worker.exit.wait = poll, kill, wait

    def release(self) -> None:
        for seen in self.seen.values():
            seen.set()


@pytest.fixture
def never_exiting() -> Iterator[NeverExiting]:
    stand_in = NeverExiting()
    yield stand_in
    stand_in.release()
    for pid in stand_in.seen:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # the zombie close left behind, reaped here
        except (ProcessLookupError, ChildProcessError):
            pass
    # A stand-in's handle is in a reference cycle (its methods close over it): its pipes are closed
    # now, not by a collection during a later test that counts this process's descriptors.
    gc.collect()


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + BOUND_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists(), "the check below must have something to see"


def test_a_worker_that_does_not_die_after_sigkill_is_reported_and_close_still_removes_the_directory(
    tmp_path, caplog, never_exiting
):
    """close() killed a worker still there after `close_timeout_s` and then waited for its exit
    without a bound: a worker in uninterruptible sleep held close (and interpreter exit) for ever.
    It now waits a bounded time after SIGKILL, names the worker it could not reap, and goes on:
    the other workers are reaped, the directory removed, and multiprocessing's own exit hook, which
    joins every child it knows of without a bound, no longer knows of that one."""
    runner = ProcessRunner(close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("nfs", lambda x: x, 2)])
    stuck, other = runner.worker_pids()
    assert runner.submit(0, 1).result(BOUND_S) == 1
    directory = runner.shm_directory
    never_exiting(runner, stuck)
    with caplog.at_level(logging.WARNING, logger="runners.process"):
        close_within_bound(runner)
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 1, warned
    assert f"stage 'nfs': worker (pid {stuck}) had not exited" in warned[0] and "SIGKILL" in warned[0], warned
    assert not os.path.exists(directory) and runner.shm_directory is None
    assert [p.pid for p in multiprocessing.active_children()] == []
    assert not Path(f"/proc/{other}").exists()


def test_a_big_worker_still_exiting_2_s_after_sigkill_is_reaped_not_reported(
    tmp_path, caplog, monkeypatch, never_exiting
):
    """A killed worker is reaped once the kernel has freed its memory, which takes time in
    proportion to it (4 GiB in 4 KiB pages took 1 s on two loaded cores). close() gave every worker
    2 s after SIGKILL whatever it held, so one of 8 GiB on a loaded machine was reported as never
    dying (uninterruptible sleep) and left a zombie for the trainer's lifetime. The wait now grows
    with the largest worker's resident memory."""
    monkeypatch.setattr(_process_close, "_resident_bytes", lambda pid: 8 << 30)
    runner = ProcessRunner(close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("decode", lambda x: x, 1)])
    [worker] = runner.worker_pids()
    never_exiting(runner, worker, seen_after_kill_s=3.0)
    with caplog.at_level(logging.WARNING, logger="runners.process"):
        close_within_bound(runner)
    assert [record.getMessage() for record in caplog.records] == []
    assert not Path(f"/proc/{worker}").exists(), "reaped"


def kill_if_still_a_child(pid: int) -> None:
    try:
        if f"PPid:\t{os.getpid()}\n" in Path(f"/proc/{pid}/status").read_text():
            os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


def _half_a_reply_then_hang(marker: str) -> None:
    """Stands in for a worker stopped part-way through sending its reply (SIGSTOP, a page fault
    that never completes): half a reply goes out, then nothing. SIGTERM does not reach it either."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = worker_pipe()
    os.write(conn.fileno(), half_of_a_reply())
    Path(marker).touch()
    while True:
        time.sleep(60)


def test_a_worker_stopped_part_way_through_a_reply_does_not_hold_close(tmp_path):
    """The reader thread was joined without a bound, and it was waiting for the rest of a reply
    that never came: close() waited for ever. The reader no longer waits for the rest of a reply
    (`test_runners_process.py::test_a_worker_dying_partway_through_a_reply_while_its_forked_child_holds_the_pipe_holds_up_no_other_reply`),
    and close kills the worker that ignores its SIGTERM once `close_timeout_s` has passed, and
    does every step."""
    marker = tmp_path / "half sent"
    runner = ProcessRunner(close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("stopped", lambda _: _half_a_reply_then_hang(str(marker)), 1)])
    [worker] = runner.worker_pids()
    future = runner.submit(0, 0)
    wait_for(marker)
    directory = runner.shm_directory
    try:
        close_within_bound(runner)
    finally:
        kill_if_still_a_child(worker)  # it ignores SIGTERM: a failed close would leave it for good
    assert future.cancelled()
    assert not os.path.exists(directory) and runner.shm_directory is None
    assert not Path(f"/proc/{worker}").exists()


def hanging_on_minus_one(marker: Path):
    """A stage function that echoes its item, but on -1 touches `marker` and hangs (a read from a
    hung NFS server, say)."""

    def hang_on_minus_one(x):
        if x == -1:
            marker.touch()
            time.sleep(3600)
        return x

    return hang_on_minus_one


def test_a_worker_killed_past_task_timeout_that_does_not_die_holds_no_other_workers_replies(
    tmp_path, caplog, never_exiting
):
    """The reader killed a worker past `task_timeout_s` and waited for its exit without a bound: a
    worker in uninterruptible sleep held the reader there, and no reply of any other worker was
    read again while the loader ran. The reader now retires it at once (its item fails with the
    timeout named, or is re-run), reads the others' replies meanwhile, and reports it 2 s after
    SIGKILL with close's warning, leaving it to multiprocessing to forget."""
    marker = tmp_path / "running"
    hang_on_minus_one = hanging_on_minus_one(marker)
    runner = ProcessRunner(task_timeout_s=ITEMS_RUN_UNDER_S, max_retries=0, close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("nfs", hang_on_minus_one, 2)])
    stuck, _ = runner.worker_pids()
    never_exiting(runner, stuck)
    with caplog.at_level(logging.WARNING, logger="runners.process"):
        hung = runner.submit(0, -1)  # to the first idle worker: `stuck`
        wait_for(marker)
        deadline = time.monotonic() + BOUND_S
        while Path(f"/proc/{stuck}/status").read_text().find("State:\tZ") < 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # killed by the reader
        error = hung.exception(BOUND_S)
        assert [runner.submit(0, x).result(BOUND_S) for x in range(4)] == list(range(4))
        deadline = time.monotonic() + BOUND_S
        while not any("SIGKILL" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.01)
        close_within_bound(runner)
    assert isinstance(error, WorkerCrashedError) and f"exceeded task_timeout_s={ITEMS_RUN_UNDER_S}" in str(error), error
    unreaped = [r.getMessage() for r in caplog.records if "SIGKILL" in r.getMessage()]
    assert len(unreaped) == 1 and f"stage 'nfs': worker (pid {stuck}) had not exited" in unreaped[0], unreaped
    assert stuck not in [p.pid for p in multiprocessing.active_children()]  # multiprocessing's exit joins it not
    assert runner.shm_directory is None


def test_a_worker_given_up_on_at_close_is_reaped_by_the_next_runner_once_it_has_exited(tmp_path, caplog):
    """close() gave up on a worker still there after SIGKILL and its grace (uninterruptible sleep)
    and forgot it: once its sleep ended and it died, nothing reaped it, and it stayed a zombie until
    the trainer exited, one more for every such close. The next runner's start reaps it, without
    waiting for it (as does any later close). Here signals reach the worker only when the test
    sends them: neither close's SIGTERM nor its SIGKILL ends it, as neither ends a process asleep
    on a hung NFS read."""
    marker = tmp_path / "running"
    runner = ProcessRunner(close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("nfs", hanging_on_minus_one(marker), 1)])
    [worker] = runner._workers
    stuck = worker.process.pid
    worker.process._popen.terminate = worker.process._popen.kill = lambda: None
    try:
        runner.submit(0, -1)
        wait_for(marker)
        with caplog.at_level(logging.WARNING, logger="runners.process"):
            close_within_bound(runner)
        assert any(f"worker (pid {stuck}) had not exited" in r.getMessage() for r in caplog.records), caplog.text
        os.kill(stuck, signal.SIGKILL)  # its sleep ends at last
        deadline = time.monotonic() + BOUND_S
        while "State:\tZ" not in Path(f"/proc/{stuck}/status").read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        with ProcessRunner(shm_root=str(tmp_path)) as next_runner:
            next_runner.start([Stage("echo", lambda x: x, 1)])
            assert not Path(f"/proc/{stuck}").exists(), "reaped"
    finally:
        with suppress(ProcessLookupError):
            os.kill(stuck, signal.SIGKILL)
        with suppress(ChildProcessError):
            os.waitpid(stuck, 0)


def hanging_on_a_block_of_ones(marker: Path):
    """`hanging_on_minus_one` for arrays: hangs on one whose first byte is 1, the rest echoed."""
    hang_on_minus_one = hanging_on_minus_one(marker)
    return lambda x: hang_on_minus_one(-int(x[0]))


def test_a_worker_given_up_on_past_task_timeout_is_reaped_as_soon_as_it_exits_while_the_runner_runs(
    tmp_path, caplog
):
    """A worker the reader killed past `task_timeout_s` and gave up on (still there after its
    grace: uninterruptible sleep) was reaped only by the runner's close or the next runner's start:
    once its sleep ended it stayed a zombie for the rest of the run, and the request-arena block
    of its item stayed taken. The reader watches its exit and reaps it then, freeing the block.
    Here signals reach the worker only when the test sends them, as neither the reader's SIGKILL
    nor close's ends a process asleep on a hung NFS read."""
    marker = tmp_path / "running"
    runner = ProcessRunner(task_timeout_s=ITEMS_RUN_UNDER_S, max_retries=0, close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("nfs", hanging_on_a_block_of_ones(marker), 1)])
    [worker] = runner._workers
    stuck = worker.process.pid
    worker.process._popen.terminate = worker.process._popen.kill = lambda: None
    block = np.ones(1 << 20, dtype=np.uint8)  # large enough for the request arena
    try:
        with caplog.at_level(logging.WARNING, logger="runners.process"):
            hung = runner.submit(0, block)
            wait_for(marker)
            assert isinstance(hung.exception(BOUND_S), WorkerCrashedError)
            deadline = time.monotonic() + BOUND_S
            while not any("had not exited" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert any(f"worker (pid {stuck}) had not exited" in r.getMessage() for r in caplog.records), caplog.text
        assert runner._requests._blocks.taken_bytes > 0, "the check below must have something to see"
        os.kill(stuck, signal.SIGKILL)  # its sleep ends at last
        deadline = time.monotonic() + BOUND_S
        while Path(f"/proc/{stuck}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not Path(f"/proc/{stuck}").exists(), "reaped while the runner runs"
        assert runner._requests._blocks.taken_bytes == 0
        assert runner.submit(0, block * 0).result(BOUND_S) == 0  # the runner runs on
    finally:
        close_within_bound(runner)
        with suppress(ProcessLookupError):
            os.kill(stuck, signal.SIGKILL)
        with suppress(ChildProcessError):
            os.waitpid(stuck, 0)


def zombie(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" in status.read_text()


def test_reaping_a_worker_given_up_on_never_reaps_another_child_given_its_pid_since(monkeypatch):
    """A worker given up on may be reaped by code of the trainer's (`os.wait()`), and its pid given
    to another child of the trainer's: reaped by pid, that child was reaped in its place, and its
    own parent's wait found nothing. It is reaped through the pidfd of the worker itself."""
    import subprocess

    from runners import _exits

    monkeypatch.setattr(_exits, "_LEFT_UNREAPED", {})
    given_up = subprocess.Popen(["sleep", "60"])
    _exits.leave_unreaped(_exits.ExitWatch(given_up))  # Linux >= 5.3: a pidfd
    given_up.kill()
    given_up.wait()  # reaped by the trainer's own code
    other = subprocess.Popen(["true"])
    deadline = time.monotonic() + BOUND_S
    while not zombie(other.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    # The pid number the worker had now names the other child, as after the pids wrapped round.
    _exits._LEFT_UNREAPED[other.pid] = _exits._LEFT_UNREAPED.pop(given_up.pid)
    _exits.reap_the_left()
    assert zombie(other.pid), "the other child is left to its own parent's wait"
    assert other.wait() == 0
    assert _exits._LEFT_UNREAPED == {}, "the worker reaped elsewhere is dropped, its pidfd closed"


@contextmanager
def reader_stuck_in_a_callback(tmp_path: Path) -> Iterator[tuple[ProcessRunner, Future]]:
    """A runner whose reader thread is held in a done-callback until the block ends, and the
    future of an item whose reply waits for that reader."""
    inside, go_on = threading.Event(), threading.Event()

    def never_returning(_future) -> None:
        inside.set()
        go_on.wait(BOUND_S)

    runner = ProcessRunner(close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("echo", lambda x: x, 1)])
    try:
        runner.submit(0, 0).add_done_callback(never_returning)
        assert inside.wait(BOUND_S), "the reader is in the callback"
        yield runner, runner.submit(0, 1)
    finally:
        go_on.set()  # the callback returns at last: the next close does the rest


def test_a_reader_thread_stuck_in_a_done_callback_is_reported_its_items_cancelled_and_the_rest_left_to_a_later_close(
    tmp_path, caplog
):
    """A done-callback runs on the reader thread; one that never returns held the reader, and
    close(), which joined the reader without a bound, for ever. close() now gives the reader
    `close_timeout_s`, kills the workers, gives it 2 s more, then reports it, cancels every item
    and leaves what the reader may still touch (workers, pipes, the directory, locked by
    `owner.lock` so that no other runner takes it) to a later close, the exit hook's at the
    latest."""
    with reader_stuck_in_a_callback(tmp_path) as (runner, unread):
        directory = runner.shm_directory
        with caplog.at_level(logging.WARNING, logger="runners.process"):
            close_within_bound(runner)
        warned = [record.getMessage() for record in caplog.records]
        assert len(warned) == 1 and "reader thread" in warned[0] and "left to a later close" in warned[0], warned
        assert unread.cancelled()
        assert os.path.exists(directory)
        assert [p.pid for p in multiprocessing.active_children()] == []  # multiprocessing's exit joins none of them
    close_within_bound(runner)
    assert not os.path.exists(directory) and runner.shm_directory is None


def test_a_submit_stuck_sending_to_a_stopped_worker_does_not_hold_close(tmp_path):
    """A submit sends an item to an idle worker under the runner's lock; one of text records,
    carried inside the pickle stream, is larger than the pipe holds, so a stopped worker (SIGSTOP)
    leaves the send waiting for it to read, lock held. close() began by taking that lock without a
    bound and waited for ever. It now waits `close_timeout_s` for it, then kills the workers, which
    ends the send, and does every step."""
    runner = ProcessRunner(close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("text", len, 1)])
    [worker] = runner.worker_pids()
    os.kill(worker, signal.SIGSTOP)
    documents = [f"{i:08d}" + "x" * 992 for i in range(4000)]  # 4 MB in the pickle stream, far beyond the pipe's buffer
    submitted = []
    submitting = threading.Thread(target=lambda: submitted.append(runner.submit(0, documents)), daemon=True)
    submitting.start()
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if not runner._lock.acquire(timeout=0.5):
            break  # held for good: the submit waits for room in the pipe
        runner._lock.release()
    else:
        pytest.fail("the check below must have something to see")
    directory = runner.shm_directory
    try:
        close_within_bound(runner)
    finally:
        kill_if_still_a_child(worker)
    submitting.join(BOUND_S)
    assert submitted and submitted[0].cancelled()
    assert not os.path.exists(directory) and runner.shm_directory is None


def test_the_exit_hook_closes_a_runner_whose_reader_is_stuck_once_and_reports_it_once(tmp_path, caplog):
    """The exit hook closed the runner again while its deadline (`close_timeout_s` and 5 s) had not
    passed, as long as the runner was not closed for good: a close left to a later one for a stuck
    reader thread was run again and again, each waiting as long and warning the same, and
    interpreter exit took that much longer. A close of its own ends the hook, whatever it could do."""
    with reader_stuck_in_a_callback(tmp_path) as (runner, unread):
        with caplog.at_level(logging.WARNING, logger="runners.process"):
            runner._at_exit()  # what interpreter exit runs for it
        warned = [record.getMessage() for record in caplog.records]
        assert len(warned) == 1 and "left to a later close" in warned[0], warned
        assert unread.cancelled()
    close_within_bound(runner)


@contextmanager
def closing_on_another_thread(runner: ProcessRunner) -> Iterator[None]:
    """While the closer thread is closing `runner` (it has taken the close lock)."""
    closing = threading.Thread(target=runner.close, name="zephon-runner-closer", daemon=True)
    closing.start()
    deadline = time.monotonic() + BOUND_S
    while not runner._close_lock.locked() and closing.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert runner._close_lock.locked(), "the check below must have something to see"
    try:
        yield
    finally:
        closing.join(BOUND_S)


def test_the_exit_hook_waits_for_another_threads_close_through_the_grace_of_a_big_worker(
    tmp_path, caplog, monkeypatch, never_exiting
):
    """The exit hook waited for a close under way on another thread for `close_timeout_s` and 5 s,
    but that close gives its killed workers 2 s and 1 s per GiB the largest holds: with 6 GiB
    (8 s), the hook gave up first, interpreter exit cut the close short and the buffer directory
    stayed. The hook now waits until the close's own last deadline, and a margin."""
    monkeypatch.setattr(_process_close, "_resident_bytes", lambda pid: 6 << 30)
    runner = ProcessRunner(close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("decode", lambda x: x, 1)])
    [worker] = runner.worker_pids()
    directory = runner.shm_directory
    never_exiting(runner, worker)
    with caplog.at_level(logging.WARNING, logger="runners.process"):
        with closing_on_another_thread(runner):
            runner._at_exit()  # what interpreter exit runs for it
            assert not os.path.exists(directory) and runner.shm_directory is None, "removed before the hook returned"
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 1 and "had not exited 8.0 s after SIGKILL" in warned[0], warned


def test_the_exit_hook_waits_for_another_threads_close_through_the_grace_of_a_worker_killed_past_task_timeout(
    tmp_path, caplog, monkeypatch, never_exiting
):
    """A worker the reader killed past `task_timeout_s` is waited for by close until its own
    `reap_by` (2 s and 1 s per GiB after that kill), which may end after close's other waits; the
    exit hook, waiting for that close on another thread, gave up `close_timeout_s` and 5 s after it
    began, and the buffer directory stayed. It now waits until that `reap_by` too, and a margin."""
    monkeypatch.setattr(_process_close, "_resident_bytes", lambda pid: 6 << 30)
    marker = tmp_path / "running"
    hang_on_minus_one = hanging_on_minus_one(marker)
    runner = ProcessRunner(task_timeout_s=0.5, max_retries=0, close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("nfs", hang_on_minus_one, 1)])
    [stuck] = runner.worker_pids()
    directory = runner.shm_directory
    never_exiting(runner, stuck)
    with caplog.at_level(logging.WARNING, logger="runners.process"):
        hung = runner.submit(0, -1)
        wait_for(marker)
        assert isinstance(hung.exception(BOUND_S), WorkerCrashedError)  # killed and retired by the reader
        with closing_on_another_thread(runner):
            runner._at_exit()  # what interpreter exit runs for it
            assert not os.path.exists(directory) and runner.shm_directory is None, "removed before the hook returned"
    unreaped = [record.getMessage() for record in caplog.records if "SIGKILL" in record.getMessage()]
    assert len(unreaped) == 1 and f"worker (pid {stuck}) had not exited 8.0 s after SIGKILL" in unreaped[0], unreaped
