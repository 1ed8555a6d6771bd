"""fsspec's cache layers named in a dataset's URL: `simplecache::` and `filecache::` are read through
Zephon's own cache in the layer's directory, `blockcache::` is refused (`zephon.io._url_caches`)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from zephon import ConfigurationError
from zephon.io import Dataset

from .conftest_io import jsonl_bytes, memory_root, put

_WHOLE_FILE_LAYERS = ("simplecache", "filecache")


def _behind(layer: str, root: str, tmp_path) -> tuple[str, dict]:
    return f"{layer}::{root}", {layer: {"cache_storage": str(tmp_path / "cache")}}


def _records(ds: Dataset, chunk_records: int) -> list[dict]:
    return [record for chunk in ds.chunks(chunk_records) for record in ds.read_chunk(chunk).records]


def test_shards_behind_filecache_planned_and_read_on_many_threads_at_once_are_all_read(tmp_path):
    """`filecache::` keeps one record of its copies, which every download loads, merges and writes
    back: planning counts remote shards on many threads, and opens racing there lost each other's
    entries (`TypeError: cannot unpack non-iterable bool object` from inside fsspec, which failed
    the dataset). Read through Zephon's cache, every shard is planned and read, as on the URL
    without the layer, the chunks on eight threads at once too; the copies are in the layer's
    directory."""
    expected = []
    for run in range(4):  # the race needs a few tries to show; each run is a new dataset and copies
        root = memory_root()
        for shard in range(24):
            records = [{"shard": shard, "i": i} for i in range(5)]
            put(f"{root}/s{shard:02d}.jsonl", jsonl_bytes(records))
        url, options = _behind("filecache", root, tmp_path / str(run))
        ds = Dataset.from_path("d", url, storage_options=options, retries=1)
        with ThreadPoolExecutor(8) as pool:
            chunks = list(pool.map(lambda chunk: ds.read_chunk(chunk).records, ds.chunks(2)))
        expected = _records(Dataset.from_path("d", root, retries=1), 2)
        assert [record for records in chunks for record in records] == expected
        assert len([copy for copy in (tmp_path / str(run) / "cache").iterdir() if copy.is_file()]) == 24
    assert len(expected) == 120


@pytest.mark.parametrize("rewritten", [[{"text": "new 1"}, {"text": "new 2"}],  # the same size
                                       [{"text": f"new {i}"} for i in range(1, 4)]])
@pytest.mark.parametrize("layer", _WHOLE_FILE_LAYERS)
def test_a_shard_rewritten_behind_a_whole_file_cache_is_read_anew_not_from_the_old_copy(layer, rewritten, tmp_path):
    """fsspec's whole-file caches name a copy by the shard's URL and never look at the store
    again: a shard regenerated in place was planned from the store's listing and read from the
    old copy, its new records missing without a word."""
    root = memory_root()
    url, options = _behind(layer, root, tmp_path)
    put(f"{root}/a.jsonl", jsonl_bytes([{"text": "old 1"}, {"text": "old 2"}]))
    assert _records(Dataset.from_path("d", url, storage_options=options, retries=1), 2) == [
        {"text": "old 1"}, {"text": "old 2"}]
    put(f"{root}/a.jsonl", jsonl_bytes(rewritten))
    assert _records(Dataset.from_path("d", url, storage_options=options, retries=1), 2) == rewritten


@pytest.mark.parametrize("layer", _WHOLE_FILE_LAYERS)
def test_local_files_behind_a_whole_file_cache_are_read_in_place(layer, tmp_path):
    """Local files are read where they are, as with Zephon's own cache, which copies none: the
    records are those of the plain path and nothing is written in the layer's directory."""
    (tmp_path / "data").mkdir()
    lines = "".join(json.dumps({"i": i}) + "\n" for i in range(7))
    (tmp_path / "data" / "a.jsonl").write_text(lines)
    url, options = _behind(layer, f"file://{tmp_path / 'data'}", tmp_path)
    ds = Dataset.from_path("d", url, storage_options=options, retries=1)
    assert _records(ds, 3) == [{"i": i} for i in range(7)]
    assert not list((tmp_path / "cache").rglob("*")), "fsspec makes the directory; nothing is copied into it"


def test_a_shard_behind_blockcache_is_refused_naming_the_url_and_what_to_name_instead(tmp_path):
    """fsspec's `blockcache` marks a block as held before it fetches it: a fetch that failed left
    the block marked and its retry read zeros, as did a read of that block on another thread
    meanwhile. Refused when the dataset is made, naming the URL, the dataset and the way out."""
    root = memory_root()
    put(f"{root}/a.jsonl", jsonl_bytes([{"i": 0}]))
    url, options = _behind("blockcache", root, tmp_path)
    with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} is read through fsspec's blockcache, .* reads "
                       r"zeros .* simplecache:: instead") as refused:
        Dataset.from_path("d", url, storage_options=options, retries=1)
    assert refused.value.__notes__ == [f"while listing dataset 'd' at {url}"]
