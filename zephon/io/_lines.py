"""Line-oriented shards (JSON Lines, text): counting lines, indexing them, and reading a line range.

A line is what lies between two b"\\n" (a final line without one counts too). Counting scans every
byte once at planning time; for uncompressed shards the same scan records the byte offset of every
SEEK_STRIDE-th line (see ShardScan), so a chunk read seeks close to its first line and reads only up
to the seek point after its last line instead of re-reading the shard.

A gzip or zstd stream cannot be entered in its middle, but a new decoder can start at any of its
members or frames: a shard written as many (`bgzip`'s 64 KiB members, `pzstd`'s frames, frames
compressed a few thousand lines at a time and concatenated) is entered at the last one before a
chunk's first line (`entry_points`), decompressed from there up to the chunk's last line. One
written as a single stream (`gzip`, `zstd`, Python's `gzip` and `zstandard` writers) has one entry
point, its start: a gzip one is decompressed from the last place this process's reads noted
before a chunk (`_resume_points`), a zstd one from its start; unless planning, asked to, wrote a
seekable copy of it in frames (`_seekable_copy`), whose entry points its reads then enter at.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import BinaryIO, ClassVar

import numpy as np

from . import _resume_points
from ._compression import Decompression, decoders_copy, decompressed_blocks, raw_blocks
from ._format import STREAM_READ_AHEAD, ShardFile, ShardScan
from ._resume_points import ResumePoint, single_stream_units
from ._seekable_copy import FramedCopy

__all__ = ["UTF8_BOM", "DecompressedFromFrames", "entry_points", "read_lines", "scan_lines"]

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


class DecompressedFromFrames:
    """What a line format's read decodes, for planning's warning (`_decode_units.DecodesInUnits`):
    a compressed shard is decompressed from the entry point before a chunk (where the shard is one
    stream, its start, or for gzip the resume point before the chunk, `_resume_points`) up to the
    chunk's last line; an uncompressed one is read from the seek point at most SEEK_STRIDE lines
    before a chunk. Its scans' seek: `seek_ndim`."""

    decode_units: ClassVar[str] = "zstd frames, gzip members or stretches of a gzip stream between resume points"
    stops_at_chunk_end: ClassVar[bool] = True
    copies_streams: ClassVar[bool] = True  # its scans copy one stream where asked (`_seekable_copy`)
    how_to_rewrite: ClassVar[str] = (
        "stored uncompressed (zstd -d, gunzip: a read seeks into those) or compressed in small frames or members, "
        "a read entering at the last before its chunk (pzstd -1 writes frames of 2 MiB of text, bgzip members of "
        "64 KiB), or planned with Dataset.from_path(..., scan_cache=DIR, seekable_copies=True) (a copy of each "
        "shard in one stream kept in such frames in DIR)"
    )

    @staticmethod
    def seek_ndim(compression: str | None) -> int:
        """An uncompressed shard's seek points are one row of byte offsets; a compressed one's entry
        points a table (`entry_points`)."""
        return 1 if compression is None else 2

    @staticmethod
    def indexes(table: np.ndarray, num_records: int) -> bool:
        """Three rows, entry points from the first line (`entry_points`), each entered by its first
        line's decompressed distance (none negative)."""
        rows, points = table.shape
        return (rows == 3 and 1 < points <= num_records and table[1, 0] == 0 and table[1, -1] < num_records
                and not np.any(table[2] < 0))

    @staticmethod
    def stream_seek(seek: np.ndarray) -> None:
        """The seek of a shard in one stream, from its copy's: none (read from its start)."""
        return None

    def unit_bounds(self, seek: np.ndarray | None, num_records: int, compression: str | None, raw_bytes: int,
                    read_together: int) -> np.ndarray | None:
        if compression is None:
            return None
        if seek is not None:
            return np.append(seek[1], num_records)
        return single_stream_units(num_records, compression, raw_bytes, read_together)


