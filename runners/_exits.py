"""Seeing a worker process exit, whatever its own children hold, and reaping, without blocking, the
workers given up on (`reap_exited` as the reader sees one exit; `reap_the_left` for those of runners
that no longer read).

multiprocessing tells a child's exit by its sentinel, a pipe whose other end the child holds: the
end closes only once every process holding it has exited. A stage function that forks (a
library's helper daemon, a subprocess started without closing descriptors) hands that end, and the
worker's own pipe, to a grandchild that may outlive the worker: the worker's death went unseen
until `task_timeout_s`, for ever without one, and close waited out `close_timeout_s` for a worker
long dead. A pidfd (Linux >= 5.3, Python >= 3.9) becomes readable when that very process exits.
"""

from __future__ import annotations

import os
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from zephon import _fork

__all__ = ["ExitWatch", "leave_unreaped", "reap_the_left"]

# Workers given up on (not reaped within the grace after SIGKILL: uninterruptible sleep) whose
# runner no longer reads, not reaped since: pid -> the pidfd that reaps that very process, or None
# where the system offers none (reaped by pid). An entry is claimed with one `pop` before it is
# waited on and put back if the worker is still there, never under a lock: the exit hook and the
# reader thread reach them too.
_LEFT_UNREAPED: dict[int, int | None] = {}
_CLAIMED = object()


class ExitWatch:
    """Tells when one worker process has exited, and reaps it: through a pidfd of it, or through its
    multiprocessing sentinel where the system offers none (pidfd_open missing or refused).

    Thread-safety: used by one thread at a time (the reader thread, then close once the reader
    has stopped)."""

    def __init__(self, process: BaseProcess) -> None:
        self.process = process
        try:
            self._pidfd: int | None = os.pidfd_open(process.pid)
        except (AttributeError, OSError):
            self._pidfd = None
        # What a selector watches for its exit: readable once it has exited.
        self.fd = process.sentinel if self._pidfd is None else self._pidfd
        # Whether only its sentinel tells its exit, which a child it forked, holding the sentinel,
        # hides: then its exit is also asked of waitpid (`exited`) while it holds items.
        self.sentinel_only = self._pidfd is None

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the process to exit; reap it if it has (`exited`)."""
        if self._pidfd is None:
            self.process.join(timeout)
        elif wait([self._pidfd], timeout):
            self.process.join()  # it has exited: waitpid returns at once

    def exited(self) -> bool:
        """Whether the process has exited and been reaped (a non-blocking waitpid)."""
        return self.process.exitcode is not None

    def reap_exited(self) -> bool:
        """Reap a process given up on, which multiprocessing no longer knows of, if it has exited
        (`fd` readable), without waiting: whether it is gone, reaped now or elsewhere. Its pidfd is
        closed once it is."""
        if not _reaped(self.process.pid, self._pidfd):
            return False
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return True

    def hand_over(self) -> int | None:
        """The pidfd, now the caller's to close (None where there is none); the watch lets go of it."""
        pidfd, self._pidfd = self._pidfd, None
        return pidfd

    def close(self) -> None:
        """Let go of a reaped process: its pidfd and multiprocessing's handle."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self.process.close()


def leave_unreaped(watch: ExitWatch) -> None:
    """Remember a worker given up on, with its pidfd, for `reap_the_left` to reap once it has
    exited: one given up on at close, or still there when its runner closes."""
    _LEFT_UNREAPED[watch.process.pid] = watch.hand_over()


def reap_the_left() -> None:
    """Reap every worker left unreaped that has exited since, without waiting for any: each was
    left a zombie until the trainer exited. One reaped elsewhere is dropped."""
    for pid in list(_LEFT_UNREAPED):
        pidfd = _LEFT_UNREAPED.pop(pid, _CLAIMED)
        if pidfd is _CLAIMED:  # another thread is reaping it
            continue
        if not _reaped(pid, pidfd):
            _LEFT_UNREAPED[pid] = pidfd
        elif pidfd is not None:
            os.close(pidfd)


def _reaped(pid: int, pidfd: int | None) -> bool:
    """Reap process `pid` if it has exited, without waiting: whether it is gone (reaped elsewhere
    too). Through its pidfd where there is one: a pid reaped elsewhere (code calling `os.wait()`)
    may have been given to another child of this process since, which a wait by pid would reap in
    its place."""
    try:
        if pidfd is None:
            return os.waitpid(pid, os.WNOHANG)[0] != 0
        return os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG) is not None
    except ChildProcessError:
        return True


def _forget_the_parents_left() -> None:
    """A child forked from this process has none of the parent's workers as children."""
    for pidfd in _LEFT_UNREAPED.values():
        if pidfd is not None:
            os.close(pidfd)
    _LEFT_UNREAPED.clear()


_fork.call_in_child(_forget_the_parents_left)
