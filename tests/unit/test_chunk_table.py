"""A plan holds a dataset's chunks as a table and makes a Chunk only when a slot is read.

Every rank binds the whole plan; with one Chunk object per chunk of the corpus, a corpus of 16
million chunks cost each rank ~2.6 GiB and minutes of binding. The table must be the dataset's
chunks exactly, with the same raw bytes, or the lanes would read other chunks.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zephon._records import Chunk
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource
from zephon.work._chunk_table import ChunkTable

DATA = Path(__file__).resolve().parents[2] / "zephon" / "data"


def _parquet_dataset(tmp_path: Path) -> Dataset:
    """Shards of 0, 5 and 130 rows: an empty shard, one shorter than a chunk, one with a tail."""
    for i, rows in enumerate([0, 5, 130]):
        pq.write_table(pa.table({"text": [f"row {i}.{r} " * (r % 7 + 1) for r in range(rows)]}), tmp_path / f"p{i}.parquet")
    return Dataset.from_path("p", str(tmp_path))


@pytest.mark.parametrize("records_per_chunk", [1, 16, 1000])
def test_a_chunk_table_is_the_datasets_chunks_with_their_raw_bytes(tmp_path, records_per_chunk):
    for dataset in (Dataset.from_path("kjv", str(DATA / "kjv")), _parquet_dataset(tmp_path)):
        table = ChunkTable.of(dataset, records_per_chunk)
        chunks = dataset.chunks(records_per_chunk)
        assert list(table) == chunks
        assert table.raw_bytes(dataset).tolist() == [dataset.raw_bytes(c) for c in chunks]
        assert table.num_records().tolist() == [c.num_records for c in chunks]


def test_a_chunks_raw_bytes_are_its_records_bytes_where_planning_saw_them_else_its_shards_prorated(tmp_path):
    """Pinned apart from the table: `Dataset.raw_bytes`, `chunks` and the table share one formula."""
    kjv, parquet = Dataset.from_path("kjv", str(DATA / "kjv")), _parquet_dataset(tmp_path)
    for shard, info in enumerate(kjv.shards):
        own = [kjv.raw_bytes(c) for c in kjv.chunks(16) if c.shard == shard]
        assert all(own) and sum(own) == info.raw_bytes
    for chunk in parquet.chunks(16):
        info = parquet.shards[chunk.shard]
        assert parquet.raw_bytes(chunk) == info.raw_bytes * chunk.num_records // info.num_records


def _count_chunks_made(monkeypatch) -> dict:
    """Counts the Chunk objects made from here on, in `["n"]`."""
    created = {"n": 0}
    original = Chunk.__init__

    def counted(self, *args, **kwargs):
        created["n"] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(Chunk, "__init__", counted)
    return created


def test_binding_a_plan_makes_no_chunk_object_per_chunk_of_the_corpus(monkeypatch):
    kjv = Dataset.from_path("kjv", str(DATA / "kjv"))
    source = StaticMixtureWorkSource([kjv], seed=3, records_per_chunk=1)
    assert len(kjv.chunks(1)) > 1000
    created = _count_chunks_made(monkeypatch)
    plan = source.bind(None, num_lanes=8)
    assert created["n"] == 0
    assert isinstance(plan.slot(3, 10**5), Chunk)


def test_the_memory_budgets_largest_chunk_is_read_from_the_tables_without_a_chunk_object(monkeypatch):
    from zephon._memory import _largest_chunk_raw_bytes

    datasets = [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))]
    plan = StaticMixtureWorkSource(datasets, seed=3, records_per_chunk=3).bind(None, num_lanes=8)
    expected = max(d.raw_bytes(c) for d in datasets for c in d.chunks(3))
    created = _count_chunks_made(monkeypatch)
    assert _largest_chunk_raw_bytes(plan) == expected
    assert created["n"] == 0
