"""The rows of an Arrow table as records, for the two formats whose shards pyarrow decodes into
one (Parquet, Arrow IPC), and the errors that make such a shard unreadable.

pyarrow is imported on first use: it adds ~37 MB to every process that imports it, and a loader
that reads neither format should not pay that.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ._errors import ShardUnavailableError
from ._policy import DUPLICATE_COLUMN, INVALID_UTF8, UNCONVERTIBLE_VALUE, Bad, Slot

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["decoding", "table_rows"]


def table_rows(table: pa.Table) -> list[Slot]:
    """Rows as dicts. pyarrow checks values only when they become Python objects: a row holding
    bytes that are not UTF-8 is `invalid_utf8`, like a JSON line would be, and one holding a value
    Python cannot represent (a timestamp or date past year 9999, a nanosecond value with a part
    below a microsecond: see `_for_python`) is `unconvertible_value`.

    A table whose columns repeat a name (pyarrow writes such a Parquet or Arrow file) has rows that
    are no dict: `to_pylist` keeps the last column of a name and drops the others' values without a
    word, so each row is `duplicate_column`, as a tar record holding one member twice is
    `duplicate_member`."""
    names = table.column_names
    if len(set(names)) < len(names):
        repeated = sorted({name for name in names if names.count(name) > 1})
        why = f"columns named {repeated} more than once: which one is meant is not known"
        return [Bad(DUPLICATE_COLUMN, why)] * table.num_rows
    import pyarrow as pa

    schema = pa.schema([field.with_type(_for_python(field.type)) for field in table.schema])

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


def _for_python(kind: pa.DataType) -> pa.DataType:
    """`kind` as its values are made Python objects: every nanosecond timestamp, duration and time
    of day in it (in lists, structs and maps too) in microseconds, the finest unit the standard
    library's types hold, and every dictionary-encoded type as its values' type.

    A dictionary-encoded column (a pandas categorical, a column written dictionary-encoded) gives
    the same values decoded first, and pyarrow makes each of its values a Python object by way of
    a scalar of its own: a column of 128 short strings took 129 µs, decoded first 22 µs (3.11).

    pyarrow makes a nanosecond value a pandas object when pandas can be imported, and refuses one
    with a part below a microsecond otherwise, so a row was kept in one environment (the 3.11
    tests', with pandas) and skipped in another (the 3.14t tests', without), and a nanosecond
    time of day lost that part unsaid. Cast safely to microseconds, such a row fails the cast
    and is `unconvertible_value` everywhere; every other value becomes a `datetime`, `timedelta`
    or `time`.
    """
    import pyarrow as pa

    types = pa.types
    if types.is_dictionary(kind):
        return _for_python(kind.value_type)
    if types.is_timestamp(kind) and kind.unit == "ns":
        return pa.timestamp("us", kind.tz)
    if types.is_duration(kind) and kind.unit == "ns":
        return pa.duration("us")
    if types.is_time64(kind) and kind.unit == "ns":
        return pa.time64("us")
    if types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind):
        item = kind.value_field.with_type(_for_python(kind.value_type))
        if types.is_fixed_size_list(kind):
            return pa.list_(item, kind.list_size)
        return pa.large_list(item) if types.is_large_list(kind) else pa.list_(item)
    if types.is_map(kind):
        return pa.map_(kind.key_field.with_type(_for_python(kind.key_type)),
                       kind.item_field.with_type(_for_python(kind.item_type)), kind.keys_sorted)
    if types.is_struct(kind):
        return pa.struct([field.with_type(_for_python(field.type)) for field in kind])
    return kind


@contextmanager
def decoding(url: str, what: str, reads_storage: bool = True) -> Iterator[None]:
    """Turn what pyarrow raises for bytes it cannot decode into ShardUnavailableError naming the
    shard (`url`) and its format (`what`: "Parquet", "Arrow IPC"). Where pyarrow also reads the
    shard (`reads_storage`), an OSError goes on as it is, as it may be the storage's, which the
    caller retries; decoding bytes already read or mapped, pyarrow's OSError (a message cut short)
    is the data's. A column name whose bytes are not UTF-8 fails as pyarrow makes it a str
    (UnicodeDecodeError)."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError, UnicodeDecodeError) as error:
        if isinstance(error, OSError) and reads_storage:
            raise  # maybe storage: the caller retries it
        raise ShardUnavailableError(url, 1, f"undecodable {what}: {type(error).__name__}: {error}") from error
