"""Parquet shards: a record is one row as a dict.

Planning reads only the footer, and keeps where each row group begins (`_decode_units` warns of
row groups far larger than a chunk). A chunk read decodes only the row groups that overlap its
range, and those only up to the chunk's end (`_decoded_until`), then slices: reading a small chunk
of a large file costs at most one row group, not the file. It finds them in the shard's footer,
parsed once per process and version of the file (`_parquet_footers`). pyarrow cannot skip the
pages before a chunk's first row, so a chunk at the end of a large row group decodes all of it.

Bytes pyarrow cannot decode (a corrupt footer or page, or a page whose stored checksum fails)
make the shard unreadable where a read decodes them: it raises ShardUnavailableError naming the
shard, at once (a chunk before the damaged page in its row group reads: it decodes no further).
pyarrow reports some corruption (a page snappy cannot decompress) as a bare OSError, like a failed
read: while a chunk's row groups are decoded, an OSError is the data's unless a read of the shard
raised (`_Spans.storage_failed`), so only a storage error is retried. At planning (the footer) an
OSError is still retried as a storage error first and then reported the same way.

pyarrow is imported on first use (`_arrow_rows`).

A chunk is read and decoded on the thread that reads it (`pre_buffer=False`, `use_threads=False`).
pyarrow's thread pools read a Python file object through Python and free the bytes read from it
there, some after the read has returned. CPython 3.14 hangs for ever a thread that enters Python as
the interpreter exits, and the process's exit then waits for ever for that pool thread (pyarrow's
pool shutdown joins its workers), after faulthandler has stopped: a process reading Parquet as
it exited hung, rarely, with no stack to show. Zephon's runners read chunks in parallel already,
and timed on 2 busy cores a chunk read no slower this way. Without pre-buffering pyarrow reads each
column chunk apart, a ranged GET each on an object store; the chunk's row groups are read in
first, in as few reads as pre-buffering made (`_parquet_spans`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ._arrow_rows import decoding, table_rows
from ._errors import ShardUnavailableError
from ._format import ShardFile, ShardScan
from ._parquet_footers import footer
from ._parquet_spans import spanned
from ._policy import Slot, fill_truncated

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

__all__ = ["Parquet"]

_BATCH_ROWS = 1024
"""Rows pyarrow decodes at a time while it reads a chunk's row groups: where the chunk's rows end
in a row group, decoding stops within this many rows. Batches of 128 to 8,192 rows read a chunk of
a 100,000-row group in the same time here."""


@dataclass(frozen=True)
class Parquet:
    name: str = "parquet"
    copies_streams: ClassVar[bool] = False  # no shard of it is one compressed stream
    decode_units: ClassVar[str] = "row groups"
    stops_at_chunk_end: ClassVar[bool] = True
    how_to_rewrite: ClassVar[str] = (
        "written in row groups of 1,000 records or fewer "
        "(pyarrow.parquet.write_table(table, where, row_group_size=1000))"
    )

    @property
    def scan_key(self) -> str:
        return "parquet row-groups"  # "parquet": before its seek held the row groups (entries without it)

    @staticmethod
    def seek_ndim(compression: str | None) -> int:
        """The seek is the first row of each row group holding rows, for planning (`_decode_units`);
        a chunk read finds its row groups in the footer (`_parquet_footers`)."""
        return 1

    def scan(self, shard: ShardFile) -> ShardScan:
        import pyarrow.parquet as pq

        with shard.open() as f, decoding(shard.url, "Parquet"):
            metadata = pq.ParquetFile(f).metadata
        groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
        sizes = np.array([group.num_rows for group in groups], dtype=np.int64)
        first_rows = (np.cumsum(sizes) - sizes)[sizes > 0] if sizes.sum() == metadata.num_rows else None
        return ShardScan(metadata.num_rows, seek=first_rows, raw_bytes=sum(group.total_byte_size for group in groups))

    def unit_bounds(self, seek: np.ndarray | None, num_records: int, compression: str | None, raw_bytes: int,
                    read_together: int) -> np.ndarray | None:
        return None if seek is None else np.append(seek, num_records)

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        import pyarrow.parquet as pq

        with shard.open(read_ahead=0) as f, decoding(shard.url, "Parquet"):  # the footer, then `spanned`'s spans
            metadata = footer(shard.url, shard.planned_version, lambda: pq.read_metadata(f))
            groups, first_row, end_row, row = [], 0, 0, 0
            for group in range(metadata.num_row_groups):
                size = metadata.row_group(group).num_rows
                if row < stop and row + size > start:
                    if not groups:
                        first_row = row
                    groups.append(group)
                    end_row = row + size
                row += size
            rows = []
            if groups:
                # A page whose checksum (where the writer stored one) fails is corrupt, not a record.
                spans = spanned(f, metadata, groups)
                parquet = pq.ParquetFile(spans, metadata=metadata, page_checksum_verification=True, pre_buffer=False)
                try:
                    table = _decoded_until(parquet, groups, stop - first_row, end_row - first_row)
                except OSError as error:
                    if spans.storage_failed:
                        raise  # storage: the caller retries it
                    raise ShardUnavailableError(shard.url, 1, f"undecodable Parquet: {type(error).__name__}: {error}") from error
                rows = table_rows(table.slice(start - first_row, stop - start))
        return fill_truncated(rows, stop - start, "shard has fewer rows than when it was planned")


def _decoded_until(parquet: pq.ParquetFile, groups: list[int], rows: int, in_groups: int) -> pa.Table:
    """The first `rows` rows (at least; whole batches) of row groups `groups`, which hold `in_groups`
    rows, decoded in batches of `_BATCH_ROWS` and no further: a chunk's rows are a small part of a
    large row group, and the pages after them are not decompressed. pyarrow cannot skip the pages
    before them. Where the rows reach into the groups' last batch, the groups are decoded whole, in
    one call: decoding in batches cost 3-5 % more there (row groups of 1,000 rows,
    `benchmarks/test_reader_bench.py`)."""
    import pyarrow as pa

    if rows + _BATCH_ROWS > in_groups:
        return parquet.read_row_groups(groups, use_threads=False)
    batches, decoded = [], 0
    reader = parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups, use_threads=False)
    while decoded < rows and (batch := next(reader, None)) is not None:
        batches.append(batch)
        decoded += batch.num_rows
    return pa.Table.from_batches(batches) if batches else parquet.schema_arrow.empty_table()
