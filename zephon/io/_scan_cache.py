"""Shard scans kept on disk, so that planning reads a shard once per cache instead of once per rank and run.

Counting the records of a JSON Lines or text shard reads every byte of it. Every rank of a job
plans for itself, and a job resumed after preemption plans again: a thousand ranks read the whole
corpus a thousand times before the first batch. `Dataset.from_path(..., scan_cache=DIR)` keeps
each shard's `ShardScan` in DIR (a local directory: the node's disk, or a filesystem the nodes
share), and planning takes it from there when it is found.

An entry is named by a hash of everything the scan depends on: `SCAN_CACHE_VERSION`, the shard's
URL (a local shard's absolute path), the version planning recorded for it (`_version`: a remote
file's size and content field; a local file's size, inode, modification time, inode change time
and host, since those describe it on its host only, so a local shard is scanned once per host),
its compression, and what the format's scan depends on besides the bytes (`ShardFormat.scan_key`:
the format, its text unit, its seek stride). The change time is there because a file rewritten
in place to its size and given back its modification time (`touch -r`, `os.utime`) keeps the
other three, and its old entry held the old file's count; a `chmod` changes it too, which costs
one scan. Entries of one shard (everything but its version) share a directory named by a hash
of that, so that storing an entry removes the shard's other versions (`_remove_superseded`) by
listing a directory of a few files, not the whole cache. A shard whose storage tells no version
is never cached: nothing would tell its entry from another file's at its URL. The version is
taken before the scan, as for planning without the cache: a file rewritten while it was scanned
is stored under the version it had before, which the next listing no longer reports, and any
plan made from that version refuses the new file at its reads.

An entry is an uncompressed `.npz` (no pickle: it is loaded with `allow_pickle=False`) holding
its own key and the scan's fields. One that cannot be loaded (cut short, a bad CRC), holds another
key, or fails the checks of `_checked` is not trusted: the shard is scanned again, the entry
replaced, and the caller counts it. Entries are written under a temporary name and renamed into
place once whole (a rename within one directory is atomic), so a killed writer never leaves half
an entry under an entry's name; they are not fsynced, since one lost with the page cache on power
loss reads as corrupt and is rescanned.

Ranks of one node planning at once all miss the same entries on a cold cache. Each entry has a
lock file (`flock`, `zephon._file_lock`): the first to miss takes it and scans, the others wait
on it and then load what it stored, so a node (or every node, where the shared filesystem carries
locks across hosts) reads each shard once, not once per rank. A warm entry is loaded without the
lock, since entries appear whole or not at all; so a warm cache on a read-only mount is usable.
The lock holder writes its entry to the entry's temporary name (`.part`), which the next holder
overwrites if a writer was killed, so nothing is left over; where the filesystem refuses locks,
ranks scan at once and each writes to a unique temporary name. Where locks are taken but do not
reach across hosts (NFS mounted `nolock`), two hosts may write one temporary name at once and
leave a damaged entry: like any, it is not trusted, and the next planning scans and replaces it.

Storing an entry removes those of the shard's other versions, which its listing no longer reports
(a corpus regenerated daily kept a copy of its scans a day, and every lock file, until the
directory was cleared): each with its lock file and `.part`, under its lock taken without waiting,
so never one another rank is scanning or storing; one whose lock is held, or on a filesystem that
takes no locks, stays until the next entry of the shard is stored. A rank waiting on a lock file
removed meanwhile finds it gone once it holds the lock, and locks the file now at its name
(`_locked`), so two ranks never scan one version under two lock files; a cleaner likewise
removes nothing under a lock it took on a file no longer at its name (`remove_if_unlocked`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import zipfile
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from .._errors import ConfigurationError
from .._file_lock import lock, remove_if_unlocked, still_at
from .._sha256 import sha256
from ._format import ShardScan
from ._seekable_copy import COPY_FRAME_BYTES, CopyNotWritten
from ._unwritable import unwritable_remedy

if TYPE_CHECKING:
    from ._format import ShardFile, ShardFormat
    from ._version import ShardVersion

__all__ = ["SCAN_CACHE_VERSION", "ScanCache"]

SCAN_CACHE_VERSION = 3
"""The layout of an entry and the meaning of a scan: bumped when either changes, so that entries
written by an older Zephon are never read as this one's. 2: entries in a directory per shard
(so that storing one removes the shard's other versions), keyed by a local file's inode change
time too. 3: a JSON Lines shard that is one JSON array is refused by its scan, where a 2 entry
held its count of malformed lines and planned it."""

_ENTRY, _LOCK, _PART, _COPY = ".npz", ".lock", ".part", ".zst"
_NAME_LENGTH = 64  # the hex digits of a SHA-256, which every file of an entry is named by first

# A disk that cannot take the entry: full, over quota, read-only, not writable by this user.
_UNWRITABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class ScanCache:
    """A directory of shard scans, and with `seekable_copies` the seekable copies planning writes of
    shards in one compressed stream (`_seekable_copy`). Thread-safe and process-safe: it
    holds no state but its path and that choice."""

    def __init__(self, directory: str | os.PathLike, seekable_copies: bool = False) -> None:
        self.seekable_copies = seekable_copies
        if not isinstance(directory, (str, os.PathLike)):
            raise ConfigurationError(f"scan_cache={directory!r} must be a local directory path (a str or os.PathLike)")
        path = os.fspath(directory)
        if not path or "://" in path:
            raise ConfigurationError(f"scan_cache={path!r} must be a local directory path, not a URL")
        self.directory = os.path.abspath(os.path.expanduser(path))  # a copy's path is read in other processes
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as error:
            raise ConfigurationError(
                f"scan cache directory {self.directory} cannot be made ({error.strerror}: {error.filename})"
            ) from error

    def scan(
        self, shard: ShardFile, url: str, version: ShardVersion, reader: ShardFormat
    ) -> tuple[ShardScan, str | None]:
        """The scan of `shard`, which is `version` of the file at `url`: its entry's, else
        `reader.scan`'s, stored, and the entries of the shard's other versions removed. The second
        value says why an entry found was not trusted."""
        shard_key = "\n".join([f"zephon scan cache {SCAN_CACHE_VERSION}", f"url={url}", f"host={version.host}",
                               f"compression={shard.compression}", f"format={reader.scan_key}"])
        key = f"{shard_key}\nversion={version.stamp}\nchanged_ns={version.changed_ns}"
        copying = self.seekable_copies and shard.compression is not None and reader.copies_streams
        if copying:  # an entry of a planning without copies holds no copy: another entry
            key += f"\nseekable copy in zstd frames of {COPY_FRAME_BYTES} bytes"
        versions = os.path.join(self.directory, _name(shard_key))
        entry = os.path.join(versions, _name(key) + _ENTRY)
        found, distrusted = _load(entry, key, reader, shard.compression)
        if found is not None:
            return found, None
        try:
            os.makedirs(versions, exist_ok=True)
            handle, locked = _locked(entry.removesuffix(_ENTRY) + _LOCK)
        except OSError as error:
            raise self._unwritable(error, url) from error
        try:
            if locked:  # whoever held the lock has stored it meanwhile
                found, _ = _load(entry, key, reader, shard.compression)
                if found is not None:
                    return found, distrusted
            try:
                scanned = _scan_and_copy(shard, reader, entry, locked) if copying else reader.scan(shard)
            except CopyNotWritten as error:
                raise self._unwritable(error.os_error, url) from error.os_error
            try:
                _store(entry, key, scanned, locked)
            except BaseException as error:
                if scanned.copy is not None:  # no entry will name it
                    with contextlib.suppress(OSError):
                        os.unlink(scanned.copy)
                if isinstance(error, OSError) and error.errno in _UNWRITABLE_ERRNOS:
                    raise self._unwritable(error, url) from error
                raise
            with contextlib.suppress(OSError):  # what cannot be removed now is tried again at the next store
                _remove_superseded(versions, entry)
            return scanned, distrusted
        finally:
            os.close(handle)  # only now: closing it drops the lock

    def _unwritable(self, error: OSError, url: str) -> ConfigurationError:
        """Not an OSError, so not retried as a failing shard: retrying frees no disk."""
        code = errno.errorcode.get(error.errno, error.errno)
        return ConfigurationError(
            f"scan cache directory {self.directory} cannot be written ({code}: {error.strerror}) while storing "
            f"the scan of shard {url}: {unwritable_remedy(error.errno)}, or set scan_cache to a directory that can "
            "be written"
        )


# Cleaners replacing a lock file between one rank's open and its lock: each retry needs another.
_RELOCK_ATTEMPTS = 16


def _name(key: str) -> str:
    return sha256(key.encode()).hexdigest()


def _locked(path: str) -> tuple[int, bool]:
    """The lock file at `path`, open and, where the filesystem takes locks, locked (waiting for
    its holder): (its descriptor, whether locked). A lock taken on a file that a cleaner removed
    meanwhile (`_remove_superseded`) guards nothing another rank would see, so it is taken again
    on the file now at `path`. A filesystem that never reports the open file as the one at its
    name gets `_RELOCK_ATTEMPTS` tries, then is used as one that takes no locks, not waited on
    for ever."""
    for _ in range(_RELOCK_ATTEMPTS):
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if not lock(handle, blocking=True):
                return handle, False
            if still_at(handle, path):
                return handle, True
        except BaseException:
            os.close(handle)
            raise
        os.close(handle)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o666), False


def _scan_and_copy(shard: ShardFile, reader: ShardFormat, entry: str, locked: bool) -> ShardScan:
    """`reader.scan` of `shard`, asked to write a seekable copy (`_seekable_copy`) to a temporary
    name (`_temporary`), which, where it wrote one, is put in place beside `entry` under the name
    `_load` looks for."""
    final = entry.removesuffix(_ENTRY) + _COPY
    try:
        handle, partial = _temporary(final, locked)
    except OSError as error:
        raise CopyNotWritten(error) from error
    os.close(handle)  # the format writes it
    try:
        scanned = reader.scan(replace(shard, copy_to=partial))
        if scanned.copy is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)  # made for it, left empty
            return scanned
        os.replace(partial, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    return replace(scanned, copy=final)


def _temporary(final: str, locked: bool) -> tuple[int, str]:
    """A file `final` is written to before it is renamed into place, open for writing, and its
    path. Under the entry's lock it is `final`'s own `.part`, overwritten by the next holder if a
    writer was killed; without one, a unique name."""
    if locked:
        partial = final + _PART
        return os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), partial
    import tempfile  # here: a planning without a scan cache never writes an entry

    return tempfile.mkstemp(dir=os.path.dirname(final), prefix=os.path.basename(final) + ".", suffix=_PART)


def _remove_superseded(versions: str, kept: str) -> None:
    """Remove from `versions`, the directory of one shard's entries, every entry but `kept`, with
    its lock file, seekable copy and temporary `.part`s: one of another version of the shard,
    which its listing no longer reports. Each is removed under its lock, taken without waiting,
    so never while another rank scans or stores that version; where the lock is held, or the
    filesystem takes none, it is left for the next entry stored."""
    kept_name = os.path.basename(kept).removesuffix(_ENTRY)
    names = {name[:_NAME_LENGTH] for name in os.listdir(versions)} - {kept_name}
    for name in sorted(names):
        stem = os.path.join(versions, name)
        remove_if_unlocked(stem + _LOCK, functools.partial(_remove_entry, stem))


def _remove_entry(stem: str) -> None:
    """The lock file last: until it is gone, the next store finds the rest by it."""
    for leftover in (stem + _ENTRY, stem + _ENTRY + _PART, stem + _COPY, stem + _COPY + _PART, stem + _LOCK):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)


def _load(entry: str, key: str, reader: ShardFormat, compression: str | None) -> tuple[ShardScan | None, str | None]:
    """The scan stored at `entry` for `key` (a scan `reader` returns for a shard of `compression`);
    (None, None) where there is none, (None, why) where the one there is not to be trusted."""
    try:
        with np.load(entry, allow_pickle=False) as stored:
            fields = {name: stored[name] for name in stored.files}
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        return None, f"{entry}: {type(error).__name__}: {error}"
    try:
        return _checked(fields, key, reader, compression, entry.removesuffix(_ENTRY) + _COPY), None
    except (ValueError, KeyError, TypeError) as error:
        return None, f"{entry}: {error}"


def _checked(fields: dict[str, np.ndarray], key: str, reader: ShardFormat, compression: str | None,
             copy: str) -> ShardScan:
    """The ShardScan `fields` hold, if they are one `reader` could have returned for `key`, a shard
    of `compression`, its seekable copy, where it names one, at `copy` and of the size it says."""
    seek_ndim = reader.seek_ndim(compression)
    if fields.pop("key").tolist() != key:
        raise ValueError("it holds the scan of another shard, version or format")
    arrays = {name: fields.pop(name, None)
              for name in ("num_records", "raw_bytes", "seek", "record_offsets", "copy_bytes")}
    if fields:
        raise ValueError(f"it holds unknown fields {sorted(fields)}")
    for name, array in arrays.items():
        dimensions = 0 if name in ("num_records", "raw_bytes", "copy_bytes") else seek_ndim if name == "seek" else 1
        if array is not None and (array.dtype != np.int64 or array.ndim != dimensions):
            raise ValueError(f"its {name} is {array.dtype} of {array.ndim} dimensions")
    num_records, raw_bytes = int(arrays["num_records"]), arrays["raw_bytes"]
    seek, offsets = arrays["seek"], arrays["record_offsets"]
    if num_records < 0 or (raw_bytes is not None and raw_bytes < 0):
        raise ValueError("it holds a negative count")
    ascending = seek if seek is None or seek.ndim == 1 else seek[:2]  # an entry-point table's third row is not
    for name, points in (("seek", ascending), ("record_offsets", offsets)):
        if points is not None and (np.any(points < 0) or np.any(np.diff(points) < 0)):
            raise ValueError(f"its {name} are not ascending offsets")
    if seek is not None and seek.ndim == 2:
        if not reader.indexes(seek, num_records):
            raise ValueError(f"its seek table of shape {seek.shape} does not index {num_records} records")
    elif seek is not None and len(seek) > max(1, num_records):
        raise ValueError(f"it holds {len(seek)} seek points for {num_records} records")
    if offsets is not None and (len(offsets) != num_records + 1 or raw_bytes is None or offsets[-1] != raw_bytes):
        raise ValueError(f"its record offsets do not bound {num_records} records of {raw_bytes} bytes")
    if (copy_bytes := arrays["copy_bytes"]) is not None:
        _check_copy(copy, int(copy_bytes), seek)
    return ShardScan(num_records, seek, None if raw_bytes is None else int(raw_bytes), offsets,
                     None if copy_bytes is None else copy)


def _check_copy(copy: str, copy_bytes: int, seek: np.ndarray | None) -> None:
    """Refuse an entry whose seekable copy is gone, or not of the size stored (cut short, or
    another planning's), or that holds no entry points into it."""
    try:
        size = os.stat(copy).st_size
    except FileNotFoundError:
        raise ValueError(f"its seekable copy {copy} is gone") from None
    if size != copy_bytes:
        raise ValueError(f"its seekable copy {copy} is {size} bytes, {copy_bytes} when stored")
    if seek is None:  # a compressed shard's seek, checked above, is its entry points
        raise ValueError("it holds a seekable copy but no entry points into it")


def _store(entry: str, key: str, scanned: ShardScan, locked: bool) -> None:
    """Write `entry` whole or not at all: to a temporary name (`_temporary`), renamed into place."""
    arrays = {"key": np.array(key), "num_records": np.int64(scanned.num_records)}
    for name in ("raw_bytes", "seek", "record_offsets"):
        if (value := getattr(scanned, name)) is not None:
            arrays[name] = np.asarray(value, dtype=np.int64)
    if scanned.copy is not None:
        arrays["copy_bytes"] = np.int64(os.path.getsize(scanned.copy))
    handle, partial = _temporary(entry, locked)
    try:
        with os.fdopen(handle, "wb") as f:
            np.savez(f, **arrays)
        os.replace(partial, entry)
    except BaseException:
        os.unlink(partial)
        raise
