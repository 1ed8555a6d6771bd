"""Streaming decompression that notices a stream cut short.

fsspec's own codecs are not used for reading because zstandard's stream reader returns an empty or
short result for a truncated frame without any error; a truncated shard would then silently lose
records. Here both codecs raise `EOFError` when the input ends inside a frame, and concatenated
gzip members or zstd frames are decoded one after the other. Bytes a codec cannot decode raise
`CorruptStreamError`, which the dataset reports as its shard being unreadable (named, not retried).

NUL bytes after a complete gzip member are padding (tape and block writers, some uploaders add
them), skipped exactly as Python's `gzip` module skips them: at the end or before a next member,
never before the first. zstd has no such padding (the `zstd` tool refuses it too); its skippable
frames are frames the decoder itself passes over.
"""

from __future__ import annotations

import functools
import zlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol

__all__ = ["BLOCK_SIZE", "CorruptStreamError", "Decompression", "StreamPoint", "compression_of", "decoders_copy",
           "decompressed_blocks", "raw_blocks"]

BLOCK_SIZE = 1 << 20  # bytes per read: large enough for object stores, small enough to bound memory
# A compressed block may expand many times over, and all of it is decoded at once: a chunk read
# decodes up to a block's output past its last line. The shipped corpus in zstd frames or gzip
# members of 1,000 lines, every chunk of 128 read: 12 % and 10 % faster than with 256 KiB blocks;
# scanning 82 MB of zstd as fast.
_COMPRESSED_BLOCK_SIZE = 1 << 16

_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


class CorruptStreamError(ValueError):
    """A compressed stream holds bytes its codec cannot decode (not a cut: that is `EOFError`)."""


class _Decompressor(Protocol):
    eof: bool
    unused_data: bytes

    def decompress(self, data: bytes) -> bytes: ...


# A codec, made once per stream: what makes a new decoder (one per frame or member), the errors a
# decoder raises on bytes it cannot decode, and the padding bytes that may follow a complete frame
# (b"": none).
_Codec = tuple[Callable[[], _Decompressor], tuple[type[Exception], ...], bytes]


def _gzip() -> _Codec:
    return lambda: zlib.decompressobj(wbits=zlib.MAX_WBITS | 16), (zlib.error,), b"\0"


def _zstd() -> _Codec:
    import zstandard  # on first use: a process reading no zstd shard does not map the library

    # Every frame's decoder is drawn from one context per stream: making a context costs ~10 µs,
    # a decoder from it ~0.05 µs, which for a shard of one-line frames was most of the reading.
    # A new decoder resets the context, which the frame before, finished, no longer uses.
    return zstandard.ZstdDecompressor().decompressobj, (zstandard.ZstdError,), b""


def _advice(error: Exception) -> str:
    """What to do about a decoder's error, where its own words do not say: a zstd frame whose window
    is over the 128 MiB (window log 27) a decoder takes by default, as `zstd --long=28` to
    `--long=31` write for large corpora, is refused "Frame requires too much memory", which names
    neither. It is not decoded here: its window costs that much memory in every reader at once."""
    if "Frame requires too much memory" in str(error):
        return (
            " (its frames need a window over the 128 MiB zstd decodes by default, as `zstd --long=28` or more "
            "writes: recompress it without --long, `zstd -d --long=31 -c FILE | zstd -o NEW`)"
        )
    return ""


_CODECS: dict[str, Callable[[], _Codec]] = {
    "gzip": _gzip,
    "zstd": _zstd,
}


@functools.cache
def decoders_copy(compression: str) -> bool:
    """Whether the codec's decoders can be copied, so that a pass notes points (`Decompression.point`)."""
    return hasattr(_CODECS[compression]()[0](), "copy")


def compression_of(path: str) -> str | None:
    """The codec named by the path's last suffix in any case (`.gz`, `.GZ`, `.Zst`: Windows tools and
    some exporters write suffixes in upper case), or None for an uncompressed file."""
    name = path.lower()
    for suffix, codec in _SUFFIXES.items():
        if name.endswith(suffix):
            return codec
    return None


def raw_blocks(f: BinaryIO, size: int = BLOCK_SIZE) -> Iterator[bytes]:
    """The bytes of `f` from its current position to its end, in blocks."""
    while block := f.read(size):
        yield block