def scan_lines(shard: ShardFile, check_opening: Callable[[bytes, int], None] | None = None) -> ShardScan:
    """Count the lines of a shard and record where each starts in the decompressed stream.

    `check_opening`, when given, is called with the shard's first OPENING_BYTES decompressed
    bytes (fewer for a shorter shard; gathered across blocks, since a shard of concatenated frames
    may decode a few bytes first) and its line count, once counted, to refuse a
    shard that is no such format (JSON Lines: `_jsonl`) without opening it a second time.

    The starts give every chunk's exact raw size for mixture planning; for uncompressed shards every
    SEEK_STRIDE-th start is also the seek index of chunk reads, and for compressed ones they and
    where the frames begin give the entry points (`entry_points`).
    A compressed shard cut short counts its complete lines plus one for the damaged tail (how many
    records the tail held is unknowable), so that reading it reports at least one truncated record
    instead of the plan silently omitting the loss.
    """
    size = 0
    ends_with_newline = True
    cut = False
    opening = b""
    starts = [np.zeros(1, dtype=np.int64)]
    frame_starts = array("q")
    copy = FramedCopy(shard.copy_to) if shard.copy_to is not None and shard.compression is not None else None
    try:
        with shard.open() as f:
            try:
                for block in _blocks_to_count(f, shard.compression, frame_starts):
                    if copy is not None and len(frame_starts) > 2:  # a second frame: entry points of its own
                        copy.abandon()
                        copy = None
                    elif copy is not None:
                        copy.write(block)
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
        if shard.compression is None:
            seek = offsets[:num_lines:SEEK_STRIDE]
        else:
            seek = entry_points(frame_starts, offsets[:num_lines])
        copied = None
        if copy is not None:
            seek, copied = _into_copy(copy, seek, cut, offsets[:num_lines])
    except BaseException:
        if copy is not None:
            copy.abandon()
        raise
    return ShardScan(num_lines, seek, raw_bytes=size, record_offsets=offsets, copy=copied)


def _into_copy(copy: FramedCopy, seek: np.ndarray | None, cut: bool,
               line_starts: np.ndarray) -> tuple[np.ndarray | None, str | None]:
    """(seek, the copy's path) of a shard scanned with its copy written as it went: the copy's
    entry points where it keeps one with several (`_seekable_copy`); else the shard's own seek and
    no copy, the copy removed."""
    if not copy.kept(whole_stream=seek is None and not cut):
        return seek, None
    into_copy = entry_points(copy.frame_starts, line_starts)
    if into_copy is None:  # its lines start in one run of SEEK_STRIDE: nothing to skip
        copy.abandon()
        return None, None
    return into_copy, copy.path


