"""A Parquet chunk's row groups read from the shard in a few large reads, not one per column.

Zephon has pyarrow read a chunk on the calling thread (`pre_buffer=False`, see `_parquet`).
Without pre-buffering pyarrow asks the file for each column chunk of each row group apart, and
an fsspec file on an object store makes a ranged GET for each read its block cache does not hold:
a shard whose column chunks outgrow the block (fsspec's default: 5 MiB) cost one request
per column per row group, where pyarrow's pre-buffering had coalesced them into one per 32 MiB.
`spanned` reads consecutive row groups as pyarrow's pre-buffering did, in spans of up to 32 MiB
(a larger row group is one span of its own), on the calling thread, and serves pyarrow's reads
from them; a read outside every span (bytes the metadata does not place) goes to the shard. The
spans are held until the chunk is decoded, as pre-buffering held its ranges: a chunk's row groups'
compressed bytes, where reading column by column held one column chunk's at a time.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    import pyarrow.parquet as pq

__all__ = ["spanned"]

SPAN_BYTES = 32 << 20
"""The most bytes of row groups read at once (pyarrow's own pre-buffering range limit)."""


def spanned(file: BinaryIO, metadata: pq.FileMetaData, groups: list[int]) -> _Spans:
    """`file` with the byte ranges of row groups `groups` (consecutive, in file order) read in. A
    range the metadata places outside the file (a corrupt footer) is left for pyarrow to read and
    report as it did."""
    size = file.seek(0, 2)
    spans: list[tuple[int, int]] = []
    for group in groups:
        start, stop = _extent(metadata.row_group(group))
        if not 0 <= start < stop <= size:
            continue
        if spans and start >= spans[-1][0] and stop - spans[-1][0] <= SPAN_BYTES:
            spans[-1] = (spans[-1][0], max(stop, spans[-1][1]))
        else:
            spans.append((start, stop))
    read = []
    for start, stop in spans:
        file.seek(start)
        read.append((start, memoryview(file.read(stop - start))))
    return _Spans(file, read)


def _extent(group: pq.RowGroupMetaData) -> tuple[int, int]:
    """[start, stop) of a row group's column chunks in the file, placed as pyarrow places them: a
    chunk starts at its dictionary page where that comes first, else at its first data page."""
    start, stop = -1, -1
    for i in range(group.num_columns):
        column = group.column(i)
        at = column.data_page_offset
        dictionary = column.dictionary_page_offset
        if column.has_dictionary_page and dictionary is not None and 0 < dictionary < at:
            at = dictionary
        start = at if start < 0 else min(start, at)
        stop = max(stop, at + column.total_compressed_size)
    return start, stop


class _Spans:
    """A read-only file that answers reads inside a span from memory and others from `file`.

    `storage_failed` is set when a read of `file` raised: pyarrow reports a page it cannot
    decompress as a bare OSError too, and only this tells the two apart.

    Thread-safety: thread-unsafe, as the file it wraps; one reader, the calling thread."""

    def __init__(self, file: BinaryIO, spans: list[tuple[int, memoryview]]) -> None:
        self._file = file
        self._spans = spans
        self._starts = [start for start, _ in spans]
        self._at = 0
        self.closed = False
        self.storage_failed = False

    def read(self, size: int = -1) -> bytes | memoryview:
        at = self._at
        i = bisect_right(self._starts, at) - 1
        if size >= 0 and i >= 0:
            start, data = self._spans[i]
            if at + size <= start + len(data):
                self._at = at + size
                return data[at - start : at - start + size]
        try:
            self._file.seek(at)
            out = self._file.read(size)
        except BaseException:
            self.storage_failed = True
            raise
        self._at = at + len(out)
        return out

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
