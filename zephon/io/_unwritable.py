"""What an operator is told to do about a local cache directory that cannot take a write.

The scan cache and the download cache both fail at once, naming the directory and the errno, when
their disk refuses a file. The remedy differs with the errno: "free space on its disk", said for
every one of them, sent whoever got a read-only mount or a directory owned by another user to
delete files that were never the problem.
"""

from __future__ import annotations

import errno

__all__ = ["unwritable_remedy"]

_REMEDIES = {
    errno.ENOSPC: "free space on its disk",
    errno.EDQUOT: "free space under its quota, or raise the quota",
    errno.EROFS: "its filesystem is mounted read-only: remount it read-write",
    errno.EACCES: "give this process's user write permission to it",
    errno.EPERM: "give this process's user write permission to it",
}


def unwritable_remedy(code: int | None) -> str:
    """What to do about a directory whose write failed with errno `code`."""
    return _REMEDIES.get(code, "make it writable")
