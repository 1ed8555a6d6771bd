"""Parquet shards: a record is one row as a dict.

Planning reads only the footer. A chunk read decodes only the row groups that overlap its range and
then slices, so reading a small chunk of a large file costs about one row group, not the file.

Bytes pyarrow cannot decode (a corrupt footer or page, or a page whose stored checksum fails)
make the shard unreadable: it raises ShardUnavailableError naming the shard, at once. pyarrow reports
some corruption (a page snappy cannot decompress) as a bare OSError, like a failed read: while a
chunk's row groups are decoded, an OSError is the data's unless a read of the shard raised
(`_Spans.storage_failed`), so only a storage error is retried. At planning (the footer) an OSError is
still retried as a storage error first and then reported the same way.

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
from typing import ClassVar

import numpy as np

from ._arrow_rows import decoding, table_rows
from ._errors import ShardUnavailableError
from ._format import ShardFile, ShardScan
from ._parquet_spans import spanned
from ._policy import Slot, fill_truncated

__all__ = ["Parquet"]


@dataclass(frozen=True)
class Parquet:
    name: str = "parquet"
    seek_ndim: ClassVar[int] = 1  # no seek: a chunk read finds its row groups in the footer

    @property
    def scan_key(self) -> str:
        return "parquet"

    def scan(self, shard: ShardFile) -> ShardScan:
        import pyarrow.parquet as pq

        with shard.open() as f, decoding(shard.url, "Parquet"):
            metadata = pq.ParquetFile(f).metadata
        raw = sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
        return ShardScan(metadata.num_rows, raw_bytes=raw)

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        import pyarrow.parquet as pq

        with shard.open(read_ahead=0) as f, decoding(shard.url, "Parquet"):  # the footer, then `spanned`'s spans
            metadata = pq.read_metadata(f)
            groups, first_row, row = [], 0, 0
            for group in range(metadata.num_row_groups):
                size = metadata.row_group(group).num_rows
                if row < stop and row + size > start:
                    if not groups:
                        first_row = row
                    groups.append(group)
                row += size
            rows = []
            if groups:
                # A page whose checksum (where the writer stored one) fails is corrupt, not a record.
                spans = spanned(f, metadata, groups)
                parquet = pq.ParquetFile(spans, metadata=metadata, page_checksum_verification=True, pre_buffer=False)
                try:
                    table = parquet.read_row_groups(groups, use_threads=False)
                except OSError as error:
                    if spans.storage_failed:
                        raise  # storage: the caller retries it
                    raise ShardUnavailableError(shard.url, 1, f"undecodable Parquet: {type(error).__name__}: {error}") from error
                rows = table_rows(table.slice(start - first_row, stop - start))
        return fill_truncated(rows, stop - start, "shard has fewer rows than when it was planned")
