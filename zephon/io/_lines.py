"""Line-oriented shards (JSON Lines, text): counting lines, indexing them, and reading a line range.

A line is what lies between two b"\\n" (a final line without one counts too). Counting scans every
byte once at planning time; for uncompressed shards the same scan records the byte offset of every
SEEK_STRIDE-th line (see ShardScan), so a chunk read seeks close to its first line and reads only up
to the seek point after its last line instead of re-reading the shard.
Compressed shards cannot seek: each read decompresses from the start and skips lines.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import BinaryIO, ClassVar

import numpy as np

from ._compression import decompressed_blocks, raw_blocks
from ._format import STREAM_READ_AHEAD, ShardFile, ShardScan

__all__ = ["UTF8_BOM", "DecompressedFromStart", "read_lines", "scan_lines"]

# A chunk read covers at most 2 * SEEK_STRIDE lines more than it needs, and the index costs 0.5 byte
# a line. At 256 reading and splitting the surplus took ~20 % as long as tokenizing (race profile).
SEEK_STRIDE = 16

SCAN_BLOCK_SIZE = 1 << 17
"""Bytes per block while counting an uncompressed shard's lines. Planning counts on threads, and
each thread's glibc heap keeps the pages its scan touched (the block and its newline mask) after
the thread ends, for whichever thread takes that heap next, often one that allocates little for
the rest of the run. Race text recipe, 3.14t: the two planning heaps held 2.05 and 1.88 MiB with
1 MiB blocks, 0.39 and 0.38 with these, and the thread heaps at the end of the run ~0.5 MiB less.
Smaller blocks count as fast: the mask of a 128 KiB block stays in cache."""

_NEWLINE = 0x0A
UTF8_BOM = b"\xef\xbb\xbf"  # opens some shards; it marks their encoding and is not text


OPENING_BYTES = 64
"""How many of a shard's first decompressed bytes `scan_lines` hands its `check_opening`."""


class DecompressedFromStart:
    """What a line format's read decodes, for planning's warning (`_decode_units.DecodesInUnits`):
    a compressed shard is one unit, decompressed from its start up to a chunk's last line; an
    uncompressed one is read from the seek point at most SEEK_STRIDE lines before a chunk."""

    decode_units: ClassVar[str] = "compressed shards"
    stops_at_chunk_end: ClassVar[bool] = True
    how_to_rewrite: ClassVar[str] = (
        "stored uncompressed (zstd -d, gunzip: a read seeks into those) or in compressed shards of 1,000 records "
        "or fewer"
    )

    def unit_bounds(self, seek: np.ndarray | None, num_records: int, compression: str | None) -> np.ndarray | None:
        return None if compression is None else np.array([0, num_records], dtype=np.int64)


def scan_lines(shard: ShardFile, check_opening: Callable[[bytes, int], None] | None = None) -> ShardScan:
    """Count the lines of a shard and record where each starts in the decompressed stream.

    `check_opening`, when given, is called with the shard's first OPENING_BYTES decompressed
    bytes (fewer for a shorter shard; gathered across blocks, since a shard of concatenated frames
    may decode a few bytes first) and its line count, once counted, to refuse a
    shard that is no such format (JSON Lines: `_jsonl`) without opening it a second time.

    The starts give every chunk's exact raw size for mixture planning; for uncompressed shards every
    SEEK_STRIDE-th start is also the seek index of chunk reads.
    A compressed shard cut short counts its complete lines plus one for the damaged tail (how many
    records the tail held is unknowable), so that reading it reports at least one truncated record
    instead of the plan silently omitting the loss.
    """
    size = 0
    ends_with_newline = True
    cut = False
    opening = b""
    starts = [np.zeros(1, dtype=np.int64)]
    with shard.open() as f:
        try:
            for block in _blocks_to_count(f, shard.compression):
                if check_opening is not None and len(opening) < OPENING_BYTES:  # a first frame may be short
                    opening += bytes(block[: OPENING_BYTES - len(opening)])
                positions = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == _NEWLINE)
                starts.append(positions.astype(np.int64) + size + 1)  # line m + 1 starts after newline m
                size += len(block)
                ends_with_newline = block[-1] == _NEWLINE
        except EOFError:
            cut = True
    offsets = np.concatenate(starts)
    unterminated = cut or not ends_with_newline
    num_lines = len(offsets) - 1 + (1 if unterminated else 0)
    offsets = np.append(offsets[:num_lines], size)  # starts of every line, then the end
    if check_opening is not None:
        check_opening(opening, num_lines)
    seek = offsets[:num_lines:SEEK_STRIDE] if shard.compression is None else None
    return ShardScan(num_lines, seek, raw_bytes=size, record_offsets=offsets)


