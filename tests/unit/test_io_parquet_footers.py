"""A Parquet shard's footer is parsed once per process and planned version of the file, not at every
chunk read (`zephon/io/_parquet_footers.py`)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zephon.io import Dataset, ShardUnavailableError, _dataset, _parquet_footers

from .conftest_io import read_all


def _write(path, first: int, rows: int = 200) -> list[dict]:
    records = [{"i": first + k, "text": f"row {first + k}"} for k in range(rows)]
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=20)
    return records


@pytest.fixture
def parsed(monkeypatch) -> list[str]:
    """The footers parsed by chunk reads, a fresh cache for each test."""
    monkeypatch.setattr(_parquet_footers, "_footers", _parquet_footers._Footers())
    seen: list[str] = []
    read_metadata = pq.read_metadata

    def counted(source, *args, **kwargs):
        seen.append(getattr(source, "name", str(source)))
        return read_metadata(source, *args, **kwargs)

    monkeypatch.setattr(pq, "read_metadata", counted)
    return seen


def test_the_chunks_of_a_shard_parse_its_footer_once(tmp_path, parsed):
    records = _write(tmp_path / "a.parquet", 0)
    ds = Dataset.from_path("d", str(tmp_path))
    assert read_all(ds, 16) == read_all(ds, 16) == (records, [])
    assert len(parsed) == 1


def test_a_shard_rewritten_after_planning_is_refused_and_its_new_plan_reads_its_new_footer(tmp_path, parsed):
    _write(tmp_path / "a.parquet", 0)
    before = Dataset.from_path("d", str(tmp_path))
    read_all(before, 16)
    records = _write(tmp_path / "a.parquet", 1000, rows=120)
    with pytest.raises(ShardUnavailableError, match="changed after planning"):
        before.read_chunk(before.chunks(16)[0])
    assert read_all(Dataset.from_path("d", str(tmp_path)), 16) == (records, [])
    assert len(parsed) == 2


def test_a_shard_whose_storage_tells_no_version_parses_its_footer_at_every_read(tmp_path, parsed, monkeypatch):
    monkeypatch.setattr(_dataset, "version_of", lambda fs, path: None)
    records = _write(tmp_path / "a.parquet", 0)
    ds = Dataset.from_path("d", str(tmp_path))
    assert read_all(ds, 16) == (records, [])
    assert len(parsed) == len(ds.chunks(16))


def test_the_footers_kept_are_bounded_and_the_least_recently_read_go_first(tmp_path, parsed, monkeypatch):
    for k in range(3):
        _write(tmp_path / f"part-{k}.parquet", 1000 * k)
    size = pq.read_metadata(tmp_path / "part-0.parquet").serialized_size
    parsed.clear()
    monkeypatch.setattr(_parquet_footers, "FOOTERS_KEPT_BYTES", 2 * size + size // 2)  # two of them
    ds = Dataset.from_path("d", str(tmp_path))
    first_chunk = {ds.shards[c.shard].url.rsplit("/", 1)[-1]: c for c in reversed(ds.chunks(16))}

    def read(name: str) -> None:
        ds.read_chunk(first_chunk[name])

    for name in ("part-0.parquet", "part-1.parquet", "part-0.parquet", "part-2.parquet"):  # 1 is dropped, not 0
        read(name)
    assert len(parsed) == 3
    read("part-0.parquet")
    assert len(parsed) == 3
    read("part-1.parquet")
    assert len(parsed) == 4
