"""Parquet shards: a record is one row as a dict.

Planning reads only the footer. A chunk read decodes only the row groups that overlap its range and
then slices, so reading a small chunk of a large file costs about one row group, not the file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from ._format import ShardFile, ShardScan
from ._policy import Slot, fill_truncated

__all__ = ["Parquet"]


@dataclass(frozen=True)
class Parquet:
    name: str = "parquet"

    def scan(self, shard: ShardFile) -> ShardScan:
        with shard.open() as f:
            metadata = pq.ParquetFile(f).metadata
        raw = sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
        return ShardScan(metadata.num_rows, raw_bytes=raw)

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        with shard.open() as f:
            parquet = pq.ParquetFile(f)
            groups, first_row, row = [], 0, 0
            for group in range(parquet.metadata.num_row_groups):
                size = parquet.metadata.row_group(group).num_rows
                if row < stop and row + size > start:
                    if not groups:
                        first_row = row
                    groups.append(group)
                row += size
            rows = []
            if groups:
                rows = parquet.read_row_groups(groups).slice(start - first_row, stop - start).to_pylist()
        return fill_truncated(rows, stop - start, "shard has fewer rows than when it was planned")