def entry_points(frame_starts: array, line_starts: np.ndarray) -> np.ndarray | None:
    """Where a chunk read may enter a compressed shard, from where in the shard each of its frames
    or members begins and how many decompressed bytes come before it (`frame_starts`, in turn),
    and each line's decompressed start: a table of three rows, for each entry point the compressed
    offset a new decoder starts at, the first line starting there or after, and the decompressed
    bytes from there to that line's start (a frame may begin inside a line, as `bgzip` and `pzstd`
    cut where their blocks fill).
    Of the frames whose first lines fall in one run of SEEK_STRIDE lines only the first is kept:
    a shard of one-line frames keeps an entry point per SEEK_STRIDE lines, not per line, and its
    reads start fewer than SEEK_STRIDE lines before their chunks, as an uncompressed shard's do.
    None where the shard has one entry point, its start (a single stream: reads decompress it
    from there)."""
    if len(frame_starts) < 4 or len(line_starts) == 0:  # one frame
        return None
    compressed, decompressed = np.frombuffer(frame_starts, dtype=np.int64).reshape(-1, 2).T
    first_line = np.searchsorted(line_starts, decompressed, side="left")
    holds_a_start = first_line < len(line_starts)  # a frame after the last line's start enters no line
    kept = np.flatnonzero(holds_a_start & np.diff(first_line // SEEK_STRIDE, prepend=-1).astype(bool))
    if len(kept) < 2:
        return None
    first_line = first_line[kept]
    return np.stack([compressed[kept], first_line, line_starts[first_line] - decompressed[kept]])


def _blocks_to_count(f: BinaryIO, compression: str | None, frame_starts: array) -> Iterator[np.ndarray | bytes]:
    """The shard's decompressed bytes in blocks, each valid only until the next is asked for; a
    compressed shard's frames noted in `frame_starts` (`decompressed_blocks`).

    An uncompressed shard is read into one reused buffer of SCAN_BLOCK_SIZE: a new `bytes` per
    block would leave each planning thread's allocator holding freed blocks (on 3.14t, 7 threads
    planning the race's 5.6 MB text corpus kept ~2.5 MiB more PSS that way).
    """
    if compression is not None:
        yield from decompressed_blocks(f, compression, frame_starts)
        return
    buffer = np.empty(SCAN_BLOCK_SIZE, dtype=np.uint8)
    while filled := f.readinto(buffer):
        yield buffer[:filled]


def read_lines(shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> tuple[list[bytes], str]:
    """The lines [start, stop) without their b"\\n", and why there are fewer if the shard ends early."""
    first = 0
    lines: list[bytes] = []
    tail_is_cut = None
    read: Iterator[bytes] | None = None  # the lines from line `first` on
    # With seek points the lines are read in one read, or in blocks of BLOCK_SIZE to the end; a
    # compressed stream from its entry point before `start` (or its start), in smaller blocks.
    exact = seek is not None and shard.compression is None
    with shard.open(read_ahead=0 if exact else STREAM_READ_AHEAD) as f:
        if exact:
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
        elif seek is not None:  # a compressed shard's entry points (`entry_points`)
            point = int(np.searchsorted(seek[1], start, side="right")) - 1
            f.seek(int(seek[0, point]))
            first = int(seek[1, point])
            blocks = _after(decompressed_blocks(f, shard.compression), int(seek[2, point]))
        elif (shard.compression is not None and decoders_copy(shard.compression)
              and (key := _resume_points.key_of(shard))):
            read, first = _from_resume_point(f, shard.compression, key, start)
        else:
            blocks = decompressed_blocks(f, shard.compression)
        if read is None:
            read = _split_lines(blocks, tail_is_cut)
        try:
            lines.extend(islice(read, start - first, stop - first))
        except EOFError as error:
            return _without_bom(lines, start), str(error)
    return _without_bom(lines, start), "shard has fewer lines than when it was planned"


def _from_resume_point(f: BinaryIO, compression: str, key: tuple, start: int) -> tuple[Iterator[bytes], int]:
    """The lines of a shard written as one stream, in a codec whose decoders copy (`decoders_copy`),
    from the last point this process noted at or
    before line `start` (its start where there is none), and that point's line; the read notes
    new points as it goes (`_resume_points`)."""
    points = _resume_points.resume_points
    point = points.before_line(key, start)
    if point is not None:
        f.seek(point.stream.compressed)
    decompression = Decompression(compression, point=None if point is None else point.stream)
    first = 0 if point is None else point.line
    begun = b"" if point is None else point.begun

    def note(lines_ended: int, pieces: list[bytes]) -> None:
        offset = decompression.decompressed_between_blocks
        if offset is None or sum(map(len, pieces)) > _resume_points.LONGEST_BEGUN or not points.wants(key, offset):
            return  # not between compressed blocks, inside a line too long to keep, or near a point
        stream = decompression.point()
        if stream is not None:
            points.note(key, ResumePoint(first + lines_ended, b"".join(pieces), stream))

    return _split_lines(decompression.blocks(f), begun=begun, at_block_end=note), first


def _after(blocks: Iterator[bytes], skipped: int) -> Iterator[bytes]:
    """`blocks` without their first `skipped` bytes: the end of a line begun before the frame a
    read entered at."""
    for block in blocks:
        if skipped >= len(block):
            skipped -= len(block)
            continue
        yield block[skipped:] if skipped else block
        skipped = 0


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


def _split_lines(blocks: Iterable[bytes], tail_is_cut: Callable[[], bool] | None = None, begun: bytes = b"",
                 at_block_end: Callable[[int, list[bytes]], None] | None = None) -> Iterator[bytes]:
    """The lines of a stream given in blocks. The pieces of a line that spans blocks are joined once,
    when its end arrives: prepending the unfinished line to each block copied a line spanning N
    blocks N times (one 200 MB line: 15 s instead of 0.15 s). Splitting each block on its own also spares
    the common case, many lines a block, a copy of the whole block. A tail without b"\\n" is a
    last line unless `tail_is_cut()`, asked once the blocks have ended, says it is a cut one's piece.
    `begun` is a line's beginning read before the first block; `at_block_end(lines, pieces)`, where
    given, is called after each block with the lines ended so far and the pieces of the next."""
    pieces: list[bytes] = [begun] if begun else []  # the line begun in earlier blocks, not ended yet
    ended = 0
    for block in blocks:
        lines = block.split(b"\n")
        end = lines.pop()
        if lines:
            if pieces:
                pieces.append(lines[0])
                lines[0] = b"".join(pieces)
                pieces.clear()
            ended += len(lines)
            yield from lines
        pieces.append(end)
        if at_block_end is not None:
            at_block_end(ended, pieces)
    if (rest := b"".join(pieces)) and (tail_is_cut is None or not tail_is_cut()):
        yield rest
