"""Which version of a shard file a plan was made from, and whether the file is still that version.

A plan holds a shard's record count, seek points and row groups as they were when it was scanned.
A shard rewritten in place (a dataset regenerated, a copy refreshed) keeps its URL, and reading it
under the planned offsets hands out the new file's records under the planned addresses: lines,
pieces of lines, rows or members other than the plan's. Only a file that grew, or was cut short,
showed it by its size. So planning records what the storage says of the file's version, and every
read of a chunk looks again, at the file it opened, and refuses a file that is another version now.

What counts as the version, cheapest first and strongest kept:
- a local file: its size, inode and modification time in nanoseconds (`os.stat` at planning,
  `os.fstat` of the handle a read opened). These describe the file on the host that planned it:
  a copy of the same data on another node has another inode and modification time, so a plan
  pickled to another host (a Dataset broadcast to ranks) is not compared there; its reads keep
  the checks of size.
- a remote file: its size and the one field of the filesystem's description of it (its listing
  entry, or its `info()`) that best follows its content: a generation (GCS), a checksum or hub
  blob id, an ETag, a version id, else its modification or creation time. One field, the first
  found in that order: GCS and Azure also change the ETag when only the object's metadata changes
  (a label, a content type), which would fail a run over data that did not change. These are the
  storage's own, the same from every host, so they are compared everywhere. A later look compares
  the field the plan's version was taken from, whichever the later description puts first.
- neither (an HTTP server that sends no ETag and no Last-Modified): no version, nothing compared.

Where each look comes from, since on an object store every `info()` is a HEAD request: planning
takes the version from the listing it already made (`find`/`glob` with details; `info()` only for
a shard whose listing entry tells no version); a read takes it from the handle it opened, which
knows it without another request (a memory file's creation time; an fsspec buffered file holds
the `info()` its open made to learn its size), and asks `info()` only of a handle that does not
tell the planned field. s3fs, gcsfs and adlfs answer that `info()` from the listings they keep,
planning's among them, so a read first drops the shard's (`forget_listing_to_open`) and the open
asks the store: one request per chunk read. fsspec's FTP filesystem describes a file from its kept
listing of the file's directory; there the open keeps that listing and the check asks the server
for the one file by MLST (`_ftp_facts`), or, where it has no MLST, drops the directory's listing
and lists it again. s3fs's reads also ask for the ETag their open saw, and refuse
a file rewritten since (`expired_while_open`).

The version is not part of a dataset's fingerprint: a checkpoint resumed on another node, or from
a copy of the data, is judged by URLs, record counts and sizes, as before.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, BinaryIO

from ._errors import ShardUnavailableError
from ._ftp_facts import is_ftp, is_ftp_file, mlst_facts
from ._protocols import is_local, protocols_of, store_of
from ._shared_handles import store_calls

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ._local import LocalFiles

__all__ = [
    "ShardVersion", "changed_after_planning", "check_opened", "check_unchanged", "expired_while_open",
    "forget_listing_to_open", "version_in", "version_of",
]

# Fields of fsspec `info()` that follow a file's content, those that change with nothing else first
# (GCS, the Hugging Face hub, S3, Azure, HTTP), then those that change when it is written (SFTP,
# HTTP, FTP, the memory filesystem). A version is the first one found.
_VERSION_FIELDS = ("generation", "blob_id", "md5Hash", "crc32c", "checksum", "Content-MD5", "Digest",
                   "ETag", "etag", "version_id", "VersionId",
                   "mtime", "LastModified", "last_modified", "Last-Modified", "modified", "updated", "modify",
                   "created")

_MLSD_TIME = re.compile(r"\d{14}(\.\d+)?")
"""An FTP server's `modify` fact as its MLSD listing gives it (RFC 3659: UTC, YYYYMMDDHHMMSS, a
fraction where it keeps one). fsspec fills `modify` from a plain LIST where the server has no
MLSD, as the listing shows it: "Jun  5 06:30" until the file is six months old, then "Jun  5
2026", so one file would read as two versions a run apart; that is taken for no version."""


