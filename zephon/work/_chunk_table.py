"""A dataset's chunks as three integer arrays, for plans over corpora of millions of chunks.

Every rank binds the whole plan (dealing a dataset's chunks to lanes needs all of them), so it
held one `Chunk` object per chunk of the corpus, ~170 bytes with its integers, and took ~15 us
to build each: a corpus of 200,000 shards of 10,000 records in chunks of 128 (16 million chunks)
cost every rank ~2.6 GiB and minutes before its first batch. A table holds 24 bytes a chunk and
makes a `Chunk` only when a slot is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._records import Chunk

if TYPE_CHECKING:
    from ..io import Dataset

__all__ = ["ChunkTable"]


class ChunkTable(Sequence):
    """`Dataset.chunks(records_per_chunk)`, in its order, as arrays: item i is the same Chunk.

    Immutable; `take` gives a lane its own rows."""

    __slots__ = ("dataset", "shard", "start", "stop")

    def __init__(self, dataset: str, shard: np.ndarray, start: np.ndarray, stop: np.ndarray) -> None:
        self.dataset, self.shard, self.start, self.stop = dataset, shard, start, stop

    @classmethod
    def of(cls, dataset: Dataset, records_per_chunk: int) -> ChunkTable:
        """Every record slot of `dataset` in one chunk: shard order, then record order."""
        return cls(dataset.name, *dataset.chunk_bounds(records_per_chunk))

    def __len__(self) -> int:
        return len(self.shard)

    def __getitem__(self, i: int) -> Chunk:
        return Chunk(self.dataset, self.shard.item(i), self.start.item(i), self.stop.item(i))

    def take(self, rows: np.ndarray) -> ChunkTable:
        return ChunkTable(self.dataset, self.shard[rows], self.start[rows], self.stop[rows])

    def num_records(self) -> np.ndarray:
        return self.stop - self.start

    def raw_bytes(self, dataset: Dataset) -> np.ndarray:
        """`dataset.raw_bytes(chunk)` of every chunk, as Python ints would compute it."""
        out = np.empty(len(self), dtype=np.int64)
        if not len(self):
            return out
        bounds = np.flatnonzero(np.diff(self.shard)) + 1
        for lo, hi in zip(np.r_[0, bounds].tolist(), np.r_[bounds, len(self)].tolist()):
            out[lo:hi] = dataset.raw_bytes_of(int(self.shard[lo]), self.start[lo:hi], self.stop[lo:hi])
        return out
