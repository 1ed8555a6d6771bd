"""fsspec's `simplecache` with copies that appear whole or not at all, one per version of a file.

`SimpleCacheFileSystem` downloads a shard straight into its final name in the cache directory and
takes any file found there as the shard. A download that fails halfway (one transient error) left a
partial copy that the retry, and every later run, read as the whole shard: records vanished from
the plan with no error and no skip. Readers that open a shard while another is still copying it
(workers of one loader, when the cache is set through `io_options` after planning) read the part
copied so far, so batches differed by runner. Here each download goes to a temporary name beside
the final one and is renamed into place once complete (a rename within one directory is atomic),
and a failed download leaves nothing behind. Two readers may then download the same shard at once;
both copies are whole and either may win.

A process killed mid-download (SIGKILL, the OOM killer) cannot remove its temporary file, and
nothing else did: each one stayed in the cache for good. A download therefore holds an exclusive
`flock` (`zephon._file_lock`) on its temporary file, which the kernel drops when the process dies,
and each download first removes the temporary files in its directory that are abandoned: no process
holds their lock, they were written on this host, and untouched for `ABANDONED_AFTER_S`. A download
in progress is never taken: its lock is held by a live process. Only this host's are tried, because
a lock taken on another host may not be visible here (NFS mounted `nolock`, some FUSE filesystems);
another host's abandoned file waits for that host's next download into the directory. The age
closes the instants a live download is unlocked: between creating its file and locking it, and, on
NFS, where Linux emulates `flock` with POSIX locks that a process drops on closing any descriptor
of the file, between fsspec closing its own and the rename. What this cannot tell apart: two hosts
with one host name sharing a directory on a filesystem whose locks do not reach across hosts, where
one may remove the other's download after `ABANDONED_AFTER_S` without a write; that download then
fails naming the file, it is never read in part.

`simplecache` also names a copy by the shard's path alone and never looks at the remote file again,
so a shard rewritten at its path (a dataset regenerated in place) was read from the old copy by
every later run: its plan took the new size from the listing and the old records from the copy,
and records added or changed were missing without a word. Here a copy is named by the path and a
version of the file (`_version`: its size and ETag, generation, checksum or the like, else its
modification time; fsspec's `ukey` where the filesystem tells none, which takes an http(s) file
as never changing). A Dataset reading through the cache gives the versions it planned: the copy
of that version is found without asking the remote again (the Dataset has just checked the
remote is still that version), and one not there yet is copied. Planning gives the versions its
listing told, and asks the remote of a file whose listing told none. Either way the version is
asked again once the copy is whole (the field the given version holds, see `_version`), and a copy
of a file that is no longer the version it is named by is thrown away and the read refused
naming the shard: a rewrite landing between the Dataset's check and the copy was copied and read
under the planned offsets. A new version is copied anew, and copies of old versions stay on disk
until the directory is cleared.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import socket
import tempfile
import time
from collections.abc import Mapping

from fsspec.implementations.cache_mapper import AbstractCacheMapper
from fsspec.implementations.cached import SimpleCacheFileSystem

from .._errors import ConfigurationError
from .._file_lock import lock, remove_if_unlocked
from ._unwritable import unwritable_remedy
from ._version import ShardVersion, changed_after_planning, version_of

__all__ = ["ABANDONED_AFTER_S", "AtomicSimpleCacheFileSystem"]

ABANDONED_AFTER_S = 600.0
"""How long an unlocked temporary file of this host must have been untouched to be removed."""

_PART = ".part"

# Errors of the local disk while the copy is written: full, over quota, read-only. A remote read
# never raises them, so from inside the download they are the cache's. Not EACCES: a remote's
# PermissionError is one too, and only making the temporary file, which the remote has no part
# in, takes it as the cache's.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
_CACHE_DIRECTORY_ERRNOS = _DISK_ERRNOS | {errno.EACCES, errno.EPERM}


class AtomicSimpleCacheFileSystem(SimpleCacheFileSystem):
    """`simplecache` whose copies are written under a temporary name and renamed when complete, and
    named by the version of the file they copy: `planned_versions[path]` where given, else the
    version the remote reports now."""

    def __init__(self, planned_versions: Mapping[str, ShardVersion] | None = None, **kwargs):
        super().__init__(**kwargs)
        self._mapper = _VersionedNames(self.fs, planned_versions or {})

    def _open(self, path, mode="rb", **kwargs):
        """A read opens the copy of the version asked once. fsspec asks the version again after
        copying and opened whatever that names: a shard rewritten meanwhile named no copy, and
        the read failed with a TypeError from `open(None)`."""
        if mode != "rb" or self.compression:
            return super()._open(path, mode, **kwargs)
        path = self._strip_protocol(path)
        version = self._mapper.version(path)
        name = _copy_name(path, version)
        for directory in self.storage:
            copy = os.path.join(directory, name)
            if os.path.exists(copy):
                return open(copy, "rb")
        _copy_whole(self, path, version)
        return open(os.path.join(self.storage[-1], name), "rb")

    def _get_cached_file_before_open(self, path, **kwargs):
        if self.compression:  # Zephon never asks the cache to decompress; fsspec's own path then
            return super()._get_cached_file_before_open(path, **kwargs)
        _copy_whole(self, path, self._mapper.version(path))


def _copy_whole(cache: AtomicSimpleCacheFileSystem, path: str, version: str) -> None:
    """Copy `path`, which is `version`, into `cache` under that version's name, whole and of that
    version or not at all. A function, not a method: fsspec's caching filesystems hand any
    attribute they do not list to the remote filesystem."""
    name = _copy_name(path, version)
    cache._cache_size = None
    directory = cache.storage[-1]
    host = socket.gethostname()
    try:
        cache._mkcache()
        _remove_abandoned(directory, host)
        handle, partial = tempfile.mkstemp(dir=directory, prefix=f"{name}.{host}.", suffix=_PART)
    except OSError as error:
        if error.errno in _CACHE_DIRECTORY_ERRNOS:
            raise _unwritable(cache, path, directory, error) from error
        raise
    try:
        lock(handle, blocking=True)
        cache.fs.get_file(path, partial)
        if (now := _current_version(cache.fs, path, cache._mapper.key(path))) != version:
            raise changed_after_planning(
                cache.fs.unstrip_protocol(path),
                f"it changed after planning or while it was copied into the cache (copied as {version}; now {now})",
            )
        os.replace(partial, os.path.join(directory, name))
    except BaseException as error:
        os.unlink(partial)
        if isinstance(error, OSError) and error.errno in _DISK_ERRNOS:
            raise _unwritable(cache, path, directory, error) from error
        raise
    finally:
        os.close(handle)  # only now: closing it drops the lock


def _unwritable(cache: AtomicSimpleCacheFileSystem, path: str, directory: str, error: OSError) -> ConfigurationError:
    """The error for a cache directory the copy cannot be written to. Not an OSError, so it is not
    retried: retrying cannot free the disk, and the retries ended in ShardUnavailableError, which
    sent the user to the remote store rather than to the cache's disk."""
    return ConfigurationError(
        f"cache directory {directory} cannot be written ({errno.errorcode.get(error.errno, error.errno)}: "
        f"{error.strerror}) while copying shard {cache.fs.unstrip_protocol(path)}: {unwritable_remedy(error.errno)}, "
        "or set io cache options {'dir': ...} to a directory that can be written"
    )


