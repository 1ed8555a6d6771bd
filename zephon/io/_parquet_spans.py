"""A Parquet chunk's row groups read from the shard in a few large reads, not one per column.

Zephon has pyarrow read a chunk on the calling thread (`pre_buffer=False`, see `_parquet`).
Without pre-buffering pyarrow asks the file for each column chunk of each row group apart, and
a chunk read's remote file fetches exactly each read's bytes (`ShardFile.open(read_ahead=0)`):
that cost one request per column per row group, where pyarrow's pre-buffering had coalesced them
into one per 32 MiB.
`spanned` reads ahead, from the first bytes pyarrow asks for, about as many bytes as the chunk's
row groups hold (up to 32 MiB at once), on the calling thread, and serves pyarrow's reads from
them; a read it does not hold reads ahead again. The spans are held until the chunk is decoded,
as pre-buffering held its ranges: a chunk's row groups' compressed bytes, where reading column by
column held one column chunk's at a time.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    import pyarrow.parquet as pq

__all__ = ["spanned"]

SPAN_BYTES = 32 << 20
"""The most bytes read ahead at once (pyarrow's own pre-buffering range limit)."""

_SLACK = 1.1
"""How much more than its estimate a chunk's read-ahead takes: a row group compressed a little
worse than the file's average is read in the same request."""


def spanned(file: BinaryIO, metadata: pq.FileMetaData, groups: list[int]) -> _Spans:
    """`file`, reading ahead about the compressed bytes of row groups `groups` wherever pyarrow
    first asks for bytes it does not hold (the first column chunk: pyarrow reads a chunk's row
    groups column by column, each column chunk in one read).

    The read-ahead is estimated, not taken from the column chunks' offsets: pyarrow (26) aborts the
    process (`terminate called`, a C++ exception its Python binding does not catch) when asked
    for a column chunk's metadata whose statistics are corrupt, where its own read of the same
    row group raises an OSError. So the bytes the file's row groups hold between its magic and its
    footer are shared out by their uncompressed sizes, which the row groups' own metadata gives
    safely: a row group's share is its compressed size where the file compresses evenly. A read
    past the estimate is one more read, as is a read outside the chunk's bytes."""
    size = file.seek(0, 2)
    stored = max(0, size - 12 - metadata.serialized_size)  # less the two magics, the footer and its length
    uncompressed = sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
    wanted = sum(metadata.row_group(g).total_byte_size for g in groups)
    estimate = stored * wanted / uncompressed if uncompressed else stored
    return _Spans(file, window=min(SPAN_BYTES, int(estimate * _SLACK) + 1), end=size)


class _Spans:
    """A read-only file that answers reads from what it read ahead of `file` where it can.

    A read it does not hold reads `window` bytes from its start (to `end` at most) and keeps
    them: the spans are held until the chunk is decoded, as pyarrow's pre-buffering held its
    ranges. `storage_failed` is set when a read of `file` raised: pyarrow reports a page it cannot
    decompress as a bare OSError too, and only this tells the two apart.

    Thread-safety: thread-unsafe, as the file it wraps; one reader, the calling thread."""

    def __init__(self, file: BinaryIO, window: int, end: int) -> None:
        self._file = file
        self._window, self._end = window, end
        self._spans: list[tuple[int, memoryview]] = []
        self._starts: list[int] = []
        self._at = 0
        self.closed = False
        self.storage_failed = False

    def read(self, size: int = -1) -> bytes | memoryview:
        at = self._at
        if size >= 0:
            i = bisect_right(self._starts, at) - 1
            if i < 0 or at + size > self._starts[i] + len(self._spans[i][1]):
                i = self._read_ahead(at, size)
            start, data = self._spans[i]
            if at + size <= start + len(data):
                self._at = at + size
                return data[at - start : at - start + size]
        out = self._from_file(at, size)
        self._at = at + len(out)
        return out

    def _read_ahead(self, at: int, size: int) -> int:
        """Read `window` bytes (at least `size`) from `at` into a span of their own; its index."""
        data = memoryview(self._from_file(at, max(size, min(self._window, self._end - at))))
        i = bisect_right(self._starts, at)
        self._starts.insert(i, at)
        self._spans.insert(i, (at, data))
        return i

    def _from_file(self, at: int, size: int) -> bytes:
        try:
            self._file.seek(at)
            return self._file.read(size)
        except BaseException:
            self.storage_failed = True
            raise

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            self._at = offset
        elif whence == 1:
            self._at += offset
        else:
            self._at = self._file.seek(offset, whence)
        return self._at

    def tell(self) -> int:
        return self._at

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        """Marks this view closed; the shard's file is closed by whoever opened it."""
        self.closed = True
