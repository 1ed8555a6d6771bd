"""Arrow IPC shards (`.arrow`, `.feather`): a record is one row as a dict, as in Parquet.

Hugging Face `datasets` keeps every dataset it saves (`save_to_disk`) or caches as Arrow streams
(`data-00000-of-00001.arrow` beside `state.json` and `dataset_info.json`), so a corpus prepared
with it is read where it lies instead of being written out again as Parquet first. Both of Arrow's
layouts are read: the stream, which `datasets` writes, and the file (Feather v2, `ARROW1` at both
ends), which is a stream with a footer around it; the footer is not needed.

Neither layout says where a row is: a stream has no index, and a file's footer gives its record
batches' offsets but not their rows. Planning walks the shard's messages once and keeps, for each
record batch holding rows (each unit: below), where its bytes begin and its first row (`seek`,
two rows: byte positions and first rows, one more column for the end). The first batch's bytes
begin after the schema and the dictionaries of dictionary-encoded columns that stand before it,
so the shard's bytes before it are all a batch needs beside its own (`_batches_start`). A local
shard is read by pyarrow's own file (a 200 MB shard in 7-12 ms from the page cache here;
memory-mapped, 3 ms, but a file cut short by another process meanwhile then ended the process
with SIGBUS, where read it ends the stream early and the read of a chunk finds the file changed);
a remote one is read once, as counting a JSON Lines shard reads it.

A chunk read fetches those bytes (the schema's and the dictionaries') and those of the batches that
hold its rows, two ranged reads on an object store, and decodes them alone. A stream may also
change a dictionary between its batches, replacing it or adding a delta to it (pandas categoricals
written a frame at a time replace theirs at every batch): a batch after a change needs the
dictionary messages since its column's last replacement, which stand before earlier batches. So
the seek lists units, not batches: each batch up to the first change, then, where the schema has
one dictionary-encoded column, each batch its dictionary was replaced before, and a unit runs up to
the next; deltas, or changes in a schema of several such columns (whose replacements the reader
does not tell apart), make the rest of the stream one unit, which planning warns of as of a large
batch. Decoding runs on the reading thread (`use_threads=False`), as Parquet's does (`_parquet`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, ClassVar

import numpy as np

from ._arrow_rows import decoding, table_rows
from ._errors import ShardUnavailableError
from ._format import ShardFile, ShardScan
from ._policy import Slot, fill_truncated
from ._protocols import is_local

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["ArrowIPC"]

_FILE_MAGIC = b"ARROW1"  # a file (Feather v2) starts with it and 2 bytes of padding, then its stream
_FEATHER_V1_MAGIC = b"FEA1"
_WHAT = "Arrow IPC"


@dataclass(frozen=True)
class ArrowIPC:
    name: str = "arrow"
    copies_streams: ClassVar[bool] = False  # no shard of it is one compressed stream
    decode_units: ClassVar[str] = "record batches"
    stops_at_chunk_end: ClassVar[bool] = False
    how_to_rewrite: ClassVar[str] = (
        "written in record batches of 1,000 records or fewer (a writer's write_table(table, max_chunksize=1000), "
        "as datasets' save_to_disk does), a dictionary-encoded column with one dictionary for the shard "
        "(table.unify_dictionaries())"
    )

    @property
    def scan_key(self) -> str:
        return "arrow dictionaries-ahead"  # a seek whose first batch begins after the dictionaries (module docstring)

    @staticmethod
    def seek_ndim(compression: str | None) -> int:
        return 2  # the seek table of the module docstring

    @staticmethod
    def indexes(table: np.ndarray, num_records: int) -> bool:
        """Two rows, byte positions and first records from 0 to all."""
        rows, points = table.shape
        return rows == 2 and 0 < points <= num_records + 1 and table[1, 0] == 0 and table[1, -1] == num_records

    def scan(self, shard: ShardFile) -> ShardScan:
        import pyarrow as pa

        if is_local(shard.fs):  # read by pyarrow, not mapped: a file cut meanwhile would end the process (SIGBUS)
            with pa.OSFile(shard.path) as local, decoding(shard.url, _WHAT, reads_storage=False):
                return ShardScan(*_batches(local, shard.url))
        with shard.open() as f, pa.PythonFile(f, mode="r") as source, decoding(shard.url, _WHAT):
            return ShardScan(*_batches(source, shard.url))

    def unit_bounds(self, seek: np.ndarray | None, num_records: int, compression: str | None, raw_bytes: int,
                    read_together: int) -> np.ndarray | None:
        return None if seek is None else seek[1]

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        import pyarrow as pa

        positions, first_rows = seek
        first = int(np.searchsorted(first_rows, start, side="right")) - 1  # the batch holding row `start`
        last = int(np.searchsorted(first_rows, stop, side="left"))  # one past the batch holding `stop - 1`
        with shard.open(read_ahead=0) as f:
            head = _stream_of(_span(f, 0, int(positions[0]))[0], shard.url)  # the schema and dictionaries
            stream, short = _after(head, f, int(positions[first]), int(positions[last]))
        with decoding(shard.url, _WHAT, reads_storage=False):
            schema, batches = _decoded(stream, complete=not short)
            wanted = pa.Table.from_batches(batches, schema=schema).slice(start - int(first_rows[first]), stop - start)
            _validate(wanted)
        return fill_truncated(table_rows(wanted), stop - start, "shard has fewer rows than when it was planned")


def _batches(source: pa.NativeFile, url: str) -> tuple[int, np.ndarray]:
    """(rows, seek) of the stream in `source`: the seek table of the module docstring."""
    import pyarrow as pa

    start = source.read(len(_FILE_MAGIC))
    _stream_of(start, url)  # refuses a Feather v1 file by name
    stream_start = 8 if start == _FILE_MAGIC else 0
    source.seek(stream_start)
    options = pa.ipc.IpcReadOptions(use_threads=False)
    reader = pa.ipc.open_stream(source, options=options)
    first_batch, dictionaries_ahead = source.tell(), 0  # the schema's end
    dictionary_columns = _dictionary_columns(reader.schema.types)
    if dictionary_columns:  # the first batch begins after the dictionaries standing before it
        first_batch, dictionaries_ahead = _batches_start(source, first_batch, dictionary_columns)
        source.seek(stream_start)
        reader = pa.ipc.open_stream(source, options=options)
    one_dictionary = dictionary_columns == 1
    starts, first_rows = [first_batch], [0]  # where each unit's bytes begin, and its first row
    position, rows, replaced = first_batch, 0, 0
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        if not batch.num_rows:  # an empty batch's bytes go with the next batch holding rows
            continue
        stats = reader.stats  # what was read up to this batch, the dictionary messages before it included
        unchanged = stats.num_dictionary_batches == dictionaries_ahead
        if rows and (unchanged or (one_dictionary and stats.num_replaced_dictionaries > replaced)):
            starts.append(position)  # a batch that needs no dictionary message before its own bytes
            first_rows.append(rows)
        position, rows, replaced = source.tell(), rows + batch.num_rows, stats.num_replaced_dictionaries
    if rows:
        starts.append(position)
        first_rows.append(rows)
    return rows, np.array([starts, first_rows], dtype=np.int64)


def _dictionary_columns(types) -> int:
    """How many dictionary-encoded types these types hold, nested ones included."""
    import pyarrow as pa

    count = 0
    for kind in types:
        if pa.types.is_dictionary(kind):
            count += 1 + _dictionary_columns([kind.value_type])
        elif kind.num_fields:
            count += _dictionary_columns(kind.field(i).type for i in range(kind.num_fields))
    return count


def _batches_start(source: pa.NativeFile, schema_end: int, dictionaries: int) -> tuple[int, int]:
    """Where the stream's first record batch begins, after its schema (which ends at `schema_end`)
    and the dictionary messages standing before that batch, one for each of the schema's
    `dictionaries`; and how many dictionary messages stand there. It stops at the last of them,
    not reading the batch after them (a whole shard, where it is one batch): a delta standing
    before the first batch too is then read with that batch, and the scan counts it as a change."""
    import pyarrow as pa

    source.seek(schema_end)
    messages = pa.ipc.MessageReader.open_stream(source)
    position, found = schema_end, 0
    while found < dictionaries:
        try:
            message = messages.read_next_message()
        except StopIteration:
            break
        if message.type != "dictionary":
            break
        position, found = source.tell(), found + 1
    return position, found


def _stream_of(head: bytes, url: str) -> bytes:
    """The stream part of a shard's first bytes: after a file's magic and padding, or all of them."""
    if head.startswith(_FEATHER_V1_MAGIC):
        raise ShardUnavailableError(
            url, 1, "a Feather v1 file (written before Arrow 0.17), which is not Arrow IPC: write it again as "
            "Feather v2 (`pyarrow.feather.write_feather`, its default) or as Parquet"
        )
    return head[8:] if head.startswith(_FILE_MAGIC) else head


def _span(f: BinaryIO, begin: int, end: int) -> tuple[bytes, bool]:
    """The shard's bytes in [begin, end), and whether it ended before `end` (cut short since planning)."""
    f.seek(begin)
    data = f.read(end - begin)
    return data, len(data) < end - begin


