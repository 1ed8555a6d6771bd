"""The contract between `Dataset` and a shard format, and the handle a format reads through.

A format knows two things about a shard: how to count its records cheaply (`scan`, run once when a
Dataset is planned) and how to read a record range (`read`, run per chunk, possibly in a worker).
`scan` may return seek points so that `read` starts near its range instead of at byte 0.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Protocol

import numpy as np

from ._cache_layer import raise_what_the_store_said
from ._errors import ShardUnavailableError
from ._no_ranges import RangesRefused
from ._policy import Slot
from ._protocols import is_local
from ._shared_handles import open_own
from ._version import ShardVersion, check_opened, forget_listing_to_open

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ._local import LocalFiles

__all__ = ["STREAM_READ_AHEAD", "ShardFile", "ShardScan", "ShardFormat"]

STREAM_READ_AHEAD = 1 << 20
"""Bytes a chunk read that streams in small reads to an end it does not know (a compressed
stream, a tar of unknown size) has a remote file fetch beyond each read its buffer cannot serve."""


@dataclass(frozen=True)
class ShardFile:
    """One shard as a format sees it: where it is and how it is compressed.

    Opening goes through the Dataset's (possibly caching) filesystem; retries are the caller's job.
    Thread-safe: every `open()` returns a handle of the caller's own, with its own position.
    """

    url: str
    path: str
    compression: str | None
    fs: AbstractFileSystem | LocalFiles
    planned_nbytes: int | None = None  # the size planning listed; None while planning
    planned_version: ShardVersion | None = None  # compared with the opened file's (see `_version`)
    from_start: bool = False  # read through one stream from byte 0: its server refuses ranges (`_no_ranges`)
    copy_to: str | None = None  # planning: where its format may write a seekable copy (`_seekable_copy`)

    def open(self, read_ahead: int | None = None) -> BinaryIO:
        """The shard for reading. `read_ahead`, for a chunk read: the bytes a remote file fetches
        beyond each read its buffer cannot serve, 0 for exactly the bytes each read asks (a caller
        that reads what it needs in a few large reads: a chunk's lines, Parquet's spans). A chunk
        read opens the file anew, so what it fetched past its chunk is never read: with fsspec's
        default, a whole block of the store's (s3fs's is 50 MiB; gcsfs's and http's 5 MiB), 200
        chunk reads of a 24 MiB JSONL shard on S3 fetched 2.4 GB. None (planning, which scans
        whole shards) keeps the store's own."""
        if self.from_start:  # its version is the caller's to check, as no handle tells it
            return io.BufferedReader(
                RangesRefused(lambda: self.fs.open(self.path, "rb", block_size=0), self.planned_nbytes))
        if self.planned_version is not None and self.planned_version.key is not None:  # a remote file's
            forget_listing_to_open(self.fs, self.path)  # else its handle tells the version planning listed
        fetching = {} if read_ahead is None or is_local(self.fs) else _fetching(read_ahead)
        try:  # memory://, tar://, zip://, ftp://, sftp:// share what their files read through
            handle = open_own(self.fs, self.path,
                              lambda opened: check_opened(self.planned_version, opened, self.fs, self.path, self.url),
                              **fetching)
        except FileNotFoundError:
            raise_what_the_store_said(self.fs, self.path)  # a cache in front of http(s) hides its status
            raise
        try:
            if self.planned_nbytes is not None:
                self._check_not_grown(handle)
        except BaseException:
            handle.close()
            raise
        return handle

    def _check_not_grown(self, handle: BinaryIO) -> None:
        """Raise ShardUnavailableError if the shard is now longer than planned: regenerated in
        place, its records no longer sit at the planned offsets, row groups or members, and reads
        handed out other records under the planned addresses without a word. The Dataset refuses
        any other version of the file before reading (`_version`); this is what is left where the
        storage tells no version. A shorter shard is read as far as it goes, its missing records
        counted as `truncated_shard`. Seeking to the
        end reads nothing (fsspec's files know their size from opening); a stream that cannot
        seek (an HTTP file of unknown size) is not checked."""
        try:
            size = handle.seek(0, io.SEEK_END)
            handle.seek(0)
        except (OSError, ValueError):  # io.UnsupportedOperation is both
            return
        if size > self.planned_nbytes:
            raise ShardUnavailableError(
                self.url, 1, f"it is {size} bytes, {self.planned_nbytes} when planned: it changed after planning "
                "(build the Dataset again to read it as it is now)"
            )


def _fetching(read_ahead: int) -> dict[str, object]:
    """fsspec's open options for a remote file that fetches `read_ahead` bytes beyond each read
    it cannot serve, or (0) exactly each read's bytes."""
    return {"cache_type": "none"} if read_ahead == 0 else {"cache_type": "readahead", "block_size": read_ahead}


@dataclass(frozen=True)
class ShardScan:
    """The planning facts of one shard. `seek` is the format's index into it: for a line format,
    `seek[j]` is the byte offset of record `j * stride`, or for a compressed shard of many frames
    three rows, its entry points (`_lines.entry_points`); for Arrow IPC (`_arrow`), two rows, where
    each record batch's bytes begin and its first record; for Parquet, each row group's first record.

    `raw_bytes` is the size of the records as stored, decompressed (None: use the file size);
    `record_offsets[i]` is where record i starts in that decompressed stream (one more entry for
    the end), when the format learns it while counting. Token estimation and mixture planning weigh
    chunks by raw bytes, because tokens per byte varies far less between records than tokens per
    record does.

    Each format picks its stride: a read starts at most `stride` records before its range, and the
    index costs 8 bytes per `stride` records on the (pickled) Dataset.

    `copy`, where planning wrote one (`_seekable_copy`), is the path of the shard's seekable copy,
    which `seek` then indexes: reads go to it, not to the shard.
    """

    num_records: int
    seek: np.ndarray | None = None
    raw_bytes: int | None = None
    record_offsets: np.ndarray | None = None
    copy: str | None = None


class ShardFormat(Protocol):
    """A way of storing records in a shard. Implementations are stateless and thread-safe."""

    name: str
    copies_streams: bool
    """Whether its `scan` of a shard in one compressed stream writes a seekable copy where its
    ShardFile has `copy_to` (`_seekable_copy`); such a format's `stream_seek(seek)` gives the
    shard's own seek from its copy's, for a read of the shard where the copy is gone."""

    @property
    def scan_key(self) -> str:
        """What `scan` returns depends on besides the file's bytes (the format, its options, its
        seek stride): part of the name of a shard's entry in the scan cache (`_scan_cache`)."""
        ...

    def seek_ndim(self, compression: str | None) -> int:
        """The dimensions of its scans' `seek` (`ShardScan`) for a shard of `compression`, which the
        scan cache checks."""
        ...

    def indexes(self, table: np.ndarray, num_records: int) -> bool:
        """Whether `table`, a two-dimensional seek, is one its scans give for a shard of
        `num_records` (asked by the scan cache of an entry it found, its first two rows already
        checked to ascend); only formats whose `seek_ndim` can be 2 are asked."""
        ...

    def scan(self, shard: ShardFile) -> ShardScan:
        """Count the shard's records, reading as little as the format allows. A change to what it
        returns for the same file changes `scan_key` (the format's entries are scanned again) or
        bumps `_scan_cache.SCAN_CACHE_VERSION` (every format's)."""
        ...

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        """One slot per record index in [start, stop): the record, or `Bad` with its reason."""
        ...