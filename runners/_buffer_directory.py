"""A process runner's buffer directory in shared memory, made holding a lock that says its runner
lives; the directories of runners that died whole are removed as a new one is made.

The parent removes its directory in `close()`, and the workers remove it when the parent dies
alone (`_worker`). A job killed whole (SIGKILL to the trainer and its workers together: Slurm's
`scancel` after its grace period, `kill -9` of the process group, the OOM killer taking the job's
cgroup) left nobody to, so the directory and the buffer files in transit stayed in /dev/shm for
good; a node running job after job filled it (a container's is often 64 MiB) and a later job
failed there.

Each directory therefore holds `owner.lock`, locked (`flock`) by the parent and, through the
descriptor inherited when they are forked, by its workers: the lock lives as long as any process of
the runner, so a parent killed alone keeps it while its workers clean up. A runner making its
directory first removes, under the same root, each directory named as a runner's (`zephon-<pid>-`
and `tempfile.mkdtemp`'s eight characters) whose lock it can take without waiting, holding the
lock as it removes it (`zephon._file_lock`): two runners sweeping at once never both remove one. The
pid in the name does not tell a dead runner: containers sharing /dev/shm count pids in namespaces
of their own, and pids are reused. It only keeps a runner from sweeping the directories named with
its own process's pid, which are its process's (or a dead namesake's, left to a runner of another
process): on NFS, Linux emulates `flock` with POSIX record locks, which a process's own opens never
conflict with and which closing any descriptor of the file drops, so a second runner in the process
of a live one (a validation loader's beside the training loader's) took the first's lock and
removed its live directory.

A lock is proof only to processes of the kernel that holds it: on a filesystem shared between
nodes (an `shm_root` on NFS mounted without its lock service) another node's lock may not be seen.
`owner.lock` therefore holds the kernel's boot id (the same in every container on a node), and a
directory another kernel locked is left to that kernel's runners.

The lock is taken on the file under another name, which is then renamed to `owner.lock`, so a
directory's `owner.lock` is locked from the moment it can be seen: a runner being made is never
taken for a dead one, however long it is held up between making its directory and locking it. A
directory without `owner.lock` is left alone: one being made, one whose runner died in that
instant, one a Zephon without this lock made, one on a filesystem that takes no locks.

A process forked from the trainer while the runner is open inherits the descriptor as its workers
do (another runner's workers, a torch DataLoader worker), so the directory of a job killed whole
waits, if such a process outlives the job, until it has exited too.

Sweeping costs a listing of the root and, per directory named as a runner's, a read of its
`owner.lock` and a lock that does not wait. It never fails the runner being made: what fails is
logged (logger `runners.process`) and skipped.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import tempfile

from zephon._file_lock import lock, remove_if_unlocked
from zephon._job_log import RankLog

__all__ = ["LOCK", "make_buffer_directory"]

_log = RankLog(logging.getLogger("runners.process"))  # the process runner's: one logger for the user to configure

LOCK = "owner.lock"
"""The file in a runner's buffer directory that its processes hold locked while any is alive."""

_LOCKING = LOCK + ".new"
_RUNNER_DIRECTORY = re.compile(r"zephon-[0-9]+-[a-z0-9_]{8}")


def make_buffer_directory(root: str | None = None) -> tuple[str, int | None]:
    """A fresh private directory for one runner's buffer files (in /dev/shm when it exists), and
    the descriptor holding its lock, which the runner's workers inherit and the runner closes once
    it has removed the directory; None where the lock could not be taken (the directory is then
    never taken for a dead runner's). Dead runners' directories under the same root go first.

    Its path is absolute: a relative `root` would name another place once the job changes its
    working directory (Hydra gives each run its own), where no buffer could be written or found."""
    if root is None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    root = os.path.abspath(root)
    _remove_dead(root)
    directory = tempfile.mkdtemp(prefix=f"zephon-{os.getpid()}-", dir=root)
    return directory, _hold(directory)


def _hold(directory: str) -> int | None:
    """The descriptor of the directory's `owner.lock`, locked before the file takes that name."""
    handle = None
    try:
        handle = os.open(os.path.join(directory, _LOCKING), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if not lock(handle, blocking=False):
            raise OSError(errno.ENOLCK, "its filesystem takes no locks")
        os.write(handle, _kernel())
        os.rename(os.path.join(directory, _LOCKING), os.path.join(directory, LOCK))
        return handle
    except OSError as error:
        if handle is not None:
            os.close(handle)
        _log.warning(
            "the buffer directory %s has no lock (%s): no later runner will remove it if this job is killed whole",
            directory,
            error,
        )
        return None


def _remove_dead(root: str) -> None:
    """Remove the buffer directories under `root` that no live process holds (see the module's
    docstring for why that is safe); log what fails and go on."""
    try:
        with os.scandir(root) as entries:
            named = [entry.path for entry in entries if _RUNNER_DIRECTORY.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)]
    except OSError as error:
        _log.warning("could not look for dead process runners' buffer directories in %s: %s", root, error)
        return
    ours = f"zephon-{os.getpid()}-"
    for directory in named:
        if os.path.basename(directory).startswith(ours) or not _locked_on_this_kernel(directory):
            continue
        try:
            if remove_if_unlocked(os.path.join(directory, LOCK), functools.partial(shutil.rmtree, directory)):
                _log.info("removed %s, the buffer directory of a process runner none of whose processes is alive", directory)
        except FileNotFoundError:  # removed by another runner between our open and our lock
            pass
        except OSError as error:
            _log.warning("could not remove %s, the buffer directory of a dead process runner: %s", directory, error)


def _locked_on_this_kernel(directory: str) -> bool:
    """Whether the directory's `owner.lock` was locked by a process of this kernel, whose locks
    this one sees; False where it cannot be read (none yet, another user's)."""
    try:
        with open(os.path.join(directory, LOCK), "rb") as file:
            return file.read(len(_kernel()) + 1) == _kernel()
    except OSError:
        return False


@functools.cache
def _kernel() -> bytes:
    """This kernel's boot id: one for every container on the node, another on any other node or
    after a reboot; empty where the system tells none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as file:
            return file.read().strip()
    except OSError:
        return b""
