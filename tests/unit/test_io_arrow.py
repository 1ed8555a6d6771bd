"""Arrow IPC shards, as Hugging Face `datasets` saves and caches them and as pyarrow writes them
(the stream and the file layout): every chunk reads its rows and no others, in order, locally and
on an object store, where a chunk fetches the schema and its own batches only; what cannot be read
is named; `datasets`' own files beside the Arrow files are no records."""

from __future__ import annotations

import itertools
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import printed_in_processes
from zephon import ConfigurationError
from zephon.io import DUPLICATE_COLUMN, TRUNCATED_SHARD, Dataset, ShardUnavailableError, _dataset

from . import conftest_io
from .conftest_io import (BufferedCountingStore, CountingStore, arrow_bytes, jsonl_bytes, memory_root, put, read_all,
                          registered)

HF = Path(__file__).resolve().parents[1] / "data" / "hf_datasets"
JARGON = Path(__file__).resolve().parents[2] / "zephon" / "data" / "jargon" / "jargon-00000-of-00003.jsonl"


def test_a_directory_datasets_saved_is_read_as_its_records_in_order_its_json_files_no_records():
    """`save_to_disk(num_shards=2)` of the first 200 records of the shipped jargon shard, written by
    datasets itself (`tests/data/hf_datasets/make.py`), in batches of 16 rows: read in any chunk
    size, the records are those of the JSON Lines they were loaded from; `state.json` and
    `dataset_info.json` beside them are no shards, where by suffix the directory held two formats."""
    expected = [json.loads(line) for line in itertools.islice(JARGON.open(encoding="utf-8"), 200)]
    ds = Dataset.from_path("jargon", str(HF / "jargon"))
    assert ds.format == "arrow"
    assert [Path(s.url).name for s in ds.shards] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert [s.num_records for s in ds.shards] == [100, 100]
    for records_per_chunk in (1, 7, 16, 33, 100, 128):
        records, skipped = read_all(ds, records_per_chunk)
        assert records == expected and skipped == []


def test_an_image_column_datasets_wrote_reads_as_its_bytes_and_path():
    """datasets stores an `Image()` column as a struct of the encoded bytes and a path: each record
    holds `{"bytes": ..., "path": None}`, which the VLM decoders read (vlm/README.md)."""
    ds = Dataset.from_path("pictures", str(HF / "pictures"))
    records, _ = read_all(ds, 4)
    assert [r["caption"] for r in records] == [f"picture {i}" for i in range(6)]
    assert all(r["image"]["path"] is None for r in records)
    assert [r["image"]["bytes"][:4] for r in records] == [b"\x89PNG", b"\xff\xd8\xff\xe0"] * 3


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch_rows=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    layout=st.sampled_from(["stream", "file"]),
    compression=st.sampled_from([None, "zstd", "lz4"]),
    dictionaries=st.sampled_from(["none", "ahead", "replaced", "deltas"]),
    kinds=st.integers(1, 30),
    records_per_chunk=st.integers(1, 40),
)
def test_every_chunk_reads_its_rows_whatever_the_batches_layout_and_encoding(
    tmp_path_factory, batch_rows, layout, compression, dictionaries, kinds, records_per_chunk
):
    """Random batch sizes (empty batches among them), both layouts, compressed buffers, and a
    dictionary-encoded column whose dictionary stands before the first batch ("ahead") or grows
    from batch to batch, replaced (a stream only) or extended by deltas: each chunk's records are
    the table's rows in its range; the seek lists the units `_units` says."""
    if dictionaries == "replaced" and layout == "file":
        layout = "stream"  # a file holds one dictionary per column, or deltas to it
    n = sum(batch_rows)
    kind = [f"kind {i % kinds}" for i in range(n)]
    table = pa.table({"text": [f"row {i} " + "x" * (i % 7) for i in range(n)], "i": list(range(n)),
                      "kind": _dictionary_encoded(kind, batch_rows) if dictionaries in ("replaced", "deltas")
                      else pa.array(kind, pa.string()).dictionary_encode() if dictionaries == "ahead"
                      else pa.array(kind, pa.string())})
    root = tmp_path_factory.mktemp("arrow")
    (root / "part.arrow").write_bytes(arrow_bytes(table, batch_rows, layout=layout, compression=compression,
                                                  dictionary_deltas=dictionaries == "deltas"))
    if n == 0:
        assert Dataset.from_path("d", str(root)).num_records == 0
        return
    ds = Dataset.from_path("d", str(root))
    assert ds.num_records == n
    for chunk in ds.chunks(records_per_chunk):
        assert ds.read_chunk(chunk).records == table.slice(chunk.start, chunk.stop - chunk.start).to_pylist()
    assert ds._access[0].seek.shape == (2, _units(batch_rows, kind, dictionaries) + 1)


