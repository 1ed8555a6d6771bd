"""A handle of the opener's own where fsspec hands every opener of a file the same file object.

`ShardFile.open` promises each caller a handle with its own position: a Dataset reads chunks of one
shard on several threads at once (planning counts shards on up to 16, a thread runner reads chunks
on several). Three fsspec filesystems break that:

- `memory://` gives every opener the one file object it stores: reads of two chunks on two threads
  moved each other's position. A `BytesIO` of its bytes is private and shares them without a copy.
- `tar://MEMBER::URL` reads every member through the archive's one file object: a member's reads
  seek it to the member's offset, then read, and two threads interleaved those steps, so a read
  took another member's bytes (records skipped as bad JSON, or wrong ones), or raised
  `tarfile.ReadError: unexpected end of data`. The members of one archive are opened, read and
  closed one call at a time here, under a lock of that filesystem's; the archive's one file
  object could not serve two reads at once anyway.
- `zip://MEMBER::URL`: `zipfile` locks each read of its file, but counts the members open without
  a lock, and on 3.14t openings and closings on two threads lost counts (an `AssertionError` in
  `ZipFile.close`; a count that reached zero with members open would close the file under them).
  Members are opened and closed under the filesystem's lock; reads, decompression included, stay
  parallel.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import weakref
from typing import BinaryIO

__all__ = ["open_own"]

_archive_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_archive_locks_made = threading.Lock()


def open_own(fs, path: str) -> tuple[BinaryIO, BinaryIO]:
    """`path` opened for reading on `fs`: (the handle `fs` gave, the caller's own handle over it;
    the same one where `fs` gives each opener its own, see the module docstring)."""
    archive = _archive_kind(fs)
    if archive is None:
        opened = fs.open(path, "rb")
        memory = sys.modules.get("fsspec.implementations.memory")  # not imported: not its file
        if memory is not None and type(opened) is memory.MemoryFile:
            return opened, io.BytesIO(opened.getvalue())
        return opened, opened
    lock = _lock_of(fs)
    with lock:
        opened = fs.open(path, "rb")
    return opened, io.BufferedReader(_ArchiveMember(opened, lock, reads_locked=archive == "tar"))


def _archive_kind(fs) -> str | None:
    """"tar" or "zip" where `fs` is fsspec's filesystem of such an archive's members, else None."""
    for kind, module, name in (("tar", "tar", "TarFileSystem"), ("zip", "zip", "ZipFileSystem")):
        implementation = sys.modules.get(f"fsspec.implementations.{module}")  # imported if fs is one
        if implementation is not None and isinstance(fs, getattr(implementation, name)):
            return kind
    return None


def _lock_of(archive) -> threading.Lock:
    with _archive_locks_made:
        lock = _archive_locks.get(archive)
        if lock is None:
            lock = _archive_locks[archive] = threading.Lock()
        return lock


class _ArchiveMember(io.RawIOBase):
    """One opener's handle of a member (which keeps its own position), closed under the archive's
    lock, and read, sought and told under it too where `reads_locked` (module docstring)."""

    def __init__(self, member: BinaryIO, lock: threading.Lock, reads_locked: bool) -> None:
        self._member, self._lock = member, lock
        self._read_lock = lock if reads_locked else contextlib.nullcontext()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        with self._read_lock:
            return self._member.readinto(buffer)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        with self._read_lock:
            return self._member.seek(offset, whence)

    def tell(self) -> int:
        with self._read_lock:
            return self._member.tell()

    def close(self) -> None:
        if not self.closed:
            with self._lock:
                self._member.close()
        super().close()
