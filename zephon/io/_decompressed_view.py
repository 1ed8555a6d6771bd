"""A tar compressed whole (`.tar.gz`, `.tgz`, `.tar.zst`) read as the tar it holds: a file whose
reads, seeks and positions are those of the decompressed stream.

`tarfile` walks a tar by seeking: forward over each member's payload to the next header, back a
header's length where a header ends the walk. Forward, a seek decompresses what it passes over
and keeps none of it; back within the last `KEPT` bytes decompressed, it is served from them.
Any other seek back, and the first read, start a decoder at the latest place before the target
where one may start: the entry point planning found (the start of the gzip member or zstd frame
holding it, where the shard holds many, as `bgzip` and `pzstd` write them), a resume point this
process noted in a gzip stream (`_resume_points`), else the stream's start. So a chunk read
decompresses from there up to its chunk's end, as a compressed JSON Lines chunk read does
(`_lines`).

A gzip stream written as one member notes resume points as it is read, with the decompressed
offset where each stands for its "line": a tar is entered by byte, not by line.
"""

from __future__ import annotations

import io
from array import array
from collections.abc import Hashable, Iterator
from typing import BinaryIO

from . import _resume_points
from ._compression import Decompression, decoders_copy
from ._resume_points import ResumePoint
from ._seekable_copy import FramedCopy

__all__ = ["KEPT", "DecompressedView"]

KEPT = 1 << 16
"""Decompressed bytes kept behind the position for a seek back: `tarfile` steps back one header
(512 bytes) at most."""


class DecompressedView:
    """The decompressed stream of `raw` (a shard compressed with `compression`), read from
    decompressed offset `entry[1]` on through a decoder started at compressed offset `entry[0]`.

    `resume_key` names the shard for `_resume_points` (None while planning: no points);
    `frame_starts`, where given (planning, from the stream's start), gets each member's or
    frame's start as `decompressed_blocks` gives them; `copy`, where given (planning), each
    decompressed byte once, in order (`_seekable_copy`). `cut` says whether a read has found the
    stream ending inside a frame, where it reads as a file cut there. Not thread-safe: one read's
    own, as its file is."""

    def __init__(self, raw: BinaryIO, compression: str, *, entry: tuple[int, int] = (0, 0),
                 resume_key: Hashable | None = None, frame_starts: array | None = None,
                 copy: FramedCopy | None = None) -> None:
        self._raw, self._compression, self._frame_starts = raw, compression, frame_starts
        self._entry = entry
        self._copy, self._copied = copy, 0  # the decompressed bytes given to `copy` so far
        self.cut = False
        self._key = resume_key if resume_key is not None and decoders_copy(compression) else None
        self._position = self._kept_start = entry[1]
        self._kept = b""
        self._decompression: Decompression | None = None  # started by the first read, where it is wanted
        self._blocks: Iterator[bytes] | None = None

    def _start(self, target: int) -> None:
        """A decoder from the latest place at or before decompressed offset `target` it may start at."""
        compressed, decompressed = self._entry if target >= self._entry[1] else (0, 0)
        point = _resume_points.resume_points.before_line(self._key, target) if self._key is not None else None
        if point is not None and point.line >= decompressed:
            self._raw.seek(point.stream.compressed)
            self._decompression = Decompression(self._compression, point=point.stream)
            self._base, self._kept_start = 0, point.line  # a point's offsets are the stream's own
        else:
            if self._frame_starts is not None:  # planning, from the start again: noted anew, not twice
                del self._frame_starts[:]
            self._raw.seek(compressed)
            self._decompression = Decompression(self._compression, self._frame_starts)
            self._base = self._kept_start = decompressed
        self._blocks = self._decompression.blocks(self._raw)
        self._kept = b""

    @property
    def _kept_end(self) -> int:
        return self._kept_start + len(self._kept)

    def _next_block(self, keep: bool) -> bool:
        """Decompress one more block, kept after the last `KEPT` bytes of what was (or, not `keep`:
        a seek passing over it, in place of them); False at the stream's end, or at a cut, where
        the stream ends inside a frame (`cut`): read as a file cut there reads."""
        try:
            block = next(self._blocks, None) if self._blocks is not None else None
        except EOFError:
            self.cut, block = True, None
        if block is None:
            self._blocks = None
            return False
        if (self._copy is not None and self._kept_end <= self._copied < self._kept_end + len(block)
                and len(self._frame_starts) <= 2):  # no more once the stream shows frames of its own
            self._copy.write(block[self._copied - self._kept_end:])  # a view started again copies no byte twice
            self._copied = self._kept_end + len(block)
        if keep and self._kept:
            behind = self._kept[-KEPT:]
            self._kept_start = self._kept_end - len(behind)
            self._kept = behind + block
        else:
            self._kept_start, self._kept = self._kept_end, block
        self._note_resume_point()
        return True

    def _note_resume_point(self) -> None:
        if self._key is None or self._base != 0:  # planning, or a decoder started at a later member
            return
        offset = self._decompression.decompressed_between_blocks
        points = _resume_points.resume_points
        if offset is not None and points.wants(self._key, offset) and (stream := self._decompression.point()):
            points.note(self._key, ResumePoint(offset, b"", stream))

    def read(self, size: int | None = -1) -> bytes:
        """Up to `size` bytes from the position (all to the end where `size` is None or negative);
        fewer where the stream is cut (`cut`), as a tar file cut at the same byte reads, so a
        compressed tar walks as the plain tar of what it decompresses to; `CorruptStreamError`
        where it cannot be decoded."""
        if self._decompression is None:
            self._start(self._position)
        while self._position >= self._kept_end:  # a seek passed beyond what is decompressed
            if not self._next_block(keep=self._position < self._kept_end + KEPT):
                return b""
        to_end = size is None or size < 0
        pieces = []
        while True:
            at = self._position - self._kept_start
            piece = self._kept[at:] if to_end else self._kept[at : at + size]
            pieces.append(piece)
            self._position += len(piece)
            if not to_end:
                size -= len(piece)
            if (not to_end and size == 0) or not self._next_block(keep=True):
                return b"".join(pieces)

    def decompressed_length(self) -> int:
        """The stream's decompressed bytes, decompressing what is left; where it is cut short, those
        before the cut (what a walk of it found is planned, the rest read as truncated)."""
        if self._decompression is None:
            self._start(self._position)
        while self._next_block(keep=False):
            pass
        return self._kept_end

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._position
        elif whence == io.SEEK_END:
            offset += self.decompressed_length()
        if self._decompression is not None and offset < self._kept_start:
            self._start(offset)
        self._position = offset
        return offset

    def tell(self) -> int:
        return self._position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True