def _units(batch_rows: list[int], kind: list[str], dictionaries: str) -> int:
    """How many units the seek lists: every batch holding rows up to the first change of the
    dictionary, then (the one dictionary-encoded column's) each such batch its dictionary was
    replaced just before, never one after a delta alone."""
    ends = np.cumsum(batch_rows)
    sizes = [len(set(kind[:max(end, 1)])) for end in ends]  # each batch's dictionary (`_dictionary_encoded`)
    grows = dictionaries in ("replaced", "deltas")
    changed = [grows and i > 0 and sizes[i] != sizes[i - 1] for i in range(len(batch_rows))]
    holding = [i for i, rows in enumerate(batch_rows) if rows]
    units = 1
    for before, batch in zip(holding, holding[1:]):
        unchanged = not any(changed[:batch + 1])
        replaced = dictionaries == "replaced" and any(changed[before + 1:batch + 1])
        units += unchanged or replaced
    return units


def test_a_stream_replacing_the_dictionaries_of_two_columns_at_different_batches_reads_every_chunk(tmp_path):
    """Replacements are told apart by count, not by column: with two dictionary-encoded columns, one
    replaced at every batch and the other every third, a batch after the first replacement needs
    messages before earlier batches, so the rest of the stream is one unit; read so, every chunk
    holds its own rows. Each batch is a unit where only one column is dictionary-encoded."""
    rows = 60
    batches = []
    for first in range(0, rows, 5):
        often = pa.array([f"often {first} {i % 2}" for i in range(5)]).dictionary_encode()
        group = first // 15  # a new dictionary every third batch
        rarely = pa.array([f"rarely {group} {i % 3}" for i in range(5)]).dictionary_encode()
        batches.append(pa.record_batch({"i": list(range(first, first + 5)), "often": often, "rarely": rarely}))
    for name, columns in [("two", ["i", "often", "rarely"]), ("one", ["i", "often"])]:
        table = pa.Table.from_batches([b.select(columns) for b in batches])  # each batch's own dictionaries
        (tmp_path / name).mkdir()
        (tmp_path / name / "part.arrow").write_bytes(arrow_bytes(table, [5] * 12))
        expected = table.to_pylist()
        ds = Dataset.from_path(name, str(tmp_path / name))
        for records_per_chunk in (1, 3, 7):
            assert read_all(ds, records_per_chunk) == (expected, [])
        assert ds._access[0].seek.shape == (2, 2 if name == "two" else 13)  # one unit, or 12 and the end


def _dictionary_encoded(values: list[str], batch_rows: list[int]) -> pa.ChunkedArray:
    """`values` dictionary-encoded batch by batch, each batch's dictionary the values seen up to
    its end in the order first seen, so that each extends the one before (an empty batch's before
    the first value holds that value: pyarrow writes no delta to an empty dictionary)."""
    seen = dict.fromkeys(values[:1], 0)
    chunks, start = [], 0
    for rows in batch_rows:
        for value in values[start:start + rows]:
            seen.setdefault(value, len(seen))
        indices = pa.array([seen[value] for value in values[start:start + rows]], pa.int32())
        chunks.append(pa.DictionaryArray.from_arrays(indices, pa.array(list(seen), pa.string())))
        start += rows
    return pa.chunked_array(chunks)


