"""Parquet and Arrow shards whose row groups or record batches dwarf a chunk, and compressed JSON
Lines or text shards of many chunks: planning warns of what reading them decodes
(`zephon/io/_decode_units.py`), and a Parquet chunk read stops decoding its row group where the
chunk ends (`_parquet._decoded_until`)."""

from __future__ import annotations

import gzip
import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from zephon import Pipeline
from zephon.io import Dataset, ShardUnavailableError
from zephon.work import StaticMixtureWorkSource

TOKENIZER = Path(__file__).resolve().parents[2] / "zephon" / "data" / "tokenizer.json"
RECORDS = 990  # 99 chunks of 10: a chunk read decodes (99 + 1) / 2 = 50 records per record in one row group


def _table(records: int = RECORDS) -> pa.Table:
    return pa.table({"id": list(range(records)), "text": [f"record {i} " * 4 for i in range(records)]})


def _parquet(directory: Path, row_group_size: int, records: int = RECORDS, **options) -> Path:
    directory.mkdir()
    pq.write_table(_table(records), directory / "part.parquet", row_group_size=row_group_size, **options)
    return directory


def _arrow(directory: Path, batch_rows: int, table: pa.Table | None = None,
           options: pa.ipc.IpcWriteOptions | None = None) -> Path:
    directory.mkdir()
    table = _table() if table is None else table
    with pa.ipc.new_stream(str(directory / "data-00000-of-00001.arrow"), table.schema, options=options) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    return directory


def test_one_parquet_row_group_read_in_small_chunks_is_warned_of_with_what_to_write_instead(tmp_path):
    dataset = Dataset.from_path("wide", str(_parquet(tmp_path / "one", RECORDS)))
    said = dataset.wasteful_decoding(10)
    assert said == (
        f"dataset 'wide': its row groups hold up to {RECORDS} records and a chunk read decodes the row groups holding "
        "it from their start up to its last record, so reading its chunks of 10 records decodes about 50 records for "
        "each one read; the same records written in row groups of 1,000 records or fewer "
        "(pyarrow.parquet.write_table(table, where, row_group_size=1000)) decode a few"
    )
    assert dataset.wasteful_decoding(RECORDS) is None  # one chunk per row group
    regrouped = Dataset.from_path("wide", str(_parquet(tmp_path / "hundreds", 100)))
    assert regrouped.wasteful_decoding(10) is None  # (10 + 1) / 2 records per record


def test_an_arrow_stream_in_one_record_batch_is_warned_of_as_decoded_whole(tmp_path):
    said = Dataset.from_path("wide", str(_arrow(tmp_path / "one", RECORDS))).wasteful_decoding(10)
    assert re.fullmatch(
        rf"dataset 'wide': its record batches hold up to {RECORDS} records and a chunk read decodes the record "
        r"batches holding it whole, so reading its chunks of 10 records decodes about 99 records for each one read; "
        r"the same records written in record batches of 1,000 records or fewer \(a writer's write_table\(table, "
        r"max_chunksize=1000\), as datasets' save_to_disk does\), a dictionary-encoded column with one dictionary "
        r"for the shard \(table.unify_dictionaries\(\)\) decode a few", said), said
    assert Dataset.from_path("wide", str(_arrow(tmp_path / "small", 100))).wasteful_decoding(10) is None