def _blocks_to_count(f: BinaryIO, compression: str | None) -> Iterator[np.ndarray | bytes]:
    """The shard's decompressed bytes in blocks, each valid only until the next is asked for.

    An uncompressed shard is read into one reused buffer of SCAN_BLOCK_SIZE: a new `bytes` per
    block would leave each planning thread's allocator holding freed blocks (on 3.14t, 7 threads
    planning the race's 5.6 MB text corpus kept ~2.5 MiB more PSS that way).
    """
    if compression is not None:
        yield from decompressed_blocks(f, compression)
        return
    buffer = np.empty(SCAN_BLOCK_SIZE, dtype=np.uint8)
    while filled := f.readinto(buffer):
        yield buffer[:filled]


def read_lines(shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> tuple[list[bytes], str]:
    """The lines [start, stop) without their b"\\n", and why there are fewer if the shard ends early."""
    first = 0
    lines: list[bytes] = []
    tail_is_cut = None
    # With seek points the lines are read in one read, or in blocks of BLOCK_SIZE to the end;
    # a compressed stream from its start, in smaller blocks.
    with shard.open(read_ahead=0 if seek is not None else STREAM_READ_AHEAD) as f:
        if seek is not None:
            point = start // SEEK_STRIDE
            first = point * SEEK_STRIDE
            end_point = -(-stop // SEEK_STRIDE)  # the first seek point at or after `stop`
            f.seek(int(seek[point]))
            if end_point < len(seek):  # read exactly the lines up to that seek point
                planned = int(seek[end_point] - seek[point])
                blocks = iter([_whole_lines(f.read(planned), planned)])
            else:
                blocks = raw_blocks(f)
                tail_is_cut = functools.partial(_ended_before_planned, f, shard.planned_nbytes)
        else:
            blocks = decompressed_blocks(f, shard.compression)
        try:
            lines.extend(islice(_split_lines(blocks, tail_is_cut), start - first, stop - first))
        except EOFError as error:
            return _without_bom(lines, start), str(error)
    return _without_bom(lines, start), "shard has fewer lines than when it was planned"


def _whole_lines(data: bytes, planned: int) -> bytes:
    """Bytes that end at a seek point, planned as whole lines. Fewer than planned means the shard
    was cut after planning, maybe inside a line: that piece of a line is dropped, so the lines from
    it on are counted as truncated instead of one of them being handed out cut."""
    return data if len(data) == planned else data[: data.rfind(b"\n") + 1]


def _ended_before_planned(f: BinaryIO, planned_nbytes: int | None) -> bool:
    """Whether `f`, read to its end, is shorter than planned. Every line of the planned file but
    its last ends with b"\\n" and that last one ends at the planned size, so in a file cut
    after planning a tail without b"\\n" is a piece of a line, not a last line without one."""
    return planned_nbytes is not None and f.tell() < planned_nbytes


def _without_bom(lines: list[bytes], start: int) -> list[bytes]:
    """A UTF-8 byte order mark opening the shard marks its encoding; it is not text of line 0."""
    if start == 0 and lines and lines[0].startswith(UTF8_BOM):
        lines[0] = lines[0][len(UTF8_BOM):]
    return lines


def _split_lines(blocks: Iterable[bytes], tail_is_cut: Callable[[], bool] | None = None) -> Iterator[bytes]:
    """The lines of a stream given in blocks. The pieces of a line that spans blocks are joined once,
    when its end arrives: prepending the unfinished line to each block copied a line spanning N
    blocks N times (one 200 MB line: 15 s instead of 0.15 s). Splitting each block on its own also spares
    the common case, many lines a block, a copy of the whole block. A tail without b"\\n" is a
    last line unless `tail_is_cut()`, asked once the blocks have ended, says it is a cut one's piece."""
    pieces: list[bytes] = []  # the line begun in earlier blocks, not ended yet
    for block in blocks:
        lines = block.split(b"\n")
        end = lines.pop()
        if lines:
            if pieces:
                pieces.append(lines[0])
                lines[0] = b"".join(pieces)
                pieces.clear()
            yield from lines
        pieces.append(end)
    if (rest := b"".join(pieces)) and (tail_is_cut is None or not tail_is_cut()):
        yield rest
