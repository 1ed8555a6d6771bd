"""A seekable copy of a JSON Lines, text or WebDataset tar shard written as one gzip or zstd stream:
its decompressed bytes again, in zstd frames of COPY_FRAME_BYTES each, kept in the scan cache, so
that a chunk read enters at the frame before its first record instead of decompressing the shard
from its start.

Why: one stream has one place a decoder may start, its start. A zstd stream's chunk reads each
decompress everything before their chunk, half the shard on average, and a gzip stream's start
from this process's resume points (`_resume_points`), which each process notes anew and which
spread further apart as it reads more shards. Corpora are often shipped that way (`zstd` and
`gzip` write one stream, and so do Python's writers), and recompressing them is the user's chore
that planning's warning names. With `Dataset.from_path(..., scan_cache=DIR, seekable_copies=True)`
planning writes the copy in the pass that counts the shard's records, which decompresses it anyway.

The copy holds the decompressed bytes planned, so a read of it gives what a read of the shard
would; reads never open the shard itself, so a shard rewritten after planning is read as planned.
It is not written where it would not help: for a shard already in many frames or members (it has
entry points of its own), one cut short (its tail is read as truncated from the shard), or one
whose bytes fit one frame of the copy (nothing to skip). Frames of 256 KiB compressed at level 1
take about as much disk as the shard (1.09–1.14× the shipped corpus's zstd and gzip streams,
`benchmarks/README.md`), and a read enters at most a frame before its chunk.
"""

from __future__ import annotations

import os
from array import array

__all__ = ["COPY_FRAME_BYTES", "CopyNotWritten", "FramedCopy"]

COPY_FRAME_BYTES = 1 << 18
"""Decompressed bytes a frame of a copy holds: a read decompresses at most this much before its chunk."""

_LEVEL = 1  # zstd's fastest: planning compresses the whole corpus once, and every read decompresses


class CopyNotWritten(Exception):
    """The copy's file could not be made or written (`os_error`): the scan cache's disk, not the shard."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


class FramedCopy:
    """Writes the bytes given to `write` to a new file at `path` as zstd frames of COPY_FRAME_BYTES,
    noting each frame's start in the file and in the bytes, two numbers a frame, in
    `frame_starts`, as `_compression.decompressed_blocks` notes a shard's."""

    def __init__(self, path: str) -> None:
        import zstandard  # on first use, as reading zstd imports it

        self.path = path
        self.frame_starts = array("q")
        self._compress = zstandard.ZstdCompressor(level=_LEVEL).compress
        self._pending = bytearray()
        self._written = self._copied = 0
        try:
            self._file = open(path, "wb")
        except OSError as error:
            raise CopyNotWritten(error) from error

    def write(self, block) -> None:
        """Copy `block` (bytes, or a buffer valid only until the call returns)."""
        self._pending += block
        while len(self._pending) >= COPY_FRAME_BYTES:
            self._frame(bytes(self._pending[:COPY_FRAME_BYTES]))
            del self._pending[:COPY_FRAME_BYTES]

    def kept(self, whole_stream: bool) -> bool:
        """Whether the copy is kept: finished where the shard proved one stream, whole, and the copy
        holds several frames; else removed (the module docstring says why)."""
        if whole_stream:
            self.finish()
            if len(self.frame_starts) > 2:
                return True
        self.abandon()
        return False

    def finish(self) -> int:
        """Write what is left as the last frame and close the file; its size."""
        if self._pending:
            self._frame(bytes(self._pending))
            self._pending.clear()
        self._close()
        return self._written

    def abandon(self) -> None:
        """Close and remove the file: no copy."""
        try:
            self._file.close()
        except OSError:  # its last bytes found the disk full: the file goes anyway
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _frame(self, text: bytes) -> None:
        self.frame_starts.extend((self._written, self._copied))
        frame = self._compress(text)
        try:
            self._file.write(frame)
        except OSError as error:
            self.abandon()
            raise CopyNotWritten(error) from error
        self._written += len(frame)
        self._copied += len(text)

    def _close(self) -> None:
        try:
            self._file.close()
        except OSError as error:  # a full disk may refuse the last buffered bytes only here
            self.abandon()
            raise CopyNotWritten(error) from error