def decompressed_blocks(f: BinaryIO, compression: str | None, frame_starts: array | None = None) -> Iterator[bytes]:
    """The decompressed bytes of `f` in blocks; `EOFError` if it ends inside a frame.

    `frame_starts`, where given (an array of "q"), gets where in `f` it begins and how many
    decompressed bytes come before it, two numbers, for each gzip member or zstd frame, the first
    included: a decoder made anew may start at any of them (`_lines`' entry points). Offsets count
    from where `f` stood. Not a list of pairs: planning a shard of a million one-line zstd frames
    peaked at 299 MiB of Python heap with one, 178 MiB with this (153 without noting frames)."""
    if compression is None:
        yield from raw_blocks(f)
        return
    yield from Decompression(compression, frame_starts).blocks(f)


@dataclass(frozen=True)
class StreamPoint:
    """Where a decompression stood between two compressed blocks, with a copy of its decoder: a
    new decompression may go on from there (`Decompression(point=...)`), `f` placed at
    `compressed`. Only a decoder that can be copied gives one: zlib's can, so a gzip stream's;
    zstandard's cannot."""

    compressed: int  # bytes of the stream read before it
    decompressed: int  # bytes decompressed before it
    decoder: _Decompressor  # never fed: each decompression from here feeds a copy of it
    inside_frame: bool
    after_frame: bool


class Decompression:
    """One pass of a decoder over a compressed stream (`blocks`), which can tell, between two of
    the stream's blocks, where it stands (`point`): a gzip stream written as one member has no
    other place a decoder may begin at, and a copy of its decoder taken on the way is one."""

    def __init__(self, compression: str, frame_starts: array | None = None, point: StreamPoint | None = None):
        self.compression, self._frame_starts = compression, frame_starts
        self._new, self._codec_errors, self._padding = _CODECS[compression]()
        if point is None:
            self._state = (0, 0, self._new(), False, False)
        else:
            self._state = (point.compressed, point.decompressed, point.decoder.copy(), point.inside_frame,
                           point.after_frame)
        self._between_blocks = False  # whether `_state` is where the pass stands, as `blocks` last yielded

    @property
    def decompressed_between_blocks(self) -> int | None:
        """The bytes decompressed so far where the last block yielded ended a compressed block
        (the only places `point` can note), None elsewhere."""
        return self._state[1] if self._between_blocks else None

    def point(self) -> StreamPoint | None:
        """Where the pass stands, if the last block yielded ended a compressed block and the
        codec's decoder can be copied; None otherwise. The copy is taken now, before `blocks`
        feeds the decoder again."""
        if not self._between_blocks or not decoders_copy(self.compression):
            return None
        read, decompressed, decoder, inside_frame, after_frame = self._state
        return StreamPoint(read, decompressed, decoder.copy(), inside_frame, after_frame)

    def blocks(self, f: BinaryIO) -> Iterator[bytes]:
        """The decompressed bytes, `f` standing where the pass begins (its start, or the point's
        `compressed`); `EOFError` if the stream ends inside a frame."""
        read, decompressed, decoder, inside_frame, after_frame = self._state
        new, codec_errors, padding, frame_starts = self._new, self._codec_errors, self._padding, self._frame_starts
        for block in raw_blocks(f, _COMPRESSED_BLOCK_SIZE):
            read += len(block)  # `block` is always the last len(block) bytes read so far
            if after_frame:  # padding may run on across blocks
                block = block.lstrip(padding)
            while block:
                if frame_starts is not None and not inside_frame:
                    frame_starts.extend((read - len(block), decompressed))
                try:
                    out = decoder.decompress(block)
                except codec_errors as error:
                    undecodable = f"undecodable {self.compression} stream: {error}{_advice(error)}"
                    raise CorruptStreamError(undecodable) from error
                if decoder.eof:
                    block, decoder, inside_frame, after_frame = decoder.unused_data.lstrip(padding), new(), False, True
                else:
                    block, inside_frame, after_frame = b"", True, False
                if out:
                    decompressed += len(out)
                    self._state = (read, decompressed, decoder, inside_frame, after_frame)
                    self._between_blocks = not block
                    yield out
        if inside_frame:
            raise EOFError(f"{self.compression} stream ends inside a frame")
