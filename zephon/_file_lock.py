"""Exclusive advisory locks (`flock`) that tell what a live process uses from what a dead one left.

Two things are left behind when their process is killed with SIGKILL (the OOM killer, a
scheduler), with nobody left to remove them: a download's temporary file in the io cache
(`zephon.io._atomic_cache`) and a process runner's buffer directory in /dev/shm
(`runners._buffer_directory`). Their owner holds an exclusive `flock` on a file of theirs for as
long as it uses them; the kernel drops it once the last descriptor of that open file is closed,
which a process that dies does for all of its own. A lock taken without waiting is therefore proof
that no live process holds it, whatever a pid says (pids are reused, and containers sharing a
directory see one another's under other numbers), and whoever takes it removes the thing while
holding it, so two cleaners never remove one thing at once. A lock file removed with its thing
may be made again at its name by a new owner; a lock taken on the removed one guards nothing,
hence `still_at`.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

__all__ = ["lock", "remove_if_unlocked", "still_at"]


def lock(handle: int, blocking: bool) -> bool:
    """Take the exclusive lock on an open file; False where another process holds it or the
    filesystem takes no locks (then nothing can tell a live owner from a dead one)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


def remove_if_unlocked(lock_path: str, remove: Callable[[], object]) -> bool:
    """Call `remove` while holding the lock on `lock_path`, if it can be taken without waiting;
    whether it was. A lock file that cannot be opened (gone meanwhile, another user's) is not
    this process's to judge, nor is one another cleaner removed after it was opened here: the lock
    taken on it says nothing of the file now at `lock_path`, whose owner may be storing the thing
    anew. What `remove` raises is raised, the lock dropped first."""
    try:
        handle = os.open(lock_path, os.O_RDWR)  # NFS's emulated flock needs a writable file
    except OSError:
        return False
    try:
        if not lock(handle, blocking=False) or not still_at(handle, lock_path):
            return False
        remove()
        return True
    finally:
        os.close(handle)  # only now: closing it drops the lock


def still_at(handle: int, path: str) -> bool:
    """Whether the file open as `handle` is the one at `path`."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
