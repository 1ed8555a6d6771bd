"""How a process runner's workers end: `close()`'s steps under one bounded clock, the reaping of
the workers it or the reader thread kills, and the exit hook that closes a runner its owner never
closed.

These are the steps that tear the pool down (stop, kill and reap the workers or give up on them,
close the pipes, cancel every held future, remove the buffer directory), each wait bounded, and
the bookkeeping of multiprocessing's own list of children, whose exit hook joins them without a
bound (and, in a forked child, would stop the parent's workers). They are kept apart from
`process`, which is left with dispatch and the reader thread, so that what a close does, and in
what order, reads in one place. `ProcessRunnerClose` is a base of `ProcessRunner`, not a helper
object: its methods are the runner's own, reading the state `ProcessRunner.__init__` makes and
taking the runner's locks exactly as they did before the split, so no lock is taken in another
order and no state is copied.

Lines are logged on `runners.process`, the logger a user configures for the process runner.

Thread-safety: as `ProcessRunner`'s: `close` from any thread, one close at a time (its close
lock); `_kill_to_retire`, `_reap_dying` and `_reap_given_up` on the reader thread, and the last two
on the closing thread once the reader has stopped.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zephon import _fork
from zephon._job_log import RankLog

from ._exits import ExitWatch, leave_unreaped, reap_the_left
from ._lifecycle import cancel_and_notify, end_in_close, exit_hook
from ._transport import discard
from ._worker import STOP

if TYPE_CHECKING:
    from .process import ProcessRunner, _Worker

__all__ = [
    "LONGEST_WAIT_S", "REAP_WAIT_S", "WORKER_PROCESSES", "CloseClock", "Dying", "ProcessRunnerClose", "close_at_exit",
]

# The process runner's logger, which users configure, whichever of its modules writes the line.
_log = RankLog(logging.getLogger("runners.process"))  # its lines are this rank's own events

# The longest one wait lasts, for the reader's next deadline and for close's joins. The selectors
# behind both refuse a wait past about 24.8 days (milliseconds in a C int) with an OverflowError:
# it stopped the reader thread, so a task_timeout_s of a month, or inf, failed every item. A
# deadline further off is reached in several waits instead.
LONGEST_WAIT_S = 3600.0

# How long close, and the reader for a worker it killed (`_kill_to_retire`), wait for a worker's
# exit after SIGKILL: this, and `_REAP_WAIT_S_PER_GIB` for each GiB the largest worker holds
# (`_reap_wait_s`). A killed process is reaped once the kernel has torn down its memory, which
# takes time in proportion to it: 4 GiB in 4 KiB pages took 1.0 s on two loaded cores, so a worker
# holding 8 GiB was reported as never dying and left a zombie. One in uninterruptible sleep (a hung
# NFS read) dies only when that sleep ends, possibly never. The exit hook, waiting for a close on
# another thread, waits this long too (`CloseClock.ends`).
REAP_WAIT_S = 2.0
_REAP_WAIT_S_PER_GIB = 1.0


@dataclass(eq=False)
class Dying:
    """A worker the reader killed (past `task_timeout_s`, after a stray reply, or still running
    when its pipe ended) and retired before its exit was seen: the reader reaps it once it has
    exited, or reports it at `reap_by`, gives up waiting for it, and reaps it when its exit comes
    (`_given_up`)."""

    exit: ExitWatch  # and through it, the process
    stage: str
    grace_s: float  # how long after its kill it may take to be reaped (`_reap_wait_s`)
    reap_by: float
    # Request-arena blocks it held: free only once it is reaped. A process in uninterruptible
    # sleep has its I/O still under way, which may be a read into one of them.
    request_blocks: set[int]


class ProcessRunnerClose:
    """`ProcessRunner`'s close and the killing and reaping of its workers (see the module's
    docstring): a base class holding no state of its own, whose methods read and change the
    runner's (`_workers`, `_dying`, `_given_up`, `_held`, `_lock`, `_close_lock`, ...)."""

    def _close(self) -> bool:
        """`close()`; False when it returned at once because another thread's close was under way."""
        if self._stages is not None and os.getpid() != self._pid:
            # A forked child's copy (a child leaving the parent's `with` block): its workers,
            # pipes and directory are the parent's, which stopping here would take from it. Only
            # the copy is marked closed; its lock is not taken, as a parent thread may have held
            # it at the fork.
            self._closing = True
            return True
        # Not under the lock: a thread holding it may be stuck sending to a worker that does not
        # read (stopped). Every submit that takes the lock from now on sees it; `_finish_close`
        # waits, boundedly, for the one holding it now.
        self._closing = True
        if not self._close_lock.acquire(blocking=False):
            return False  # another thread is closing it (one of its done-callbacks, say)
        try:
            self._finish_close()
        finally:
            self._close_lock.release()
        return True

    def _finish_close(self) -> None:
        """Every step of `close`, each forgetting what it freed only once it is freed, so that a
        close cut short (Ctrl-C while it waits for the workers) is finished by the next `close()`
        or by the exit hook, which stays registered until the very end; a finished close makes
        the next one a few no-op checks.

        Every wait is bounded (`CloseClock`): the reader thread, a submit still holding the
        runner's lock and the workers get `close_timeout_s` in all to end by themselves; then the
        workers are killed (which also ends a submit's wait for room in a stopped worker's
        pipe) and everything gets `_reap_wait_s` more. A reader thread or a lock
        still not free then leaves the rest to a later close (`_leave_to_a_later_close`)."""
        clock = self._close_clock = CloseClock(self._close_timeout_s, self._kill_workers)
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            self._wake()
            if not clock.wait(lambda until: _joined(reader.join, lambda: not reader.is_alive(), until)):
                self._leave_to_a_later_close("the reader thread had not stopped", clock)
                return
        if not clock.wait(self._lock_free_by):
            self._leave_to_a_later_close("a thread sending an item to a worker still held the runner's lock", clock)
            return
        self._stop_workers(clock)
        self._reap_dying(until=clock.reach(max((dying.reap_by for dying in self._dying), default=0.0)))
        while self._given_up:
            leave_unreaped(self._given_up.pop().exit)
        reap_the_left()
        fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        for queue in self._queued:
            while queue:
                discard(queue.popleft().envelope)
        with self._lock:
            held = list(self._held)
        for future in held:
            if self._claim(future):
                end_in_close(_log, cancel_and_notify, future)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
        if self._directory_lock is not None:
            os.close(self._directory_lock)
            self._directory_lock = None
        self._requests = None  # unmapped once its last view is gone
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None

    def _kill_workers(self) -> int:
        """SIGKILL every worker, taking no lock: the thread holding it may be the one waiting for a
        worker (room in its pipe), which that worker's death frees. The
        resident bytes of the largest, which its exit has to free."""
        largest = 0
        for worker in list(self._workers):
            with suppress(ValueError):  # closed: the reader retired it just now
                largest = max(largest, _resident_bytes(worker.process.pid))
                worker.process.kill()
        return largest

    def _lock_free_by(self, until: float) -> bool:
        """Whether the runner's lock could be taken before `until`: no submit is still dispatching,
        and every later one sees `_closing`."""
        while True:
            if self._lock.acquire(timeout=_wait_left(until)):
                self._lock.release()
                return True
            if time.monotonic() >= until:
                return False

    def _leave_to_a_later_close(self, why: str, clock: CloseClock) -> None:
        """What close must wait for still runs after its workers were killed (a worker that outlived
        SIGKILL, a done-callback that does not return): cancel every held future, report it, and
        leave what that thread may still touch (workers, pipes, the directory) to the next close,
        or the exit hook, which stays registered. Meanwhile `owner.lock` keeps the directory from
        other runners' sweeps, and after this process exits it is theirs to remove.
        multiprocessing's exit hook, which joins every child it knows of without a bound, is told
        to forget the workers."""
        for process in [worker.process for worker in list(self._workers)] + [dying.exit.process for dying in list(self._dying)]:
            _forget_process(process)
        for future in list(self._held):
            if self._claim(future):
                end_in_close(_log, cancel_and_notify, future)
        _log.warning("close: %s %.1f s after close began and %.1f s after the workers were killed with SIGKILL "
                     "(a worker that does not die, or a done-callback that does not return); every item "
                     "cancelled, the workers and the buffer directory %s left to a later close (at interpreter "
                     "exit at the latest)", why, self._close_timeout_s, clock.grace_s, self._directory)

    def _stop_workers(self, clock: CloseClock) -> None:
        """Stop every worker: idle ones are told to, busy ones terminated (their results would be
        discarded), stragglers killed at the clock's deadline. A worker leaves `_workers` only once it is
        reaped or given up on, so a close interrupted while it waits leaves the rest to the next.

        A busy worker that outlives `close_timeout_s` is reported, as the thread runner reports a
        thread it leaves running: its stage function survived SIGTERM (it blocks or ignores the
        signal), a fault the user must hear of rather than a detail of closing. One not reaped
        `_reap_wait_s` after SIGKILL (uninterruptible sleep: a hung NFS read) is reported and
        given up on: its exit was waited for without a bound, holding close and interpreter exit
        for ever. multiprocessing forgets it, and a later start or close reaps it (`_give_up_on`)."""
        with self._lock:
            workers = list(self._workers)
        terminated = []
        for worker in workers:
            if not worker.tasks and not worker.broken:
                try:
                    worker.conn.send_bytes(STOP)
                except OSError:
                    pass
            else:
                worker.process.terminate()
                terminated.append(worker)
        for worker in workers:
            _join(worker.exit, clock.deadline)
        stragglers = [worker for worker in workers if not worker.exit.exited()]
        for worker in stragglers:
            if worker in terminated and self._close_timeout_s > 0:  # 0 asks for SIGKILL at once
                _log.warning("stage %r: busy worker (pid %s) had not exited %.1f s after SIGTERM "
                             "(close_timeout_s); killed with SIGKILL",
                             self._stages[worker.stage].name, worker.process.pid, self._close_timeout_s)
        reap_by = clock.kill() if stragglers else clock.deadline
        for worker in workers:
            reaped = _join(worker.exit, reap_by)
            worker.conn.close()
            with self._lock:
                self._workers.remove(worker)  # before close(): a rerun would join a closed process
            for task in worker.tasks:
                discard(task.envelope)
            if reaped:
                worker.exit.close()
                continue
            _give_up_on(worker.exit, self._stages[worker.stage].name, clock.grace_s)
            leave_unreaped(worker.exit)

    @staticmethod
    def _kill_to_retire(worker: _Worker) -> int:
        """SIGKILL a worker the reader retires without waiting for its exit, and its pid: one in
        uninterruptible sleep (a hung NFS read) outlives SIGKILL, and a reader waiting for it read
        no other worker's reply again. Its grace (`_reap_wait_s`) is measured before its memory
        goes; `_reap_dying` reaps it within that, or gives up on it."""
        worker.grace_s = _reap_wait_s(_resident_bytes(worker.process.pid))
        worker.process.kill()
        return worker.process.pid

    def _reap_dying(self, until: float) -> None:
        """Reap each killed worker that has exited by `until` (waiting for none past its
        `reap_by`), freeing its request blocks; report one still there at its `reap_by`, as close
        does (`_give_up_on`), and move it to `_given_up`."""
        for dying in list(self._dying):
            if not _join(dying.exit, min(until, dying.reap_by)) and time.monotonic() < dying.reap_by:
                continue
            self._dying.remove(dying)
            if not dying.exit.exited():
                _give_up_on(dying.exit, dying.stage, dying.grace_s)
                self._given_up.append(dying)
                continue
            dying.exit.close()
            if dying.request_blocks:
                self._requests.give_back(dying.request_blocks)

    def _reap_given_up(self, ready: set[Any]) -> None:
        """Reap each worker given up on whose exit `ready` shows (its uninterruptible sleep ended),
        freeing its request blocks: it stayed a zombie until the runner's close, and its blocks
        taken for the runner's life. One that cannot be reaped all the same (its watch shows an
        exit waitid does not) is left to `reap_the_left`, so that its readable descriptor never
        spins the reader."""
        for dying in [dying for dying in self._given_up if dying.exit.fd in ready]:
            self._given_up.remove(dying)
            if not dying.exit.reap_exited():
                leave_unreaped(dying.exit)
            elif dying.request_blocks:
                self._requests.give_back(dying.request_blocks)