@pytest.mark.parametrize("dictionary", [False, True])
@pytest.mark.parametrize("layout", ["stream", "file"])
def test_a_remote_chunk_fetches_the_schema_and_its_own_batches_in_two_ranged_reads(monkeypatch, layout, dictionary):
    """On an object store a chunk asks for two byte ranges, the schema's (and the dictionaries'
    before the first batch, where a column is dictionary-encoded) and its batches', and fetches a
    small part of a large shard, not the shard (the file's block cache here 2 KiB, where fsspec's
    default block, 5 MiB, would hold the whole shard)."""
    monkeypatch.setattr(BufferedCountingStore, "block_size", 2048)
    fetched = []
    fetch_range = conftest_io._RangeReadFile._fetch_range
    monkeypatch.setattr(conftest_io._RangeReadFile, "_fetch_range",
                        lambda self, start, end: fetched.append(end - start) or fetch_range(self, start, end))
    table = pa.table({"text": [f"record {i} " + "y" * 200 for i in range(1280)]})
    if dictionary:
        table = table.append_column("kind", pa.array([f"kind {i % 50}" for i in range(1280)]).dictionary_encode())
    with registered(BufferedCountingStore):
        url = put("bufstore://bucket/data/part-000.arrow", arrow_bytes(table, [32] * 40, layout=layout))
        ds = Dataset.from_path("d", url, retry_delay=0)
        chunk = ds.chunks(16)[21]  # rows 336-351, in the eleventh batch
        CountingStore.asked.clear()
        fetched.clear()
        assert ds.read_chunk(chunk).records == table.slice(336, 16).to_pylist()
        assert CountingStore.asked_of("get", [url]) == 2
        assert sum(fetched) < ds.shards[0].nbytes / 10


def test_a_remote_shard_is_planned_and_read_through_fsspec_as_a_local_one():
    root = memory_root()
    table = pa.table({"text": [f"t{i}" for i in range(50)], "n": list(range(50))})
    put(f"{root}/a.arrow", arrow_bytes(table, [10, 0, 25, 15]))
    put(f"{root}/b.feather", arrow_bytes(table, [50], layout="file"))
    ds = Dataset.from_path("d", root, retry_delay=0)
    assert [s.num_records for s in ds.shards] == [50, 50]
    assert read_all(ds, 12)[0] == table.to_pylist() * 2


def test_the_scan_cache_keeps_an_arrow_shards_index_and_the_plan_is_the_same(tmp_path):
    table = pa.table({"text": [f"t{i}" for i in range(90)]})
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.arrow").write_bytes(arrow_bytes(table, [20, 30, 0, 40]))
    cache = tmp_path / "scans"
    first = Dataset.from_path("d", str(data), scan_cache=str(cache))
    again = Dataset.from_path("d", str(data), scan_cache=str(cache))
    assert any(cache.iterdir())
    assert np.array_equal(first._access[0].seek, again._access[0].seek)
    assert read_all(again, 25)[0] == table.to_pylist()


