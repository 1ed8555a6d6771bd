"""Places inside a shard written as one gzip stream where this process's reads may start again.

Such a shard has one entry point, its start (`_lines`): without these, every chunk read
decompresses it from there up to its chunk, and a lane reads a dataset's chunks in a seeded
order, so reading a shard of N chunks decompressed it about N / 2 times over. zlib's decoder can be
copied, so a read notes, between compressed blocks, a copy of its decoder with the line it stood
in (`ResumePoint`), points at least `spacing` decompressed bytes apart; a later read of the same
shard in this process starts from the last point before its chunk's first line. After about one
pass over a shard a chunk read decompresses about `spacing` bytes before its chunk, at most two
spacings and a compressed block's output (`tests/unit/test_io_resume_points.py`).

A copy costs about 38 KiB (zlib's 32 KiB window and its state), so points are few: at most
POINTS_PER_SHARD a shard, every other one dropped and the shard's spacing doubled when there would
be more (a shard of 64 MiB decompressed keeps points 1 MiB apart, one of 1 GiB 16 MiB apart), and
at most POINTS_PER_PROCESS in all, thinned out the same way in the shard holding most: a process
reading D decompressed bytes of such shards in a mixed order keeps their points about D / 256
apart (512 MiB of shards: 2 MiB apart), and a shard shorter than that holds none, every chunk of
it read from its start as without points (256 shards of 256 MiB: none in any). Planning's
warning counts the spacing a dataset's shards settle at (`settled_spacing`).

Only gzip: zstandard's decoders cannot be copied, so a shard written as one zstd stream is still
decompressed from its start for every chunk (planning warns of it). A tar compressed as one gzip
stream notes and takes points the same way (`_decompressed_view`), by decompressed offset, not
by line. Points are kept per process
and never written anywhere: a worker process finds its own, and a shard whose version changes is
another key (`ShardFile.planned_version`).
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

import numpy as np

from .. import _fork
from ._compression import StreamPoint, decoders_copy

if TYPE_CHECKING:
    from ._format import ShardFile

__all__ = ["FIRST_SPACING", "LONGEST_BEGUN", "POINTS_PER_PROCESS", "POINTS_PER_SHARD", "ResumePoint", "ResumePoints",
           "key_of", "resume_points", "settled_spacing", "single_stream_units"]

FIRST_SPACING = 1 << 20
"""Decompressed bytes between a shard's points until it holds POINTS_PER_SHARD. A gzip stream
decompresses at about 400 MB/s here, so a read from a point 1 MiB before its chunk spends under
3 ms more than one from its chunk's first line."""

POINTS_PER_SHARD = 64
POINTS_PER_PROCESS = 256  # about 10 MiB of decoder copies

LONGEST_BEGUN = 1 << 15
"""The most of an unfinished line a point keeps (`ResumePoint.begun`): between two compressed
blocks inside a longer line no point is noted, so that 256 points hold at most 8 MiB of text
besides their decoders. A compressed block decompresses to about 250 KiB of text, so in a shard
of lines of megabytes about one line in eight still has a point near its start."""


@dataclass(frozen=True)
class ResumePoint:
    """A read may start at `stream` (`Decompression(point=...)`): the lines before it are
    `line`, and `begun` is what was decompressed of line `line` before it. A compressed tar is
    entered by byte, not by line (`_decompressed_view`): its points' `line` is the decompressed
    bytes before them, and `begun` empty."""

    line: int
    begun: bytes
    stream: StreamPoint


@dataclass
class _ShardPoints:
    spacing: int
    most: int  # points it may hold
    points: list[ResumePoint] = field(default_factory=list)  # by decompressed offset (their lines ascend too)

    def before_line(self, line: int) -> ResumePoint | None:
        """The last point whose line is at or before `line`."""
        at = bisect.bisect_right(self.points, line, key=_line)
        return self.points[at - 1] if at else None

    def wants(self, offset: int) -> bool:
        """Whether a point at `offset` is at least `spacing` from both its neighbours."""
        at = bisect.bisect_left(self.points, offset, key=_offset)
        return ((at == 0 or offset - _offset(self.points[at - 1]) >= self.spacing)
                and (at == len(self.points) or _offset(self.points[at]) - offset >= self.spacing))

    def add(self, point: ResumePoint) -> None:
        bisect.insort_left(self.points, point, key=_offset)
        if len(self.points) > self.most:
            self.thin()

    def thin(self) -> None:
        """Every other point dropped, and new ones noted twice as far apart."""
        del self.points[1::2]
        self.spacing *= 2


def _line(point: ResumePoint) -> int:
    return point.line


def _offset(point: ResumePoint) -> int:
    return point.stream.decompressed


