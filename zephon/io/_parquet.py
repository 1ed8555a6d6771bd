"""Parquet shards: a record is one row as a dict.

Planning reads only the footer. A chunk read decodes only the row groups that overlap its range and
then slices, so reading a small chunk of a large file costs about one row group, not the file.

Bytes pyarrow cannot decode (a corrupt footer or page, or a page whose stored checksum fails)
make the shard unreadable: it raises ShardUnavailableError naming the shard, at once. pyarrow reports
some corruption (a page snappy cannot decompress) as a bare OSError, like a failed read: while a
chunk's row groups are decoded, an OSError is the data's unless a read of the shard raised
(`_Spans.storage_failed`), so only a storage error is retried. At planning (the footer) an OSError is
still retried as a storage error first and then reported the same way.

pyarrow is imported on first use: it adds ~37 MB to every process that imports it, and a loader
that reads no Parquet should not pay that.

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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ._errors import ShardUnavailableError
from ._format import ShardFile, ShardScan
from ._parquet_spans import spanned
from ._policy import DUPLICATE_COLUMN, INVALID_UTF8, UNCONVERTIBLE_VALUE, Bad, Slot, fill_truncated

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["Parquet"]


@dataclass(frozen=True)
class Parquet:
    name: str = "parquet"

    @property
    def scan_key(self) -> str:
        return "parquet"

    def scan(self, shard: ShardFile) -> ShardScan:
        import pyarrow.parquet as pq

        with shard.open() as f, _decoding(shard.url):
            metadata = pq.ParquetFile(f).metadata
        raw = sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
        return ShardScan(metadata.num_rows, raw_bytes=raw)

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        import pyarrow.parquet as pq

        with shard.open(read_ahead=0) as f, _decoding(shard.url):  # the footer, then `spanned`'s spans
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
                rows = _rows(table.slice(start - first_row, stop - start))
        return fill_truncated(rows, stop - start, "shard has fewer rows than when it was planned")


def _rows(table: pa.Table) -> list[Slot]:
    """Rows as dicts. pyarrow checks values only when they become Python objects: a row holding
    bytes that are not UTF-8 is `invalid_utf8`, like a JSON line would be, and one holding a value
    Python cannot represent (a timestamp or date past year 9999, a nanosecond value with a part
    below a microsecond: see `_in_microseconds`) is `unconvertible_value`.

    A file whose columns repeat a name (pyarrow writes one) has rows that are no dict: `to_pylist`
    keeps the last column of a name and drops the others' values without a word, so each row is
    `duplicate_column`, as a tar record holding one member twice is `duplicate_member`."""
    names = table.column_names
    if len(set(names)) < len(names):
        repeated = sorted({name for name in names if names.count(name) > 1})
        return [Bad(DUPLICATE_COLUMN, f"columns named {repeated} more than once: which one is meant is not known")] * table.num_rows
    import pyarrow as pa

    schema = pa.schema([field.with_type(_in_microseconds(field.type)) for field in table.schema])

    def as_dicts(part: pa.Table) -> list[dict]:
        return (part if schema.equals(part.schema) else part.cast(schema)).to_pylist()

    try:
        return as_dicts(table)
    except (UnicodeDecodeError, OverflowError, ValueError):  # a failed safe cast is an ArrowInvalid, a ValueError
        pass
    rows: list[Slot] = []
    for i in range(table.num_rows):
        try:
            rows.extend(as_dicts(table.slice(i, 1)))
        except UnicodeDecodeError as error:
            rows.append(Bad(INVALID_UTF8, str(error)))
        except (OverflowError, ValueError) as error:
            rows.append(Bad(UNCONVERTIBLE_VALUE, f"{type(error).__name__}: {error}"))
    return rows


def _in_microseconds(kind: pa.DataType) -> pa.DataType:
    """`kind` with every nanosecond timestamp, duration and time of day in it (in lists, structs
    and maps too) in microseconds, the finest unit the standard library's types hold.

    pyarrow makes a nanosecond value a pandas object when pandas can be imported, and refuses one
    with a part below a microsecond otherwise, so a row was kept in one environment (the 3.11
    tests', with pandas) and skipped in another (the 3.14t tests', without), and a nanosecond
    time of day lost that part unsaid. Cast safely to microseconds, such a row fails the cast
    and is `unconvertible_value` everywhere; every other value becomes a `datetime`, `timedelta`
    or `time`.
    """
    import pyarrow as pa

    types = pa.types
    if types.is_timestamp(kind) and kind.unit == "ns":
        return pa.timestamp("us", kind.tz)
    if types.is_duration(kind) and kind.unit == "ns":
        return pa.duration("us")
    if types.is_time64(kind) and kind.unit == "ns":
        return pa.time64("us")
    if types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind):
        item = kind.value_field.with_type(_in_microseconds(kind.value_type))
        if types.is_fixed_size_list(kind):
            return pa.list_(item, kind.list_size)
        return pa.large_list(item) if types.is_large_list(kind) else pa.list_(item)
    if types.is_map(kind):
        return pa.map_(kind.key_field.with_type(_in_microseconds(kind.key_type)),
                       kind.item_field.with_type(_in_microseconds(kind.item_type)), kind.keys_sorted)
    if types.is_struct(kind):
        return pa.struct([field.with_type(_in_microseconds(field.type)) for field in kind])
    return kind


@contextmanager
def _decoding(url: str) -> Iterator[None]:
    import pyarrow as pa

    try:
        yield
    except pa.ArrowException as error:
        if isinstance(error, OSError):
            raise  # maybe storage: the caller retries it
        raise ShardUnavailableError(url, 1, f"undecodable Parquet: {type(error).__name__}: {error}") from error
