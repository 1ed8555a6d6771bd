"""Which version of a shard file a plan was made from, and whether the file is still that version.

A plan holds a shard's record count, seek points and row groups as they were when it was scanned.
A shard rewritten in place (a dataset regenerated, a copy refreshed) keeps its URL, and reading it
under the planned offsets hands out the new file's records under the planned addresses: lines,
pieces of lines, rows or members other than the plan's. Only a file that grew, or was cut short,
showed it by its size. So planning records what the storage says of the file's version, and every
read of a chunk asks again (one `stat`, or one `info()` of the remote filesystem, per read, never
per record) and refuses a file that is another version now.

What counts as the version, cheapest first and strongest kept:
- a local file: its size, inode and modification time in nanoseconds (`os.stat`). These describe
  the file on the host that planned it: a copy of the same data on another node has another inode
  and modification time, so a plan pickled to another host (a Dataset broadcast to ranks) is not
  compared there; its reads keep the checks of size.
- a remote file: its size and the one field of the filesystem's `info()` that best follows its
  content: a generation (GCS), a checksum or hub blob id, an ETag, a version id, else its
  modification or creation time. One field, the first found in that order: GCS and Azure also
  change the ETag when only the object's metadata changes (a label, a content type), which would
  fail a run over data that did not change. These are the storage's own, the same from every
  host, so they are compared everywhere.
- neither (an HTTP server that sends no ETag and no Last-Modified): no version, nothing compared.

The version is not part of a dataset's fingerprint: a checkpoint resumed on another node, or from
a copy of the data, is judged by URLs, record counts and sizes, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._errors import ShardUnavailableError
from ._locate import is_local

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ._local import LocalFiles

__all__ = ["ShardVersion", "changed_after_planning", "check_unchanged", "version_of"]

# Fields of fsspec `info()` that follow a file's content, those that change with nothing else first
# (GCS, the Hugging Face hub, S3, Azure, HTTP), then those that change when it is written (SFTP,
# HTTP, the memory filesystem). A version is the first one found.
_VERSION_FIELDS = ("generation", "blob_id", "md5Hash", "crc32c", "checksum", "Content-MD5", "Digest",
                   "ETag", "etag", "version_id", "VersionId",
                   "mtime", "LastModified", "last_modified", "Last-Modified", "modified", "updated", "created")


@dataclass(frozen=True)
class ShardVersion:
    """What the storage said of a shard file's version. `host` is the host whose disk a local
    file's stamp describes, None for a remote file's, which every host sees alike."""

    stamp: str
    host: str | None = None

    def comparable_here(self) -> bool:
        return self.host is None or self.host == _this_host()


def version_of(fs: AbstractFileSystem | LocalFiles, path: str) -> ShardVersion | None:
    """The version of `path` on `fs` now, or None when the storage tells none. May raise OSError
    (the file vanished, the storage failed), which the caller retries."""
    if is_local(fs):
        status = os.stat(path)
        return ShardVersion(f"size={status.st_size} inode={status.st_ino} mtime_ns={status.st_mtime_ns}",
                            _this_host())
    info = fs.info(path)
    field = next((name for name in _VERSION_FIELDS if info.get(name) is not None), None)
    if field is None:
        return None
    return ShardVersion(f"size={info.get('size')} {field}={info[field]}")


def check_unchanged(planned: ShardVersion | None, fs: AbstractFileSystem | LocalFiles, path: str, url: str) -> None:
    """Raise ShardUnavailableError naming the shard if it is no longer the version planned.

    Not retried (it is no OSError): another attempt reads the same other file."""
    if planned is None or not planned.comparable_here():
        return
    now = version_of(fs, path)
    if now != planned:
        raise changed_after_planning(
            url, f"it changed after planning (planned: {planned.stamp}; now: {now.stamp if now else 'unknown'})"
        )


def changed_after_planning(url: str, what: str) -> ShardUnavailableError:
    """The error of a shard that is no longer the version planned, `what` saying how it was seen.

    Not retried (it is no OSError): another attempt reads the same other file."""
    return ShardUnavailableError(
        url, 1, f"{what}: its records no longer sit where the plan has them "
        "(build the Dataset again to read it as it is now)"
    )


def _this_host() -> str:
    return os.uname().nodename