class ResumePoints:
    """The points this process noted, by shard. Thread-safe: reads of one shard on several threads
    look up and note points under one lock (noting copies no decoder: the caller copied it)."""

    def __init__(self, first_spacing: int = FIRST_SPACING, per_shard: int = POINTS_PER_SHARD,
                 per_process: int = POINTS_PER_PROCESS) -> None:
        self.first_spacing, self._per_shard, self._per_process = first_spacing, per_shard, per_process
        self._lock = threading.Lock()
        self._shards: OrderedDict[Hashable, _ShardPoints] = OrderedDict()  # least recently read first

    def before_line(self, shard: Hashable, line: int) -> ResumePoint | None:
        """Where a read of `shard` wanting `line` on may start: the last point at or before it."""
        with self._lock:
            points = self._shards.get(shard)
            if points is None:
                return None
            self._shards.move_to_end(shard)
            return points.before_line(line)

    def wants(self, shard: Hashable, offset: int) -> bool:
        """Whether a point of `shard` at decompressed `offset` would be noted (asked before copying
        a decoder for it)."""
        with self._lock:
            points = self._shards.get(shard)
            return points is None or points.wants(offset)

    def note(self, shard: Hashable, point: ResumePoint) -> None:
        """Keep `point` of `shard`, unless another read noted one near it meanwhile; then thin
        out points where there are more than the bounds take."""
        with self._lock:
            points = self._shards.get(shard)
            if points is None:
                points = self._shards[shard] = _ShardPoints(self.first_spacing, self._per_shard)
            self._shards.move_to_end(shard)
            if not points.wants(point.stream.decompressed):  # another thread noted one near it meanwhile
                return
            points.add(point)
            while self._held() > self._per_process:
                self._make_room()

    def _make_room(self) -> None:
        """Thin out the points of the shard holding most (every other one, its spacing doubled),
        so that shards read together share the process's points about evenly, as
        `settled_spacing` counts on; a shard down to one point is forgotten, the least recently
        read first."""
        fullest = max(self._shards.values(), key=lambda points: len(points.points))
        if len(fullest.points) > 1:
            fullest.thin()
        else:
            self._shards.popitem(last=False)

    def _held(self) -> int:
        return sum(len(points.points) for points in self._shards.values())

    def count(self) -> int:
        """The points held, all shards'."""
        with self._lock:
            return self._held()

    def forget(self) -> None:
        """Drop every point: reads start from their shards' starts again until they note new ones."""
        with self._lock:
            self._shards = OrderedDict()

    def _renew_in_child(self) -> None:
        """A child forked while another thread held the lock would wait on it for ever, and its
        points are forgotten too: a thread of the parent may have been copying one's decoder,
        whose own lock the child would then find held."""
        self._lock = threading.Lock()
        self.forget()


def key_of(shard: ShardFile) -> tuple | None:
    """What names a shard's bytes here: its URL with the size and version planning listed; None
    while planning (no version yet) or where the shard is read through from its start anyway (its
    server refuses ranges)."""
    if shard.planned_version is None or shard.from_start:
        return None
    return shard.url, shard.planned_nbytes, shard.planned_version


def single_stream_units(num_records: int, compression: str, raw_bytes: int, read_together: int) -> np.ndarray:
    """The units planning's warning counts (`_decode_units.DecodesInUnits.unit_bounds`) in a shard
    written as one stream of `raw_bytes` decompressed, its dataset's such shards holding
    `read_together`: stretches between resume points as far apart as they settle, the records
    taken as spread evenly; the whole shard where its codec's decoders cannot be copied or the
    points settle further apart than it is long."""
    spacing = settled_spacing(raw_bytes, read_together) if decoders_copy(compression) else raw_bytes
    if spacing >= raw_bytes:  # decompressed from its start for every chunk
        return np.array([0, num_records], dtype=np.int64)
    records_apart = max(1, num_records * spacing // raw_bytes)
    return np.append(np.arange(0, num_records, records_apart, dtype=np.int64), num_records)


def settled_spacing(raw_bytes: int, read_together: int) -> int:
    """About how far apart a shard's points end up once read through, for planning's warning
    (`_lines.DecompressedFromFrames`): `raw_bytes` decompressed, in a process reading shards of
    `read_together` decompressed bytes in all (its dataset's) in a mixed order. Each shard holds at
    most POINTS_PER_SHARD and they share POINTS_PER_PROCESS (`ResumePoints._make_room`)."""
    spacing = FIRST_SPACING
    while spacing < raw_bytes and (raw_bytes > spacing * POINTS_PER_SHARD
                                   or read_together > spacing * POINTS_PER_PROCESS):
        spacing *= 2
    return spacing


resume_points = ResumePoints()


def _renew_in_child() -> None:
    resume_points._renew_in_child()


_fork.call_in_child(_renew_in_child)