def test_an_arrow_stream_whose_dictionary_grows_by_deltas_is_warned_of_and_one_replaced_or_unified_is_not(tmp_path):
    """A batch of a stream whose dictionary grows by deltas needs every delta before it, so from the
    first batch on the stream is one unit, read from there for every chunk: planning warns, naming
    unify_dictionaries. The same column with its dictionary replaced at each batch (as pandas
    categoricals written a frame at a time are), or one dictionary for the shard, reads batch by
    batch, unwarned."""
    table = _table()
    kinds = [f"kind {i // 100}" for i in range(RECORDS)]  # a kind more in each batch of 100
    grown = [pa.DictionaryArray.from_arrays(pa.array([k // 100] * len(kinds[k:k + 100]), pa.int32()),
                                            pa.array([f"kind {j}" for j in range(k // 100 + 1)]))
             for k in range(0, RECORDS, 100)]
    deltas = _arrow(tmp_path / "deltas", 100, table.append_column("kind", pa.chunked_array(grown)),
                    pa.ipc.IpcWriteOptions(emit_dictionary_deltas=True))
    said = Dataset.from_path("kinds", str(deltas)).wasteful_decoding(10)
    assert said is not None and f"hold up to {RECORDS} records" in said and "unify_dictionaries()" in said, said
    replaced = table.append_column("kind", pa.chunked_array(grown))  # each batch's dictionary replaces the last
    assert Dataset.from_path("kinds", str(_arrow(tmp_path / "replaced", 100, replaced))).wasteful_decoding(10) is None
    unified = table.append_column("kind", pa.array(kinds).dictionary_encode())
    assert Dataset.from_path("kinds", str(_arrow(tmp_path / "unified", 100, unified))).wasteful_decoding(10) is None


@pytest.mark.parametrize("suffix, format", [(".jsonl.zst", None), (".jsonl.gz", None), (".txt.gz", "text")])
def test_a_compressed_line_shard_of_many_chunks_is_warned_of_as_decompressed_from_its_start(tmp_path, suffix, format):
    """A gzip or zstd stream is decompressed from its start for every chunk read of it (a gzip one
    of under a megabyte holds no resume points): 990 records in chunks of 10 decompress 50 records
    per record read, as one Parquet row group does.
    The same records in many frames or members, or many shards, decompress a few."""
    lines = "".join((f'{{"text": "r{i}"}}' if format is None else f"r{i}") + "\n" for i in range(RECORDS)).encode()
    compress = zstandard.ZstdCompressor().compress if suffix.endswith(".zst") else gzip.compress
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / f"part{suffix}").write_bytes(compress(lines))
    said = Dataset.from_path("packed", str(tmp_path / "one"), format=format).wasteful_decoding(10)
    units = "zstd frames, gzip members or stretches of a gzip stream between resume points"
    assert said == (
        f"dataset 'packed': its {units} hold up to {RECORDS} records and a chunk read decodes the {units} holding it "
        "from their start up to its last record, so reading its chunks "
        "of 10 records decodes about 50 records for each one read; the same records stored uncompressed (zstd -d, "
        "gunzip: a read seeks into those) or compressed in small frames or members, a read entering at the last "
        "before its chunk (pzstd -1 writes frames of 2 MiB of text, bgzip members of 64 KiB), or planned with "
        "Dataset.from_path(..., scan_cache=DIR, seekable_copies=True) (a copy of each shard in one stream kept in "
        "such frames in DIR) decode a few"
    )
    pieces = [b"".join(lines.splitlines(True)[k:k + 90]) for k in range(0, RECORDS, 90)]  # 11 of 9 chunks
    (tmp_path / "one" / f"part{suffix}").write_bytes(b"".join(map(compress, pieces)))  # 11 frames or members
    assert Dataset.from_path("packed", str(tmp_path / "one"), format=format).wasteful_decoding(10) is None
    (tmp_path / "many").mkdir()
    for k, piece in enumerate(pieces):  # 11 shards: 5 records per record
        (tmp_path / "many" / f"part-{k * 90:04d}{suffix}").write_bytes(compress(piece))
    assert Dataset.from_path("packed", str(tmp_path / "many"), format=format).wasteful_decoding(10) is None
    (tmp_path / "one" / f"part-plain{suffix.rsplit('.', 1)[0]}").write_bytes(lines)  # (50 + 1) / 2 per record
    assert Dataset.from_path("packed", str(tmp_path / "one"), format=format).wasteful_decoding(10) is None


def test_uncompressed_line_shards_and_empty_parquet_shards_are_not_warned_of(tmp_path):
    (tmp_path / "lines").mkdir()
    (tmp_path / "lines" / "part.jsonl").write_text("".join(f'{{"text": "r{i}"}}\n' for i in range(RECORDS)))
    assert Dataset.from_path("lines", str(tmp_path / "lines")).wasteful_decoding(1) is None
    (tmp_path / "empty").mkdir()
    pq.write_table(_table(0), tmp_path / "empty" / "part.parquet")
    pq.write_table(_table(), tmp_path / "empty" / "full.parquet", row_group_size=10)
    assert Dataset.from_path("empty", str(tmp_path / "empty")).wasteful_decoding(10) is None


def test_the_row_groups_are_kept_in_the_scan_cache_and_warned_of_from_it(tmp_path):
    """A plan from kept scans is the plan a scan makes: the warning too. Entries kept before the
    seek held the row groups had the scan key "parquet", which no longer names an entry."""
    shards, cache = _parquet(tmp_path / "one", RECORDS), tmp_path / "scans"
    scanned = Dataset.from_path("wide", str(shards), scan_cache=str(cache)).wasteful_decoding(10)
    (kept,) = [entry for entry in cache.rglob("*.npz")]
    warm = Dataset.from_path("wide", str(shards), scan_cache=str(cache)).wasteful_decoding(10)
    assert scanned is not None and warm == scanned
    assert [entry for entry in cache.rglob("*.npz")] == [kept]


def test_the_loader_logs_the_warning_on_rank_0(tmp_path, caplog):
    source = StaticMixtureWorkSource([Dataset.from_path("wide", str(_parquet(tmp_path / "one", RECORDS)))],
                                     seed=1, records_per_chunk=10, num_epochs=1)
    pipeline = Pipeline(source).options(num_lanes=2).tokenize(str(TOKENIZER), field="text").pack_flat(64).batch(2)
    with caplog.at_level(logging.WARNING, logger="zephon"), pipeline.shard(0, 1) as loader:
        next(iter(loader))
    warned = [r.getMessage() for r in caplog.records if "decodes about 50 records for each one read" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("dataset 'wide': its row groups"), warned


def test_a_parquet_chunk_read_decodes_its_row_group_no_further_than_its_end(tmp_path):
    """A byte changed in the last page of a row group of 5,000 records (its checksum then fails) is
    decoded by a read of the last chunk only: a chunk at the start of the row group no longer
    decodes it. Read whole, as before, the row group made every chunk's read fail."""
    path = _parquet(tmp_path / "one", 5000, 5000, data_page_size=256, write_batch_size=10,
                    use_dictionary=False, write_page_checksum=True) / "part.parquet"
    data = bytearray(path.read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    data[footer - 20] ^= 0xFF  # inside the text column's last page
    path.write_bytes(bytes(data))
    dataset = Dataset.from_path("wide", str(path.parent))
    first, *_, last = dataset.chunks(10)
    assert [r["id"] for r in dataset.read_chunk(first).records] == list(range(10))
    with pytest.raises(ShardUnavailableError, match="undecodable Parquet"):
        dataset.read_chunk(last)