@dataclass(frozen=True)
class ShardVersion:
    """What the storage said of a shard file's version. `host` is the host whose disk a local
    file's stamp describes, None for a remote file's, which every host sees alike. `key` is the
    field of a remote file's description the stamp holds (None for a local file's).

    `changed_ns` is a local file's inode change time (`st_ctime_ns`; None for a remote file),
    which a rewrite given back its size and mtime (`touch -r`, `os.utime`) does not undo. It is
    no part of comparing versions, since a `chmod` or a new hard link changes it too and a read
    refused for those would fail a run over data that did not change; the scan cache keys its
    entries by it, where such a change costs one scan of the shard."""

    stamp: str
    host: str | None = None
    key: str | None = field(default=None, compare=False)
    changed_ns: int | None = field(default=None, compare=False)

    def comparable_here(self) -> bool:
        return self.host is None or self.host == _this_host()


def version_in(details: Mapping[str, Any], key: str | None = None) -> ShardVersion | None:
    """The version a remote file's description (a listing entry, an `info()`) tells: its field
    `key` where given (the one a plan's version holds), else the first of `_VERSION_FIELDS` it
    holds; None when it holds none. A time is written as a POSIX timestamp: fsspec's memory
    filesystem lists its creation time as one and gives it as a datetime from `info()`."""
    if key is None:
        key = next((name for name in _VERSION_FIELDS if details.get(name) is not None), None)
    value = None if key is None else details.get(key)
    if value is None or (key == "modify" and not _MLSD_TIME.fullmatch(str(value))):
        return None
    if isinstance(value, datetime):
        value = value.timestamp()
    return ShardVersion(f"size={details.get('size')} {key}={value}", key=key)


def version_of(
    fs: AbstractFileSystem | LocalFiles, path: str, key: str | None = None, *, afresh: bool = False
) -> ShardVersion | None:
    """The version of `path` on `fs` (`key` as in `version_in`), or None when the storage tells
    none. May raise OSError (the file vanished, the storage failed), which the caller retries.
    Asked of the store under a cache in front of it (`_protocols.store_of`): fsspec's `filecache`
    and `blockcache` describe a file from a listing of its directory, which on http(s) tells no
    version, so every read through them was refused as a file changed after planning.

    `afresh` asks the store itself, past the listings it keeps: s3fs, gcsfs and the hub answer
    `info()` from the listing planning made, for the life of the filesystem, so a check of a
    shard rewritten since then compared the planned version with itself and passed. Planning,
    which has just listed, takes what it listed."""
    if is_local(fs):
        return _local_version(os.stat(path))
    store = store_of(fs)
    with store_calls(fs):  # ftp:// and sftp:// take one call at a time
        if afresh:
            if is_ftp(store) and (facts := mlst_facts(store, path)) is not None:
                return version_in(facts, key)
            forget_listing(fs, path)
        return version_in(store.info(path), key)


_forgetting = threading.Lock()
"""Held while listings are dropped. fsspec's DirCache is no thread-safe mapping: its `pop` looks a
key up, then deletes it, so two threads dropping one directory's listing at once (a thread runner's
chunk reads of one S3 prefix) had the second's delete raise KeyError, which ended the run (3.14t,
`test_io_s3.py`'s thread-runner pipeline: about 1 run in 7). Dropping is a few dict operations."""


def forget_listing(fs: AbstractFileSystem, path: str) -> None:
    """Drop what the store under `fs` keeps of `path` from listings, so that the next `info()` or
    open describes the file as it is now, not as planning listed it: s3fs, gcsfs, adlfs and the
    hub keep every listing for the life of the filesystem and describe a file, and open it, from
    there. fsspec's FTP filesystem keeps them by directory and describes a file from its
    directory's, so the directory's listing goes too: dropping the file's alone left a rewritten
    shard read under the planned version (an FTP server without MLST, `version_of`)."""
    store = store_of(fs)
    with _forgetting:
        store.invalidate_cache(path)
        store.invalidate_cache(store._parent(path))