class CloseClock:
    """The deadlines of one close: `close_timeout_s` from its start for the reader thread, the
    runner's lock and the workers to be done by themselves; then, once the workers are killed (once
    only), `_reap_wait_s` of the largest worker for the rest. So close returns within
    `close_timeout_s` and that, or by the `reap_by` of a worker the reader killed before, if later.

    `ends` is when the close's last wait ends, as far as known so far: the exit hook, waiting for a
    close another thread runs, reads it on every poll, so that it waits as long as that close's
    grace, which only the kill can tell (a flat `close_timeout_s` and 5 s gave up first on
    workers of over 3 GiB, and exit then cut the close short)."""

    def __init__(self, timeout_s: float, kill_workers: Callable[[], int]) -> None:
        self.deadline = self.ends = time.monotonic() + timeout_s
        self._kill_workers = kill_workers
        self._grace_ends: float | None = None
        self.grace_s = 0.0

    def wait(self, done_by: Callable[[float], bool]) -> bool:
        """`done_by(deadline)`; if that is not done, the workers are killed and it gets the grace."""
        return done_by(self.deadline) or done_by(self.kill())

    def kill(self) -> float:
        """Kill every worker, the first time; when the grace after that kill ends."""
        if self._grace_ends is None:
            self.grace_s = _reap_wait_s(self._kill_workers())
            self._grace_ends = self.reach(time.monotonic() + self.grace_s)
        return self._grace_ends

    def reach(self, until: float) -> float:
        """`until`, a wait's deadline, which `ends` now covers."""
        self.ends = max(self.ends, until)
        return until


