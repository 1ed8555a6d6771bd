"""Line-oriented shards (JSON Lines, text): counting lines, indexing them, and reading a line range.

A line is what lies between two b"\\n" (a final line without one counts too). Counting scans every
byte once at planning time; for uncompressed shards the same scan records the byte offset of every
SEEK_STRIDE-th line (see ShardScan), so a chunk read seeks close to its first line instead of
re-reading the shard.
Compressed shards cannot seek: each read decompresses from the start and skips lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

import numpy as np

from ._compression import decompressed_blocks, raw_blocks
from ._format import ShardFile, ShardScan

__all__ = ["scan_lines", "read_lines", "lines_raw_bytes"]

SEEK_STRIDE = 256  # lines are small: a chunk read skips at most a few hundred of them

_NEWLINE = 0x0A


def scan_lines(shard: ShardFile) -> ShardScan:
    """Count the lines of a shard; index them when it is uncompressed.

    A compressed shard cut short counts its complete lines plus one for the damaged tail (how many
    records the tail held is unknowable), so that reading it reports at least one truncated record
    instead of the plan silently omitting the loss.
    """
    indexed = shard.compression is None
    newlines = size = 0
    last = b""
    cut = False
    starts = [np.zeros(1, dtype=np.int64)]
    with shard.open() as f:
        try:
            for block in decompressed_blocks(f, shard.compression):
                if indexed:
                    positions = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == _NEWLINE)
                    # line m + 1 starts after newline m; keep the lines whose number is a stride multiple
                    first = (SEEK_STRIDE - 1 - newlines) % SEEK_STRIDE
                    starts.append(positions[first::SEEK_STRIDE].astype(np.int64) + size + 1)
                    newlines += positions.size
                else:
                    newlines += block.count(b"\n")
                size += len(block)
                last = block[-1:]
        except EOFError:
            cut = True
    num_lines = newlines + (1 if cut or (size and last != b"\n") else 0)
    if not indexed:
        return ShardScan(num_lines, raw_bytes=size)
    num_points = -(-num_lines // SEEK_STRIDE)
    return ShardScan(num_lines, np.concatenate(starts)[:num_points], raw_bytes=size)


def lines_raw_bytes(shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> int:
    """Bytes of the lines [start, stop), newlines included."""
    lines, _ = read_lines(shard, seek, start, stop)
    return sum(len(line) + 1 for line in lines)


def read_lines(shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> tuple[list[bytes], str]:
    """The lines [start, stop) without their b"\\n", and why there are fewer if the shard ends early."""
    first = 0
    lines: list[bytes] = []
    with shard.open() as f:
        if seek is not None:
            point = start // SEEK_STRIDE
            first = point * SEEK_STRIDE
            f.seek(int(seek[point]))
            blocks = raw_blocks(f)
        else:
            blocks = decompressed_blocks(f, shard.compression)
        try:
            lines.extend(islice(_split_lines(blocks), start - first, stop - first))
        except EOFError as error:
            return lines, str(error)
    return lines, "shard has fewer lines than when it was planned"


def _split_lines(blocks: Iterable[bytes]) -> Iterator[bytes]:
    rest = b""
    for block in blocks:
        *complete, rest = (rest + block).split(b"\n")
        yield from complete
    if rest:
        yield rest
