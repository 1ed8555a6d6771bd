"""What reading a dataset's chunks decodes beyond their own records, for a warning at planning.

Parquet and Arrow IPC cannot decode a single row: a read decodes whole row groups or record
batches (a format's *units*) around a chunk's rows. pyarrow (26) cannot skip the pages of a row
group before a chunk's first row, so a Parquet chunk read decodes its row group from its start
up to the chunk's end (`_parquet`), and an Arrow chunk read decodes its record batches whole
(`_arrow`). A gzip or zstd stream cannot be entered in its middle either: a chunk read of a
compressed JSON Lines or text shard decompresses the zstd frame or gzip member holding its first
line from its start, the whole shard's start where the shard is one stream (`_lines`), or, one
gzip stream, from the last resume point this process noted before the chunk (`_resume_points`).

Units of about a chunk cost little: `datasets`' 1,000-row batches read a chunk of 128 records in
half a JSON Lines chunk's time (`benchmarks/test_reader_bench.py`). Units of many chunks decode
their records many times over, measured here with records of 800 bytes read in chunks of 128:
100,000 in one Parquet row group (as `pyarrow.parquet.write_table` writes up to 1,048,576 rows)
at 7.6 k records/s against 175 k/s in row groups of 1,000, the chunks decoding 392 records per
record they return; 20,000 in one `.jsonl.zst` at 8.3 k records/s (`.jsonl.gz`: 4.8 k) against
342 k/s uncompressed. Nothing is wrong with the records, and the plan does not depend on their
layout, so a run is not refused: planning warns, naming how to store them instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["DecodesInUnits", "Shard", "WASTEFUL_DECODING", "wasteful_decoding"]

Shard = tuple["np.ndarray | None", int, "str | None", int]
"""What of a shard's plan tells what its reads decode: its scan's seek, its records, its compression,
its decompressed bytes."""

WASTEFUL_DECODING = 32
"""Records decoded per record read from which planning warns. Those Parquet records of 800 bytes
cost about 0.3 µs each to decode here and 120 µs each to tokenize (the shipped tokenizer): at 32
the decoding costs under a tenth of the tokenizing. A line of a zstd stream costs about 3 µs to
decompress and split (the shipped corpus, 1.6 KB a record, `benchmarks/test_reader_bench.py`), a
third of its tokenizing at 32. `datasets`' Arrow batches of 1,000 rows read in chunks of 128
decode about 8, the shipped KJV's `.jsonl.zst` shards of 297 records about 2."""


@runtime_checkable
class DecodesInUnits(Protocol):
    """A shard format (`ShardFormat`) whose read decodes whole units of records around a chunk's."""

    decode_units: str  # what its units are called: "row groups"
    stops_at_chunk_end: bool  # a read decodes its first unit from its start up to the chunk's end only
    how_to_rewrite: str  # how the same records decode a few, for the warning: "written in ... (write_table(...))"

    def unit_bounds(self, seek: np.ndarray | None, num_records: int, compression: str | None, raw_bytes: int,
                    read_together: int) -> np.ndarray | None:
        """The first record of each unit of a shard holding records, then `num_records`, from
        its scan's `seek`, its compression and its decompressed bytes, its dataset's shards
        holding `read_together` in all; None where a read decodes about its own records, or where
        the seek does not tell."""
        ...


@dataclass(frozen=True)
class _Decoding:
    decoded: int  # records decoded reading every chunk once
    records: int  # records in those chunks
    largest_unit: int


def wasteful_decoding(reader: object, name: str, shards: Sequence[Shard], records_per_chunk: int) -> str | None:
    """A warning for dataset `name` when reading its chunks of `records_per_chunk` decodes at
    least `WASTEFUL_DECODING` records per record, its `shards` read by `reader`; None otherwise,
    and for a format that decodes about a chunk's records."""
    if not isinstance(reader, DecodesInUnits):
        return None
    found = _decoding(reader, shards, records_per_chunk)
    if found is None or found.decoded < WASTEFUL_DECODING * found.records:
        return None
    units = reader.decode_units
    decodes = "from their start up to its last record" if reader.stops_at_chunk_end else "whole"
    chunks = f"{records_per_chunk} record{'s' if records_per_chunk != 1 else ''}"
    return (
        f"dataset {name!r}: its {units} hold up to {found.largest_unit:,} records and a chunk read decodes the "
        f"{units} holding it {decodes}, so reading its chunks of {chunks} decodes about "
        f"{found.decoded / found.records:.0f} records for each one read; the same records {reader.how_to_rewrite} "
        "decode a few"
    )


def _decoding(reader: DecodesInUnits, shards: Sequence[Shard], records_per_chunk: int) -> _Decoding | None:
    decoded = records = largest = 0
    read_together = sum(raw_bytes for *_, raw_bytes in shards)
    for seek, count, compression, raw_bytes in shards:
        if count == 0:
            continue
        records += count
        bounds = reader.unit_bounds(seek, count, compression, raw_bytes, read_together)
        if bounds is None or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != count:
            decoded += count  # about its own records (an uncompressed line shard), or a seek that does not tell
            continue
        starts = np.arange(0, count, records_per_chunk, dtype=np.int64)
        stops = np.minimum(starts + records_per_chunk, count)
        first = bounds[np.searchsorted(bounds, starts, side="right") - 1]
        end = stops if reader.stops_at_chunk_end else bounds[np.searchsorted(bounds, stops, side="left")]
        decoded += int((end - first).sum())
        largest = max(largest, int(np.diff(bounds).max()))
    return _Decoding(decoded, records, largest) if records else None