def test_an_arrow_file_that_is_no_arrow_or_cut_short_when_planned_is_named_not_read(tmp_path):
    table = pa.table({"text": [f"t{i}" for i in range(40)]})
    whole = arrow_bytes(table, [10] * 4)
    (tmp_path / "cut.arrow").write_bytes(whole[: len(whole) // 2])  # a partial download
    with pytest.raises(ShardUnavailableError, match="undecodable Arrow IPC") as raised:
        Dataset.from_path("d", str(tmp_path / "cut.arrow"), retry_delay=0)
    assert raised.value.url.endswith("cut.arrow")
    (tmp_path / "text.arrow").write_bytes(b"just some text, no Arrow\n" * 10)
    with pytest.raises(ShardUnavailableError, match="undecodable Arrow IPC"):
        Dataset.from_path("d", str(tmp_path / "text.arrow"), retry_delay=0)


@pytest.mark.filterwarnings("ignore:Feather V1 files are deprecated")
def test_a_feather_v1_file_is_named_as_such_with_what_to_do(tmp_path):
    path = tmp_path / "old.feather"
    feather.write_feather(pa.table({"text": ["a", "b"]}), str(path), version=1)
    with pytest.raises(ShardUnavailableError, match="Feather v1 file") as raised:
        Dataset.from_path("d", str(path), retry_delay=0)
    assert "write_feather" in str(raised.value)


def test_a_shard_cut_short_after_planning_counts_its_lost_rows_where_storage_tells_no_version(tmp_path, monkeypatch):
    """Where the storage tells no version (only then: otherwise a cut file is refused as changed),
    the rows of the batches the cut took are counted `truncated_shard`, the whole batches before it
    read."""
    monkeypatch.setattr(_dataset, "version_of", lambda fs, path: None)
    table = pa.table({"text": [f"t{i}" for i in range(40)]})
    path = tmp_path / "a.arrow"
    path.write_bytes(arrow_bytes(table, [10] * 4))
    ds = Dataset.from_path("d", str(tmp_path), retry_delay=0)
    positions = ds._access[0].seek[0]
    path.write_bytes(path.read_bytes()[: int(positions[3]) - 5])  # inside the third batch
    records, skipped = read_all(ds, 40)
    assert records == table.slice(0, 20).to_pylist()
    assert [reason for _, reason in skipped] == [TRUNCATED_SHARD] * 20


def test_columns_of_one_name_make_each_row_a_duplicate_column_as_in_parquet(tmp_path):
    table = pa.Table.from_arrays([pa.array(["a", "b"]), pa.array(["c", "d"])], names=["text", "text"])
    (tmp_path / "a.arrow").write_bytes(arrow_bytes(table, [2]))
    records, skipped = read_all(Dataset.from_path("d", str(tmp_path)), 2)
    assert records == [] and [reason for _, reason in skipped] == [DUPLICATE_COLUMN] * 2


def test_a_compressed_arrow_shard_is_refused_naming_it(tmp_path):
    (tmp_path / "a.arrow.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(ConfigurationError, match=r"a\.arrow\.gz is a arrow shard .* read by seeking"):
        Dataset.from_path("d", str(tmp_path), format="arrow")


def test_a_dataset_dict_saved_whole_is_refused_naming_its_splits_and_one_split_is_read(tmp_path):
    """`DatasetDict.save_to_disk` (written by datasets: `tests/data/hf_datasets/splits`) holds a
    directory per split: read whole, its train and test splits were one dataset."""
    read_as_one = r"holds a DatasetDict .* splits \(test, train\) would be read as one"
    with pytest.raises(ConfigurationError, match=read_as_one) as raised:
        Dataset.from_path("d", str(HF / "splits"))
    assert str(raised.value).endswith(f"name one split's directory ({HF / 'splits' / 'train'})")
    train = Dataset.from_path("d", str(HF / "splits" / "train"))
    assert [r["term"] for r in read_all(train, 4)[0]] == [
        json.loads(line)["term"] for line in itertools.islice(JARGON.open(encoding="utf-8"), 6)]


def test_a_datasets_cache_directory_holding_map_results_is_refused_and_a_glob_names_the_split(tmp_path):
    """The cache datasets keeps of a loaded dataset holds, beside its split files, a
    `cache-<fingerprint>.arrow` per `map` or `filter` run on it: read whole, their records were read
    as more of the dataset's."""
    table = pa.table({"text": [f"t{i}" for i in range(6)]})
    for name in ("json-train.arrow", "json-test.arrow", "cache-5f3a9c0e1b2d4a67.arrow"):
        (tmp_path / name).write_bytes(arrow_bytes(table, [6]))
    (tmp_path / "dataset_info.json").write_text('{"description": ""}')
    with pytest.raises(ConfigurationError, match=r"cache files .* \(cache-5f3a9c0e1b2d4a67\.arrow\)") as raised:
        Dataset.from_path("d", str(tmp_path))
    assert "glob" in str(raised.value)
    named = Dataset.from_path("d", str(tmp_path / "*-train*.arrow"))
    assert [Path(s.url).name for s in named.shards] == ["json-train.arrow"]


def test_json_lines_beside_arrow_files_are_several_formats_unless_format_names_one(tmp_path):
    shutil.copytree(HF / "jargon", tmp_path / "d")
    (tmp_path / "d" / "extra.jsonl").write_bytes(jsonl_bytes([{"text": "x"}]))
    with pytest.raises(ConfigurationError, match=r"several formats: arrow \(data-00000-of-00002\.arrow"):
        Dataset.from_path("d", str(tmp_path / "d"))
    assert Dataset.from_path("d", str(tmp_path / "d"), format="arrow").num_records == 200


def _one_record_fewer(fields: dict) -> None:
    fields["num_records"] = fields["num_records"] - 1


def _positions_for_first_rows(fields: dict) -> None:
    fields["seek"] = fields["seek"][::-1].copy()


def _a_flat_seek(fields: dict) -> None:
    fields["seek"] = fields["seek"][0].copy()


@pytest.mark.parametrize("damage", [_one_record_fewer, _positions_for_first_rows, _a_flat_seek])
def test_a_scan_cache_entry_whose_arrow_index_does_not_fit_its_shard_is_not_trusted(tmp_path, caplog, damage):
    """An entry (a damaged disk, another Zephon's) whose seek table does not index the shard's
    records, or is no table, is scanned again, not read into chunks of other rows."""
    table = pa.table({"text": [f"t{i}" for i in range(30)]})
    (tmp_path / "a.arrow").write_bytes(arrow_bytes(table, [10, 10, 10]))
    cache = tmp_path / "scans"
    Dataset.from_path("d", str(tmp_path / "a.arrow"), scan_cache=str(cache))
    [entry] = [path for path in cache.rglob("*.npz")]
    with np.load(entry) as stored:
        fields = {name: stored[name] for name in stored.files}
    damage(fields)
    with open(entry, "wb") as f:
        np.savez(f, **fields)
    with caplog.at_level("WARNING", logger="zephon"):
        ds = Dataset.from_path("d", str(tmp_path / "a.arrow"), scan_cache=str(cache))
    assert any("could not be trusted" in r.getMessage() for r in caplog.records)
    assert read_all(ds, 7)[0] == table.to_pylist()


def test_a_batch_whose_string_offsets_point_past_its_data_is_refused_naming_the_shard_not_read(tmp_path):
    """The IPC reader checks a batch's buffers against its length, not the offsets inside them: a
    damaged offset made `to_pylist` read past the data, and the process died of SIGSEGV. Run in a
    child, so that a crash is this test's failure, not the test run's end."""
    table = pa.table({"text": ["aaaa", "bbbb", "cccc", "dddd"]})
    data = bytearray(arrow_bytes(table, [4]))
    at = data.index(struct.pack("<5i", 0, 4, 8, 12, 16))  # the string column's offsets
    data[at + 8:at + 12] = struct.pack("<i", 10**8)
    (tmp_path / "a.arrow").write_bytes(bytes(data))
    code = (
        "import sys\nfrom zephon.io import Dataset, ShardUnavailableError\n"
        f"ds = Dataset.from_path('d', {str(tmp_path)!r}, retry_delay=0)\n"
        "try:\n    ds.read_chunk(ds.chunks(4)[0])\nexcept ShardUnavailableError as error:\n    print(error)\n"
    )
    [printed] = printed_in_processes(code, seeds=[0])  # a child that dies fails the test (check=True)
    assert "undecodable Arrow IPC" in printed and "out of bounds" in printed and "a.arrow" in printed


def test_a_column_name_damaged_to_bytes_that_are_no_utf8_names_the_shard(tmp_path):
    """Found by fuzzing: pyarrow raised UnicodeDecodeError as it made the name a str, out of the read."""
    data = arrow_bytes(pa.table({"text": ["a", "b"]}), [2])
    (tmp_path / "a.arrow").write_bytes(data.replace(b"text", b"\x80ext", 1))
    ds = Dataset.from_path("d", str(tmp_path), retry_delay=0)
    with pytest.raises(ShardUnavailableError, match="undecodable Arrow IPC: UnicodeDecodeError"):
        ds.read_chunk(ds.chunks(2)[0])


def test_a_local_shard_cut_short_while_it_is_planned_is_named_when_read_not_a_crash(tmp_path):
    """Planned through a memory map, a file another process cut meanwhile ended the process with
    SIGBUS as its next message was touched. Read through pyarrow's file, the scan ends where the
    file now does, and the chunk read finds the file changed since its version was taken. In a
    child, which cuts the file after the scan's first batch: a crash is this test's failure."""
    path = tmp_path / "a.arrow"
    path.write_bytes(arrow_bytes(pa.table({"text": ["x" * 1000] * 200}), [20] * 10))
    code = f"""
import os, pyarrow.ipc
from zephon.io import Dataset, ShardUnavailableError
open_stream = pyarrow.ipc.open_stream

class CutAfterTheFirstBatch:
    def __init__(self, reader):
        self.reader, self.read = reader, 0
    def __getattr__(self, name):
        return getattr(self.reader, name)
    def read_next_batch(self):
        self.read += 1
        if self.read == 2:
            os.truncate({str(path)!r}, 9_000)
        return self.reader.read_next_batch()

pyarrow.ipc.open_stream = lambda *args, **kwargs: CutAfterTheFirstBatch(open_stream(*args, **kwargs))
ds = Dataset.from_path("d", {str(path)!r}, retry_delay=0)
pyarrow.ipc.open_stream = open_stream
print("planned", ds.num_records)
try:
    ds.read_chunk(ds.chunks(20)[0])
except ShardUnavailableError as error:
    print(error)
"""
    [printed] = printed_in_processes(code, seeds=[0])  # a child that dies fails the test (check=True)
    assert "changed after planning" in printed, printed