def _remove_abandoned(directory: str, host: str) -> None:
    """Remove the temporary files in `directory` that downloads of `host` left when killed (see
    the module's docstring for why each condition makes that safe)."""
    now = time.time()
    with os.scandir(directory) as entries:
        for entry in entries:
            # A temporary file is named `{64 hex digits}.{host}.{random, no dot}.part`.
            stem = entry.name.removesuffix(_PART)
            if stem == entry.name or stem[64:65] != "." or stem[65:].rpartition(".")[0] != host:
                continue
            try:
                if now - entry.stat().st_mtime < ABANDONED_AFTER_S:
                    continue
            except OSError:  # gone meanwhile (renamed into place, removed by another download), or not ours
                continue
            try:
                remove_if_unlocked(entry.path, functools.partial(os.unlink, entry.path))
            except FileNotFoundError:
                pass


class _VersionedNames(AbstractCacheMapper):
    """The name of a copy: a hash of the remote path and of its version, the one planned where
    `planned` holds it (no round trip to the remote), else the one `fs` reports now."""

    def __init__(self, fs, planned: Mapping[str, ShardVersion]) -> None:
        self.fs = fs
        self.planned = {fs._strip_protocol(path): version for path, version in planned.items()}

    def version(self, path: str) -> str:
        planned = self.planned.get(self.fs._strip_protocol(path))
        return planned.stamp if planned is not None else _current_version(self.fs, path)

    def key(self, path: str) -> str | None:
        """The field of the file's details its planned version was taken from (see `_version`)."""
        planned = self.planned.get(self.fs._strip_protocol(path))
        return None if planned is None else planned.key

    def __call__(self, path: str) -> str:
        return _copy_name(path, self.version(path))


def _current_version(fs, path: str, key: str | None = None) -> str:
    """The version `fs` reports for `path` now: as a plan records it (its field `key` where given),
    or fsspec's `ukey` where the filesystem tells none (an http(s) file: its URL, so it is taken as
    never changing)."""
    version = version_of(fs, path, key, afresh=True)
    return version.stamp if version is not None else f"ukey {fs.ukey(path)}"


def _copy_name(path: str, version: str) -> str:
    return hashlib.sha256(f"{path}\n{version}".encode()).hexdigest()