WORKER_PROCESSES: weakref.WeakSet = weakref.WeakSet()
"""The worker processes of this process's runners, live or not yet reaped."""


def _forget_the_parents_workers() -> None:
    """In a child forked from a process with runners: drop their workers from multiprocessing's
    own list of this process's children, which a fork copies.

    multiprocessing's exit hook terminates every daemonic process on that list, so a child forked
    with os.fork (a fork-based helper, a child iterating its copy of a loader) that ended through
    normal interpreter exit sent SIGTERM to the parent's workers (replaced, their items re-run as
    after a crash) and printed an AssertionError when it could not join them. They are not its
    children, and their runner's owner alone stops them."""
    for process in list(WORKER_PROCESSES):
        _forget_process(process)
    WORKER_PROCESSES.clear()


def _forget_process(process: multiprocessing.process.BaseProcess) -> None:
    """Drop `process` from multiprocessing's list of this process's children, which its exit hook
    terminates and then joins without a bound."""
    children = getattr(multiprocessing.process, "_children", None)
    if children is not None:
        children.discard(process)


_fork.call_in_child(_forget_the_parents_workers)


# How much longer than the end of a close's last wait (`CloseClock.ends`) the exit hook waits for
# that close, another thread's: the kill (measuring the workers' memory first), and the closing of
# pipes and removal of the directory after the waits.
_EXIT_WAIT_MARGIN_S = 5.0


