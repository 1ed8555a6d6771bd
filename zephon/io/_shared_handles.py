"""A handle of the opener's own where fsspec's files share what cannot serve two threads at once.

`ShardFile.open` promises each caller a handle with its own position: a Dataset reads chunks of one
shard on several threads at once (planning counts shards on up to 16, a thread runner reads chunks
on several). Five fsspec filesystems break that:

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
- `ftp://` sends every file's commands over the filesystem's one control connection: planning's
  threads interleaved theirs, so no FTP dataset of more than one shard could be planned
  (`error_reply('200 Type set to: Binary.')`, or a timeout), nor its chunks read on several
  threads. Its files are opened, read and closed one call at a time, as tar's members are.
- `sftp://` sends every file's requests over paramiko's one SFTP client, which threads cannot
  share (paramiko issue #1836): a dataset planned and read on eight threads failed with
  `SFTPError('Garbage packet received')` or hung for good. Its files too are used one call at a
  time, the check of the version a file was opened at (a `stat` over the same client) included.

A cache in front of one of them (`cache={"enabled": True}`) copies a shard through the same one
connection or client: planning's threads copied at once, so an FTP dataset with a cache could not
be planned (`error_reply('200 Type set to: Binary.')`) and an SFTP one hung for good. Opening
through a cache, which copies the shard where no copy exists yet, is done under its store's lock;
the copy it gives is a local file of the opener's own. So is every other call on such a store
(`store_calls`): the version checks beside the opens.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import weakref
from collections.abc import Callable
from typing import BinaryIO

from ._protocols import store_of

__all__ = ["open_own", "store_calls"]

_filesystem_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_filesystem_locks_made = threading.Lock()


def open_own(fs, path: str, check: Callable[[BinaryIO], None], **options) -> BinaryIO:
    """`path` opened for reading on `fs` (with fsspec's open `options`), as a handle of the
    caller's own (module docstring), once `check` (which may ask `fs` about the file) passed for
    the handle `fs` gave, under the lock where the filesystem's calls are made one at a time."""
    store = store_of(fs)
    shared = _what_is_shared(store)
    if shared is None:
        opened = _open_checked(fs, path, check, options)
        memory = sys.modules.get("fsspec.implementations.memory")  # not imported: not its file
        if memory is not None and type(opened) is memory.MemoryFile:
            return io.BytesIO(opened.getvalue())
        return opened
    lock = _lock_of(store)
    with lock:
        opened = _open_checked(fs, path, check, options)
    if store is not fs:  # the cache's local copy, made under the lock
        return opened
    return io.BufferedReader(_SharingFile(opened, lock, reads_locked=shared == "reads"))


def store_calls(fs) -> contextlib.AbstractContextManager:
    """Where the calls on the store under `fs` (`_protocols.store_of`) must be made one at a time
    (module docstring): its lock, which the thread holding it may take again; else nothing."""
    store = store_of(fs)
    return contextlib.nullcontext() if _what_is_shared(store) is None else _lock_of(store)


def _open_checked(fs, path: str, check: Callable[[BinaryIO], None], options: dict) -> BinaryIO:
    opened = fs.open(path, "rb", **options)
    try:
        check(opened)
    except BaseException:
        opened.close()
        raise
    return opened


# fsspec's filesystems whose files share what cannot serve two calls at once (module docstring):
# "reads", every call on a file (one file object, one connection); "opens", opening and closing.
_SHARING = (("tar", "TarFileSystem", "reads"), ("ftp", "FTPFileSystem", "reads"), ("sftp", "SFTPFileSystem", "reads"),
            ("zip", "ZipFileSystem", "opens"))


def _what_is_shared(fs) -> str | None:
    """"reads" or "opens" where `fs` is one of `_SHARING`'s filesystems, else None."""
    for module, name, shared in _SHARING:
        implementation = sys.modules.get(f"fsspec.implementations.{module}")  # imported if fs is one
        if implementation is not None and isinstance(fs, getattr(implementation, name)):
            return shared
    return None


def _lock_of(fs) -> contextlib.AbstractContextManager:
    """`fs`'s lock, reentrant: an open's check, made under it, asks the store for the version."""
    with _filesystem_locks_made:
        lock = _filesystem_locks.get(fs)
        if lock is None:
            lock = _filesystem_locks[fs] = threading.RLock()
        return lock


class _SharingFile(io.RawIOBase):
    """One opener's handle of a file (which keeps its own position), closed under its filesystem's
    lock, and read, sought and told under it too where `reads_locked` (module docstring)."""

    def __init__(self, member: BinaryIO, lock: contextlib.AbstractContextManager, reads_locked: bool) -> None:
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
            self._member.seek(offset, whence)  # paramiko's (sftp) returns None
            return self._member.tell()

    def tell(self) -> int:
        with self._read_lock:
            return self._member.tell()

    def close(self) -> None:
        if not self.closed:
            with self._lock:
                self._member.close()
        super().close()
