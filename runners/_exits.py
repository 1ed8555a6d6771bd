"""Seeing a worker process exit, whatever its own children hold, and reaping, without blocking, the
workers a close gave up on.

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

# Pids of workers given up on (not reaped within the grace after SIGKILL: uninterruptible sleep)
# and not reaped since. Taken and dropped with single set operations, never under a lock: the exit
# hook and the reader thread reach them too.
_LEFT_UNREAPED: set[int] = set()


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

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the process to exit; reap it if it has (`exited`)."""
        if self._pidfd is None:
            self.process.join(timeout)
        elif wait([self._pidfd], timeout):
            self.process.join()  # it has exited: waitpid returns at once

    def exited(self) -> bool:
        """Whether the process has exited and been reaped (a non-blocking waitpid)."""
        return self.process.exitcode is not None

    def close(self) -> None:
        """Let go of the pidfd, once the process is reaped or given up on; idempotent."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def leave_unreaped(pid: int) -> None:
    """Remember a worker given up on, for `reap_the_left` to reap once it has exited."""
    _LEFT_UNREAPED.add(pid)


def reap_the_left() -> None:
    """Reap every worker given up on that has exited since, without waiting for any: each was left
    a zombie until the trainer exited. A pid stays this process's until it is reaped, so waiting on
    it reaps no other process; one reaped elsewhere (code calling `os.wait()`) is dropped."""
    for pid in list(_LEFT_UNREAPED):
        try:
            reaped = os.waitpid(pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            reaped = True
        if reaped:
            _LEFT_UNREAPED.discard(pid)


# A child forked from this process (a worker, a fork-based helper) has none of these as children.
_fork.call_in_child(_LEFT_UNREAPED.clear)