def _after(head: bytes, f: BinaryIO, begin: int, end: int) -> tuple[pa.Buffer, bool]:
    """`head`, then the shard's bytes in [begin, end) read straight after it, and whether the
    shard ended before `end`. The bytes are read once into a buffer of pyarrow's, which is not
    zeroed first: read and then joined to the schema's, or into a zeroed bytearray, a chunk's record
    batches were written twice more, which took most of a chunk read where batches dwarf chunks."""
    import pyarrow as pa

    stream = pa.allocate_buffer(len(head) + end - begin)
    with memoryview(stream).cast("B") as view:  # pyarrow's format is signed bytes
        view[: len(head)] = head
        f.seek(begin)
        got = len(head)
        while got < len(view) and (n := f.readinto(view[got:])):
            got += n
    return stream.slice(0, got), got < len(stream)


def _decoded(stream: pa.Buffer, complete: bool) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """The schema and record batches of `stream` (a schema, dictionaries, then batches). A stream
    cut short (not `complete`) keeps its whole batches."""
    import pyarrow as pa

    reader = pa.ipc.open_stream(stream, options=pa.ipc.IpcReadOptions(use_threads=False))
    batches = []
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            return reader.schema, batches
        except (pa.ArrowException, OSError):  # a message cut short: ArrowInvalid, or a short read's OSError
            if complete:
                raise
            return reader.schema, batches


def _validate(rows: pa.Table) -> None:
    """Raise ArrowInvalid where the rows' values are not what their buffers promise. The IPC reader
    checks a batch's buffers against its length but not the offsets inside them: a string whose
    offset pointed past its data (a damaged byte) crashed the process as its row became a Python
    object. The full check reads each of the chunk's offsets and strings once, not its batches'
    other rows (`benchmarks/test_reader_bench.py`)."""
    rows.validate(full=True)