def forget_listing_to_open(fs: AbstractFileSystem, path: str) -> None:
    """`forget_listing` before a chunk read opens `path`, but on the hub and on FTP. The hub's
    filesystem is made with the planning process's listings in every worker
    (`Dataset.__getstate__`) so that reads ask the hub, which limits requests, for none. So a hub
    file rewritten on its branch during a run is seen only through the cache (one request per
    copy); a URL naming a commit (`@<sha>`) reads that commit's files, which never change. An FTP
    file is opened at the size its directory's kept listing tells, and its version asked by MLST
    (`_ftp_facts`), which spares listing the directory again at each read."""
    store = store_of(fs)
    if "hf" not in protocols_of(store) and not is_ftp(store):
        forget_listing(fs, path)


def check_unchanged(planned: ShardVersion | None, fs: AbstractFileSystem | LocalFiles, path: str, url: str) -> None:
    """Raise ShardUnavailableError naming the shard if it is no longer the version planned, asking
    `fs` (one `stat`, or one `info()`). Not retried (it is no OSError): another attempt reads the
    same other file."""
    if planned is None or not planned.comparable_here():
        return
    _compare(planned, version_of(fs, path, planned.key, afresh=True), url)


def check_opened(
    planned: ShardVersion | None, handle: BinaryIO, fs: AbstractFileSystem | LocalFiles, path: str, url: str
) -> None:
    """`check_unchanged` of the file `handle` opened, from what the handle knows of it where it
    tells the planned field, else by asking `fs`."""
    if planned is None or not planned.comparable_here():
        return
    now = _version_of_handle(handle, planned)
    _compare(planned, now if now is not None else version_of(fs, path, planned.key, afresh=True), url)


def _version_of_handle(handle: BinaryIO, planned: ShardVersion) -> ShardVersion | None:
    if planned.key is None:  # a local file's
        return _local_version(os.fstat(handle.fileno()))
    memory = sys.modules.get("fsspec.implementations.memory")  # neither is imported for local files
    spec = sys.modules.get("fsspec.spec")
    if memory is not None and type(handle) is memory.MemoryFile:
        return version_in({"size": handle.size, "created": handle.created}, planned.key)
    # An FTP file's details are its directory's kept listing (`forget_listing_to_open`), not the
    # server's answer now: its version is asked by MLST instead (`version_of`).
    if spec is not None and isinstance(handle, spec.AbstractBufferedFile) and not is_ftp_file(handle):
        return version_in(handle.details, planned.key)
    return None


def _compare(planned: ShardVersion, now: ShardVersion | None, url: str) -> None:
    if now != planned:
        raise changed_after_planning(
            url, f"it changed after planning (planned: {planned.stamp}; now: {now.stamp if now else 'unknown'})"
        )


def _local_version(status: os.stat_result) -> ShardVersion:
    stamp = f"size={status.st_size} inode={status.st_ino} mtime_ns={status.st_mtime_ns}"
    return ShardVersion(stamp, _this_host(), changed_ns=status.st_ctime_ns)


def expired_while_open(error: BaseException) -> bool:
    """Whether `error` is s3fs's refusal to read on in a file rewritten since it was opened: its
    reads ask for the ETag the open saw (`FileExpired`, an OSError, which was retried as a failure
    of the store and then reported as one). The open saw the planned version, or its check would
    have refused it, so the file changed after planning."""
    expired = getattr(sys.modules.get("s3fs.utils"), "FileExpired", None)  # imported where s3fs reads
    return expired is not None and isinstance(error, expired)


def changed_after_planning(url: str, what: str) -> ShardUnavailableError:
    """The error of a shard that is no longer the version planned, `what` saying how it was seen.

    Not retried (it is no OSError): another attempt reads the same other file."""
    return ShardUnavailableError(
        url, 1, f"{what}: its records no longer sit where the plan has them "
        "(build the Dataset again to read it as it is now)"
    )


def _this_host() -> str:
    return os.uname().nodename