def close_at_exit(runner: ProcessRunner, pid: int) -> None:
    """Close a runner its owner never closed: stop its workers and remove its buffer directory.

    Only in the process that started it: a child forked from it (which inherits the atexit
    registry) must not stop the parent's workers or remove the parent's directory.

    A close under way on another thread (the closer thread, closing a dropped loader's runner)
    made `close()` here return at once, and interpreter exit then cut that close short, leaving the
    directory behind: the hook waits for it, for as long as that close's waits last (its clock's
    `ends`, which grows once it kills the workers, and a margin; at least `close_timeout_s` and the
    margin from now, as that close may not have published its clock yet), then finishes whatever
    is left. It polls `locked()` rather than taking the lock: an exit hook must never block on a
    lock. It waits again only when its own close returned because the other thread took the lock
    just after the hook looked. A close of its own that left the rest to a later close (a reader
    thread still busy) ends it too: another would wait as long again for the same thread and
    report it again, and the hook closed the runner again until its deadline had passed (three
    closes, three warnings, for `close_timeout_s=0.2`). A done-callback raising a BaseException as
    the close cancels a held future is logged and the close goes on (`exit_hook`): nothing closes
    the runner later."""
    if os.getpid() != pid:
        return
    at_least = time.monotonic() + runner._close_timeout_s + _EXIT_WAIT_MARGIN_S

    def waited_enough() -> bool:
        clock = runner._close_clock
        ends = at_least if clock is None else max(at_least, clock.ends + _EXIT_WAIT_MARGIN_S)
        return time.monotonic() >= ends

    with exit_hook():
        while True:
            while runner._close_lock.locked() and not waited_enough():
                time.sleep(0.01)
            if runner._close() or waited_enough():
                return


def _reap_wait_s(resident_bytes: int) -> float:
    """How long to wait for a killed process holding `resident_bytes` to be reaped."""
    return REAP_WAIT_S + _REAP_WAIT_S_PER_GIB * resident_bytes / 2**30


def _resident_bytes(pid: int | None) -> int:
    """The resident memory of process `pid`; 0 if it cannot be read (it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _give_up_on(watch: ExitWatch, stage: str, waited_s: float) -> None:
    """Report a worker not reaped `waited_s` after SIGKILL and stop waiting for it: multiprocessing,
    whose exit hook joins its children without a bound, forgets it. It is reaped once it has
    exited, without being waited for: by the reader, which watches its exit (`_reap_given_up`),
    or, once its runner no longer reads, by the next runner's start or close (`reap_the_left`)."""
    _forget_process(watch.process)
    _log.warning("stage %r: worker (pid %s) had not exited %.1f s after SIGKILL (uninterruptible "
                 "sleep: a hung NFS read, say); no longer waited for, reaped once it exits",
                 stage, watch.process.pid, waited_s)


def _wait_left(deadline: float) -> float:
    """Seconds to `deadline`, at most `LONGEST_WAIT_S`: a wait past ~24.8 days raises OverflowError."""
    return min(max(0.0, deadline - time.monotonic()), LONGEST_WAIT_S)


def _join(watch: ExitWatch, deadline: float) -> bool:
    """Wait until a worker has exited and been reaped, or `deadline` has passed; whether it was."""
    return _joined(watch.wait, watch.exited, deadline)


def _joined(join: Callable[[float], None], ended: Callable[[], bool], deadline: float) -> bool:
    while True:
        join(_wait_left(deadline))
        if ended():
            return True
        if time.monotonic() >= deadline:
            return False
